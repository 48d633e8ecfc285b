"""Process groups and meshes reused by later fits in the same processes (``lightning_deepseek.parallel.groups``):
an idle gloo group slows its process down, and a calibration fits dozens of times."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist

from lightning_deepseek.parallel import groups
from lightning_deepseek.parallel.dims import ParallelDims
from tests.helpers import run_distributed


def _twice(rank: int, world_size: int) -> dict[str, Any]:
    from lightning_deepseek.compression.hook import _exchange_group

    live = dist.distributed_c10d._world.pg_map
    before = len(live)
    first = ParallelDims(world_size, tp=2).build_mesh("cpu", [0, 1]).dense
    after_one = len(live)
    second = ParallelDims(world_size, tp=2).build_mesh("cpu", [0, 1]).dense
    other = ParallelDims(world_size, tp=1).build_mesh("cpu", [0, 1]).dense
    exchange = [_exchange_group(dist.group.WORLD) for _ in range(3)]
    return {"same_mesh": first is second, "other_mesh": other is not first, "groups": [before, after_one, len(live)],
            "same_exchange": all(g is exchange[0] for g in exchange)}


def test_the_same_mesh_and_communicator_are_reused_on_real_processes() -> None:
    for rank in run_distributed(_twice, 2):
        assert rank["same_mesh"] and rank["other_mesh"] and rank["same_exchange"]
        before, after_one, after_all = rank["groups"]
        # the (1 x 2) mesh once, the (2 x 1) mesh once, the exchange group once: nothing for the repeats
        assert after_one > before and after_all <= after_one + 3


def test_a_new_world_starts_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[int] = []

    def make() -> int:
        made.append(len(made))
        return made[-1]

    world = SimpleNamespace(WORLD=object())
    monkeypatch.setattr(groups, "dist", SimpleNamespace(is_initialized=lambda: True, group=world))
    monkeypatch.setattr(groups, "_CACHE", {})
    assert groups.reused("k", make) == groups.reused("k", make) == 0
    world.WORLD = object()  # destroyed and initialised again: the old groups are gone
    assert groups.reused("k", make) == 1 and groups.reused("k", make) == 1
    monkeypatch.setattr(groups, "dist", SimpleNamespace(is_initialized=lambda: False, group=world))
    assert groups.reused("k", make) == 2 and groups.reused("k", make) == 3  # no process group: nothing kept
