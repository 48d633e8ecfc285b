"""Elastic training: resize a running torchrun job, resume exactly, and decide when to resize."""

from lightning_deepseek.elastic.callback import RESTART_EXIT_CODE, ElasticStop, ElasticTraining
from lightning_deepseek.elastic.checkpoint import CheckpointMismatchError, ElasticCheckpointer, find_latest
from lightning_deepseek.elastic.report import GradNormMonitor, Reports, write_report
from lightning_deepseek.elastic.sampler import ElasticSampler

__all__ = [
    "RESTART_EXIT_CODE", "CheckpointMismatchError", "ElasticCheckpointer", "ElasticSampler", "ElasticStop",
    "ElasticTraining", "GradNormMonitor", "Reports", "find_latest", "write_report",
]
