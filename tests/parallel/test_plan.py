"""The automatic plan finds feed-forward blocks by structure in models it has never seen, and only those."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from lightning_deepseek.models import GPT, GPTConfig
from lightning_deepseek.parallel.plan import (
    Plan,
    add_attention_heads,
    auto_plan,
    explicit_plan,
    find_feed_forward_blocks,
    format_plan_table,
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


class MyRMSNorm(nn.Module):
    """A norm class of the user's own (as every HF model has): found by its shape and name."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Standardize(MyRMSNorm):
    """The same norm under a name that says nothing: found by behaviour (scaling its input changes nothing)."""


class ChannelScale(MyRMSNorm):
    """Element-wise, not a norm (scaling its input scales its output): it does not break a pair."""

    def forward(self, x):
        return self.weight * x


def _with_middle(middle: type[nn.Module]) -> nn.Module:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(8, 32)
            self.mid = middle(32)
            self.down = nn.Linear(32, 8)

    return Block()


def test_a_norm_over_the_hidden_width_of_any_class_breaks_the_pair() -> None:
    assert _pairs(_with_middle(MyRMSNorm)) == set()
    assert _pairs(_with_middle(Standardize)) == set()
    assert _pairs(_with_middle(ChannelScale)) == {(("up",), "down")}


class MLA(nn.Module):
    """DeepSeek's multi-head latent attention, its projections only: query d -> r -> d (heads x head width == d)."""

    def __init__(self, norm: bool) -> None:
        super().__init__()
        self.q_a_proj = nn.Linear(32, 16, bias=False)
        if norm:
            self.q_a_layernorm = MyRMSNorm(16)
        self.q_b_proj = nn.Linear(16, 32, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(32, 20, bias=False)
        self.kv_b_proj = nn.Linear(16, 48, bias=False)
        self.o_proj = nn.Linear(32, 32, bias=False)


def test_attention_low_rank_projections_are_never_paired() -> None:
    assert _pairs(MLA(norm=True)) == set()
    assert _pairs(MLA(norm=False)) == set()  # the low-rank rule alone: other projections of the stream beside it
    assert _pairs(GatedMLP(32, 16)) == {(("gate_proj", "up_proj"), "down_proj")}  # a narrow expert MLP still is


class BertLikeLayer(nn.Module):
    """BERT's layout: the feed-forward split across sibling modules, and an attention output d -> d beside it."""

    class _Dense(nn.Module):
        def __init__(self, n_in: int, n_out: int, norm: bool) -> None:
            super().__init__()
            self.dense = nn.Linear(n_in, n_out)
            if norm:
                self.LayerNorm = nn.LayerNorm(n_out)

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.ModuleDict({"query": nn.Linear(8, 8), "output": self._Dense(8, 8, norm=True)})
        self.intermediate = self._Dense(8, 32, norm=False)
        self.output = self._Dense(32, 8, norm=True)


def test_feed_forward_split_across_sibling_modules() -> None:
    assert _pairs(BertLikeLayer()) == {(("intermediate.dense",), "output.dense")}


class Declares(nn.Module):
    """A model that declares its tensor-parallel plan as HF models do (``_tp_plan``), attention and experts too."""

    _tp_plan = {"layers.*.attn.q": "colwise", "layers.*.attn.k": "colwise", "layers.*.attn.v": "colwise",
                "layers.*.attn.o": "rowwise", "layers.*.mlp.w_in": "colwise", "layers.*.mlp.w_out": "rowwise",
                "layers.*.experts.gate_up_proj": "packed_colwise", "embed": "embedding_rowwise"}

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        layer = nn.ModuleDict({"attn": nn.ModuleDict({n: nn.Linear(8, 8) for n in "qkvo"}),
                               "mlp": nn.ModuleDict({"w_in": nn.Linear(8, 16), "w_out": nn.Linear(16, 8)})})
        self.layers = nn.ModuleList([layer])


def test_declared_plan_gives_its_feed_forward_entries_and_structure_the_rest() -> None:
    model = nn.ModuleDict({"hf": Declares(), "head": nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))})
    entries, _ = auto_plan(model, 2, 0)
    assert [(e.name, e.style, e.source) for e in entries] == [
        ("hf.layers.0.mlp.w_in", "colwise", "declared by Declares"),
        ("hf.layers.0.mlp.w_out", "rowwise", "declared by Declares"),
        ("head.0", "colwise", "structure"), ("head.2", "rowwise", "structure")]


def test_plan_table_prints_the_source() -> None:
    model = nn.ModuleDict({"hf": Declares()})
    entries, _ = auto_plan(model, 2, 0)
    table = format_plan_table(model, Plan(tuple(entries)), 2)
    assert "| hf.layers.0.mlp.w_in | colwise | declared by Declares | 144 | 288 |" in table


def test_empty_plan_hint_names_the_models_own_linear_layers() -> None:
    cause, fix = why_auto_plan_is_empty(MLA(norm=True), 0)
    assert "q_a_proj, q_b_proj, kv_a_proj_with_mqa" in fix and "*.mlp.fc1" not in fix


def test_transformers_conv1d_is_a_linear_layer() -> None:
    pytorch_utils = pytest.importorskip("transformers.pytorch_utils", reason="needs transformers (the test extra)")
    mlp = nn.ModuleDict({"c_fc": pytorch_utils.Conv1D(32, 8), "c_proj": pytorch_utils.Conv1D(8, 32)})  # (nf, nx)
    assert _pairs(mlp) == {(("c_fc",), "c_proj")}
    assert [e.name for e in explicit_plan(mlp, {"c_fc": "colwise", "c_proj": "rowwise"}, 2)] == ["c_fc", "c_proj"]
    with pytest.raises(ValueError, match="not divisible by tensor_parallel_size=3"):
        explicit_plan(mlp, {"c_fc": "colwise"}, 3)  # its output width is 32, the second dim of its weight


def test_tiny_deepseek_v3_structure_never_pairs_mla() -> None:
    transformers = pytest.importorskip("transformers", reason="needs transformers (the test extra)")
    config = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1, q_lora_rank=16, kv_lora_rank=16,
        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)
    model = transformers.DeepseekV3Model(config)
    assert {b.down for b in find_feed_forward_blocks(model)} == {"layers.0.mlp.down_proj",
                                                                  "layers.1.mlp.shared_experts.down_proj"}
    assert {e.source for e in auto_plan(model, 2, 0)[0]} == {"declared by DeepseekV3Model"}


def test_empty_plan_says_a_declared_plan_had_no_feed_forward_pair() -> None:
    class ExpertsOnly(nn.Module):
        _tp_plan = {"layers.*.attn.q": "colwise", "layers.*.experts.gate_up_proj": "packed_colwise"}

        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.ModuleDict({"attn": nn.ModuleDict({"q": nn.Linear(8, 8)})})])

    cause, _ = why_auto_plan_is_empty(ExpertsOnly(), 0)
    assert "ExpertsOnly declares a tensor-parallel plan, but none of its entries is a feed-forward linear pair" in cause


def test_attention_heads_join_the_plan_where_the_tp_ranks_share_the_batch() -> None:
    transformers = pytest.importorskip("transformers", reason="needs transformers (the test extra)")
    config = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = transformers.Qwen3ForCausalLM(config)
    feed_forward = Plan(tuple(auto_plan(model, 2, 0)[0]))
    plan = add_attention_heads(model, feed_forward, 2, 0)
    assert [(e.name, e.style) for e in plan][:7] == [
        ("model.layers.0.self_attn.q_proj", "colwise"), ("model.layers.0.self_attn.k_proj", "colwise"),
        ("model.layers.0.self_attn.v_proj", "colwise"), ("model.layers.0.self_attn.o_proj", "rowwise"),
        ("model.layers.0.mlp.gate_proj", "colwise"), ("model.layers.0.mlp.up_proj", "colwise"),
        ("model.layers.0.mlp.down_proj", "rowwise")]
    assert plan.sources == ["declared by Qwen3ForCausalLM", "declared by Qwen3ForCausalLM (attention heads)"]
    with pytest.warns(UserWarning, match="does not divide its 4 heads and 2 key/value heads"):
        assert add_attention_heads(model, feed_forward, 4, 0) == feed_forward  # 2 key/value heads over 4 ranks
    assert add_attention_heads(model, feed_forward, 2, 10**9) == feed_forward  # under min_shard_params
    gpt = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=32))
    gpt_plan = Plan(tuple(auto_plan(gpt, 2, 0)[0]))
    assert add_attention_heads(gpt, gpt_plan, 2, 0) == gpt_plan  # its fused query/key/value stays replicated
