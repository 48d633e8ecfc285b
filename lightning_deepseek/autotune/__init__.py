"""The ``"auto"`` settings of the library (docs/autotune.md): ``HybridParallelStrategy(tensor_parallel_size="auto")``,
``expert_parallel_size="auto"`` and ``GradientCompression(bits="auto")`` time a copy of each candidate layout at
setup and keep the fastest by a margin (``cost_model``, ``measure``, ``auto_parallel``). Imported on first use.
"""

import importlib
from typing import Any

_LAZY = dict.fromkeys(("ComputeProfile", "Decision", "Machine", "ModelFacts", "NoCandidateFitsError", "Prediction",
                       "decide", "predict"), "cost_model")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"lightning_deepseek.autotune.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [*_LAZY]
