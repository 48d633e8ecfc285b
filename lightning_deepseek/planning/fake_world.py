"""``fake_world``: torch's ``fake`` process-group backend at any world size, in this process, for the duration of a
``with`` block.

Every collective on it returns at once without moving data, so one process can set up the strategy's meshes and
shards as rank ``r`` of a 2,048-rank world. It refuses to start where a process group already exists (a real run's
group is never replaced) and always destroys its group on leaving, so a real run started later in the same process
starts afresh (the strategy's cache of meshes, :mod:`lightning_deepseek.parallel.groups`, belongs to the group it was
made under).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist

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
