"""The plan of each layout the strategy supports against one real step on 2 and 4 gloo processes (DDP, tensor and expert
parallelism, ZeRO-1, FSDP2 (with tp), HSDP, activation checkpointing, pipelines of every schedule and with tp, ep,
ZeRO-1, FSDP2 (with ep, and under the interleaved and V schedules) or ``GradientCompression`` (int8, and int4 with
ZeRO-1; a step past the warm-up), and HF Llama's attention heads and sequence parallelism at pp x tp: every pipeline
rank against the plan's row for it, at the second step): the model-state bytes per rank (parameters, gradients,
optimizer states, from the sharded tensors) exactly; the bytes per step of every (mesh dimension, collective)
exactly, except the expert all-to-all's token rows, which follow the real router's choices (the plan assumes uniform
routing): their relative error is bounded; and the peak of the step's allocations as torch's ``MemTracker`` sees them
within ``PEAK_TOLERANCE`` (the issue's target: 10%).
"""

from __future__ import annotations

from typing import Any

import pytest

from lightning_deepseek.models.config import PRESETS
from lightning_deepseek.planning import ModelSpec, PlanLayout, PlanReport, StepShape, plan
from lightning_deepseek.planning.cluster import ClusterSpec
from tests.helpers import run_distributed
from tests.planning.real_run import real_step

DENSE = ModelSpec("lds-tiny", "lds", dict(PRESETS["tiny"]))
DEEP = ModelSpec("lds-tiny-4", "lds", dict(PRESETS["tiny"], n_layer=4))  # two stages per rank (V, interleaved)
MOE = ModelSpec("mixtral-tiny", "hf", dict(model_type="mixtral", hidden_size=64, intermediate_size=128,
                                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                           vocab_size=256, max_position_embeddings=128, num_local_experts=4,
                                           num_experts_per_tok=2))
LLAMA = ModelSpec("llama-tiny", "hf", dict(model_type="llama", hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          vocab_size=256, max_position_embeddings=128, tie_word_embeddings=False))
CLUSTER = ClusterSpec.from_mapping(dict(name="two-per-node", gpus_per_node=2, peak_tflops={"fp32": 0.05},
                                        memory_gib=16, memory_bandwidth_gbs=20,
                                        links={"intra": {"bandwidth_gbs": 2, "latency_us": 30},
                                               "inter": {"bandwidth_gbs": 0.125, "latency_us": 100}}), "test")
MICRO, SEQ = 2, 32
CASES = {
    2: [("ddp", DENSE, PlanLayout()), ("tp=2", DENSE, PlanLayout(tp=2)),
        ("zero1", DENSE, PlanLayout(shard_optimizer_states=True)), ("ep=2", MOE, PlanLayout(ep=2)),
        ("fsdp=2", DENSE, PlanLayout(dp_shard=2)),
        ("fsdp=2 ac=full", DENSE, PlanLayout(dp_shard=2, activation_checkpointing="full")),
        ("pp=2", DENSE, PlanLayout(pp=2)),
        *[(f"pp=2 {name}", DEEP, PlanLayout(pp=2, pp_schedule=name))
          for name in ("Interleaved1F1B", "ZBVZeroBubble", "DualPipeV")],
        # the split backward with recomputation: the input part keeps the recomputed forward until the weight part
        ("pp=2 ZBVZeroBubble ac=full", DEEP, PlanLayout(pp=2, pp_schedule="ZBVZeroBubble",
                                                        activation_checkpointing="full"))],
    4: [("ddp", DENSE, PlanLayout()), ("tp=2", DENSE, PlanLayout(tp=2)),
        ("tp=2 zero1", DENSE, PlanLayout(tp=2, shard_optimizer_states=True)),
        ("ep=2 zero1", MOE, PlanLayout(ep=2, shard_optimizer_states=True)),
        ("fsdp=4", DENSE, PlanLayout(dp_shard=4)), ("hsdp=2x2", DENSE, PlanLayout(dp_shard=2)),
        ("fsdp=4 ac=full", DENSE, PlanLayout(dp_shard=4, activation_checkpointing="full")),
        ("fsdp=2 ep=2 ac=selective", MOE, PlanLayout(ep=2, dp_shard=2, activation_checkpointing="selective")),
        ("tp=2 fsdp=2", DENSE, PlanLayout(tp=2, dp_shard=2)),
        ("pp=2 dp=2", DENSE, PlanLayout(pp=2)), ("pp=2 fsdp=2", DENSE, PlanLayout(pp=2, dp_shard=2)),
        ("pp=2 dp=2 zero1", DENSE, PlanLayout(pp=2, shard_optimizer_states=True)),
        ("pp=2 dp=2 int8", DENSE, PlanLayout(pp=2, bits=8)), ("pp=2 dp=2 zero1 int4", DEEP,
                                                                PlanLayout(pp=2, shard_optimizer_states=True, bits=4)),
        ("pp=2 tp=2", DENSE, PlanLayout(pp=2, tp=2)), ("pp=2 ep=2", MOE, PlanLayout(pp=2, ep=2)),
        ("pp=2 ep=2 fsdp=2", MOE, PlanLayout(pp=2, ep=2, dp_shard=2)),
        *[(f"pp=2 {name} fsdp=2", DEEP, PlanLayout(pp=2, pp_schedule=name, dp_shard=2,
                                                   reshard_after_forward=name == "Interleaved1F1B"))
          for name in ("Interleaved1F1B", "ZBVZeroBubble", "DualPipeV")],
        ("pp=2 tp=2 sp", LLAMA, PlanLayout(pp=2, tp=2, sequence_parallel=True)),
        ("pp=2 tp=2 sp loss-parallel", LLAMA, PlanLayout(pp=2, tp=2, sequence_parallel=True, loss_parallel=True))],
}
ALL_TO_ALL_TOLERANCE = 0.5  # routing of a freshly initialised router on random tokens is far from uniform
PEAK_TOLERANCE = 0.10  # the peak's error is reported in benchmarks/planning/REPORT.md (0.0% bar the all-to-all's)


def _real_steps(rank: int, world_size: int) -> list[dict[str, Any]]:
    return [real_step(spec, layout, world_size, MICRO, SEQ, CLUSTER.gpus_per_node)
            for _, spec, layout in CASES[world_size]]


def _planned(spec: ModelSpec, layout: PlanLayout, world_size: int) -> tuple[dict[str, int],
                                                                         dict[tuple[str, str], int], PlanReport]:
    report = plan(spec, world_size, layout, CLUSTER, StepShape(MICRO, SEQ, "fp32", min_shard_params=0))
    memory = {"params": report.memory.params, "grads": report.memory.grads, "states": report.memory.states,
              "peak": report.memory.peak}
    traffic: dict[tuple[str, str], int] = {}
    for row in report.traffic:  # a (dimension, op) can appear in two phases of the step
        traffic[row.dim, row.op] = traffic.get((row.dim, row.op), 0) + row.num_bytes
    return memory, traffic, report


def _check_pipeline_ranks(name: str, report: PlanReport, real: list[dict[str, Any]], world_size: int) -> int:
    """Every pipeline rank's row against the real rank with that pipeline coordinate; returns the rank whose
    traffic the report gives (the most loaded)."""
    assert report.pipeline is not None
    stride = world_size // report.layout.pp
    for row in report.pipeline.ranks:
        measured = real[row.pp_rank * stride]
        planned = {"params": row.params, "grads": row.grads, "states": row.states, "buffers": row.buffers}
        assert planned == {k: measured[k] for k in planned}, (name, row, measured)
        assert abs(row.peak - measured["peak"]) <= PEAK_TOLERANCE * measured["peak"], (name, row, measured)
    return max(report.pipeline.ranks, key=lambda row: row.peak).pp_rank * stride


@pytest.mark.parametrize("world_size", [2, 4])
def test_plan_equals_real_step(world_size: int) -> None:
    real = run_distributed(_real_steps, world_size, timeout=600)  # rank 0: the rank the plan steps, or every pp rank
    for i, (name, spec, layout) in enumerate(CASES[world_size]):
        memory, traffic, report = _planned(spec, layout, world_size)
        measured = real[0][i]
        if layout.pp > 1:
            measured = real[_check_pipeline_ranks(name, report, [r[i] for r in real], world_size)][i]
        else:
            assert abs(memory["peak"] - measured["peak"]) <= PEAK_TOLERANCE * measured["peak"], (name, memory,
                                                                                                  measured)
        states = ("params", "grads", "states")
        assert {k: memory[k] for k in states} == {k: measured[k] for k in states}, (name, memory, measured)
        assert set(traffic) == set(measured["traffic"]), (name, traffic, measured["traffic"])
        for key, planned in traffic.items():
            got = measured["traffic"][key]
            if key[1] == "all_to_all":
                assert abs(planned - got) <= ALL_TO_ALL_TOLERANCE * got, (name, key, planned, got)
            else:
                assert planned == got, (name, key, planned, got)
