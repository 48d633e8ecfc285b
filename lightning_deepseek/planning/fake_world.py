"""``fake_world``: torch's ``fake`` process-group backend at any world size, in this process, for the duration of a
``with`` block.

Every collective on it returns at once without moving data, so one process can set up the strategy's meshes and
shards as rank ``r`` of a 2,048-rank world. It refuses to start where a process group already exists (a real run's
group is never replaced) and always destroys its group on leaving, so a real run started later in the same process
starts afresh (the strategy's cache of meshes, :mod:`lightning_deepseek.parallel.groups`, belongs to the group it was
made under). DTensor's caches of sharding decisions are cleared on leaving too: they hold the meshes of the world they
were made in, whose process groups are gone once it is destroyed (a reduce-scatter of a later world looked its group up
by the old name and failed).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist
from torch.distributed.tensor import _redistribute
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

# torch 2.11-2.13 register the "fake" backend only in this testing module; there is no public FakeStore
# (torchtitan imports it from here for COMM_MODE=fake_backend as well).
from torch.testing._internal.distributed.fake_pg import FakeStore


@contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """This process as ``rank`` of a fake world of ``world_size`` ranks (see the module docstring)."""
    if dist.is_initialized():
        raise RuntimeError("lds-plan: a process group is already initialised in this process (a training run?). "
                           "Plan before starting it, or in another process: the fake world never replaces a real one.")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        _clear_dtensor_caches()


def _clear_dtensor_caches() -> None:
    # private LRU caches, in torch 2.11-2.13: the sharding propagator's (Python and the C++ fast path's: torch's
    # debug module clears both) and the redistribute planner's
    _clear_sharding_prop_cache()
    getattr(_redistribute, "clear_redistribute_planner_cache", lambda: None)()
    for name in ("_gen_transform_infos", "_gen_transform_infos_non_cached"):
        cached = getattr(_redistribute, name, None)
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
