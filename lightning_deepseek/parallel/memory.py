"""What one rank holds for training (parameters, gradients, optimizer states), and ZeRO-1's set-up.

Printed once at setup, after the optimizers exist: a table of the memory per rank of plain DDP, of this layout
(tensor- and expert-parallel shards) and of this layout with ZeRO-1, whichever the run uses marked. Optimizer
states are estimated from each optimizer's kind before its first step creates them
(:func:`lightning_deepseek.parallel.zero.estimated_state_bytes`).

ZeRO-1 (``shard_optimizer_states=True``, :mod:`lightning_deepseek.parallel.zero`) deals each parameter to an owner
inside its *replica group*: the world for replicated parameters (under a pipeline the stage's ``dp`` ranks, those
holding the same stages), ``dp`` for tensor-parallel shards, ``edp`` for expert slices.
:func:`setup_optimizer_states` builds that partition (also without ZeRO-1, for the table's figure) and, when asked,
shards the states.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_deepseek.parallel import zero
from lightning_deepseek.parallel.dims import WorldMesh
from lightning_deepseek.parallel.expert import is_expert_param
from lightning_deepseek.parallel.layout import Layout
from lightning_deepseek.parallel.zero import Partition, ShardedOptimizerStates, estimated_state_bytes


@dataclass(frozen=True)
class MemoryPerRank:
    """Bytes one rank holds for the parameters, their gradients and the optimizer states."""

    params: int
    grads: int
    states: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.states


def memory_per_rank(optimizers: list[Optimizer], partitions: list[Partition],
                    world_size: int) -> dict[str, MemoryPerRank]:
    """Memory per rank of plain DDP, of this layout, and of this layout with ZeRO-1 (``partitions``: one per
    optimizer, the owners ZeRO-1 deals or would deal; the ZeRO figure is the most loaded rank's).

    Optimizer states are estimated from each optimizer's kind before its first step creates them
    (:func:`lightning_deepseek.parallel.zero.estimated_state_bytes`); gradients are one per trainable element.
    """
    full = local = states_full = states_local = 0
    states_owned = [0] * world_size
    seen: set[int] = set()
    for optimizer, owners in zip(optimizers, partitions):
        for group in optimizer.param_groups:
            for param in group["params"]:
                if id(param) in seen or not param.requires_grad:
                    continue
                seen.add(id(param))
                state = estimated_state_bytes(optimizer, param, group)
                shard = param.to_local() if isinstance(param, DTensor) else param
                fraction = shard.numel() / max(param.numel(), 1)
                full += param.numel() * param.element_size()
                local += shard.numel() * param.element_size()
                states_full, states_local = states_full + round(state / fraction), states_local + state
                states_owned[owners.owner.get(id(param), 0)] += state
    return {"DDP": MemoryPerRank(full, full, states_full), "this layout": MemoryPerRank(local, local, states_local),
            "this layout + ZeRO-1": MemoryPerRank(local, local, max(states_owned, default=0))}


def format_memory_table(memory: dict[str, MemoryPerRank], zero: bool) -> str:
    """Markdown table of ``memory_per_rank``: MiB per rank of each layout, and each against DDP."""
    ddp = memory["DDP"]
    names = list(memory)
    used = "this layout + ZeRO-1" if zero else "this layout"
    header = " | ".join(f"{name} (this run)" if name == used else name for name in names)
    rows = [f"| memory per rank (MiB) | {header} |", "|---" * (len(names) + 1) + "|"]
    for label, field in (("parameters", "params"), ("gradients", "grads"), ("optimizer states", "states"),
                         ("total", "total")):
        cells = []
        for name in names:
            value, base = getattr(memory[name], field), getattr(ddp, field)
            ratio = f" ({value / base:.0%})" if name != "DDP" and base else ""
            cells.append(f"{value / 2**20:.2f}{ratio}")
        rows.append(f"| {label} | {' | '.join(cells)} |")
    return "\n".join(rows)


def _replica_group(mesh: DeviceMesh) -> zero.ReplicaGroup:
    group = mesh.get_group()
    return zero.ReplicaGroup(tuple(dist.get_process_group_ranks(group)), group)


def setup_optimizer_states(optimizers: list[Optimizer], rank: int, world_size: int, mesh: WorldMesh | None,
                           shard: bool, previous: list[ShardedOptimizerStates] = ()) -> list[ShardedOptimizerStates]:
    """Print the memory per rank and, with ``shard``, shard the optimizer states (ZeRO-1) over the replica groups.

    Args:
        optimizers: the strategy's optimizers (Lightning's wrappers or torch's).
        rank: this rank.
        world_size: all ranks.
        mesh: the run's meshes (None: every parameter replicated over the world); tensor-parallel shards are
            replicated over ``dp``, expert slices over ``edp``, a pipeline's stages over ``dp``.
        shard: ``shard_optimizer_states``.
        previous: the handles of an earlier setup in the same processes, removed first.

    Returns:
        One ZeRO-1 handle per optimizer when sharding, else none.
    """
    for handle in previous:
        handle.remove()
    if world_size == 1:
        if shard:
            rank_zero_warn("HybridParallelStrategy: shard_optimizer_states=True on one process: every parameter "
                           "has one replica, so there is nothing to shard. Run on 2 or more devices to shard the "
                           "optimizer states.")
        return []
    world = zero.ReplicaGroup(tuple(range(world_size)), None)
    dp = _replica_group(mesh["dp"]) if mesh is not None else world
    edp = _replica_group(mesh["edp"]) if mesh is not None and mesh.dims.ep_enabled else world
    replicated = dp if mesh is not None and mesh.dims.pp > 1 else world  # a pipeline: the ranks holding the stage

    def replica_group_of(param: torch.Tensor) -> zero.ReplicaGroup:
        if is_expert_param(param):
            return edp  # expert slices: replicated over the expert-data-parallel group
        return dp if isinstance(param, DTensor) else replicated
    inners = [o._optimizer if isinstance(o, LightningOptimizer) else o for o in optimizers]
    owners = [zero.partition([p for g in o.param_groups for p in g["params"]], replica_group_of) for o in inners]
    memory = memory_per_rank(inners, owners, world_size)  # with the partition ZeRO-1 deals or would deal
    if mesh is not None and mesh.dims.fsdp_enabled:  # parameter sharding already shards the states
        memory.pop("this layout + ZeRO-1")
    if mesh is not None and mesh.dims.pp_enabled:
        memory = _per_pipeline_rank(memory, mesh["pp"].get_group(), "this layout + ZeRO-1" if shard else "this layout")
    rank_zero_info(f"HybridParallelStrategy memory per rank:\n{format_memory_table(memory, shard)}")
    if not shard:
        return []
    handles = []
    for i, (inner, owned) in enumerate(zip(inners, owners)):
        zero.check_shardable(inner, i)
        handles.append(ShardedOptimizerStates(inner, owned, rank))
    return handles


def _per_pipeline_rank(memory: dict[str, MemoryPerRank], pp_group: dist.ProcessGroup,
                       used: str) -> dict[str, MemoryPerRank]:
    """The table's columns under a pipeline (collective over ``pp_group``, one rank of each stage): DDP holding the
    whole model (the sum of every stage's unsharded figures) and what each pipeline rank holds of its own stages in
    this run (``used``: the column of ``memory`` the run uses)."""
    gathered: list[dict[str, MemoryPerRank] | None] = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(gathered, memory, group=pp_group)
    ddp = MemoryPerRank(*(sum(getattr(m["DDP"], f) for m in gathered) for f in ("params", "grads", "states")))
    return {"DDP": ddp, **{f"pp rank {r}": m[used] for r, m in enumerate(gathered)}}


def summary_rows(module: nn.Module, layout: Layout, num_sharded_layers: int, optimizers: list[Optimizer],
                 sharded: list[ShardedOptimizerStates], rank: int) -> dict[str, object]:
    """The layout, parameter and optimizer-state bytes per rank against DDP's, and the measured peak (CUDA: the
    caching allocator's ``max_memory_allocated``; CPU: the process's peak resident set), as rows of a run summary.

    Under a pipeline each rank holds its own stages (collective over the world, every rank calls it): the rows are
    the most loaded rank's, DDP's figure is the whole model's, and ``..._per_pp_rank`` rows list each pipeline
    rank's (the most loaded of its data-parallel replicas)."""
    params = list(module.parameters())
    full = sum(p.numel() * p.element_size() for p in params)
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in params)
    dims = layout.dims
    mesh = f"dp={dims.dp} x tp={dims.tp}" + (f", dp_shard={dims.dp_shard}" if dims.fsdp_enabled else "")
    device = params[0].device if params else torch.device("cpu")
    states = sum(zero.state_bytes(o) for o in optimizers) if optimizers else None
    peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    zero_state = sum(z.partition.state_fraction(rank) * local for z in sharded) / len(sharded) if sharded else None
    if dims.pp_enabled:
        return _pipeline_rows(layout, rank, (full, local, states, zero_state, peak))
    rows: dict[str, object] = {"hybrid_mesh": f"{mesh} ({layout.placement})",
                               "hybrid_sharded_layers": num_sharded_layers,
                               "hybrid_param_bytes_vs_ddp": round(local / max(full, 1), 3),
                               **(layout.decision.summary() if layout.decision is not None else {})}
    if states is not None:
        rows["hybrid_optimizer_state_bytes"] = states
        rows["hybrid_model_state_bytes"] = 2 * local + states  # parameters, their gradients, optimizer states
    rows["peak_memory_bytes"] = peak
    if zero_state is not None:
        rows["hybrid_optimizer_state_bytes_vs_ddp"] = round(zero_state / max(full, 1), 3)
    return rows


def _pipeline_rows(layout: Layout, rank: int, figures: tuple[int, int, int | None, float | None, int]
                   ) -> dict[str, object]:
    """:func:`summary_rows` under a pipeline from this rank's ``figures`` (its stages' unsharded parameter bytes, what
    it holds of them, its optimizer-state bytes, its ZeRO-1 state figure, its peak): every rank's gathered, the most
    loaded one's and each ``pp`` rank's."""
    dims = layout.dims
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (layout.order.index(rank) // (dims.dp * dims.tp), *figures))
    whole = sum({pp_rank: full for pp_rank, full, *_ in gathered}.values())  # each stage's, once
    per_pp = [[f for f in gathered if f[0] == r] for r in range(dims.pp)]
    shard = f", dp_shard={dims.dp_shard}" if dims.fsdp_enabled else ""
    rows: dict[str, object] = {"hybrid_mesh": f"pp={dims.pp} x dp={dims.dp} x tp={dims.tp}{shard} ({layout.placement})",
                               "hybrid_param_bytes_vs_ddp": round(max(f[2] for f in gathered) / max(whole, 1), 3)}
    if figures[2] is not None:
        model_state = [max(2 * f[2] + f[3] for f in ranks) for ranks in per_pp]  # parameters, gradients, states
        rows["hybrid_optimizer_state_bytes"] = max(f[3] for f in gathered)
        rows["hybrid_model_state_bytes"] = max(model_state)
        rows["hybrid_model_state_bytes_per_pp_rank"] = model_state
    rows["peak_memory_bytes"] = max(f[5] for f in gathered)
    rows["peak_memory_bytes_per_pp_rank"] = [max(f[5] for f in ranks) for ranks in per_pp]
    if figures[3] is not None:
        rows["hybrid_optimizer_state_bytes_vs_ddp"] = round(max(f[4] for f in gathered) / max(whole, 1), 3)
    return rows
