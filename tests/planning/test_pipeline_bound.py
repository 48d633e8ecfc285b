"""A pipelined layout's peak bound before any step (:mod:`lightning_deepseek.planning.pipeline_bound`): below the
plan's peak under every schedule, with ZeRO-1, FSDP2, tensor parallelism with sequence and loss parallelism, and
expert parallelism; a search leaves unplanned what it bounds over the device and plans what fits."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_deepseek.planning import ModelSpec, PlanLayout, plan
from lightning_deepseek.planning.pipeline import V_SCHEDULES
from lightning_deepseek.planning.pipeline_bound import PipelinePeaks
from lightning_deepseek.planning.search import search
from tests.planning.test_cache import FAST
from tests.planning.test_depth import DEEP, LLAMA, MIXED, STEP


def _layout(schedule: str) -> tuple[ModelSpec, PlanLayout]:
    """One layout per schedule, each with other parallelisms (CI's time; 47 pairs of schedule, layout and step shape,
    FSDP2's BF16 policy among them, were checked by hand: the bound 0.19 to 0.85 of the peak)."""
    v = schedule in V_SCHEDULES
    common = dict(pp_schedule=schedule, reshard_after_forward=not v)
    return {"1F1B": (DEEP, PlanLayout(pp=4, shard_optimizer_states=True, activation_checkpointing="full", **common)),
            "Interleaved1F1B": (DEEP, PlanLayout(pp=2, dp_shard=4, activation_checkpointing="full", **common)),
            "ZBVZeroBubble": (LLAMA, PlanLayout(tp=2, pp=2, sequence_parallel=True, loss_parallel=True, **common)),
            "DualPipeV": (MIXED, PlanLayout(ep=2, pp=2, activation_checkpointing="full", **common))}[schedule]


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"])
def test_bound_is_below_the_planned_peak(schedule: str) -> None:
    model, layout = _layout(schedule)
    peak = plan(model, 8, layout, FAST, STEP).memory.steady_peak
    bound = PipelinePeaks(model, 8, STEP).least_peak(layout)
    assert 0.25 * peak < bound <= peak, (layout, bound, peak)


def test_search_prunes_by_the_bound_and_keeps_what_fits() -> None:
    """A device between the peak of 1F1B at 2 micro-batches and the bound at 64 (each adds receive buffers): the
    search plans the first, which fits, and prunes the second unplanned."""
    layouts = [PlanLayout(pp=2, pp_microbatches=m, activation_checkpointing="full") for m in (2, 64)]
    fits = plan(DEEP, 8, layouts[0], FAST, STEP)
    bound = PipelinePeaks(DEEP, 8, STEP).least_peak(layouts[1])
    assert fits.memory.steady_peak < bound
    cluster = dataclasses.replace(FAST, memory_gib=(fits.memory.steady_peak + bound) / 2 / 2**30)
    result = search(DEEP, 8, cluster, STEP, layouts)
    assert [lay for lay, _ in result.pruned] == [layouts[1]] and "on a pipeline rank" in result.pruned[0][1]
    assert [dataclasses.replace(r, plan_seconds=0.0, memory_capacity=0) for r in result.fitting] == [
        dataclasses.replace(fits, plan_seconds=0.0, memory_capacity=0)]
