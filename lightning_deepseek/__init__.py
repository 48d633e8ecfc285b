"""lightning-deepseek: DeepSeek-style training efficiency as drop-in PyTorch Lightning components.

The public names are imported on first use (PEP 562), so ``from lightning_deepseek import StagedPrecision`` does not
import Optuna or the other components' dependencies.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "ElasticTraining": "lightning_deepseek.elastic",
    "GPT": "lightning_deepseek.models",
    "GPTConfig": "lightning_deepseek.models",
    "GradientCompression": "lightning_deepseek.compression",
    "HybridParallelStrategy": "lightning_deepseek.parallel",
    "LightningGPT": "lightning_deepseek.models",
    "OptunaPruning": "lightning_deepseek.hpo",
    "StagedPrecision": "lightning_deepseek.precision",
    "TextDataModule": "lightning_deepseek.data",
    "register_compression_hook": "lightning_deepseek.compression",
    "search": "lightning_deepseek.hpo",
}

__all__ = [
    "ElasticTraining", "GPT", "GPTConfig", "GradientCompression", "HybridParallelStrategy", "LightningGPT",
    "OptunaPruning", "StagedPrecision", "TextDataModule", "register_compression_hook", "search",
]

if TYPE_CHECKING:
    from lightning_deepseek.compression import GradientCompression, register_compression_hook
    from lightning_deepseek.data import TextDataModule
    from lightning_deepseek.elastic import ElasticTraining
    from lightning_deepseek.hpo import OptunaPruning, search
    from lightning_deepseek.models import GPT, GPTConfig, LightningGPT
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
