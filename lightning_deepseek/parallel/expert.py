"""Expert parallelism: routed experts sharded over an expert-parallel group, tokens sent to them by all-to-all.

The world is laid out as the 2-D ``(edp, ep)`` view of the run's mesh (:mod:`~lightning_deepseek.parallel.dims`):
``ep`` consecutive ranks of placement's order form one expert-parallel group and together hold all experts,
``E / ep`` each (as ``DTensor`` shards ``Shard(0)`` on the ``ep`` mesh dimension, so that DCP checkpoints,
full-state gathering and the mesh-aware gradient norm handle them like the tensor-parallel shards); the ranks with
the same ``ep`` coordinate (the ``edp`` dimension) hold replicas of the same slice. Everything else in the model
(attention, router, shared experts, norms) stays data-parallel.

Forward of one experts module of the ``"top_k"`` convention (:mod:`lightning_deepseek.moe.protocol`; ours and
transformers' fused experts alike), on each rank with its own tokens, already routed:
1. the ``T x k`` (token, expert) pairs are sorted by expert; the per-expert counts are exchanged with one
   ``all_to_all_single`` over ``ep`` (split sizes first), so every rank knows what it will receive;
2. the token rows go to the ranks holding their experts with ``all_to_all_single`` (uneven splits) through
   ``torch.distributed._functional_collectives.all_to_all_single_autograd``, whose backward is the reverse
   all-to-all: torch's own autograd all-to-all, so nothing of ours runs in backward;
3. the module's own forward computes its local experts on the received rows (weights 1);
4. the reverse all-to-all returns the outputs, which are multiplied by the routing weights and summed per token.

Dropless routing makes this exact: every pair is computed once, by the same expert weights, whatever the split;
only the order of the final ``k``-term sum may differ (tested to 1e-5 against one process over 20 steps).
An experts module of the ``"grouped"`` convention (torchtitan's ``GroupedExperts``: rows already sorted by expert and
the count per expert) takes the same path with each row as a token of one expert and weight 1, and its own forward
sees the received rows sorted by local expert with their counts; its outputs return unweighted, in its rows' order,
for its caller to combine. Exact in the same way (tested to 1e-4 in FP32); an experts forward computing in BF16
(torchtitan's casts to BF16 itself) gives per-row results that can differ by BF16 rounding between a row's place in
a large and a small group (docs/moe.md states the measured bound).

Gradient-scale rule (the same as for tensor-parallel shards): after backward, a rank's expert gradient is the sum,
over the micro-batches of its ``ep`` group, of their losses' gradients (the all-to-all's backward brings each
sender's contribution). :func:`reduce_expert_gradients` sums it over the ``edp`` replicas and divides by the world
size, which is DDP's mean over all ranks. Run it once per optimizer step after backward (accumulated micro-batches
add up locally first). The experts must be kept out of DDP (its ignore list): DDP would average them over the
world, mixing different slices.

Costs per MoE layer and micro-batch: one all-to-all of ``E`` int64 counts, and two all-to-alls (forward) plus two
(backward) of ``T x k x d`` activation elements in total, of which the fraction ``(ep - 1) / ep`` leaves the rank
under uniform routing (:func:`all_to_all_bytes`). Saved: the expert gradients' all-reduce shrinks to ``1 / ep`` of
the bytes over ``world / ep`` ranks, and expert weights and optimizer states to ``1 / ep`` per rank.
This flat dispatch sends one row per (token, expert) pair. When an ``ep`` group spans islands of the topology, the
strategy (``expert_dispatch="auto"``) puts the per-island dispatch of :mod:`lightning_deepseek.parallel.expert_dispatch`
in front of it: a token crosses to each island it uses once and is fanned out there by :func:`exchange_pairs` over
the island's ranks, which is what makes node-limited routing (:mod:`lightning_deepseek.moe.node_limited`) save
slow-link bytes. Not supported: token dropping/capacity, expert tensor parallelism,
ranks of one ``ep`` group calling the layer a different number of times (every rank must run the same forward
passes, as under DDP).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from lightning_deepseek.moe.protocol import ExpertLayer, find_expert_layers
from lightning_deepseek.parallel.dims import ParallelDims
from lightning_deepseek.parallel.gradients import reduce_shard_gradients
from lightning_deepseek.parallel.pipeline_overlap import all_to_all_rows

EP_DIM, REPLICA_DIM = "ep", "edp"


def is_expert_param(param: torch.Tensor) -> bool:
    """Whether ``param`` is an expert shard made by :func:`apply_expert_parallel`."""
    return isinstance(param, DTensor) and param.device_mesh.mesh_dim_names == (EP_DIM,)


class ExpertParallel:
    """Mixin placed in front of an experts module's class by :func:`apply_expert_parallel` (as FSDP2's
    ``fully_shard`` does): dispatch, local compute through the class's own forward, combine. This one serves the
    ``"top_k"`` convention (:mod:`lightning_deepseek.moe.protocol`)."""

    num_global_experts: int
    _ep_group: dist.ProcessGroup
    _island_dispatch: Any = None  # an expert_dispatch.IslandDispatch when the ep group spans islands

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                *args: Any, **kwargs: Any) -> torch.Tensor:
        def compute(rows: torch.Tensor, local_index: torch.Tensor) -> torch.Tensor:
            ones = torch.ones(local_index.numel(), 1, dtype=top_k_weights.dtype, device=top_k_weights.device)
            with _local_parameters(self):
                return super(ExpertParallel, self).forward(rows, local_index[:, None], ones, *args, **kwargs)

        return self._dispatch(hidden_states, top_k_index, top_k_weights, compute)

    def _dispatch(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                  compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        num_local = self.num_experts
        if self._island_dispatch is not None:
            return self._island_dispatch.forward(hidden_states, top_k_index, top_k_weights, num_local, compute)
        num_tokens, top_k = top_k_index.shape
        flat_index = top_k_index.reshape(-1)
        order = torch.argsort(flat_index, stable=True)
        counts = torch.bincount(flat_index, minlength=dist.get_world_size(self._ep_group) * num_local)
        out = exchange_pairs(hidden_states[order // top_k], counts, num_local, self._ep_group, compute)
        out = out[torch.argsort(order)].view(num_tokens, top_k, -1)
        return (out * top_k_weights[..., None].to(out.dtype)).sum(dim=1).to(hidden_states.dtype)


class GroupedExpertParallel(ExpertParallel):
    """The mixin for the ``"grouped"`` convention: ``forward(rows sorted by expert, num_tokens_per_expert)``.

    Each row is a (token, expert) pair already, so it is dispatched as a token with one expert of weight 1 (exact:
    the combine multiplies by 1 and sums one term); the local experts see their received rows sorted by local
    expert with their counts, and the outputs come back in the order of ``rows``.
    """

    def forward(self, rows: torch.Tensor, num_tokens_per_expert: torch.Tensor, *args: Any, **kwargs: Any
                ) -> torch.Tensor:
        num_local = self.num_experts

        def compute(received: torch.Tensor, local_index: torch.Tensor) -> torch.Tensor:
            order = torch.argsort(local_index, stable=True)
            counts = torch.bincount(local_index, minlength=num_local).to(num_tokens_per_expert.dtype)
            with _local_parameters(self):
                out = super(ExpertParallel, self).forward(received[order], counts, *args, **kwargs)
            return out[torch.argsort(order)]

        experts = torch.arange(num_tokens_per_expert.numel(), device=rows.device)
        index = torch.repeat_interleave(experts, num_tokens_per_expert.to(rows.device, torch.long))[:, None]
        ones = torch.ones(index.shape, dtype=rows.dtype, device=rows.device)
        return self._dispatch(rows, index, ones, compute)


def exchange_pairs(rows: torch.Tensor, counts: torch.Tensor, num_local: int, group: dist.ProcessGroup,
                   compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Send ``rows`` (one per (token, expert) pair, sorted by expert) to the ranks of ``group`` holding their
    experts, ``compute(received_rows, local_expert_index)`` there, and return the outputs in the order of ``rows``.

    Args:
        rows: the pairs' token rows, sorted by expert (numbered ``group rank * num_local + local expert``).
        counts: pairs per expert (``group size * num_local``).
        num_local: experts per rank.
        group: the ranks exchanging (the ``ep`` group, or an island of it).
        compute: the local experts' forward on the received rows.
    """
    size = dist.get_world_size(group)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    received = received.view(size, num_local)
    send_splits = counts.view(size, num_local).sum(1).tolist()
    recv_splits = received.sum(1).tolist()
    # torch's autograd all-to-all, or the DualPipeV overlap's asynchronous one (lets another micro-batch compute)
    rows = all_to_all_rows(rows, recv_splits, send_splits, group)
    local_index = torch.repeat_interleave(torch.arange(num_local, device=counts.device).repeat(size),
                                          received.flatten())
    return all_to_all_rows(compute(rows, local_index), send_splits, recv_splits, group)


@contextmanager
def _local_parameters(module: nn.Module) -> Iterator[None]:
    """Let the module's own forward see its expert shards as plain local tensors (``to_local`` is differentiable,
    so the gradients land on the DTensor parameters); what ``torch.func.functional_call`` does, without calling
    ``module.__call__`` again."""
    saved = dict(module._parameters)
    try:
        for name, param in saved.items():
            if isinstance(param, DTensor):
                module._parameters[name] = param.to_local()
        yield
    finally:
        module._parameters.update(saved)


_EP_CLASSES: dict[tuple[type, str], type] = {}
_MIXINS = {"top_k": ExpertParallel, "grouped": GroupedExpertParallel}


def _expert_parallel_class(cls: type, convention: str) -> type:
    if (cls, convention) not in _EP_CLASSES:
        mixin = _MIXINS[convention]
        _EP_CLASSES[cls, convention] = type(f"{mixin.__name__}{cls.__name__}", (mixin, cls), {})
    return _EP_CLASSES[cls, convention]


def shard_experts(layer: ExpertLayer, mesh: DeviceMesh) -> None:
    """Shard one experts module over ``mesh["ep"]`` (its parameters with leading dimension ``num_experts``) and
    route its forward through the all-to-all dispatch."""
    experts, ep_mesh = layer.experts, mesh[EP_DIM]
    for name, param in list(experts.named_parameters(recurse=False)):
        if param.dim() >= 1 and param.size(0) == layer.num_experts:
            shard = distribute_tensor(param.detach(), ep_mesh, [Shard(0)])
            experts.register_parameter(name, nn.Parameter(shard, requires_grad=param.requires_grad))
    experts.num_global_experts = layer.num_experts
    experts.num_experts = layer.num_experts // ep_mesh.size()
    experts._ep_group = ep_mesh.get_group()
    experts.moe_convention = layer.convention  # found again after the class swap (its forward is ours then)
    experts.__class__ = _expert_parallel_class(type(experts), layer.convention)


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh, layers: list[ExpertLayer] | None = None
                          ) -> list[ExpertLayer]:
    """Shard the routed experts of ``model`` (found by the MoE protocol) over ``mesh``'s ``ep`` dimension.

    Every rank must hold the same full weights before the call (as after DDP's initial broadcast).

    Args:
        model: the model; its experts modules are changed in place.
        mesh: the ``(edp, ep)`` view of the run's mesh (``ParallelDims.build_mesh(...)["edp", "ep"]``).
        layers: the layers to shard; default: all found in ``model``.

    Returns:
        The sharded layers (empty when the model has none).
    """
    layers = find_expert_layers(model) if layers is None else layers
    ParallelDims(mesh.size(), ep=mesh[EP_DIM].size()).check_experts(layers)
    for layer in layers:
        if not isinstance(layer.experts, ExpertParallel):
            shard_experts(layer, mesh)
    return layers


@torch.no_grad()
def reduce_expert_gradients(params: Iterable[torch.Tensor], mesh: DeviceMesh) -> None:
    """Sum the expert gradients among ``params`` over their replicas (``edp``) and divide by the world size."""
    grads = [p.grad.to_local() for p in params if is_expert_param(p) and p.grad is not None]
    replicas = mesh.get_group(REPLICA_DIM) if grads and mesh[REPLICA_DIM].size() > 1 else None
    reduce_shard_gradients(grads, replicas, mesh.size())


def all_to_all_bytes(num_tokens: int, top_k: int, dim: int, ep_size: int, itemsize: int) -> int:
    """Bytes one rank sends to other ranks per MoE layer, forward and backward, under uniform routing."""
    return 4 * num_tokens * top_k * dim * itemsize * (ep_size - 1) // ep_size
