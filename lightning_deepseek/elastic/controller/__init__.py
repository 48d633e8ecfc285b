"""The ``lds-elastic`` controller program: decides each job's size from its reports and resizes it through a backend.

It runs outside the training processes (``python -m lightning_deepseek.elastic.controller`` or ``lds-elastic``) and
never touches them: it reads the report file they write (``elastic/report.py``) and starts or stops torchrun agents.
It imports neither torch nor Lightning. What runs inside each training process (``ElasticTraining``, its
checkpoints, sampler and reports) is the parent package, ``lightning_deepseek.elastic``.
"""

from lightning_deepseek.elastic.controller.backend import (
    Backend,
    BackendError,
    JobSpec,
    LocalBackend,
    RendezvousTuning,
)
from lightning_deepseek.elastic.controller.controller import ElasticController, JobFailed, main
from lightning_deepseek.elastic.controller.policy import JobStatus, ScalingPolicy

__all__ = ["Backend", "BackendError", "ElasticController", "JobFailed", "JobSpec", "JobStatus", "LocalBackend",
           "RendezvousTuning", "ScalingPolicy", "main"]
