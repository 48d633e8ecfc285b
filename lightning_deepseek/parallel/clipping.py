"""Gradient clipping over parameters that mix plain tensors and DTensor shards.

``torch.nn.utils.clip_grad_norm_`` fails when a parameter list mixes ``DTensor`` and ``Tensor`` (or DTensors of
different meshes). Here each rank adds up the norms of its local pieces: a plain (replicated) gradient counts
whole, a DTensor gradient counts its local shard, and the shard sums are reduced over the process groups of the
mesh dimensions they are sharded on, in turn (a shard over ``dp`` and ``tp``, as FSDP over tensor parallelism makes
it, over both); one all-reduce per such group and kind of shard. Clipping by value is element-wise and needs no
communication.

Every rank must call these functions with the same parameters (they are collective when DTensors are present).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer


def _shard_groups(grad: DTensor) -> tuple[dist.ProcessGroup, ...]:
    """The process groups over which ``grad``'s local pieces must be summed, one per sharded mesh dimension (none
    when it is replicated)."""
    # Not `is_shard()`: FSDP over tensor parallelism places `_StridedShard`, which is not a `Shard` in every torch.
    return tuple(grad.device_mesh.get_group(i) for i, placement in enumerate(grad.placements)
                 if not (placement.is_replicate() or placement.is_partial()))


def total_grad_norm(parameters: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all gradients of ``parameters`` taken together, as a plain tensor equal on every rank.

    Shared: ``clip_grad_norm_`` below, and ``ElasticTraining``'s health check (``lightning_deepseek.elastic``), which
    imports it from here (also exported as ``lightning_deepseek.parallel.total_grad_norm``). Collective when
    DTensors are present: every rank must call it with the same parameters.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    device = grads[0].device
    is_inf = norm_type == float("inf")
    replicated = torch.zeros((), device=device, dtype=torch.float32)
    by_groups: dict[tuple[dist.ProcessGroup, ...], torch.Tensor] = {}
    for grad in grads:
        groups = _shard_groups(grad) if isinstance(grad, DTensor) else ()
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        piece = torch.linalg.vector_norm(local.float(), norm_type)
        piece = piece if is_inf else piece.pow(norm_type)
        if not groups:
            replicated = torch.maximum(replicated, piece) if is_inf else replicated + piece
        else:
            current = by_groups.get(groups, torch.zeros((), device=device, dtype=torch.float32))
            by_groups[groups] = torch.maximum(current, piece) if is_inf else current + piece
    total = replicated
    for groups, value in by_groups.items():
        for group in groups:
            dist.all_reduce(value, op=dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM, group=group)
        total = torch.maximum(total, value) if is_inf else total + value
    return total if is_inf else total.pow(1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale the gradients of ``parameters`` so that their joint norm is at most ``max_norm``; return the norm.

    Args:
        parameters: parameters whose ``.grad`` may be plain tensors or DTensors.
        max_norm: the largest allowed joint norm.
        norm_type: the p of the p-norm (``float("inf")`` for the max norm).
    """
    parameters = list(parameters)
    norm = total_grad_norm(parameters, norm_type)
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in parameters:
        if p.grad is not None:
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            grad.mul_(scale.to(grad.device, grad.dtype))
    return norm


@torch.no_grad()
def clip_grad_value_(parameters: Iterable[torch.Tensor], clip_value: float) -> None:
    """Clamp every gradient of ``parameters`` to ``[-clip_value, clip_value]``, shard by shard."""
    for p in parameters:
        if p.grad is not None:
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            grad.clamp_(-clip_value, clip_value)


def route_clipping(plugin: Any) -> None:
    """Make a Lightning precision plugin clip with the functions above (collective when DTensors are present).

    Lightning clips through the precision plugin with torch's ``clip_grad_norm_``, which fails on a mix of DTensor
    and plain gradients; the plugin is the user's (any ``Precision`` subclass), so its two clipping methods are
    redirected on this instance rather than by subclassing every plugin.
    """

    def clip_grad_by_norm(optimizer: Optimizer, clip_val: float) -> None:
        clip_grad_norm_(plugin.main_params(optimizer), clip_val)

    def clip_grad_by_value(optimizer: Optimizer, clip_val: float) -> None:
        clip_grad_value_(plugin.main_params(optimizer), clip_val)

    plugin.clip_grad_by_norm = clip_grad_by_norm
    plugin.clip_grad_by_value = clip_grad_by_value
