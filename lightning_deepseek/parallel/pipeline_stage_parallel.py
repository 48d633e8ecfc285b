"""Tensor and expert parallelism inside pipeline stages (``pipeline_parallel_size`` with ``tensor_parallel_size`` or
``expert_parallel_size``), and the data-parallel exchange of a stage's gradients that mix plain tensors and shards.

Tensor parallelism (pp x tp): the strategy's automatic plan (:mod:`.plan`) is decided on the whole model before the
split (its names are the whole model's, which the rank module keeps) and applied to this rank's stages over the mesh's
``tp`` dimension at fixed ``(pp, dp)``. Unlike the strategy without a pipeline (each rank its own batch, the
feed-forward input gathered over ``tp``), the ranks of a ``tp`` group here read the same batch (their ``dp``
coordinate's shard): column-wise layers take the replicated input and row-wise layers all-reduce their partial sums back
to a replicated output (Megatron's layout, torch's ``ColwiseParallel()`` / ``RowwiseParallel()`` defaults), so each
stage receives and sends plain full tensors. With ``plan="auto"`` the attention modules a model declares
(transformers' plans: query, key, value column-wise, output row-wise) are sharded too, each rank computing its share
of the heads (:func:`~lightning_deepseek.parallel.plan.add_attention_heads`); everything else outside the plan (norms,
embeddings, an attention with fused projections such as our GPT's) runs replicated on every ``tp`` rank. With FSDP2
over the stage's ``dp`` ranks (``data_parallel_shard_size``) the sharded layers become 2-D DTensors over ``(dp, tp)``
(``_shard_stages`` in :mod:`.pipeline_loop`). Costs per sharded pair (feed-forward or attention) and micro-batch: one
all-reduce of the pair's output in the forward and one of its input gradient in the backward, over ``tp``; the
replicated layers compute ``tp`` times.

Expert parallelism (pp x ep, DeepSeek-V3's shape): the routed experts of this rank's stages are sharded over the
mesh's ``ep`` dimension inside the stage (``ep`` consecutive ranks of the stage's ``dp`` ranks, each reading its own
batch), tokens dispatched by the all-to-all of :mod:`.expert`; every rank of an ``ep`` group runs the same schedule,
so their MoE layers are called in the same order. With ZeRO-1 (``shard_optimizer_states``, :mod:`.memory`) the
replicated parameters' states are dealt over the stage's ``dp`` ranks, the experts' over its ``edp`` ranks
(under ``tp`` every state over the stage's ``dp`` ranks at its ``tp`` coordinate). With FSDP2
(``data_parallel_shard_size``) the experts are sharded over the stage's ``edp`` ranks (``_shard_stages``).

Does not support: ``tp`` and ``ep`` both above 1 under a pipeline; a split that separates a column-wise layer from its
row-wise partner (the stage boundary would be sharded over ``tp``: refused); dropout inside a tensor-parallel stage
differs between the ``tp`` ranks (no shared random state), so it runs correctly only without dropout.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module

from lightning_deepseek.moe.protocol import find_expert_layers
from lightning_deepseek.parallel.dims import WorldMesh
from lightning_deepseek.parallel.expert import REPLICA_DIM, is_expert_param
from lightning_deepseek.parallel.expert_plan import ExpertParallelPlan, setup_expert_parallel
from lightning_deepseek.parallel.expert_routing import ExpertRouting
from lightning_deepseek.parallel.layout import LayoutSettings, decide_layout_plan
from lightning_deepseek.parallel.pipeline_split import PipelineSplit
from lightning_deepseek.parallel.plan import Plan, add_attention_heads
from lightning_deepseek.parallel.styles import Conv1DColwiseParallel, Conv1DRowwiseParallel
from lightning_deepseek.parallel.topology import Topology

__all__ = ["apply_stage_tensor_parallel", "check_stage_boundaries", "plan_stage_tensor_parallel",
           "reduce_stage_gradients", "setup_stage_expert_parallel", "sum_partial_gradients",
           "tensor_parallel_partial_params"]


def plan_stage_tensor_parallel(module: nn.Module, settings: LayoutSettings, mesh: WorldMesh) -> Plan:
    """The tensor-parallel plan of the whole (unsplit) ``module`` at ``mesh.dims.tp`` (empty at ``tp=1``)."""
    if not mesh.dims.tp_enabled:
        return Plan(reason=f"tensor_parallel_size={settings.tp!r} resolves to 1 under a pipeline.")
    plan = decide_layout_plan(module, settings, mesh.dims, None)
    if settings.plan != "auto":
        return plan
    return add_attention_heads(module, plan, mesh.dims.tp, settings.min_shard_params)


def check_stage_boundaries(plan: Plan, split: PipelineSplit, prefix: str, tp_size: int) -> None:
    """Raise when a stage would end between a column-wise layer and its row-wise partner (its output sharded over
    ``tp`` at the boundary). ``prefix``: the model's attribute in the LightningModule (the plan's names carry it)."""
    def stage_of(name: str) -> int:
        relative = name[len(prefix) + 1:] if prefix else name
        for stage in split.stages:
            if any(relative == owned or relative.startswith(owned + ".") for owned in stage.modules):
                return stage.index
        raise ValueError(f"the tensor-parallel plan names {name!r}, which no pipeline stage owns.")

    by_stage: dict[int, list[tuple[str, str]]] = {}
    for entry in plan:
        by_stage.setdefault(stage_of(entry.name), []).append((entry.name, entry.style))
    for index, styles in by_stage.items():
        if styles[-1][1] == "colwise" or styles[0][1] == "rowwise":
            name = styles[-1][0] if styles[-1][1] == "colwise" else styles[0][0]
            raise ValueError(
                f"tensor_parallel_size={tp_size} with pipeline_parallel_size={split.pp_size}: pipeline stage {index} "
                f"{'ends after' if styles[-1][1] == 'colwise' else 'begins with'} the tensor-parallel layer {name!r} "
                "without its partner, so the stage boundary would be sharded over tp. Pass a plan= whose column-wise "
                "and row-wise pairs lie inside one block, or set tensor_parallel_size=1.")


def apply_stage_tensor_parallel(module: nn.Module, plan: Plan, tp_mesh: DeviceMesh,
                                sequence_parallel: bool = False) -> None:
    """Shard the planned layers this rank's stages hold (in ``module``, the LightningModule after the split) over
    ``tp_mesh``: column-wise from a replicated input, row-wise to a replicated output (see the module docstring), or
    with ``sequence_parallel`` reduce-scattered to sequence shards (:mod:`.sequence_parallel`)."""
    held = dict(module.named_modules())
    styles = {name: style for name, style in plan.styles.items() if name in held}
    make = {"colwise": Conv1DColwiseParallel,
            "rowwise": (lambda: Conv1DRowwiseParallel(output_layouts=Shard(1))) if sequence_parallel
            else Conv1DRowwiseParallel}
    if styles:
        parallelize_module(module, tp_mesh, {name: make[style]() for name, style in styles.items()})


def tensor_parallel_partial_params(module: nn.Module, plan: Plan) -> list[nn.Parameter]:
    """The trainable parameters of ``module`` whose gradient each ``tp`` rank holds only its share of: those inside an
    attention module whose heads ``plan`` splits, outside its projections (a norm over each head: each rank normalises
    its own heads). Their gradients are summed over ``tp`` (:func:`sum_partial_gradients`)."""
    attention = {e.name.rpartition(".")[0] for e in plan if e.heads}
    planned = set(plan.names)
    return [p for name, p in module.named_parameters()
            if p.requires_grad and name.rpartition(".")[0] not in planned
            and any(name.startswith(f"{parent}.") for parent in attention)]


@torch.no_grad()
def sum_partial_gradients(params: Sequence[nn.Parameter], tp_group: dist.ProcessGroup) -> None:
    """Sum the gradients of ``params`` (:func:`tensor_parallel_partial_params`; their local pieces under FSDP2) over
    ``tp_group`` with one flat all-reduce; a missing gradient counts as zeros."""
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=tp_group)
    for grad, piece in zip(grads, flat.split([g.numel() for g in grads])):
        grad.copy_(piece.view_as(grad))


def setup_stage_expert_parallel(module: nn.Module, whole: nn.Module, mesh: WorldMesh, topology: Topology | None,
                                routing: ExpertRouting | None) -> ExpertParallelPlan | None:
    """Shard the routed experts of this rank's stages (in ``module``, after the split) over the ``ep`` ranks of the
    stage; ``whole`` (the model before the split) is checked for expert counts ``ep`` divides. Collective over the
    world: every rank calls it, whether its stages hold MoE layers or not. None where ``ep=1``."""
    dims = mesh.dims
    if not dims.ep_enabled:
        return None
    layers = find_expert_layers(whole)
    if not layers:  # warns, shards nothing (no collective)
        return setup_expert_parallel(module, mesh, topology, routing)
    dims.check_experts(layers)
    mesh["edp", "ep"]  # the expert mesh is made by every rank, also where this rank's stages hold no MoE layer
    if not find_expert_layers(module):
        rank_zero_info(f"pipeline rank {mesh['pp'].get_local_rank()}: its stages hold no MoE layer.")
        return None
    return setup_expert_parallel(module, mesh, topology, routing)


@torch.no_grad()
def reduce_stage_gradients(params: Sequence[nn.Parameter], dp_group: dist.ProcessGroup,
                           expert_mesh: DeviceMesh | None) -> None:
    """Average a stage's gradients over its ``dp`` replicas (``dp_group``): one flat all-reduce of every gradient
    but the routed experts' (tensor-parallel shards as their local pieces: the ranks of ``dp_group`` hold the same
    piece), and one of the experts' over ``expert_mesh``'s ``edp`` group (their ``ep`` group already summed the
    contributions of its ranks' batches in the all-to-all's backward), both divided by the ``dp`` size. A missing
    gradient counts as zeros, so every replica sends the same layout."""
    params = [p for p in params if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
    experts = [g for p, g in zip(params, local) if is_expert_param(p)]
    others = [g for p, g in zip(params, local) if not is_expert_param(p)]
    replicas = expert_mesh.get_group(REPLICA_DIM) if expert_mesh is not None and expert_mesh[REPLICA_DIM].size() > 1 \
        else None
    for grads, group in ((others, dp_group), (experts, replicas)):
        if not grads:
            continue
        flat = torch.cat([g.reshape(-1) for g in grads])
        if group is not None:
            dist.all_reduce(flat, group=group)
        flat.div_(dist.get_world_size(dp_group))
        for grad, piece in zip(grads, flat.split([g.numel() for g in grads])):
            grad.copy_(piece.view_as(grad))
