"""The automatic plan finds feed-forward blocks by structure in models it has never seen, and only those."""

from __future__ import annotations

import pytest
import torch.nn as nn

from lightning_deepseek.models import GPT, GPTConfig
from lightning_deepseek.parallel.plan import (
    auto_plan,
    explicit_plan,
    find_feed_forward_blocks,
    why_auto_plan_is_empty,
)


class SwiGLU(nn.Module):
    """Llama's order: w1 (gate), w2 (down), w3 (up): the down-projection is registered between the two ups."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class GatedMLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden)
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)


class NormedHidden(nn.Module):
    """A LayerNorm over the hidden width would see only a shard: not a feed-forward block to shard."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 32)
        self.norm = nn.LayerNorm(32)
        self.down = nn.Linear(32, 8)


def _pairs(model: nn.Module) -> set[tuple[tuple[str, ...], str]]:
    return {(b.ups, b.down) for b in find_feed_forward_blocks(model)}


def test_gpt_mlps_and_not_attention() -> None:
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16))
    assert _pairs(model) == {(("blocks.0.mlp.fc1",), "blocks.0.mlp.fc2"), (("blocks.1.mlp.fc1",), "blocks.1.mlp.fc2")}


def test_torch_transformer_encoder_and_decoder_layers() -> None:
    model = nn.Sequential(nn.TransformerEncoderLayer(16, 2, dim_feedforward=64, batch_first=True),
                          nn.TransformerDecoderLayer(16, 2, dim_feedforward=48))
    assert _pairs(model) == {(("0.linear1",), "0.linear2"), (("1.linear1",), "1.linear2")}


def test_gated_mlps_in_either_registration_order() -> None:
    assert _pairs(SwiGLU(16, 64)) == {(("w1", "w3"), "w2")}
    assert _pairs(GatedMLP(16, 64)) == {(("gate_proj", "up_proj"), "down_proj")}


def test_sequential_mlp_and_normed_hidden() -> None:
    assert _pairs(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))) == {(("0",), "2")}
    assert _pairs(NormedHidden()) == set()
    assert _pairs(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))) == set()  # h == d: ambiguous


def test_flat_list_of_layers_pairs_in_order() -> None:
    flat = nn.ModuleList([nn.Linear(8, 32), nn.Linear(32, 8), nn.Linear(8, 32), nn.Linear(32, 8)])
    assert _pairs(flat) == {(("0",), "1"), (("2",), "3")}


def test_threshold_and_divisibility() -> None:
    model = nn.ModuleDict({"small": nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4)),
                           "large": nn.Sequential(nn.Linear(16, 96), nn.GELU(), nn.Linear(96, 16))})
    entries, indivisible = auto_plan(model, tp_size=2, min_params=100)
    assert [(e.name, e.style) for e in entries] == [("large.0", "colwise"), ("large.2", "rowwise")]
    entries, indivisible = auto_plan(model, tp_size=5, min_params=0)
    assert entries == [] and {b.down for b in indivisible} == {"small.2", "large.2"}


def test_explicit_plan_patterns() -> None:
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16))
    entries = explicit_plan(model, {"blocks.*.mlp.fc1": "colwise", "blocks.*.mlp.fc2": "rowwise"}, 2)
    assert [e.name for e in entries] == ["blocks.0.mlp.fc1", "blocks.1.mlp.fc1", "blocks.0.mlp.fc2",
                                         "blocks.1.mlp.fc2"]
    with pytest.raises(ValueError, match=r"plan pattern 'blocks\.\*\.ffn\.w1' matches no module"):
        explicit_plan(model, {"blocks.*.ffn.w1": "colwise"}, 2)
    with pytest.raises(ValueError, match="not a style"):
        explicit_plan(model, {"blocks.*.mlp.fc1": "diagonal"}, 2)
    with pytest.raises(ValueError, match="not divisible by tensor_parallel_size=3"):
        explicit_plan(model, {"blocks.0.mlp.fc1": "colwise"}, 3)
    with pytest.raises(ValueError, match="only nn.Linear"):
        explicit_plan(model, {"blocks.0.mlp": "colwise"}, 2)


def test_empty_automatic_plan_explains_itself() -> None:
    model = nn.ModuleDict({"a": nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4)),
                           "b": nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))})
    assert auto_plan(model, 2, 1000)[0] == []
    cause, fix = why_auto_plan_is_empty(model, 1000)
    assert cause == "no feed-forward block reaches min_shard_params=1000: the largest (b.0, b.2) has 552 parameters"
    assert fix.startswith("Set min_shard_params=552 (lds-train: strategy.min_shard_params=552)")
    assert auto_plan(model, 2, 552)[0]  # the number it gives does shard the block
    cause, fix = why_auto_plan_is_empty(NormedHidden(), 0)
    assert cause.startswith("plan='auto' found no feed-forward block") and "explicit plan" in fix
