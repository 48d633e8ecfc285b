"""``ParallelDims``: validated once at construction, derived sizes as properties, built without a process group;
``WorldMesh``: every mesh over one rank order, fetched by name (real processes)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch.distributed as dist

from lightning_deepseek.parallel import ParallelDims
from tests.helpers import run_distributed


def test_derived_sizes() -> None:
    dims = ParallelDims(world_size=8, tp=2)
    assert (dims.dp, dims.tp, dims.ep, dims.edp, dims.tp_enabled, dims.ep_enabled) == (4, 2, 1, 8, True, False)
    assert ParallelDims(world_size=4, tp=1, ep=4).ep_enabled


def test_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        ParallelDims(world_size=2, tp=2).tp = 1


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(world_size=4, tp=3), r"tensor_parallel_size=3 does not divide the world size 4. Choose one of \[1, 2, 4\]"),
    (dict(world_size=4, tp=0), "tensor_parallel_size=0 must be a positive integer"),
    (dict(world_size=6, ep=4), r"expert_parallel_size=4 does not divide the world size 6. Choose one of \[1, 2, 3"),
    (dict(world_size=0), "world_size=0 must be a positive integer"),
])
def test_bad_sizes_name_the_setting_and_the_fix(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ParallelDims(**kwargs)


def test_mesh_order_must_hold_every_rank_once() -> None:
    with pytest.raises(ValueError, match=r"rank order \[0, 0, 1, 2\] is not a permutation of the 4 ranks"):
        ParallelDims(world_size=4, tp=2).build_mesh("cpu", [0, 0, 1, 2])


def _views(rank: int, world_size: int) -> dict[str, Any]:
    mesh = ParallelDims(world_size, tp=2, ep=2).build_mesh("cpu", [0, 2, 1, 3])  # placement's order

    def ranks(names: Any) -> list[int]:
        return sorted(dist.get_process_group_ranks(mesh[names].get_group()))
    views = {"tp": ranks("tp"), "dp": ranks("dp"), "ep": ranks("ep"), "edp": ranks("edp"),
             "dense": mesh["dp", "tp"].mesh.tolist(), "expert": mesh["edp", "ep"].mesh.tolist(),
             "same": mesh["edp", "ep"] is mesh.expert and mesh["dp", "tp"] is mesh.dense}
    return _after_every_rank(views)


def _after_every_rank(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` once every rank has built its groups: a rank that returned first would close the store (rank 0's)
    that a slower one still connects its groups through ("Connection reset by peer")."""
    dist.barrier()
    return result


def test_every_view_is_cut_from_the_same_rank_order_on_real_processes() -> None:
    results = run_distributed(_views, 4)
    assert results[0]["dense"] == [[0, 2], [1, 3]] and results[0]["expert"] == [[0, 2], [1, 3]]
    tp_groups = {0: [0, 2], 2: [0, 2], 1: [1, 3], 3: [1, 3]}
    for rank, views in enumerate(results):
        assert views["tp"] == tp_groups[rank] and views["ep"] == tp_groups[rank] and views["same"]
        assert views["dp"] == views["edp"] == ([0, 1] if rank in (0, 1) else [2, 3])


def test_an_unknown_view_names_the_dimensions() -> None:
    from lightning_deepseek.parallel.dims import WorldMesh

    with pytest.raises(KeyError, match="no mesh dimension 'pp'"):
        WorldMesh(ParallelDims(1), "cpu", (0,), dense=None)["pp"]  # type: ignore[arg-type]


def test_shard_split_gives_every_parameter_the_same_replicas() -> None:
    # 8 ranks, shard groups of 4: a tp=2 shard over 2 of its 4 replicas, replicated across the 2 groups
    dims = ParallelDims(world_size=8, tp=2, ep=4, dp_shard=4)
    assert (dims.dp_replicate, dims.shard_split(2), dims.shard_split(4)) == (2, (2, 2), (2, 1))
    assert ParallelDims(world_size=8, tp=4, dp_shard=2).shard_split(4) == (2, 1)  # tp spans whole shard groups
    assert ParallelDims(world_size=8, tp=2, dp_shard=8).shard_split(2) == (1, 4)  # FSDP over all: no replication


def test_a_shard_size_that_cuts_a_model_parallel_group_names_the_setting_and_the_fix() -> None:
    with pytest.raises(ValueError, match=r"data_parallel_shard_size=6 with expert_parallel_size=4: one must divide "
                       r"the other .* Choose data_parallel_shard_size among \[1, 2, 4, 12\]"):
        ParallelDims(world_size=12, ep=4, dp_shard=6)


def _shard_views(rank: int, world_size: int) -> dict[str, Any]:
    mesh = ParallelDims(world_size, tp=2, ep=2, dp_shard=2).build_mesh("cpu", [0, 2, 1, 3])

    def ranks(names: Any) -> list[int]:
        return sorted(dist.get_process_group_ranks(mesh[names].get_group()))
    return _after_every_rank({
        "tp_split": mesh["dp_replicate_tp", "dp_shard_tp"].mesh.tolist(),
        "ep_split": mesh["edp_replicate", "edp_shard"].mesh.tolist(),
        "tp_replicate": ranks("dp_replicate_tp"), "edp_shard": ranks("edp_shard"),
        "same_root": mesh["dp_replicate_tp", "dp_shard_tp"]._get_root_mesh() is mesh.dense._get_root_mesh()})


def test_the_model_parallel_shards_split_views_share_the_dense_and_expert_roots_on_real_processes() -> None:
    results = run_distributed(_shard_views, 4)
    for rank, views in enumerate(results):
        column = [[0], [1]] if rank in (0, 1) else [[2], [3]]  # the rank's tp coordinate's replicas, (2, 1)
        assert views["tp_split"] == views["ep_split"] == column and views["same_root"]
        assert views["tp_replicate"] == sorted(sum(column, [])) and views["edp_shard"] == [rank]


def test_pipeline_size_is_validated_and_leaves_dp_per_stage() -> None:
    dims = ParallelDims(world_size=8, tp=2, pp=2)
    assert (dims.dp, dims.pp_enabled, ParallelDims(world_size=8).pp_enabled) == (2, True, False)
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=3 does not divide the world size 4"):
        ParallelDims(world_size=4, pp=3)
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=4 x tensor_parallel_size=4 does not divide"):
        ParallelDims(world_size=8, tp=4, pp=4)


def _pipeline_views(rank: int, world_size: int) -> dict[str, Any]:
    mesh = ParallelDims(world_size, pp=2).build_mesh("cpu")

    def ranks(names: Any) -> list[int]:
        return sorted(dist.get_process_group_ranks(mesh[names].get_group()))
    return _after_every_rank({"pp": ranks("pp"), "dp": ranks("dp"), "dense": mesh["dp", "tp"].mesh.tolist()})


def test_pipeline_is_the_outermost_dimension_on_real_processes() -> None:
    results = run_distributed(_pipeline_views, 4)
    for rank, views in enumerate(results):  # [pp, dp, tp] over ranks 0..3: a pp group strides over dp
        assert views["pp"] == [rank % 2, rank % 2 + 2]
        assert views["dp"] == views["dense"][0][:1] + views["dense"][1][:1] == ([0, 1] if rank < 2 else [2, 3])
