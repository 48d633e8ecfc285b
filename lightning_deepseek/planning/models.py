"""The models a plan is for: a transformers config (a preset's fields or a local ``config.json``) or one of this
package's GPT presets, built on fake tensors: shapes and dtypes only, nothing materialised, no weights read.

transformers' config classes hold the published shapes (Llama 3, Mixtral, Qwen3-MoE, DeepSeek-V3, ...); a preset is
such a config's fields (``model_type`` names the class), built with ``AutoModelForCausalLM.from_config`` under the
planner's ``FakeTensorMode``. Supported: causal language models of transformers 5.x whose forward takes
``input_ids`` and ``labels`` and returns ``.loss``; this package's ``GPT`` (loss: cross-entropy of next tokens).
Routed experts are planned under uniform routing (:mod:`lightning_deepseek.planning.routing`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

SOURCES = ("hf", "lds")


@dataclass(frozen=True)
class ModelSpec:
    """A model to plan.

    Args:
        name: the preset's or file's name (printed).
        source: ``"hf"`` (``config`` holds a transformers config's fields with ``model_type``) or ``"lds"``
            (``config`` holds ``GPTConfig`` fields, e.g. a ``PRESETS`` entry).
        config: the fields.
    """

    name: str
    source: str
    config: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"model {self.name!r}: source={self.source!r} must be one of {SOURCES}.")
        if self.source == "hf" and "model_type" not in self.config:
            raise ValueError(f"model {self.name!r}: a transformers config needs 'model_type' (e.g. 'llama').")

    @classmethod
    def from_config_json(cls, path: str | Path) -> ModelSpec:
        """A local transformers ``config.json`` (its ``model_type`` names the class)."""
        return cls(Path(path).name, "hf", json.loads(Path(path).read_text()))

    @property
    def vocab_size(self) -> int:
        return int(self.config.get("vocab_size", 256 if self.source == "lds" else 32000))

    def build(self) -> nn.Module:
        """The model (call under ``FakeTensorMode``: parameters are fake tensors)."""
        if self.source == "lds":
            from lightning_deepseek.models.gpt import GPT, GPTConfig

            return GPT(GPTConfig(**dict(self.config)))
        from transformers import AutoConfig, AutoModelForCausalLM

        fields = dict(self.config)
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        config._attn_implementation = "sdpa"
        return AutoModelForCausalLM.from_config(config)

    def loss(self, model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """The training loss of one micro-batch (next-token cross-entropy)."""
        if self.source == "lds":
            logits = model(input_ids)
            return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), input_ids[:, 1:].reshape(-1))
        return model(input_ids=input_ids, labels=input_ids).loss

    def loss_from_logits(self, logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """The same loss from the last pipeline stage's logits (the pipeline's ``pipeline_loss``)."""
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), input_ids[:, 1:].reshape(-1))
