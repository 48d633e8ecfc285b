"""lightning-deepseek: DeepSeek-style training efficiency as drop-in PyTorch Lightning components.

The top level exports the components (a strategy, callbacks, a precision plugin, the search entry point); the
example models and data are in :mod:`lightning_deepseek.models` and :mod:`lightning_deepseek.data`, the ``lds-train``
application in :mod:`lightning_deepseek.app`. The names are imported on first use (PEP 562), so
``from lightning_deepseek import StagedPrecision`` does not import Optuna or the other components' dependencies.
Importing it checks the versions of the required dependencies (:mod:`lightning_deepseek.versions`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_deepseek.versions import require

for _package in ("torch", "lightning", "optuna", "hydra-core"):  # the required ones; optional ones where used
    require(_package)
del _package

_EXPORTS = {
    "ElasticTraining": "lightning_deepseek.elastic",
    "ExpertLoadBalancing": "lightning_deepseek.moe",
    "GradientCompression": "lightning_deepseek.compression",
    "HybridParallelStrategy": "lightning_deepseek.parallel",
    "OptunaPruning": "lightning_deepseek.hpo",
    "StagedPrecision": "lightning_deepseek.precision",
    "register_compression_hook": "lightning_deepseek.compression",
    "search": "lightning_deepseek.hpo",
}

__all__ = [
    "ElasticTraining", "ExpertLoadBalancing", "GradientCompression", "HybridParallelStrategy", "OptunaPruning",
    "StagedPrecision", "register_compression_hook", "search",
]

if TYPE_CHECKING:
    from lightning_deepseek.compression import GradientCompression, register_compression_hook
    from lightning_deepseek.elastic import ElasticTraining
    from lightning_deepseek.hpo import OptunaPruning, search
    from lightning_deepseek.moe import ExpertLoadBalancing
    from lightning_deepseek.parallel import HybridParallelStrategy
    from lightning_deepseek.precision import StagedPrecision


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lightning_deepseek' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
