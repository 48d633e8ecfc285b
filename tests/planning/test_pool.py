"""Layouts planned side by side (:mod:`lightning_deepseek.planning.pool`, ``search(workers=2)``): the same fitting
plans as one process, every candidate accounted for, a layout sharing stepped copies with one in flight waits for
its worker, and a worker's failure fails the search with the layout instead of hanging it."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_deepseek.planning import ModelSpec, PlanLayout
from lightning_deepseek.planning.pool import PlanPool, affinity
from lightning_deepseek.planning.report import PlanReport
from lightning_deepseek.planning.search import search
from tests.planning.test_cache import FAST, LAYOUTS
from tests.planning.test_depth import DENSE, STEP

PIPELINED = [PlanLayout(pp=2, activation_checkpointing=mode, pp_microbatches=count)
             for mode in ("none", "full") for count in (None, 4)]


def _numbers(report: PlanReport) -> PlanReport:
    return dataclasses.replace(report, plan_seconds=0.0)


def test_two_workers_plan_what_one_process_plans_and_prune_only_what_could_not_rank() -> None:
    layouts = [*LAYOUTS[0:2], LAYOUTS[5], *PIPELINED[:2], PlanLayout(tp=3)]  # tp=3: the strategy refuses it
    seen: list[PlanLayout] = []
    alone = search(DENSE, 4, FAST, STEP, layouts, top=2)
    side_by_side = search(DENSE, 4, FAST, STEP, layouts, top=2, workers=2, progress=lambda r: seen.append(r.layout))
    assert [_numbers(r) for r in side_by_side.fitting[:2]] == [_numbers(r) for r in alone.fitting[:2]]
    assert side_by_side.rejected == alone.rejected and "tensor_parallel_size" in alone.rejected[0][1]
    planned = [r.layout for r in side_by_side.fitting + side_by_side.not_fitting]
    assert sorted(seen, key=layouts.index) == sorted(planned, key=layouts.index)  # progress: each plan once
    assert {*planned, *(lay for lay, _ in side_by_side.pruned)} == set(layouts[:-1])
    # a layout pruned here and planned alone (the bounds grow in another order) did not rank there
    assert not {lay for lay, _ in side_by_side.pruned} & {r.layout for r in alone.fitting[:2]}


def test_a_layout_waits_for_the_worker_holding_its_cached_values_and_a_dead_worker_fails_the_search() -> None:
    """The micro-batch counts of one pipelined layout share its stepped copies, the checkpointing modes of a ZeRO-1
    layout its optimizer step: they go to one worker. A worker that exits without answering (as one the kernel's
    out-of-memory killer ends) fails the search with the layout it was planning, instead of hanging it."""
    assert affinity(PIPELINED[0]) == affinity(PIPELINED[1]) == affinity(PIPELINED[2])
    assert affinity(PIPELINED[0]) != affinity(dataclasses.replace(PIPELINED[0], tp=2))
    zbv, dual = (PlanLayout(pp=2, pp_schedule=s, reshard_after_forward=False) for s in ("ZBVZeroBubble", "DualPipeV"))
    assert affinity(zbv) == affinity(dual) != affinity(dataclasses.replace(zbv, pp_schedule="Interleaved1F1B"))
    zero1, zero1_full = LAYOUTS[0], LAYOUTS[1]
    with PlanPool(2, DENSE, 4, FAST, STEP, "representative") as pool:
        pool.submit(0, 0, zero1)
        assert pool.idle() == [1] and pool.busy
        assert not pool.takes(1, zero1_full) and pool.takes(0, zero1_full)
        assert pool.takes(1, LAYOUTS[5])
        index, layout, report = pool.result()
        assert (index, layout) == (0, zero1) and isinstance(report, PlanReport) and not pool.busy
        pool.submit(1, 5, LAYOUTS[5])
        pool._processes[1].kill()
        with pytest.raises(RuntimeError, match=r"planning dp=2 tp=2 fsdp=2x2 exited with code -9 before answering"):
            pool.result()


def test_a_failing_plan_fails_the_search_with_its_layout() -> None:
    broken = ModelSpec("broken", "lds", {"no_such_field": 1})  # GPTConfig refuses it: a TypeError, not a refusal
    with pytest.raises(RuntimeError, match=r"(?s)planning dp=\d tp=\d failed in an lds-plan worker.*no_such_field"):
        search(broken, 4, FAST, STEP, [PlanLayout(), PlanLayout(tp=2)], cache=False, workers=2)


def test_workers_must_be_positive() -> None:
    with pytest.raises(ValueError, match="workers=0 must be a positive number"):
        search(DENSE, 4, FAST, STEP, LAYOUTS, workers=0)
