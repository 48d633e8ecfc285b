"""Representative layers (:mod:`lightning_deepseek.planning.depth`): a plan of a deep model from copies with three or
four blocks of each kind equals the plan that steps every block in model states, FLOPs and bytes per collective, and
its peak is within ``PEAK_TOLERANCE`` of it (the errors at the presets' scale are in benchmarks/planning/REPORT.md)."""

from __future__ import annotations

import pytest
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_deepseek.models.config import PRESETS
from lightning_deepseek.planning import ModelSpec, PlanLayout, StepShape, plan
from lightning_deepseek.planning.depth import layer_kinds
from tests.planning.test_against_real_runs import CLUSTER

DENSE = ModelSpec("lds-tiny-6", "lds", {**PRESETS["tiny"], "n_layer": 6})
MIXED = ModelSpec("deepseek-v3-tiny", "hf", dict(
    model_type="deepseek_v3", hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=8,
    first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
    qk_nope_head_dim=8, v_head_dim=16, vocab_size=256, max_position_embeddings=128))
STEP = StepShape(2, 32, "fp32", min_shard_params=0)
PEAK_TOLERANCE = 0.05


def test_layer_kinds() -> None:
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = MIXED.build()
    kinds = layer_kinds(model)  # outside the mode, as the planner: block detection probes norms with real tensors
    assert kinds.kinds == (0, 0, 1, 1, 1, 1, 1, 1) and kinds.base == (0, 1, 2, 3, 4)
    assert kinds.with_one_more(1) == (0, 1, 2, 3, 4, 5)
    assert kinds.extended == [1] and kinds.worth_it


@pytest.mark.parametrize(("spec", "layout"), [
    (DENSE, PlanLayout()), (DENSE, PlanLayout(tp=2, shard_optimizer_states=True)),
    (DENSE, PlanLayout(dp_shard=4, activation_checkpointing="full")),
    (MIXED, PlanLayout(ep=2, shard_optimizer_states=True)),
    (MIXED, PlanLayout(ep=2, dp_shard=2, activation_checkpointing="selective")),  # experts: an FSDP unit inside
])
def test_representative_equals_full(spec: ModelSpec, layout: PlanLayout) -> None:
    full = plan(spec, 4, layout, CLUSTER, STEP, depth="full")
    representative = plan(spec, 4, layout, CLUSTER, STEP)
    for name in ("params", "grads", "states", "states_max", "ddp_buckets"):
        assert getattr(representative.memory, name) == getattr(full.memory, name), name
    assert representative.flops == full.flops
    assert {(t.dim, t.op, t.calls, t.num_bytes) for t in representative.traffic} == {
        (t.dim, t.op, t.calls, t.num_bytes) for t in full.traffic}
    assert abs(representative.memory.peak - full.memory.peak) <= PEAK_TOLERANCE * full.memory.peak


DEEP = ModelSpec("lds-tiny-16", "lds", {**PRESETS["tiny"], "n_layer": 16})  # 8 blocks a stage at pp=2: 3 + 4 stepped
LLAMA = ModelSpec("llama-tiny-10", "hf", dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=128,
                                              num_hidden_layers=10, num_attention_heads=4, num_key_value_heads=2,
                                              tie_word_embeddings=False))


@pytest.mark.parametrize(("spec", "layout"), [
    (DEEP, PlanLayout(pp=2, dp_shard=2)),
    (LLAMA, PlanLayout(tp=2, pp=2, activation_checkpointing="full", sequence_parallel=True)),  # hooks on stage ends
    (DEEP, PlanLayout(pp=2, shard_optimizer_states=True, bits=8)),  # copies without ZeRO-1 and compression
])
def test_representative_stages_equal_full(spec: ModelSpec, layout: PlanLayout) -> None:
    """Pipelined plans (:mod:`lightning_deepseek.planning.stage_depth`): every pipeline rank's states and every
    stage's activations equal, the step's FLOPs and bytes too, the peaks within ``PEAK_TOLERANCE``."""
    full = plan(spec, 4, layout, CLUSTER, STEP, depth="full")
    representative = plan(spec, 4, layout, CLUSTER, STEP)
    assert full.pipeline is not None and representative.pipeline is not None
    for row, other in zip(full.pipeline.ranks, representative.pipeline.ranks):
        assert (row.params, row.grads, row.states, row.buffers) == (other.params, other.grads, other.states,
                                                                     other.buffers)
        assert abs(row.peak - other.peak) <= PEAK_TOLERANCE * row.peak
    assert [s.activations for s in full.pipeline.stages] == [s.activations for s in representative.pipeline.stages]
    assert representative.flops == full.flops
    assert {(t.dim, t.op, t.calls, t.num_bytes) for t in representative.traffic} == {
        (t.dim, t.op, t.calls, t.num_bytes) for t in full.traffic}
    assert abs(representative.memory.steady_peak - full.memory.steady_peak) <= PEAK_TOLERANCE * full.memory.steady_peak


def test_unknown_depth() -> None:
    with pytest.raises(ValueError, match="depth='shallow' must be one of"):
        plan(DENSE, 4, PlanLayout(), CLUSTER, STEP, depth="shallow")
