"""Automatic configuration (docs/autotune.md): two ways to choose the parallel layout and compression.

- Decisions by a cost model (``cost_model``, ``measure``, ``auto_parallel``): ``HybridParallelStrategy(
  tensor_parallel_size="auto")``, ``expert_parallel_size="auto"`` and ``GradientCompression(bits="auto")`` predict
  each candidate's step time from measured compute and links, at setup.
- Calibration (``candidates``, ``checks``, ``calibrate``, ``choice``, ``table``): ``lds-train tune=auto|quick|grid``
  measures candidate configurations in the training processes and trains with the fastest.

The candidates and the checks import neither torch nor Optuna (``lds-train`` checks ``tune`` before loading them);
everything else is imported on first use. The cost model's own ``Candidate`` (tp, ep, bits) is
``lightning_deepseek.autotune.cost_model.Candidate``; ``Candidate`` here is an lds-train configuration.
"""

import importlib
from typing import Any

from lightning_deepseek.autotune.candidates import PLAIN_DDP, Candidate, candidates, forced_settings
from lightning_deepseek.autotune.checks import check_tune, check_tune_option

_LAZY = {
    **dict.fromkeys(("calibrate", "calibrated_config"), "calibrate"),
    **dict.fromkeys(("Choice", "choose"), "choice"),
    **dict.fromkeys(("Calibration", "Row", "TuneReport"), "table"),
    **dict.fromkeys(("ComputeProfile", "Decision", "Machine", "ModelFacts", "NoCandidateFitsError", "Prediction",
                     "decide", "predict"), "cost_model"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"lightning_deepseek.autotune.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["PLAIN_DDP", "Candidate", "candidates", "check_tune", "check_tune_option", "forced_settings", *_LAZY]
