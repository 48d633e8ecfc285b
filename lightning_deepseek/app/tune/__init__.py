"""``lds-train tune=auto|quick|grid``: calibration of the application's configurations (docs/autotune.md).

Candidate configurations of ``lds-train`` (``candidates``) are measured in the training processes (``calibrate``),
chosen by the margin rule (``choice``) and reported (``table``). The candidates and the checks import neither torch
nor Optuna (``lds-train`` checks ``tune`` before loading them); everything else is imported on first use.
"""

import importlib
from typing import Any

from lightning_deepseek.app.tune.candidates import PLAIN_DDP, Candidate, candidates, forced_settings
from lightning_deepseek.app.tune.checks import check_tune, check_tune_option

_LAZY = {
    **dict.fromkeys(("calibrate", "calibrated_config"), "calibrate"),
    **dict.fromkeys(("Choice", "choose"), "choice"),
    **dict.fromkeys(("Calibration", "Row", "TuneReport"), "table"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"lightning_deepseek.app.tune.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["PLAIN_DDP", "Candidate", "candidates", "check_tune", "check_tune_option", "forced_settings", *_LAZY]
