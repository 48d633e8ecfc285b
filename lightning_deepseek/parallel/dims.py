"""``ParallelDims``: the parallel sizes of a run, decided once and validated once (after torchtitan's
``distributed/parallel_dims.py``).

The strategy builds one when the world size is known (``setup_environment``) and reads it everywhere else: the
data-parallel size, whether tensor or expert parallelism is on, and the ``(dp, tp)`` device mesh, built once from
the rank grid that placement chose (the same mesh again for the same grid in the same processes:
:mod:`~lightning_deepseek.parallel.groups`). Tests build it without a process group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

from lightning_deepseek.parallel.groups import reused


@dataclass(frozen=True)
class ParallelDims:
    """World, tensor-parallel and expert-parallel sizes; the data-parallel size is derived.

    Args:
        world_size: number of processes.
        tp: size of the ``tp`` mesh dimension (the feed-forward shards); divides ``world_size``.
        ep: size of the expert-parallel group (routed experts sharded over it); divides ``world_size``. 1: off.
    """

    world_size: int
    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size={self.world_size!r} must be a positive integer.")
        for name, size in (("tensor_parallel_size", self.tp), ("expert_parallel_size", self.ep)):
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"{name}={size!r} must be a positive integer.")
            if self.world_size % size:
                divisors = [d for d in range(1, self.world_size + 1) if self.world_size % d == 0]
                raise ValueError(f"{name}={size} does not divide the world size {self.world_size}. "
                                 f"Choose one of {divisors}.")

    @property
    def dp(self) -> int:
        """Size of the ``dp`` mesh dimension: the number of tensor-parallel groups."""
        return self.world_size // self.tp

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    def build_mesh(self, device_type: str, grid: list[list[int]]) -> DeviceMesh:
        """The 2-D ``(dp, tp)`` mesh over ``grid`` (ranks by mesh coordinate, from placement)."""
        shape = (len(grid), len(grid[0]) if grid else 0)
        if shape != (self.dp, self.tp):
            raise ValueError(f"rank grid of shape {shape} does not match dp={self.dp} x tp={self.tp}.")
        key = ("dp_tp_mesh", device_type, tuple(tuple(row) for row in grid))
        return reused(key, lambda: DeviceMesh(device_type, torch.tensor(grid), mesh_dim_names=("dp", "tp")))
