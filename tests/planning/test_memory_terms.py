"""The memory terms of a plan's report: the caching allocator's reserved estimate over the tensors' peak, and what
``fits`` is judged on."""

from __future__ import annotations

import pytest

from lightning_deepseek.planning.layout import PlanLayout, StepShape
from lightning_deepseek.planning.report import ALLOCATOR_RESERVE, GIB, PlanReport, RankMemory

# torchtitan's 8B eager rows the reserve is calibrated on: published reserved GiB over the same step's tensors' peak
CALIBRATION_ROWS = {"FSDP8": (82.4, 68.6), "FSDP128": (67.0, 58.1)}


def report(steady_peak: int, capacity: int) -> PlanReport:
    memory = RankMemory(params=1, grads=1, states=2, states_max=2, activations=3, ddp_buckets=0,
                        peak=steady_peak - 2, steady_peak=steady_peak)
    return PlanReport(model="m", world_size=8, layout=PlanLayout(dp_shard=8), cluster="h100", step=StepShape(),
                      placement="tp_intra_node", num_sharded_layers=0, memory=memory, memory_capacity=capacity,
                      traffic=(), flops=1.0, compute_seconds=1.0, optimizer_seconds=0.0, comm_seconds=0.0,
                      step_seconds=1.0, tokens_per_second_per_gpu=1.0, mfu=0.1, plan_seconds=0.0, assumptions=())


def test_reserved_is_the_later_steps_peak_times_the_allocator_reserve() -> None:
    r = report(10 * GIB, 80 * GIB)
    assert r.memory.reserved == int(10 * GIB * ALLOCATOR_RESERVE)
    assert r.to_dict()["memory"]["reserved"] == r.memory.reserved
    assert f"reserved by the caching allocator, later steps (x{ALLOCATOR_RESERVE}, estimate) | " \
           f"{r.memory.reserved / GIB:,.2f} |" in r.table()


def test_fits_is_judged_on_the_tensors_not_the_reserve() -> None:
    # the allocator frees its cache and retries before it runs out: a reserve over capacity is no OOM
    r = report(75 * GIB, 80 * GIB)
    assert r.memory.reserved > r.memory_capacity and r.fits


@pytest.mark.parametrize("row", sorted(CALIBRATION_ROWS))
def test_the_reserve_lies_within_the_rows_it_is_calibrated_on(row: str) -> None:
    published, tensors = CALIBRATION_ROWS[row]
    assert abs(tensors * ALLOCATOR_RESERVE / published - 1) < 0.03
