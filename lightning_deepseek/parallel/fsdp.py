"""Sharded parameters on the data-parallel dimension (ZeRO-3) through torch's FSDP2 ``fully_shard``, and the
materialisation of a model built on the meta device.

``HybridParallelStrategy(data_parallel_shard_size=N)`` shards every parameter over ``N`` consecutive ranks of
placement's order (inside a node where placement keeps them together), and the ``world / N`` groups of such ranks
(``dp_replicate``) replicate the shards (HSDP: reduce-scatter inside a group, all-reduce across groups). ``N``
means the same for every parameter: each rank holds ``1/N`` of it, and every parameter has the same
``dp_replicate`` replicas:

- parameters replicated over the world (attention, embeddings, norms, dense feed-forward layers left unsharded):
  over the ``(dp_replicate, dp_shard)`` view of the run's mesh;
- tensor-parallel shards: over the ``N / tp`` of their ``dp`` replicas inside a shard group, replicated across the
  groups (the ``(dp_replicate_tp, dp_shard_tp)`` split of ``dp``); routed experts under expert parallelism
  likewise over ``N / ep`` of their ``edp`` replicas (``(edp_replicate, edp_shard)``), as torchtitan shards them.
  Where a tp or ep group spans whole shard groups (``N`` divides its size) its shards are replicated only; a size
  neither dividing nor divided by ``N`` is refused (``ParallelSizeError`` naming ``data_parallel_shard_size`` and
  the sizes that work): a shard group would hold parts of some shards and not of others. Such a shard's gradient,
  already summed over its model-parallel group's micro-batches, is summed over all its replicas and divided by the
  world size once (``set_gradient_divide_factor``): DDP's mean.

Each transformer block is one FSDP unit (its parameters all-gathered just before its forward and its backward, its
gradients reduce-scattered right after its backward, overlapped with the next block's by FSDP's streams on CUDA),
each child of the LightningModule (the modules its steps call: embeddings, final norm and head) a last one, each
model-parallel module one of its own; ``reshard_after_forward=False`` keeps a block's gathered parameters from
forward to backward (ZeRO-2-like: less communication, more memory). Parameters, gradients and optimizer states per
rank shrink to ``1/N`` (to ``1/tp`` or ``1/ep`` of a shard replicated only).

Why FSDP2 and not our own: it is torch's maintained ZeRO-3 (DTensor parameters that DCP, the state-dict helpers
and the mesh-aware clipping already handle); what it leaves to the caller, and this module does, is choosing the
units and the meshes and initialising a meta model.

Meta-device models (:func:`materialize`): ``to_empty`` on the strategy's device, then the model's own
``init_weights()`` where a module defines one (torchtitan's models, transformers' ``PreTrainedModel``), else every
module's ``reset_parameters()``; a module with parameters or buffers and neither is named in an error. Each rank
allocates only its shards.

Not supported: ZeRO-1 (``shard_optimizer_states``) on top of parameter sharding (FSDP already shards the optimizer
states); CPU offload.
"""

from __future__ import annotations

import itertools

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from lightning_deepseek.moe.protocol import find_expert_layers
from lightning_deepseek.parallel.activation_checkpointing import find_transformer_blocks
from lightning_deepseek.parallel.dims import EXPERT_SHARD_DIMS, TP_SHARD_DIMS, WorldMesh
from lightning_deepseek.parallel.expert import is_expert_param


def apply_fsdp(model: nn.Module, mesh: WorldMesh, reshard_after_forward: bool = True, announce: bool = True
               ) -> list[str]:
    """Shard ``model``'s parameters over ``mesh["dp_shard"]`` (replicated over ``dp_replicate``): the experts of
    each MoE layer and the tensor-parallel modules (over their replicas, split alike), each block, then each child
    of ``model`` (a LightningModule: the modules its steps call). Returns the units' names.

    Args:
        model: the model, after tensor and expert parallelism and activation checkpointing.
        mesh: the run's meshes (``mesh.dims.dp_shard`` > 1).
        reshard_after_forward: free a block's gathered parameters after its forward (False: keep them until its
            backward).
        announce: print the units on rank 0.
    """
    dims = mesh.dims
    shard_mesh = mesh["dp_shard"] if dims.dp_replicate == 1 else mesh["dp_replicate", "dp_shard"]
    names = {id(m): name for name, m in model.named_modules()}
    units = []
    # Shards of a model-parallel dimension first, each over the ranks replicating it, cut from the same mesh (FSDP2
    # requires it): their gradients are sums over their group's micro-batches, so divided by the world size.
    sharded = []
    if dims.ep_enabled:
        experts = replicas_mesh(mesh, "edp", EXPERT_SHARD_DIMS)
        sharded += [(layer.experts, experts) for layer in find_expert_layers(model)]
    if dims.tp_enabled:
        tp_replicas = replicas_mesh(mesh, "dp", TP_SHARD_DIMS)
        sharded += [(m, tp_replicas) for m in model.modules()
                    if any(isinstance(p, DTensor) for p in m.parameters(recurse=False)) and not is_expert_module(m)]
    for module, replicas in sharded:
        fully_shard(module, mesh=replicas, reshard_after_forward=reshard_after_forward)
        module.set_gradient_divide_factor(float(dims.world_size))
        # Sum, then divide: gloo has no PREMUL_SUM. Not over one shard rank: there torch (2.11 to 2.13) divides
        # once in place of the reduce-scatter and again after the all-reduce when sums are forced.
        module.set_force_sum_reduction_for_comms(replicas.size(replicas.ndim - 1) > 1)
        units.append(names[id(module)])
    modules = dict(model.named_modules())
    for name in find_transformer_blocks(model):
        fully_shard(modules[name], mesh=shard_mesh, reshard_after_forward=reshard_after_forward)
        units.append(name)
    # The roots are the modules the LightningModule's steps call (its children), not the LightningModule itself,
    # whose forward its steps need not call; parameters of its own stay replicated (DDP reduces them).
    for name, child in model.named_children():
        if any(not isinstance(p, DTensor) for p in child.parameters()):
            fully_shard(child, mesh=shard_mesh, reshard_after_forward=reshard_after_forward)
            units.append(name)
    if announce:
        splits = [f"{name} shards over {shard} x {replicate} replicas" for name, on, size in
                  (("tp", dims.tp_enabled, dims.tp), ("expert", dims.ep_enabled, dims.ep)) if on
                  for replicate, shard in [dims.shard_split(size)]]
        rank_zero_info(f"HybridParallelStrategy: parameters sharded over dp_shard={dims.dp_shard} x "
                       f"dp_replicate={dims.dp_replicate} (FSDP2{'; ' if splits else ''}{'; '.join(splits)}), "
                       f"{len(units)} units: {', '.join(units[:4])}" + (", ..." if len(units) > 4 else ""))
    return units


def replicas_mesh(mesh: WorldMesh, replicas: str, split: tuple[str, str]) -> DeviceMesh:
    """FSDP's mesh for the shards of a model-parallel dimension: their ``replicas`` (``"dp"``, ``"edp"``) alone
    where they are sharded over all of them, else split into ``(replicate, shard)`` (HSDP)."""
    model_parallel = mesh.dims.tp if replicas == "dp" else mesh.dims.ep
    replicate, _ = mesh.dims.shard_split(model_parallel)
    return mesh[replicas] if replicate == 1 else mesh[split]


def is_expert_module(module: nn.Module) -> bool:
    return any(is_expert_param(p) for p in module.parameters(recurse=False))


def check_no_legacy_fsdp(module: nn.Module) -> None:
    """Raise ``TypeError`` when ``module`` holds a module wrapped in torch's FSDP1 (``FullyShardedDataParallel``)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
        raise TypeError("HybridParallelStrategy found modules wrapped with torch's FullyShardedDataParallel (FSDP1): "
                        "it supports FSDP2 only. Use torch.distributed.fsdp.fully_shard in configure_model, or let "
                        "the strategy shard (data_parallel_shard_size).")


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))


@torch.no_grad()
def materialize(module: nn.Module, device: torch.device) -> None:
    """Allocate a meta-device ``module`` on ``device`` (only each rank's shards where it is sharded) and initialise
    it: a module's own ``init_weights()`` covers it and everything below it, else each module's
    ``reset_parameters()``. Raises ``ValueError`` naming the modules that have neither."""
    if not has_meta_tensors(module):
        return
    module.to_empty(device=device)
    covered: set[int] = set()
    missing: list[str] = []
    for name, sub in module.named_modules():
        if id(sub) in covered:
            continue
        if callable(getattr(sub, "init_weights", None)):
            sub.init_weights()
            covered.update(id(m) for m in sub.modules())
            continue
        if not any(True for _ in itertools.chain(sub.parameters(recurse=False), sub.buffers(recurse=False))):
            continue
        if callable(getattr(sub, "reset_parameters", None)):
            sub.reset_parameters()
        else:
            missing.append(f"{name or '(root)'} ({type(sub).__name__})")
    if missing:
        raise ValueError(f"the model was built on the meta device, but these modules cannot be initialised on the "
                         f"strategy's device: {', '.join(missing[:8])}{', ...' if len(missing) > 8 else ''}. Give "
                         "them a reset_parameters() method, give the model an init_weights() method, or build the "
                         "model on a real device (outside trainer.init_module(empty_init=True)).")
