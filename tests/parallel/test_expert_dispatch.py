"""The per-island expert dispatch: the choice between flat and per-island, the island layout, the bad settings, the
expected rows per token; and, on real gloo processes, exactness and rows crossing islands.

The process runs (:func:`island_scenarios`) join the one 4-process spawn of ``test_expert_strategy.py``
(``four_ranks``), where the plain expert-parallel loop of ``test_expert.py`` over two declared islands of 2 ranks
runs 8 SGD steps with the balancing bias, against one process (losses, final weights and the first step's router
gradients within 1e-5 relative):
- per island at ep=4, unrestricted routing, islands ``0,1;2,3``;
- per island at ep=4 with node-limited routing ``max_islands_per_token=1``, islands ``0,2;1,3`` (interleaved: island
  groups 0,2 and 1,3, peer groups 0,1 and 2,3);
- per island at ep=2 x edp=2 across the nodes ``0,2;1,3`` (one rank per island in each group: island groups of
  one rank, two expert-parallel groups);
and the rows that crossed to another island (the expert ids of stage 1, counted at the collective) are exactly one
per (token, remote island used), fewer than the flat dispatch's one per (token, remote expert).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_deepseek.parallel import ExpertRouting, expert_dispatch
from lightning_deepseek.parallel.expert_dispatch import cross_island_rows, island_layout, resolve_dispatch
from lightning_deepseek.parallel.topology import parse_topology
from tests.parallel.test_expert import expert_parallel_run

TWO_NODES, INTERLEAVED = parse_topology("0,1;2,3"), parse_topology("0,2;1,3")
STEPS = 8


def test_auto_is_per_island_only_under_node_limited_routing_where_an_ep_group_spans_equal_islands() -> None:
    assert resolve_dispatch("auto", TWO_NODES, [[0, 1, 2, 3]], node_limited=True) == "per_island"
    assert resolve_dispatch("auto", INTERLEAVED, [[0, 1], [2, 3]], node_limited=True) == "per_island"  # ep=2 x edp=2
    assert resolve_dispatch("auto", TWO_NODES, [[0, 1, 2, 3]]) == "flat"  # unrestricted: its latency costs more
    assert resolve_dispatch("per_island", TWO_NODES, [[0, 1, 2, 3]]) == "per_island"
    assert resolve_dispatch("auto", TWO_NODES, [[0, 1], [2, 3]]) == "flat"  # ep inside the nodes
    assert resolve_dispatch("auto", parse_topology("0;1,2,3"), [[0, 1, 2, 3]]) == "flat"  # unequal islands
    assert resolve_dispatch("auto", None, [[0, 1, 2, 3]]) == "flat"
    assert resolve_dispatch("flat", TWO_NODES, [[0, 1, 2, 3]]) == "flat"


def test_per_island_where_it_cannot_be_names_the_fix() -> None:
    for topology, grid in ((TWO_NODES, [[0, 1], [2, 3]]), (parse_topology("0;1,2,3"), [[0, 1, 2, 3]]),
                           (None, [[0, 1]])):
        with pytest.raises(ValueError, match=r"expert_routing.dispatch='per_island' needs expert-parallel groups "
                                             r"that span islands of equal size.*or use "
                                             r"expert_routing.dispatch='auto' or 'flat'"):
            resolve_dispatch("per_island", topology, grid)


def test_unknown_dispatch_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"expert_routing.dispatch='tree' is not a dispatch: use 'auto'.*'flat'.*"
                                         r"'per_island'"):
        ExpertRouting(dispatch="tree")


def test_interleaved_islands_give_the_island_and_peer_groups() -> None:
    layout = island_layout(INTERLEAVED, [0, 1, 2, 3])
    assert layout.islands == (0, 1, 0, 1) and layout.equal
    assert layout.island_ranks(0) == [0, 2] and layout.island_ranks(1) == [1, 3]
    assert [layout.within(p) for p in range(4)] == [0, 0, 1, 1]
    assert layout.peer_ranks(0) == [0, 1] and layout.peer_ranks(1) == [2, 3]


def test_expected_rows_crossing_per_token() -> None:
    assert cross_island_rows(16, 2, 2, "flat") == 1.0
    assert cross_island_rows(16, 2, 2, "per_island") == pytest.approx(1 - 28 / 120)  # 1 - C(8,2)/C(16,2)
    assert cross_island_rows(16, 2, 2, "per_island", max_islands=1) == 0.5


class _CountCrossing:
    """Rows of stage 1 sent to another island (its int32 expert ids, one row per (token, island)), and the rows
    the routing implies: per island, one per (token, remote island used); flat, one per (token, remote expert)."""

    def __init__(self, topology: Any, rank: int) -> None:
        self.topology, self.rank = topology, rank
        self.counted = self.per_island = self.flat = 0
        self._original = expert_dispatch.all_to_all_single_autograd

    def __enter__(self) -> _CountCrossing:
        expert_dispatch.all_to_all_single_autograd = self._collective
        return self

    def __exit__(self, *exc: object) -> None:
        expert_dispatch.all_to_all_single_autograd = self._original

    def _collective(self, tensor: torch.Tensor, output_splits: list[int], input_splits: list[int],
                    group: dist.ProcessGroup) -> torch.Tensor:
        if tensor.dtype == torch.int32:
            mine = self.topology.island_of(self.rank)
            self.counted += sum(size for peer, size in zip(dist.get_process_group_ranks(group), input_splits)
                                if self.topology.island_of(peer) != mine)
        return self._original(tensor, output_splits, input_splits, group)

    def routed(self, module: torch.nn.Module, args: tuple) -> None:
        per_rank = module.num_global_experts // dist.get_world_size()
        islands = torch.tensor([self.topology.island_of(r) for r in range(dist.get_world_size())])
        used, mine = islands[args[1] // per_rank], self.topology.island_of(self.rank)
        self.flat += int((used != mine).sum())
        self.per_island += sum(len(set(row) - {mine}) for row in used.tolist())


def _counted_run(rank: int, world_size: int, topology: Any, max_islands: int | None) -> dict[str, Any]:
    from lightning_deepseek.moe.protocol import find_expert_layers
    from tests.parallel import test_expert

    counter = _CountCrossing(topology, rank)
    build = test_expert._model

    def model_with_hooks() -> torch.nn.Module:
        model = build()
        for layer in find_expert_layers(model):
            layer.experts.register_forward_pre_hook(counter.routed)
        return model

    test_expert._model = model_with_hooks
    try:
        with counter:
            run = expert_parallel_run(rank, world_size, 4, topology, max_islands, steps=STEPS)
    finally:
        test_expert._model = build
    rows = torch.tensor([counter.counted, counter.per_island, counter.flat])
    dist.all_reduce(rows)
    return {**run, "rows": rows.tolist()}


def island_scenarios(rank: int, world_size: int) -> dict[str, Any]:
    """The per-island runs of the 4-process spawn (see the module docstring)."""
    return {"unrestricted": _counted_run(rank, world_size, TWO_NODES, None),
            "limited": _counted_run(rank, world_size, INTERLEAVED, 1),
            "replicas": expert_parallel_run(rank, world_size, 2, INTERLEAVED, steps=STEPS)}


def check_island_runs(runs: dict[str, Any]) -> None:
    """The assertions on :func:`island_scenarios`' results (called by ``test_expert_strategy.py``)."""
    from tests.parallel.test_expert import _check

    _check(runs["unrestricted"], 4)
    _check(runs["limited"], 4, max_islands=1, groups=[0, 0, 1, 1, 0, 0, 1, 1])
    _check(runs["replicas"], 4)
    for run in (runs["unrestricted"], runs["limited"]):
        counted, per_island, flat = run["rows"]
        assert counted == per_island > 0  # one row per (token, remote island), nothing else crossed
        assert per_island < flat
    # node-limited: a token reaches one island, so at most one row crosses per token
    assert runs["limited"]["rows"][1] * 2 == runs["limited"]["rows"][2]
