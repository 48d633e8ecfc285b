"""``ParallelDims``: validated once at construction, derived sizes as properties; built without a process group."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_deepseek.parallel import ParallelDims


def test_derived_sizes() -> None:
    dims = ParallelDims(world_size=8, tp=2)
    assert (dims.dp, dims.tp, dims.ep, dims.tp_enabled, dims.ep_enabled) == (4, 2, 1, True, False)
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


def test_mesh_grid_must_match_the_sizes() -> None:
    with pytest.raises(ValueError, match=r"rank grid of shape \(1, 2\) does not match dp=2 x tp=1"):
        ParallelDims(world_size=2, tp=1).build_mesh("cpu", [[0, 1]])
