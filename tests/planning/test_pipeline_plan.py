"""Pipelined plans without a process group of their own: the schedules' orders (1F1B's written out, torch's tables
replayed), and one large-world plan of each of two schedules (1,024 fake ranks, FSDP2 over each stage's 256 ``dp``
ranks): the micro-batches each stage holds in flight as torch's tables give them, the point-to-point bytes per step,
the model states per pipeline rank, and the smaller bubble of the interleaved schedule; sequence parallelism's
collectives and smaller activations (a tiny HF Llama at pp=2 x tp=2)."""

from __future__ import annotations

import pytest

from lightning_deepseek.models.config import PRESETS
from lightning_deepseek.planning import ModelSpec, PlanLayout, StepShape, plan
from lightning_deepseek.planning.bounds import ParameterShards, _mean_compute
from lightning_deepseek.planning.cache import PlanCache
from lightning_deepseek.planning.cluster import ClusterSpec
from lightning_deepseek.planning.schedule import held_forwards, one_f_one_b, replay
from lightning_deepseek.planning.search import pipelined_layouts
from tests.planning.test_against_real_runs import MOE

DEEP = ModelSpec("lds-tiny-8", "lds", dict(PRESETS["tiny"], n_layer=8))
TINY = ModelSpec("lds-tiny", "lds", dict(PRESETS["tiny"]))
H100 = ClusterSpec.from_mapping(dict(name="h100-like", gpus_per_node=8, peak_tflops={"bf16": 989.5},
                                     memory_gib=79.6, memory_bandwidth_gbs=3350,
                                     links={"intra": {"bandwidth_gbs": 450, "latency_us": 3},
                                            "inter": {"bandwidth_gbs": 50, "latency_us": 5}}), "test")
MICRO, SEQ, WORLD, PP, M = 2, 64, 1024, 4, 8


def test_one_f_one_b_order_and_bubble() -> None:
    order = one_f_one_b(PP, M)
    assert {rank: held_forwards(actions) for rank, actions in order.items()} == {r: {r: PP - r} for r in range(PP)}
    cost = {(kind, stage): seconds for stage in range(PP) for kind, seconds in (("F", 1.0), ("B", 2.0))}
    run = replay(order, {stage: stage for stage in range(PP)}, cost)
    assert run.makespan == pytest.approx((M + PP - 1) * 3.0)  # the (P - 1) / (M + P - 1) bubble of 1F1B
    assert run.busy == {r: M * 3.0 for r in range(PP)}
    delayed = replay(order, {stage: stage for stage in range(PP)}, cost, {("F", 0): 0.5})
    assert delayed.makespan > run.makespan and delayed.busy == run.busy  # stage 0's outputs reach stage 1 later
    # an overlapped pair (DualPipeV's F&B) starts when the inputs of both its actions are there
    paired = replay(order, {stage: stage for stage in range(PP)}, cost, together={("F", 0, PP - 1): ("B", 0, 0)})
    assert paired.makespan > run.makespan and paired.busy == run.busy


def test_large_world_pipelined_plans() -> None:
    step = StepShape(MICRO, SEQ, "bf16")
    reports = {schedule: plan(DEEP, WORLD, PlanLayout(pp=PP, pp_schedule=schedule, pp_microbatches=M,
                                                      dp_shard=WORLD // PP), H100, step)
               for schedule in ("1F1B", "Interleaved1F1B")}
    one, interleaved = reports["1F1B"].pipeline, reports["Interleaved1F1B"].pipeline
    assert one is not None and interleaved is not None
    assert {s.stage: s.in_flight for s in one.stages} == {0: 4, 1: 3, 2: 2, 3: 1}
    # torch's ScheduleInterleaved1F1B table at 4 ranks and 8 micro-batches (stage s on rank s mod 4)
    assert {s.stage: s.in_flight for s in interleaved.stages} == {0: 8, 1: 8, 2: 7, 3: 5, 4: 4, 5: 4, 6: 3, 7: 1}
    assert interleaved.bubble_seconds / interleaved.makespan < one.bubble_seconds / one.makespan
    hidden_bytes = MICRO * SEQ * PRESETS["tiny"]["n_embd"] * 4  # FP32 hidden states per micro-batch
    shards = ParameterShards.of(DEEP, WORLD, step, (1,))
    for report, sends in ((reports["1F1B"], M), (reports["Interleaved1F1B"], 3 * M)):  # rank 0: its stages' sends
        worst = max(report.pipeline.ranks, key=lambda row: row.peak)
        assert worst.pp_rank == 0 and report.memory.steady_peak == worst.peak
        sent = {(t.dim, t.op): t.num_bytes for t in report.traffic}
        assert sent["pp", "send"] == sent["pp", "recv"] == sends * hidden_bytes
        assert sent["dp", "reduce_scatter"] > 0 and sent["dp", "all_gather"] > 0  # FSDP2 over each stage's dp
        least = shards.least_states(report.layout)  # layout=auto's bound
        assert least is not None and least <= max(row.params + row.grads + row.states for row in report.pipeline.ranks)
        for row in report.pipeline.ranks:
            assert row.grads == row.params and row.states >= 2 * row.params
            assert row.peak >= row.params + row.states + row.grads + row.activations + row.buffers


def test_fsdp_bf16_policy_halves_gathers_and_hidden_states() -> None:
    """``fsdp_bf16``: FSDP2's units under the BF16 stage policy gather half the bytes and, in a pipeline, send BF16
    hidden states; the reduce-scatters stay FP32."""
    layouts = (PlanLayout(dp_shard=4), PlanLayout(pp=2, dp_shard=2))
    for layout in layouts:
        plain, bf16 = ({(t.dim, t.op): t.num_bytes for t in plan(TINY, 4, layout, H100, StepShape(
            MICRO, SEQ, "bf16", fsdp_bf16=policy)).traffic} for policy in (False, True))
        for key, num_bytes in plain.items():
            if layout.pp > 1 and key[1] not in ("send", "recv"):  # the most loaded rank's: it may change
                continue
            expected = num_bytes // 2 if key[1] in ("all_gather", "send", "recv") else num_bytes
            assert bf16[key] == expected, (layout, key, num_bytes, bf16[key])
    with pytest.raises(ValueError, match="fsdp_bf16=True needs dtype='bf16'"):
        StepShape(MICRO, SEQ, "fp32", fsdp_bf16=True)


LLAMA = ModelSpec("llama-tiny", "hf", dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          tie_word_embeddings=False))


def test_sequence_parallel_plan_holds_a_slice_of_the_tokens() -> None:
    step = StepShape(1, SEQ, "bf16", min_shard_params=0)
    reports = {sp: plan(LLAMA, 8, PlanLayout(tp=2, pp=2, pp_microbatches=4, activation_checkpointing="full",
                                             sequence_parallel=sp), H100, step) for sp in (False, True)}
    tp = {sp: {t.op: t.num_bytes for t in r.traffic if t.dim == "tp"} for sp, r in reports.items()}
    assert set(tp[False]) == {"all_reduce"} and set(tp[True]) == {"all_gather", "reduce_scatter", "all_reduce"}
    assert tp[True]["all_reduce"] < tp[False]["all_reduce"] / 10  # only the blocks' norms' gradients, once per step
    first = {sp: r.pipeline.stages[0].activations for sp, r in reports.items()}  # per micro-batch, stage 0
    assert first[True] < first[False]
    assert reports[True].memory.params == reports[False].memory.params


def test_loss_parallel_plan_shards_the_vocabulary_and_search_turns_it_on() -> None:
    step = StepShape(1, SEQ, "bf16", min_shard_params=0)
    reports = {lp: plan(LLAMA, 8, PlanLayout(tp=2, pp=2, pp_microbatches=4, sequence_parallel=True, loss_parallel=lp),
                        H100, step) for lp in (False, True)}
    # each pipeline rank holds one of the embedding and the head (128 x 64, FP32): half of it per tp rank
    assert [a.params - b.params for a, b in zip(reports[False].pipeline.ranks, reports[True].pipeline.ranks)] == [
        128 * 64 // 2 * 4] * 2
    least = ParameterShards.of(LLAMA, 8, step, (2,)).least_states(reports[True].layout)  # layout=auto's bound holds
    assert least is not None and least <= max(r.params + r.grads + r.states for r in reports[True].pipeline.ranks)
    layouts = pipelined_layouts(8, [1, 2, 4], 4, vocab_size=6)  # 4 does not divide a vocabulary of 6
    assert {(layout.tp, layout.loss_parallel) for layout in layouts} == {(1, False), (2, True), (4, False)}


def test_micro_batch_counts_are_an_axis_sharing_the_stepped_stages() -> None:
    """More micro-batches shrink the bubble's share and add torch's receive buffers; the stages are stepped once for
    every count (``PlanCache``: a count only composes the schedule anew)."""
    layouts = [layout for layout in pipelined_layouts(4, [1], 8) if layout.pp_schedule == "1F1B" and layout.pp == 2
               and layout.dp_shard == 1 and not layout.shard_optimizer_states and layout.bits is None
               and layout.activation_checkpointing == "none"]
    assert [layout.num_microbatches for layout in layouts] == [2, 4, 8]
    cache, step = PlanCache(), StepShape(MICRO, SEQ, "bf16")
    reports = [plan(DEEP, 4, layouts[0], H100, step, cache=cache)]
    misses = cache.misses
    reports += [plan(DEEP, 4, layout, H100, step, cache=cache) for layout in layouts[1:]]
    assert cache.misses - misses == 2  # one action table per count, no stage stepped again
    shares = [r.pipeline.bubble_seconds / r.pipeline.makespan for r in reports]
    assert shares == sorted(shares, reverse=True) and shares[0] > 1.5 * shares[2]
    rates = [r.tokens_per_second_per_gpu for r in reports]
    assert rates == sorted(rates)
    buffers = [r.pipeline.ranks[1].buffers for r in reports]  # rank 1 receives every micro-batch's hidden states
    assert buffers == [buffers[0], 2 * buffers[0], 4 * buffers[0]] and buffers[0] > 0


def test_stage_compute_per_token_depends_on_neither_pp_schedule_micro_batches_nor_sharding() -> None:
    """What layout=auto's bound by the average rank's compute assumes under a pipeline (``bounds._mean_compute``)."""
    step = StepShape(MICRO, SEQ, "bf16")
    layouts = [PlanLayout(pp=2), PlanLayout(pp=2, pp_microbatches=4, dp_shard=2),
               PlanLayout(pp=4, pp_schedule="Interleaved1F1B"), PlanLayout(pp=2, pp_schedule="DualPipeV")]
    cache = PlanCache()
    per_token = {_mean_compute(r) / (r.tokens_per_second_per_gpu * r.step_seconds)
                 for r in (plan(DEEP, 4, layout, H100, step, cache=cache) for layout in layouts)}
    assert max(per_token) == pytest.approx(min(per_token), rel=1e-9)
    checkpointed = plan(DEEP, 4, PlanLayout(pp=2, activation_checkpointing="full"), H100, step, cache=cache)
    assert _mean_compute(checkpointed) / (checkpointed.tokens_per_second_per_gpu * checkpointed.step_seconds) > max(
        per_token)


def test_pipelined_candidates_hold_experts_and_zero1_and_their_bound_holds() -> None:
    """``layout=auto``'s pipelined axes: ``tp`` or ``ep`` inside the stages (not both: the strategy refuses it),
    unsharded, ZeRO-1 or FSDP2, ``pp`` up to 16, compression where the stages are replicated (no tp, ep or FSDP2,
    ``dp > 1``: what the strategy composes it with); the bound of model states before planning stays below the
    planned ones of expert-parallel stages."""
    layouts = pipelined_layouts(32, [1, 2], 32, eps=(1, 2))
    assert {layout.pp for layout in layouts} == {2, 4, 8, 16}
    assert {(layout.tp, layout.ep) for layout in layouts} == {(1, 1), (2, 1), (1, 2)}
    assert {(layout.shard_optimizer_states, layout.dp_shard > 1) for layout in layouts} == {
        (False, False), (True, False), (False, True)}
    replicated = [lay for lay in layouts if (lay.tp, lay.ep, lay.dp_shard) == (1, 1, 1) and lay.pp < 32]
    assert sorted(lay.bits or 0 for lay in replicated) == sorted([0, 4, 8] * (len(replicated) // 3))
    assert all(lay.bits is None for lay in layouts if lay not in replicated)
    step = StepShape(MICRO, SEQ, "bf16")
    shards = ParameterShards.of(MOE, 4, step, (1,))
    for layout in (PlanLayout(pp=2, ep=2), PlanLayout(pp=2, ep=2, shard_optimizer_states=True),
                   PlanLayout(pp=2, ep=2, dp_shard=2)):
        ranks = plan(MOE, 4, layout, H100, step).pipeline.ranks
        least = shards.least_states(layout)
        assert least is not None and least <= max(row.params + row.grads + row.states for row in ranks), layout
