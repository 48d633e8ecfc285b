"""The fake process group never leaks into a real run: a plan refuses to start inside one, leaves nothing behind,
and a real fit in the same processes afterwards runs on gloo with the strategy's meshes made afresh."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch.distributed as dist

from lightning_deepseek.planning import PlanLayout, StepShape, plan
from tests.helpers import run_distributed
from tests.planning.real_run import real_step
from tests.planning.test_against_real_runs import CLUSTER, DENSE

SMALL = StepShape(1, 16, "fp32", min_shard_params=0)


def _plan_inside_a_real_run(rank: int, world_size: int) -> str:
    try:
        plan(DENSE, 64, PlanLayout(tp=2), CLUSTER, SMALL)
    except RuntimeError as exc:
        dist.barrier()  # the real group still works
        return str(exc)
    return "planned"


def test_plan_refuses_inside_a_real_run() -> None:
    messages = run_distributed(_plan_inside_a_real_run, 2)
    assert all("already initialised" in m for m in messages), messages


def _plan_then_fit(rank: int, world_size: int, store_path: str) -> dict[str, Any]:
    dist.destroy_process_group()  # this rank as a fresh process: nothing initialised
    planned = plan(DENSE, 64, PlanLayout(tp=2), CLUSTER, SMALL)
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size)
    result = real_step(DENSE, PlanLayout(tp=2), world_size, 1, 16, CLUSTER.gpus_per_node)
    return {"backend": dist.get_backend(), "planned_world": planned.world_size, "params": result["params"]}


def test_real_fit_after_a_plan_in_the_same_process() -> None:
    store = os.path.join(tempfile.mkdtemp(prefix="lds-plan-"), "store")
    results = run_distributed(_plan_then_fit, 2, store, timeout=300)
    assert all(r["backend"] == "gloo" and r["planned_world"] == 64 for r in results), results


def test_plan_leaves_no_process_group() -> None:
    plan(DENSE, 8, PlanLayout(tp=2, shard_optimizer_states=True), CLUSTER, SMALL)
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="does not divide the world size"):
        plan(DENSE, 6, PlanLayout(tp=4), CLUSTER, SMALL)
    assert not dist.is_initialized()
