"""The example models. Names are imported on first use (PEP 562): ``lightning_deepseek.models.config``
(``GPTConfig``, ``PRESETS``) imports no torch, so ``lds-train`` checks the model settings before importing it."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {"GPT": "gpt", "GPTConfig": "config", "PRESETS": "config", "LightningGPT": "lightning_gpt"}

__all__ = ["GPT", "GPTConfig", "LightningGPT", "PRESETS"]

if TYPE_CHECKING:
    from lightning_deepseek.models.config import PRESETS, GPTConfig
    from lightning_deepseek.models.gpt import GPT
    from lightning_deepseek.models.lightning_gpt import LightningGPT


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lightning_deepseek.models' has no attribute {name!r}")
    return getattr(importlib.import_module(f"lightning_deepseek.models.{_EXPORTS[name]}"), name)
