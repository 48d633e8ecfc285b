"""Measured auto-configuration: ``lds-train tune=quick|grid`` measures candidate configurations in the training
processes and trains with the fastest (docs/autotune.md, "Calibration: lds-train tune").

The candidates and the checks import neither torch nor Optuna (``lds-train`` checks ``tune`` before loading
them); the calibration itself is imported on first use.
"""

from typing import Any

from lightning_deepseek.autotune.candidates import PLAIN_DDP, Candidate, candidates, forced_settings
from lightning_deepseek.autotune.checks import check_tune, check_tune_option

_LAZY = ("Calibration", "Row", "TuneReport", "calibrate", "calibrated_config", "choose")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module("lightning_deepseek.autotune.calibrate"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "PLAIN_DDP",
    "Calibration",
    "Candidate",
    "Row",
    "TuneReport",
    "calibrate",
    "calibrated_config",
    "candidates",
    "check_tune",
    "check_tune_option",
    "choose",
    "forced_settings",
]
