"""The strategy's side of expert parallelism: find the MoE layers, build the ``(edp, ep)`` mesh, shard, report.

``HybridParallelStrategy(expert_parallel_size=ep)`` calls :func:`setup_expert_parallel` once at setup (after
every rank holds rank 0's weights) and :func:`reduce_expert_gradients` once per optimizer step; the experts are
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
from lightning_deepseek.moe.protocol import BIAS_NAMES, EP_PLAN_STYLE, ExpertLayer, find_expert_layers
from lightning_deepseek.parallel.expert import (
    ExpertParallelDims,
    apply_expert_parallel,
    build_expert_mesh,
)
from lightning_deepseek.parallel.expert_dispatch import (
    Dispatch,
    apply_island_dispatch,
    build_island_dispatch,
    resolve_dispatch,
)
from lightning_deepseek.parallel.topology import Topology


@dataclass(frozen=True)
class ExpertParallelPlan:
    """What expert parallelism sharded, decided once at setup.

    Args:
        dims: the expert-parallel sizes.
        mesh: the ``(edp, ep)`` mesh, or None when nothing is sharded.
        layers: the sharded experts modules' names and global expert counts.
        expert_bytes: bytes of all routed-expert parameters (what every rank holds under DDP).
        other_bytes: bytes of every other parameter.
        dispatch: how tokens reach their experts, ``"flat"`` or ``"per_island"``
            (:mod:`lightning_deepseek.parallel.expert_dispatch`).
    """

    dims: ExpertParallelDims
    mesh: DeviceMesh | None
    layers: tuple[tuple[str, int], ...]
    expert_bytes: int
    other_bytes: int
    dispatch: str = "flat"

    @property
    def local_expert_bytes(self) -> int:
        """Expert parameter bytes per rank under EP."""
        return self.expert_bytes // self.dims.ep_size if self.mesh is not None else self.expert_bytes

    @property
    def param_bytes_vs_ddp(self) -> float:
        """Parameter bytes per rank against DDP's (optimizer states follow the same ratio)."""
        total = self.expert_bytes + self.other_bytes
        return (self.local_expert_bytes + self.other_bytes) / max(total, 1)

    def table(self) -> str:
        """The plan table printed at setup."""
        ep = self.dims.ep_size
        lines = [f"{'experts module':<40} {'experts':>8} {'per rank':>9}"]
        lines += [f"{name:<40} {num:>8} {num // ep:>9}" for name, num in self.layers]
        lines.append(f"expert parameters per rank: {self.local_expert_bytes / 2**20:.2f} MiB of "
                     f"{self.expert_bytes / 2**20:.2f} MiB under DDP; all parameters per rank: "
                     f"{self.param_bytes_vs_ddp:.3f} x DDP; dispatch: {self.dispatch}")
        return "\n".join(lines)

    def summary(self) -> dict[str, object]:
        """Entries for ``lds-train``'s run summary."""
        if self.mesh is None:
            return {}
        return {"expert_parallel": f"ep={self.dims.ep_size} x edp={self.dims.replicas}, "
                                   f"{len(self.layers)} MoE layers",
                "expert_param_bytes_vs_ddp": round(self.param_bytes_vs_ddp, 3), "expert_dispatch": self.dispatch}


def _param_bytes(params: list[torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def resolve_ep_size(ep_size: int | Literal["auto"], world_size: int, local_size: int,
                    layers: list[ExpertLayer]) -> int:
    """``expert_parallel_size`` as a number. ``"auto"``: the largest size that keeps every expert-parallel group
    inside one node and divides every layer's expert count (``gcd`` of processes per node and expert counts);
    1 for a model without MoE layers. (The topology cost model does not weigh spanning nodes yet.)"""
    if ep_size != "auto":
        return ep_size
    if not layers:
        return 1
    return math.gcd(local_size, world_size, *(layer.num_experts for layer in layers))


def setup_expert_parallel(module: nn.Module, device_type: str, world_size: int,
                          ep_size: int | Literal["auto"], local_size: int, topology: Topology | None = None,
                          max_islands: int | None = None, dispatch: Dispatch = "auto") -> ExpertParallelPlan:
    """Shard ``module``'s routed experts over ``ep_size`` ranks (collective); print the plan table.

    Args:
        module: the model.
        device_type: ``"cpu"`` or ``"cuda"``.
        world_size: all ranks.
        ep_size: ``expert_parallel_size`` (see :func:`resolve_ep_size` for ``"auto"``).
        local_size: processes per node.
        topology: the strategy's islands (for node-limited routing).
        max_islands: ``max_islands_per_token`` (:mod:`lightning_deepseek.moe.node_limited`); None: no limit.
        dispatch: ``expert_dispatch`` (:func:`~lightning_deepseek.parallel.expert_dispatch.resolve_dispatch`).
    """
    layers: list[ExpertLayer] = find_expert_layers(module)
    dims = ExpertParallelDims(world_size, resolve_ep_size(ep_size, world_size, local_size, layers))
    expert_ids = {id(p) for layer in layers for p in layer.experts.parameters(recurse=False)
                  if p.dim() >= 1 and p.size(0) == layer.num_experts}
    params = list(module.parameters())
    expert_bytes = _param_bytes([p for p in params if id(p) in expert_ids])
    other_bytes = _param_bytes([p for p in params if id(p) not in expert_ids])
    named = tuple((layer.name, layer.num_experts) for layer in layers)
    if max_islands is not None and (dims.ep_size == 1 or not layers):
        rank_zero_warn(f"HybridParallelStrategy: {MAX_ISLANDS}={max_islands} has no effect without expert "
                       f"parallelism (expert_parallel_size={dims.ep_size}, {len(layers)} MoE layers): every rank "
                       f"holds every expert. Set expert_parallel_size > 1 on an MoE model, or remove {MAX_ISLANDS}.")
    if dims.ep_size == 1:
        return ExpertParallelPlan(dims, None, named, expert_bytes, other_bytes)
    if not layers:
        rank_zero_warn(f"HybridParallelStrategy: expert_parallel_size={dims.ep_size} but the model has no MoE "
                       f"layer: looked for modules marked `is_moe_experts` (lightning_deepseek.moe.register_experts) "
                       f"and transformers' `base_model_ep_plan` entries of style {EP_PLAN_STYLE!r}. Training "
                       "continues without expert parallelism; set expert_parallel_size=1 to silence this.")
        return ExpertParallelPlan(dims, None, named, expert_bytes, other_bytes)
    dims.check_experts(layers)
    mesh = build_expert_mesh(device_type, dims)
    apply_expert_parallel(module, mesh, layers)
    grid = mesh.mesh.tolist()
    if max_islands is not None and topology is not None:
        limit_routing(layers, topology, grid, max_islands)
    dispatch = resolve_dispatch(dispatch, topology, grid, node_limited=max_islands is not None)
    if dispatch == "per_island":
        assert topology is not None  # resolve_dispatch chose it from the topology
        apply_island_dispatch(layers, build_island_dispatch(topology, grid))
    plan = ExpertParallelPlan(dims, mesh, named, expert_bytes, other_bytes, dispatch)
    rank_zero_info(f"HybridParallelStrategy expert plan (ep={dims.ep_size}, edp={dims.replicas}; balancing bias "
                   f"looked for as {BIAS_NAMES}):\n{plan.table()}")
    return plan
