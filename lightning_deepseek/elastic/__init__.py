"""Elastic training: resize a running torchrun job, resume exactly, and decide when to resize.

Two programs share this package. Inside each training process: ``ElasticTraining`` (``callback.py``), its step
checkpoints (``checkpoint.py``), its resumable sampler (``sampler.py``) and the reports it writes (``report.py``).
Outside them: the ``lds-elastic`` controller program (``controller/``: the control loop, the scaling policy, the
launcher backends), which reads those reports. The names below are imported on first use (PEP 562), so that the
controller, which only needs ``report.py``, starts without importing torch or Lightning.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "RESTART_EXIT_CODE": "callback", "ElasticStop": "callback", "ElasticTraining": "callback",
    "CheckpointMismatchError": "checkpoint", "ElasticCheckpointer": "checkpoint", "find_latest": "checkpoint",
    "GradNormMonitor": "report", "Reports": "report", "write_report": "report",
    "ElasticSampler": "sampler",
}

__all__ = [
    "RESTART_EXIT_CODE", "CheckpointMismatchError", "ElasticCheckpointer", "ElasticSampler", "ElasticStop",
    "ElasticTraining", "GradNormMonitor", "Reports", "find_latest", "write_report",
]

if TYPE_CHECKING:
    from lightning_deepseek.elastic.callback import RESTART_EXIT_CODE, ElasticStop, ElasticTraining
    from lightning_deepseek.elastic.checkpoint import CheckpointMismatchError, ElasticCheckpointer, find_latest
    from lightning_deepseek.elastic.report import GradNormMonitor, Reports, write_report
    from lightning_deepseek.elastic.sampler import ElasticSampler


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lightning_deepseek.elastic' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
