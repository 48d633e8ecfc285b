"""The strategy's side of expert parallelism: find the MoE layers, shard them over the ``(edp, ep)`` view of the
run's mesh, report.

``HybridParallelStrategy(expert_parallel_size=ep)`` resolves the size with :func:`resolve_ep_size`, calls
:func:`setup_expert_parallel` once at setup (after every rank holds rank 0's weights) and
:func:`reduce_expert_gradients` once per optimizer step; the experts are
DTensors, which the strategy already keeps out of DDP. Everything else about EP is in
:mod:`lightning_deepseek.parallel.expert`. A model with no MoE layer (by the protocol of
:mod:`lightning_deepseek.moe.protocol`) trains as without EP, after a warning naming what was looked for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_deepseek.moe.node_limited import SETTING as MAX_ISLANDS
from lightning_deepseek.moe.node_limited import limit_routing
from lightning_deepseek.moe.protocol import BIAS_NAMES, SEARCHED, ExpertLayer, find_expert_layers
from lightning_deepseek.parallel.dims import ParallelDims, WorldMesh
from lightning_deepseek.parallel.expert import apply_expert_parallel
from lightning_deepseek.parallel.expert_dispatch import apply_island_dispatch, build_island_dispatch, resolve_dispatch
from lightning_deepseek.parallel.expert_routing import ExpertRouting
from lightning_deepseek.parallel.topology import Topology


@dataclass(frozen=True)
class ExpertParallelPlan:
    """What expert parallelism sharded, decided once at setup.

    Args:
        dims: the parallel sizes.
        mesh: the ``(edp, ep)`` view of the run's mesh, or None when nothing is sharded.
        layers: the sharded experts modules' names and global expert counts.
        expert_bytes: bytes of all routed-expert parameters (what every rank holds under DDP).
        other_bytes: bytes of every other parameter.
        dispatch: how tokens reach their experts, ``"flat"`` or ``"per_island"``
            (:mod:`lightning_deepseek.parallel.expert_dispatch`).
    """

    dims: ParallelDims
    mesh: DeviceMesh | None
    layers: tuple[tuple[str, int], ...]
    expert_bytes: int
    other_bytes: int
    dispatch: str = "flat"

    @property
    def local_expert_bytes(self) -> int:
        """Expert parameter bytes per rank under EP."""
        return self.expert_bytes // self.dims.ep if self.mesh is not None else self.expert_bytes

    @property
    def param_bytes_vs_ddp(self) -> float:
        """Parameter bytes per rank against DDP's (optimizer states follow the same ratio)."""
        total = self.expert_bytes + self.other_bytes
        return (self.local_expert_bytes + self.other_bytes) / max(total, 1)

    def table(self) -> str:
        """The plan table printed at setup."""
        ep = self.dims.ep
        lines = [f"{'experts module':<40} {'experts':>8} {'per rank':>9}"]
        lines += [f"{name:<40} {num:>8} {num // ep:>9}" for name, num in self.layers]
        lines.append(f"expert parameters per rank: {self.local_expert_bytes / 2**20:.2f} MiB of "
                     f"{self.expert_bytes / 2**20:.2f} MiB under DDP; all parameters per rank: "
                     f"{self.param_bytes_vs_ddp:.3f} x DDP; dispatch: {self.dispatch}")
        return "\n".join(lines)

    def summary(self) -> dict[str, object]:
        """Rows of a run summary (:mod:`lightning_deepseek.reporting`)."""
        if self.mesh is None:
            return {}
        return {"expert_parallel": f"ep={self.dims.ep} x edp={self.dims.edp}, "
                                   f"{len(self.layers)} MoE layers",
                "expert_param_bytes_vs_ddp": round(self.param_bytes_vs_ddp, 3), "expert_dispatch": self.dispatch}


def _param_bytes(params: list[torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def resolve_ep_size(ep_size: int | Literal["per_node"], world_size: int, local_size: int,
                    layers: list[ExpertLayer]) -> int:
    """``expert_parallel_size`` as a number. ``"per_node"``: the largest size that keeps every expert-parallel
    group inside one node and divides every layer's expert count (``gcd`` of processes per node and expert
    counts); 1 for a model without MoE layers."""
    if ep_size != "per_node":
        return ep_size
    if not layers:
        return 1
    return math.gcd(local_size, world_size, *(layer.num_experts for layer in layers))


def setup_expert_parallel(module: nn.Module, mesh: WorldMesh, topology: Topology | None = None,
                          routing: ExpertRouting | None = None) -> ExpertParallelPlan:
    """Shard ``module``'s routed experts over ``mesh["edp", "ep"]`` (collective); print the plan table.

    Args:
        module: the model.
        mesh: the run's meshes; ``mesh.dims.ep`` is the expert-parallel size (1: experts stay replicated).
        topology: the strategy's islands (for node-limited routing and per-island dispatch).
        routing: node-limited routing and the dispatch.
    """
    routing = routing or ExpertRouting()
    dims, max_islands = mesh.dims, routing.max_islands_per_token
    layers: list[ExpertLayer] = find_expert_layers(module)
    expert_ids = {id(p) for layer in layers for p in layer.experts.parameters(recurse=False)
                  if p.dim() >= 1 and p.size(0) == layer.num_experts}
    params = list(module.parameters())
    expert_bytes = _param_bytes([p for p in params if id(p) in expert_ids])
    other_bytes = _param_bytes([p for p in params if id(p) not in expert_ids])
    named = tuple((layer.name, layer.num_experts) for layer in layers)
    if max_islands is not None and (dims.ep == 1 or not layers):
        rank_zero_warn(f"HybridParallelStrategy: {MAX_ISLANDS}={max_islands} has no effect without expert "
                       f"parallelism (expert_parallel_size={dims.ep}, {len(layers)} MoE layers): every rank "
                       f"holds every expert. Set expert_parallel_size > 1 on an MoE model, or remove {MAX_ISLANDS}.")
    if dims.ep == 1:
        return ExpertParallelPlan(dims, None, named, expert_bytes, other_bytes)
    if not layers:
        rank_zero_warn(f"HybridParallelStrategy: expert_parallel_size={dims.ep} but the model has no MoE "
                       f"layer: {SEARCHED}. Training continues without expert parallelism; register the experts "
                       "(lightning_deepseek.moe.register_experts), or set expert_parallel_size=1 to silence this.")
        return ExpertParallelPlan(dims, None, named, expert_bytes, other_bytes)
    dims.check_experts(layers)
    expert_mesh = mesh["edp", "ep"]
    apply_expert_parallel(module, expert_mesh, layers)
    grid = expert_mesh.mesh.tolist()
    if max_islands is not None and topology is not None:
        limit_routing(layers, topology, grid, max_islands)
    dispatch = resolve_dispatch(routing.dispatch, topology, grid, node_limited=max_islands is not None)
    if dispatch == "per_island":
        assert topology is not None  # resolve_dispatch chose it from the topology
        apply_island_dispatch(layers, build_island_dispatch(topology, grid))
    plan = ExpertParallelPlan(dims, expert_mesh, named, expert_bytes, other_bytes, dispatch)
    rank_zero_info(f"HybridParallelStrategy expert plan (ep={dims.ep}, edp={dims.edp}; balancing bias "
                   f"looked for as {BIAS_NAMES}):\n{plan.table()}")
    return plan
