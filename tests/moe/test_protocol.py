"""The MoE protocol on its own (no process group): transformers' plan vocabularies of every 5.x release, the two
calling conventions, registration and its errors, torchtitan's experts and bias found as they are."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_deepseek.moe import ExpertLoadBalancing, find_expert_layers, register_experts
from lightning_deepseek.moe.balancing import LoadCounter
from lightning_deepseek.moe.protocol import declared_experts
from lightning_deepseek.parallel.declared import feed_forward_role
from tests.moe.grouped_models import NUM_EXPERTS, UserGroupedExperts, build

_ATTN = {f"layers.*.self_attn.{n}_proj": "colwise" for n in "qkv"} | {"layers.*.self_attn.o_proj": "rowwise"}
_MLP = {"layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"}
EXPERTS = "layers.*.mlp.experts"
STACKED = ("gate_up_proj", "down_proj")
# Plans as transformers' model configs declare them (Mixtral unless named), oldest release first, with the names
# that must be stacked parameters of the module for it to be an experts module.
PLANS = {
    "5.0 tp (gather, local_*)": (_ATTN | {"layers.*.mlp.gate": "ep_router", f"{EXPERTS}.gate_up_proj": "local_colwise",
                                          f"{EXPERTS}.down_proj": "local_rowwise", EXPERTS: "gather"}, STACKED),
    "5.0 tp qwen3-moe": (_ATTN | _MLP | {f"{EXPERTS}.gate_up_proj": "local_rowwise",
                                         f"{EXPERTS}.down_proj": "local_rowwise", EXPERTS: "gather"}, STACKED),
    "5.0 tp gpt-oss (gather, grouped_gemm)": ({"layers.*.mlp.router": "ep_router", EXPERTS: "gather",
                                               f"{EXPERTS}.gate_up_proj": "grouped_gemm",
                                               f"{EXPERTS}.down_proj": "grouped_gemm"}, STACKED),
    "5.0 tp llama4 (local)": ({f"{EXPERTS}.gate_up_proj": "local_packed_rowwise",
                               f"{EXPERTS}.down_proj": "local_colwise", EXPERTS: "local"}, STACKED),
    "5.1-5.24 tp (moe_tp_experts)": (_ATTN | {f"{EXPERTS}.gate_up_proj": "packed_colwise",
                                              f"{EXPERTS}.down_proj": "rowwise", EXPERTS: "moe_tp_experts"}, ()),
    "5.3-5.22 ep (moe_tp_experts)": ({"layers.*.mlp.gate": "ep_router", f"{EXPERTS}.gate_up_proj": "grouped_gemm",
                                      f"{EXPERTS}.down_proj": "grouped_gemm", EXPERTS: "moe_tp_experts"}, ()),
    "5.19-5.25 ep (ep_dispatch_experts)": ({f"{EXPERTS}.gate_up_proj": "grouped_gemm",
                                            f"{EXPERTS}.down_proj": "grouped_gemm", EXPERTS: "ep_dispatch_experts"},
                                           ()),
}


@pytest.mark.parametrize("release", PLANS)
def test_every_5x_plan_vocabulary_names_its_experts(release: str) -> None:
    plan, stacked = PLANS[release]
    assert declared_experts(plan) == {EXPERTS: stacked}


@pytest.mark.parametrize("plan", [_ATTN | _MLP, {}], ids=["llama / qwen2-moe before 5.13", "empty"])
def test_plans_without_experts_name_none(plan: dict[str, str]) -> None:
    assert declared_experts(plan) == {}


class _Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.num_experts = 4
        self.gate_up_proj = nn.Parameter(torch.zeros(4, 8, 4))
        self.down_proj = nn.Parameter(torch.zeros(4, 4, 4))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                ) -> torch.Tensor:
        return hidden_states


def _hf_like(experts: nn.Module, **plans: dict[str, str]) -> nn.Module:
    """A model laid out as transformers' (``model.layers.0.mlp.experts``) declaring ``plans`` in its config."""
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList([nn.ModuleDict({"mlp": nn.ModuleDict({"experts": experts})})])
    model.base_model_prefix = "model"
    model.config = SimpleNamespace(**plans)
    return model


def test_experts_only_a_tp_plan_names_are_skipped_when_they_break_the_contract() -> None:
    """LongCat-Flash's experts (``moe_tp_experts`` in its TP plan, no ``num_experts``) stay replicated, as before
    plans were read; the same module named by an expert-parallel plan is an error naming the fix."""
    longcat = _Experts()
    del longcat.num_experts
    assert find_expert_layers(_hf_like(longcat, base_model_tp_plan={EXPERTS: "moe_tp_experts"})) == []
    with pytest.raises(TypeError, match="no positive int attribute `num_experts`"):
        find_expert_layers(_hf_like(longcat, base_model_ep_plan={EXPERTS: "ep_dispatch_experts"}))
    found = find_expert_layers(_hf_like(_Experts(), base_model_tp_plan={EXPERTS: "moe_tp_experts"}))
    assert [(layer.name, layer.convention) for layer in found] == [("model.layers.0.mlp.experts", "top_k")]


def test_a_5_0_container_style_on_a_dense_block_is_no_experts_module() -> None:
    """transformers 5.0's Llama-4 gives ``gather`` to its feed-forward and ``local_colwise`` to its linears, the
    styles it gives Mixtral's experts and their stacked weights: only the module holding them as parameters counts."""
    dense = nn.ModuleDict({"gate_proj": nn.Linear(4, 8), "up_proj": nn.Linear(4, 8), "down_proj": nn.Linear(8, 4)})
    moe = nn.ModuleDict({"experts": _Experts()})
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList([nn.ModuleDict({"feed_forward": dense}), nn.ModuleDict({"feed_forward": moe})])
    model.base_model_prefix = "model"
    model.config = SimpleNamespace(base_model_tp_plan={
        "layers.*.feed_forward": "gather", "layers.*.feed_forward.gate_proj": "local_colwise",
        "layers.*.feed_forward.up_proj": "local_colwise", "layers.*.feed_forward.down_proj": "local_rowwise",
        "layers.*.feed_forward.experts": "local", "layers.*.feed_forward.experts.gate_up_proj": "local_packed_rowwise",
        "layers.*.feed_forward.experts.down_proj": "local_colwise"})
    assert [layer.name for layer in find_expert_layers(model)] == ["model.layers.1.feed_forward.experts"]


@pytest.mark.parametrize(("style", "role"), [
    ("colwise", "up"), ("local_colwise", "up"), ("rowwise", "down"), ("local_rowwise", "down"),
    ("colwise_rep", None), ("colwise_gather_output", None), ("rowwise_rep", None), ("rowwise_split_input", None),
    ("packed_colwise", None), ("packed_rowwise", None), ("unit_colwise", None), ("unit_rowwise", None),
    ("embedding_rowwise", None), ("moe_tp_experts", None), ("grouped_gemm", None), ("ep_router", None),
    ("gather", None), ("mla_kv_a_proj", None), ("replicated_with_grad_allreduce", None)])
def test_declared_tensor_parallel_styles_taken_as_feed_forward(style: str, role: str | None) -> None:
    assert feed_forward_role(style) == role


class _TopK(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.num_experts = 2
        self.w = nn.Parameter(torch.zeros(2, 3, 3))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                ) -> torch.Tensor:
        return hidden_states


class _NoConvention(_TopK):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return hidden_states


def test_register_experts_reads_the_convention_from_forward() -> None:
    root = nn.ModuleDict({"a": register_experts(_TopK()), "b": register_experts(UserGroupedExperts())})
    assert [(layer.name, layer.convention) for layer in find_expert_layers(root)] == [("a", "top_k"), ("b", "grouped")]


def test_register_experts_takes_a_named_convention() -> None:
    module = register_experts(_NoConvention(), convention="grouped")
    assert find_expert_layers(nn.ModuleDict({"x": module}))[0].convention == "grouped"


def test_a_forward_fitting_no_convention_names_both() -> None:
    with pytest.raises(TypeError, match=r"fits no calling convention.*'top_k': forward\(hidden_states.*'grouped': "
                                        r"forward\(rows.*register_experts\(module, convention=\.\.\.\)"):
        register_experts(_NoConvention())


def test_an_unknown_convention_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"convention='sorted'.*use one of \('top_k', 'grouped'\)"):
        register_experts(_TopK(), convention="sorted")


def test_experts_without_stacked_parameters_name_the_fix() -> None:
    module = _TopK()
    module.w = nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(TypeError, match="no parameter whose leading dimension is num_experts=2"):
        register_experts(module)


def test_torchtitan_experts_and_bias_found_as_they_are() -> None:
    pytest.importorskip("torchtitan.models.common.moe", reason="torchtitan 0.3 (a test dependency, see Makefile)")
    model = build("titan")
    layers = find_expert_layers(model)
    assert [(layer.name, layer.convention, layer.num_experts) for layer in layers] == [
        (f"moes.{i}.routed_experts.inner_experts", "grouped", NUM_EXPERTS) for i in range(2)]
    assert all(layer.bias is model.moes[i].expert_bias_E for i, layer in enumerate(layers))


def test_grouped_layers_counted_from_their_token_counts() -> None:
    """The load counter adds the ``num_tokens_per_expert`` a grouped layer receives: its routed pairs."""
    model = build("user").train()
    counter = LoadCounter(find_expert_layers(model))
    tokens = torch.randint(0, 64, (3, 9), generator=torch.Generator().manual_seed(1))
    model(tokens)
    counts = counter.take()
    assert counts.shape == (2, NUM_EXPERTS) and (counts.sum(dim=1) == 3 * 9 * 2).all()  # tokens x top-k per layer
    counter.remove()


def test_balancing_warns_naming_what_it_looked_for() -> None:
    import lightning.pytorch as pl

    with pytest.warns(UserWarning, match="base_model_ep_plan / base_model_tp_plan.*torchtitan's GroupedExperts"):
        ExpertLoadBalancing().setup(pl.Trainer(logger=False, enable_checkpointing=False), pl.LightningModule(), "fit")
