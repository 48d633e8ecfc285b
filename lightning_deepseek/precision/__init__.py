"""Staged precision: FP32 -> FP16 -> BF16 schedule with a dynamic loss scaler and FP16 fallback."""

from lightning_deepseek.precision.loss_scaler import DynamicLossScaler
from lightning_deepseek.precision.lr_scheduler import SkippedStepSchedulerGuard
from lightning_deepseek.precision.schedule import PrecisionSchedule, ScheduleError, Stage
from lightning_deepseek.precision.staged import StagedPrecision, StagedPrecisionError

__all__ = [
    "DynamicLossScaler", "PrecisionSchedule", "ScheduleError", "SkippedStepSchedulerGuard", "Stage", "StagedPrecision",
    "StagedPrecisionError",
]
