"""``lds-train tune=auto|quick|grid``: calibration of the application's configurations (docs/autotune.md).

The candidate configurations of ``lds-train`` (``configurations``) are measured in the training processes
(``calibrate``; a long run's paired rounds: ``paired``), chosen by the margin rule (``choice``) and reported
(``table``). The configurations and the checks import neither torch nor Optuna (``lds-train`` checks ``tune``
before loading them); everything else is imported on first use. Not to be confused with the library's
``autotune.Candidate`` (a ``(tp, ep, bits)`` layout timed on copies of a model): a ``Configuration`` is a whole
``lds-train`` configuration, timed by short fits.
"""

import importlib
from typing import Any

from lightning_deepseek.app.tune.checks import check_tune, check_tune_option
from lightning_deepseek.app.tune.configurations import PLAIN_DDP, Configuration, configurations, forced_settings

_LAZY = {
    **dict.fromkeys(("calibrate", "calibrated_config"), "calibrate"),
    **dict.fromkeys(("Choice", "choose"), "choice"),
    **dict.fromkeys(("Calibration", "Row", "TuneReport"), "table"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"lightning_deepseek.app.tune.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["PLAIN_DDP", "Configuration", "check_tune", "check_tune_option", "configurations", "forced_settings",
           *_LAZY]
