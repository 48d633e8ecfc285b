"""Byte-level text data. Names are imported on first use (PEP 562): ``lightning_deepseek.data.corpus`` reads and
checks a corpus without importing torch or Lightning (``lds-train`` checks its configuration before either)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {"DataError": "corpus", "read_corpus": "corpus", "TextDataModule": "text"}

__all__ = ["DataError", "TextDataModule", "read_corpus"]

if TYPE_CHECKING:
    from lightning_deepseek.data.corpus import DataError, read_corpus
    from lightning_deepseek.data.text import TextDataModule


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lightning_deepseek.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"lightning_deepseek.data.{_EXPORTS[name]}"), name)
