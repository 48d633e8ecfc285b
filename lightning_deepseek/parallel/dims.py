"""``ParallelDims``: the parallel sizes of a run, decided once and validated once, and ``WorldMesh``: every device
mesh of the run, built once over one rank order (after torchtitan's ``distributed/parallel_dims.py``).

The strategy builds the sizes when the world size is known and the meshes once placement has chosen the rank order
(:mod:`~lightning_deepseek.parallel.placement`); every other module fetches a named view (``mesh["tp"]``,
``mesh["edp", "ep"]``) and none builds a mesh of its own. The views:

- ``("dp", "tp")``: the dense layout. Row ``i`` of the order, reshaped ``dp x tp``, is a tensor-parallel group;
  attention and everything not sharded is replicated over the whole world.
- ``("edp", "ep")``: the routed experts. ``ep`` consecutive ranks of the same order hold all experts between them;
  ranks with the same ``ep`` coordinate (``edp``) hold replicas of the same slice.
- ``("dp_replicate", "dp_shard")``: parameter sharding (FSDP2). ``dp_shard`` consecutive ranks of the order shard
  each replicated parameter between them (inside a node where placement keeps consecutive ranks together); the
  ``dp_replicate`` groups hold replicas of the same shards (HSDP).
- ``("dp_replicate_tp", "dp_shard_tp")`` and ``("edp_replicate", "edp_shard")``: the same sharding for the shards
  of a model-parallel dimension, ``dp`` and ``edp`` split in two (:meth:`ParallelDims.shard_split`): each
  tensor-parallel shard (expert slice) is sharded over its replicas inside one ``dp_shard`` group and replicated
  across the groups, so every parameter has the same ``dp_replicate`` replicas. Cut from the dense and expert
  meshes, as FSDP2 requires of a DTensor's mesh and its own.
- ``("pp", "dp", "tp")``: pipeline stages, only where ``pp > 1``; ``pp`` outermost as in torchtitan (the order
  reshaped ``pp x dp x tp``): a ``pp`` group takes one rank from each block of ``dp * tp`` consecutive ranks, and
  ``("dp", "tp")`` is then the slice of the rank's own pipeline stage.

A new dimension (parameter sharding, pipeline stages) is one more named size here and one more view. Meshes are
made through :func:`~lightning_deepseek.parallel.groups.reused`, so a later fit in the same processes gets the
same process groups back. Tests build ``ParallelDims`` without a process group.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.distributed.device_mesh import DeviceMesh

from lightning_deepseek.parallel.groups import reused

if TYPE_CHECKING:
    from lightning_deepseek.moe.protocol import ExpertLayer

DENSE_DIMS = ("dp", "tp")
EXPERT_DIMS = ("edp", "ep")
SHARD_DIMS = ("dp_replicate", "dp_shard")
TP_SHARD_DIMS = ("dp_replicate_tp", "dp_shard_tp")
EXPERT_SHARD_DIMS = ("edp_replicate", "edp_shard")
PIPELINE_DIMS = ("pp", "dp", "tp")


class ParallelSizeError(ValueError, RuntimeError):
    """A parallel size that does not divide the world size (a ``ValueError``, and the ``RuntimeError`` Lightning's own
    model-parallel strategy raises for it)."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ParallelDims:
    """World, tensor-parallel, expert-parallel, parameter-sharding and pipeline sizes; the data-parallel sizes are
    derived.

    Args:
        world_size: number of processes.
        tp: size of the ``tp`` mesh dimension (the feed-forward shards); divides ``world_size``.
        ep: size of the ``ep`` mesh dimension (routed experts sharded over it); divides ``world_size``. 1: off.
        dp_shard: ranks sharding each replicated parameter, its gradient and optimizer state (FSDP2); divides
            ``world_size``. 1: off.
        pp: pipeline ranks (:mod:`~lightning_deepseek.parallel.pipeline`); ``pp * tp`` divides ``world_size``. 1: off.
    """

    world_size: int
    tp: int = 1
    ep: int = 1
    dp_shard: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size={self.world_size!r} must be a positive integer.")
        for name, size in (("tensor_parallel_size", self.tp), ("expert_parallel_size", self.ep),
                           ("data_parallel_shard_size", self.dp_shard), ("pipeline_parallel_size", self.pp)):
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"{name}={size!r} must be a positive integer.")
            if self.world_size % size:
                raise ParallelSizeError(f"{name}={size} does not divide the world size {self.world_size}. "
                                 f"Choose one of {_divisors(self.world_size)}.")
        self._check_shard_groups()

    def _check_shard_groups(self) -> None:
        """Each tp and ep group lies inside one ``dp_shard`` group or spans whole ones (else a shard group would
        hold parts of some model-parallel shards and not others)."""
        for name, size in (("tensor_parallel_size", self.tp), ("expert_parallel_size", self.ep)):
            if self.dp_shard > 1 and self.dp_shard % size and size % self.dp_shard:
                sizes = [d for d in _divisors(self.world_size)
                         if all(d % m == 0 or m % d == 0 for m in (self.tp, self.ep))]
                raise ParallelSizeError(
                    f"data_parallel_shard_size={self.dp_shard} with {name}={size}: one must divide the other (each "
                    f"{name.split('_')[0]}-parallel group lies inside one shard group, or spans whole ones). Choose "
                    f"data_parallel_shard_size among {sizes}, or change {name}.")
        for name, size in (("tensor_parallel_size", self.tp), ("expert_parallel_size", self.ep)):
            if self.world_size % (self.pp * size):
                raise ParallelSizeError(f"pipeline_parallel_size={self.pp} x {name}={size} does not divide the world "
                                        f"size {self.world_size}: choose sizes whose product does.")

    @property
    def dp(self) -> int:
        """Size of the ``dp`` mesh dimension: the number of tensor-parallel groups (of one pipeline stage)."""
        return self.world_size // (self.pp * self.tp)

    @property
    def edp(self) -> int:
        """Size of the ``edp`` mesh dimension: the ranks holding the same expert slice (of one pipeline stage)."""
        return self.world_size // (self.pp * self.ep)

    @property
    def dp_replicate(self) -> int:
        """Size of the ``dp_replicate`` mesh dimension: the replicas of each parameter shard."""
        return self.world_size // self.dp_shard

    def shard_split(self, model_parallel: int) -> tuple[int, int]:
        """``(replicate, shard)``: how parameter sharding splits the ``world_size / model_parallel`` replicas of one
        shard of a model-parallel dimension of that size (``tp``, ``ep``). Sharded over the
        ``dp_shard / model_parallel`` replicas inside one ``dp_shard`` group, so that a rank holds ``1 / dp_shard`` of
        it as of every other parameter, and replicated over the ``dp_replicate`` groups; where the dimension spans
        whole shard groups (``dp_shard`` divides it), replicated only (shard 1)."""
        replicas = self.world_size // model_parallel
        shard = self.dp_shard // model_parallel if self.dp_shard % model_parallel == 0 else 1
        return replicas // shard, shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    def check_experts(self, layers: Iterable[ExpertLayer]) -> None:
        """Raise when ``ep`` does not divide a layer's expert count."""
        for layer in layers:
            if layer.num_experts % self.ep:
                choices = [d for d in _divisors(layer.num_experts) if self.world_size % d == 0]
                raise ValueError(f"expert_parallel_size={self.ep} does not divide the {layer.num_experts} experts "
                                 f"of {layer.name}. Choose one of {choices}, or a model whose expert count it "
                                 "divides.")

    def build_mesh(self, device_type: str, order: Sequence[int] | None = None) -> WorldMesh:
        """Every mesh of the run over ``order`` (all ranks, placement's order; default ``0..world_size-1``).
        Collective: every rank calls it with the same order."""
        ranks = torch.tensor(list(range(self.world_size)) if order is None else list(order))
        if sorted(ranks.tolist()) != list(range(self.world_size)):
            raise ValueError(f"rank order {ranks.tolist()} is not a permutation of the {self.world_size} ranks.")
        names, shape = (PIPELINE_DIMS, (self.pp, self.dp, self.tp)) if self.pp_enabled else (DENSE_DIMS,
                                                                                           (self.dp, self.tp))
        dense = reused(("mesh", names, shape[-1] if len(shape) == 2 else shape, device_type, tuple(ranks.tolist())),
                       lambda: DeviceMesh(device_type, ranks.view(shape), mesh_dim_names=names))
        return WorldMesh(self, device_type, tuple(ranks.tolist()), dense)


@dataclass(frozen=True)
class WorldMesh:
    """The run's device meshes over one rank order, fetched by name: ``mesh["tp"]``, ``mesh["dp", "tp"]``,
    ``mesh["ep"]``, ``mesh["edp", "ep"]``, ``mesh["dp_shard"]``, ``mesh["dp_replicate", "dp_shard"]``,
    ``mesh["dp_replicate_tp", "dp_shard_tp"]``, ``mesh["edp_replicate", "edp_shard"]``, and where ``pp > 1``
    ``mesh["pp"]`` (the expert and sharding views are made on first use: collective, every rank asks)."""

    dims: ParallelDims
    device_type: str
    order: tuple[int, ...]
    dense: DeviceMesh

    @property
    def sharding(self) -> DeviceMesh:
        """The ``(dp_replicate, dp_shard)`` mesh over the same order."""
        ranks = torch.tensor(self.order).view(self.dims.dp_replicate, self.dims.dp_shard)
        return reused(("mesh", SHARD_DIMS, self.dims.dp_shard, self.device_type, self.order),
                      lambda: DeviceMesh(self.device_type, ranks, mesh_dim_names=SHARD_DIMS))

    @property
    def expert(self) -> DeviceMesh:
        """The ``(edp, ep)`` mesh over the same order; where ``pp > 1``, ``(pp, edp, ep)``: each stage's ranks hold
        all its experts between them (``mesh["edp", "ep"]`` is the rank's stage)."""
        names, shape = (("pp", *EXPERT_DIMS), (self.dims.pp, self.dims.edp, self.dims.ep)) if self.dims.pp_enabled \
            else (EXPERT_DIMS, (self.dims.edp, self.dims.ep))
        ranks = torch.tensor(self.order).view(shape)
        return reused(("mesh", names, shape, self.device_type, self.order),
                      lambda: DeviceMesh(self.device_type, ranks, mesh_dim_names=names))

    def split(self, source: str, names: tuple[str, str]) -> DeviceMesh:
        """``mesh[source]`` (``"dp"`` or ``"edp"``) split into ``names`` = (replicate, shard) by
        :meth:`ParallelDims.shard_split`, over the same root mesh (the tp or ep shards' DTensors live on it)."""
        parent, model_parallel = (self.dense, self.dims.tp) if source == "dp" else (self.expert, self.dims.ep)
        sizes = self.dims.shard_split(model_parallel)
        # torch has no public way to split one mesh dimension in two over the same root: DeviceMesh._unflatten
        # (by index: torch 2.11 refuses a dimension given by name)
        dim = parent.mesh_dim_names.index(source)
        return reused(("mesh", names, model_parallel, sizes, self.device_type, self.order),
                      lambda: parent._unflatten(dim, sizes, names)[names])

    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        wanted = (names,) if isinstance(names, str) else tuple(names)
        dense_dims = PIPELINE_DIMS if self.dims.pp_enabled else DENSE_DIMS
        for dims, make in ((dense_dims, lambda: self.dense), (EXPERT_DIMS, lambda: self.expert),
                           (SHARD_DIMS, lambda: self.sharding),
                           (TP_SHARD_DIMS, lambda: self.split("dp", TP_SHARD_DIMS)),
                           (EXPERT_SHARD_DIMS, lambda: self.split("edp", EXPERT_SHARD_DIMS))):
            if set(wanted) <= set(dims):
                mesh = make()
                return mesh if wanted == mesh.mesh_dim_names else mesh[wanted if len(wanted) > 1 else wanted[0]]
        known = dense_dims + EXPERT_DIMS + SHARD_DIMS + TP_SHARD_DIMS + EXPERT_SHARD_DIMS
        raise KeyError(f"no mesh dimension {names!r}: the meshes have {known}.")
