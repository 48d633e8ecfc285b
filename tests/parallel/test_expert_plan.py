"""The expert plan value and ``expert_parallel_size="auto"``, without processes."""

from __future__ import annotations

import pytest
import torch

from lightning_deepseek import HybridParallelStrategy
from lightning_deepseek.moe.protocol import ExpertLayer
from lightning_deepseek.parallel.dims import ParallelDims
from lightning_deepseek.parallel.expert import all_to_all_bytes
from lightning_deepseek.parallel.expert_plan import ExpertParallelPlan, resolve_ep_size


def _layers(*counts: int) -> list[ExpertLayer]:
    return [ExpertLayer(f"layers.{i}.experts", torch.nn.Module(), n, None) for i, n in enumerate(counts)]


@pytest.mark.parametrize(("local", "world", "counts", "expected"), [
    (8, 16, (64, 64), 8),   # a node's 8 ranks share the experts
    (4, 8, (6,), 2),        # the largest size that divides the expert count and stays inside a node
    (2, 4, (), 1),          # no MoE layer: no expert parallelism, no warning
])
def test_per_node_keeps_expert_groups_inside_a_node(local: int, world: int, counts: tuple, expected: int) -> None:
    assert resolve_ep_size("per_node", world, local, _layers(*counts)) == expected
    assert resolve_ep_size(2, world, local, _layers(*counts)) == 2


def test_plan_reports_bytes_per_rank_against_ddp() -> None:
    plan = ExpertParallelPlan(ParallelDims(4, ep=2), mesh=object(), layers=(("a", 8), ("b", 8)),
                              expert_bytes=800, other_bytes=200)
    assert plan.local_expert_bytes == 400
    assert plan.param_bytes_vs_ddp == pytest.approx(0.6)
    assert "expert parameters per rank: 0.00 MiB of 0.00 MiB" in plan.table()
    assert plan.summary()["expert_parallel"] == "ep=2 x edp=2, 2 MoE layers"


def test_all_to_all_formula() -> None:
    # 32 tokens x top-2 x 128 wide fp32, half of it leaves the rank at ep=2, four times (dispatch, return, x2 in bwd)
    assert all_to_all_bytes(32, 2, 128, 2, 4) == 4 * 32 * 2 * 128 * 4 // 2


@pytest.mark.parametrize("value", [0, -2, "4", 1.5])
def test_bad_expert_parallel_size_names_the_setting(value: object) -> None:
    with pytest.raises(ValueError, match=f"expert_parallel_size={value!r} must be a positive integer, 'auto'"):
        HybridParallelStrategy(expert_parallel_size=value)
