"""Lightning's loop through a pipeline: ``HybridParallelStrategy(pipeline_parallel_size=P)`` runs training,
validation, test and predict steps with :class:`~lightning_deepseek.parallel.pipeline.PipelineRunner`.

Why our own: Lightning has no pipeline parallelism, and ``torch.distributed.pipelining`` gives schedules, not a
loop: a LightningModule's ``training_step`` computes the loss of the whole model in one call, which cannot run when
each rank holds a few layers. Here the strategy's own ``training_step`` runs forward and backward of every
micro-batch through the schedule (its ``backward`` only puts back the gradients, which Lightning zeroes in between),
and ``validation_step`` / ``test_step`` run the forwards only; what the module declares instead is the protocol below.

The protocol (a LightningModule trained under a pipeline defines):

- ``pipeline_loss(output, target) -> Tensor`` (required): the mean loss of one micro-batch from the last stage's
  output (the model's output, e.g. logits) and its targets. It runs on the rank of the last stage.
- ``pipeline_batch(batch) -> (inputs, targets)`` (optional): the model's input tensor and the targets of a batch
  (default: the batch is an ``(inputs, targets)`` pair). Inputs are read on the first stage's rank, targets on the
  last's.
- ``pipeline_module: str`` (optional): the attribute holding the model to split (default: the module's only child).
- ``on_pipeline_loss(loss, batch, step)`` (optional): called after each step with the loss (the same on every rank
  of the pipeline; the batch's on each data-parallel replica) and ``step`` in ``"training"``, ``"validation"``,
  ``"test"``: where ``self.log`` goes. The module's own ``training_step``, ``validation_step`` and ``test_step``
  are not called (Lightning still requires a ``training_step`` to exist). Lightning's ``on_train_batch_end`` hooks
  receive the loss as the step output.
- ``pipeline_predict(output, batch)`` (optional): what ``trainer.predict`` returns for a batch from the last stage's
  output of the whole batch (default: that output); the module's ``predict_step`` is not called.

Predict: the forwards of each batch's inputs (the batch itself when a tensor or a one-element tuple or list, else
the first of ``pipeline_batch``); the last stage's output is broadcast over the pipeline group (one broadcast of the
output per batch), so every rank returns its data-parallel shard's predictions as under DDP, and the ranks of one
pipeline the same ones. Under FSDP2 stages the replicas' predict shares must be of one size (their all-gathers pair
up; checked before the first batch).

Data parallelism: the pipeline group is the mesh's ``pp`` dimension (outermost, torchtitan's order); the ranks
holding the same stages form the ``dp`` group, each reads its own data shard (``DistributedSampler`` by its ``dp``
coordinate), and its stage gradients are averaged over ``dp`` with one flat all-reduce per optimizer step, after
the last accumulated batch and before clipping. With ``data_parallel_shard_size`` equal to that ``dp`` size, FSDP2
shards each stage over it instead (every block, then the stage; the reduce-scatter at the end of each schedule step,
as torch's ``PipelineStage`` runs it); under ZBVZeroBubble and DualPipeV only with ``reshard_after_forward=False``.

Model parallelism inside a stage (:mod:`.pipeline_stage_parallel`): ``tensor_parallel_size`` (the ``tp`` ranks of a
stage read the same batch; the automatic plan's feed-forward pairs sharded Megatron-style, stage boundaries plain full
tensors; with ``loss_parallel`` the embedding, head and loss sharded by vocabulary: :mod:`.loss_parallel`) or
``expert_parallel_size`` (routed experts over ``ep`` of the stage's ``dp`` ranks, all-to-all dispatch;
expert gradients summed over the stage's ``edp`` replicas, with ZeRO-1 their states dealt over ``edp``); ZeRO-1 deals
the states over the stage's ``dp`` ranks; with FSDP2 the tensor-parallel layers are sharded over ``dp`` too (2-D
DTensors over ``(dp, tp)``), the routed experts over ``edp`` (over ``(edp, ep)``); ``"auto"`` sizes resolve to 1 under a
pipeline.

Supports: every schedule of :mod:`.pipeline`; gradient accumulation (``grad_scale = 1 / accumulate_grad_batches``);
clipping by norm (the norm over all stages, :meth:`.PipelineRunner.clip_grad_norm_`; by value untested); LR schedulers
and optimizers as the module configures them (they see only the rank's stage parameters); meta-device models (each
rank materialises its stages only); ZeRO-1 over each stage's ``dp`` ranks; ``GradientCompression`` of the ``dp``
exchange (:mod:`.pipeline_exchange`); FP16 loss scaling by ``StagedPrecision`` or ``'16-mixed'`` (each micro-batch's
loss times the scale, an overflow anywhere skipping the step everywhere: :mod:`.pipeline_scaling`). Costs: per
optimizer step one all-reduce of the rank's stage gradients over ``dp`` (not overlapped with the backward, as DDP's
buckets are), and the runner's costs.

Does not support: manual optimisation, training batches of different sizes, tensor and expert parallelism together
inside a stage (or either with ``GradientCompression``), HSDP (a stage sharded over part of its replicas), FSDP2
resharding after forward and selective activation checkpointing under ZBVZeroBubble and DualPipeV (their split
backward), ``GradientCompression`` on FSDP2 stages or with ``bits="auto"``, one-file checkpoints
(``save_distributed_checkpoint=False``, and resuming from a file: refused, the ranks hold other stages).

Checkpoints: the DCP folder holds each rank's stages and their optimizer states under the whole model's parameter
names (:mod:`.checkpoint`; states and hyperparameters keyed by name, not group index), so a pipelined run resumes at
the same or another ``pp`` size, or without a pipeline. A folder written without a pipeline (param_groups by index,
Lightning's ``ModelParallelStrategy`` form) resumes under one, each saved group's hyperparameters mapped to this
rank's parameters by name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from lightning_deepseek.moe.protocol import find_expert_layers
from lightning_deepseek.parallel.activation_checkpointing import apply_activation_checkpointing
from lightning_deepseek.parallel.dims import WorldMesh
from lightning_deepseek.parallel.expert_plan import ExpertParallelPlan
from lightning_deepseek.parallel.expert_routing import ExpertRouting
from lightning_deepseek.parallel.layout import LayoutSettings
from lightning_deepseek.parallel.loss_parallel import (
    apply_loss_parallel,
    gather_vocabulary,
    loss_parallel,
    parallel_loss,
    vocabulary_modules,
)
from lightning_deepseek.parallel.pipeline import PipelineRunner, check_pipeline_settings, min_microbatches
from lightning_deepseek.parallel.pipeline_exchange import average_gradients
from lightning_deepseek.parallel.pipeline_split import PipelineSplit, build_rank_module, plan_pipeline_split
from lightning_deepseek.parallel.pipeline_stage_parallel import (
    apply_stage_tensor_parallel,
    check_stage_boundaries,
    plan_stage_tensor_parallel,
    reduce_stage_gradients,
    setup_stage_expert_parallel,
    sum_partial_gradients,
    tensor_parallel_partial_params,
)
from lightning_deepseek.parallel.sequence_parallel import (
    apply_sequence_parallel,
    check_sequence_parallel,
    sequence_local_params,
)
from lightning_deepseek.parallel.topology import Topology

if TYPE_CHECKING:
    from lightning_deepseek.compression.state import CompressionState

__all__ = ["PipelineLoop", "split_lightning_module"]

_PROTOCOL = "docs/pipeline.md, 'In Lightning'"


@dataclass
class PipelineLoop:
    """This rank's part of a pipelined LightningModule: the split, its stage modules, the groups, and the runner
    (built on first use, once the stages are materialised and on their device)."""

    split: PipelineSplit
    stage_modules: list[nn.Module]
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup | None
    num_microbatches: int
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    split_batch: Callable[[Any], tuple[torch.Tensor, torch.Tensor]]
    on_loss: Callable[[torch.Tensor, Any, str], None]
    device: torch.device
    runner: PipelineRunner | None = None
    expert_plan: ExpertParallelPlan | None = None  # this rank's stages' experts under expert parallelism
    batch_size: int | None = None
    overlap: bool = False  # pipeline_overlap: DualPipeV's MoE all-to-all behind the paired micro-batch's compute
    compression: CompressionState | None = None  # set by GradientCompression (compress_pipeline_gradients)
    tp_partial: tuple[list[nn.Parameter], dist.ProcessGroup] | None = None  # summed over tp first (split heads' norms)
    vocabulary_mesh: DeviceMesh | None = None  # loss_parallel: the logits sharded by vocabulary over this tp mesh
    _pending: list[torch.Tensor | None] | None = None

    @property
    def expert_mesh(self) -> DeviceMesh | None:
        """This stage's ``(edp, ep)`` mesh under expert parallelism (None without it, or without MoE layers)."""
        return self.expert_plan.mesh if self.expert_plan is not None else None

    def _runner(self) -> PipelineRunner:
        if self.runner is None:
            self.runner = PipelineRunner.from_stage_modules(self.split, self.stage_modules, self.loss_fn,
                                                            self.pp_group, self.num_microbatches, self.device,
                                                            self.overlap)
        return self.runner

    def training_step(self, batch: Any, grad_scale: float, accumulating: bool = False) -> torch.Tensor:
        """Forward and backward of ``batch`` through the pipeline; the mean micro-batch loss, on every rank.

        ``accumulating``: the gradients already in ``.grad`` are kept for :meth:`add_gradients` (a batch inside an
        accumulation window). Otherwise they are dropped before the schedule runs (Lightning zeroes them after this
        step anyway): the schedule's peak holds one set of gradients, not the previous step's beside its own.
        """
        inputs, targets = self.split_batch(batch)
        size = inputs.size(0)
        check_pipeline_settings(self.split.pp_size, self.split.pp_size, self.split.schedule, self.num_microbatches,
                                size)
        if self.batch_size not in (None, size):
            raise ValueError(f"a training batch of {size} samples follows batches of {self.batch_size}: the pipeline's "
                             "stages keep the micro-batch shape of the first step. Give every training batch the "
                             "same size (DataLoader(drop_last=True)).")
        self.batch_size = size
        params = self._parameters()
        held = [p.grad if accumulating else None for p in params]
        for p in params:
            p.grad = None
        with self.loss_context():
            loss = self._runner().step(inputs, targets, grad_scale=grad_scale)
        self._pending = [p.grad for p in params]
        for p, grad in zip(params, held):
            p.grad = grad
        self.on_loss(loss, batch, "training")
        return loss

    @torch.no_grad()
    def add_gradients(self) -> None:
        """Add the gradients of the last ``training_step`` to ``.grad``. Lightning zeroes the gradients between
        ``training_step`` and ``backward``, so the step sets its gradients aside (no copy) and this puts them back."""
        for p, grad in zip(self._parameters(), self._pending or []):
            if grad is not None:
                p.grad = grad if p.grad is None else p.grad.add_(grad)
        self._pending = None

    def _parameters(self) -> list[nn.Parameter]:
        return [p for module in self.stage_modules for p in module.parameters()]

    def eval_step(self, batch: Any, step: str) -> torch.Tensor:
        """Forwards of ``batch`` through the pipeline; the mean micro-batch loss, on every rank."""
        with self.loss_context():
            loss = self._runner().eval_step(*self.split_batch(batch))
        self.on_loss(loss, batch, step)
        return loss

    def predict_step(self, batch: Any) -> torch.Tensor:
        """Forwards of ``batch``'s inputs through the pipeline; the last stage's output for the whole batch, on every
        rank of the pipeline. The inputs: ``batch`` itself (a tensor, or a one-element tuple or list as a
        ``TensorDataset`` of inputs gives), else the first of ``pipeline_batch(batch)``."""
        if isinstance(batch, torch.Tensor):
            inputs = batch
        elif isinstance(batch, (tuple, list)) and len(batch) == 1:
            inputs = batch[0]
        else:
            inputs = self.split_batch(batch)[0]
        output = self._runner().predict_step(inputs)
        return output if self.vocabulary_mesh is None else gather_vocabulary(output, self.vocabulary_mesh)

    def loss_context(self) -> contextlib.AbstractContextManager:
        """What the schedule's forwards and backwards run under: torch's ``loss_parallel()`` with ``loss_parallel``
        (:mod:`.loss_parallel`), else nothing."""
        return loss_parallel() if self.vocabulary_mesh is not None else contextlib.nullcontext()

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Average this rank's stage gradients over its ``dp`` group (:mod:`.pipeline_exchange`: one flat all-reduce,
        or compressed where ``GradientCompression`` set ``compression``); uncompressed, tensor-parallel shards as their
        local pieces and routed experts summed over their ``edp`` group (:func:`.reduce_stage_gradients`); first the
        gradients each ``tp`` rank holds a share of are summed over ``tp`` (:func:`.sum_partial_gradients`)."""
        if self.tp_partial is not None:
            sum_partial_gradients(*self.tp_partial)
        if self.dp_group is None:
            return
        if self.compression is None:
            reduce_stage_gradients(self._parameters(), self.dp_group, self.expert_mesh)
            return
        average_gradients(self._parameters(), self.dp_group, self.compression)


def _model_attribute(module: pl.LightningModule) -> str:
    name = getattr(module, "pipeline_module", None)
    if name is None:
        children = [n for n, child in module.named_children() if any(True for _ in child.parameters())]
        if len(children) != 1:
            raise ValueError(
                f"{type(module).__name__} has {len(children)} child modules with parameters ({children}): under "
                "pipeline_parallel_size > 1 set its attribute pipeline_module = '<name>' to the model to split "
                f"({_PROTOCOL}).")
        name = children[0]
    if not isinstance(getattr(module, name, None), nn.Module):
        raise ValueError(f"{type(module).__name__}.pipeline_module={name!r} is not a submodule: name the attribute "
                         f"holding the model to split ({_PROTOCOL}).")
    return name


def _default_split_batch(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise ValueError(f"a batch of type {type(batch).__name__} is not an (inputs, targets) pair: define "
                     f"pipeline_batch(batch) -> (inputs, targets) on the LightningModule ({_PROTOCOL}).")


def split_lightning_module(module: pl.LightningModule, mesh: WorldMesh, settings: LayoutSettings,
                           device: torch.device, topology: Topology | None = None,
                           routing: ExpertRouting | None = None) -> PipelineLoop:
    """Split ``module``'s model into pipeline stages and keep this rank's: the model attribute is replaced by the
    module holding this rank's stages (the whole model's parameter names), so ``configure_optimizers`` and
    checkpoints see only them. The tensor-parallel plan is decided and activation checkpointing applied on the
    whole model before the split; tensor and expert parallelism inside the stages (:mod:`.pipeline_stage_parallel`;
    ``topology`` and ``routing`` as for the strategy's experts) and parameter sharding (FSDP2 over the stage's ``dp``
    group, ``data_parallel_shard_size`` equal to it) after. Works on the meta device (nothing is allocated).

    Raises:
        ValueError: the module lacks the protocol (naming the hook) or the model cannot be split as asked.
    """
    if not callable(getattr(module, "pipeline_loss", None)):
        raise ValueError(
            f"{type(module).__name__} has no pipeline_loss(output, target) method: under pipeline_parallel_size="
            f"{mesh.dims.pp} its training_step cannot run across the stages, so the strategy runs the model itself and "
            f"needs the loss of one micro-batch from the model's output. Define pipeline_loss ({_PROTOCOL}).")
    if not module.automatic_optimization:
        raise ValueError(f"{type(module).__name__}.automatic_optimization=False: manual optimisation is not supported "
                         "with pipeline_parallel_size > 1 (the strategy runs each step's backward).")
    dims = mesh.dims
    if dims.dp_shard not in (1, dims.dp):
        raise ValueError(
            f"data_parallel_shard_size={dims.dp_shard} with pipeline_parallel_size={dims.pp}: a stage's parameters "
            f"are sharded over all {dims.dp} ranks holding that stage or not at all. Set data_parallel_shard_size to "
            f"{dims.dp} or 1.")
    name = _model_attribute(module)
    pp_mesh = mesh["pp"]
    tp_plan = plan_stage_tensor_parallel(module, settings, mesh)  # on the whole model: its names
    whole = getattr(module, name)
    apply_activation_checkpointing(whole, settings.activation_checkpointing)  # on the whole model
    split = plan_pipeline_split(whole, dims.pp, settings.pp_schedule)
    check_stage_boundaries(tp_plan, split, name, dims.tp)
    if settings.loss_parallel:
        embeddings, head = vocabulary_modules(whole, split, dims.tp)
        vocabulary = ([f"{name}.{e}" if name else e for e in embeddings], f"{name}.{head}" if name else head)
    if settings.sp:
        check_sequence_parallel(tp_plan, split, name, dims.tp)
    pp_rank = pp_mesh.get_local_rank()
    rank_module, stage_modules = build_rank_module(whole, split, pp_rank)
    setattr(module, name, rank_module)
    apply_stage_tensor_parallel(module, tp_plan, mesh["tp"], settings.sp)
    loss_fn = module.pipeline_loss
    if settings.loss_parallel:
        apply_loss_parallel(module, *vocabulary, mesh["tp"])
        loss_fn = parallel_loss(loss_fn, mesh["tp"])
    if settings.sp:
        apply_sequence_parallel(module, tp_plan, split, split.stage_indices(pp_rank), stage_modules, name, mesh["tp"])
    expert_plan = setup_stage_expert_parallel(module, whole, mesh, topology, routing)
    if dims.fsdp_enabled:
        _shard_stages(split, pp_rank, stage_modules, mesh["dp"], settings.reshard_after_forward,
                      mesh["edp"] if expert_plan is not None else None)
    rank_zero_info(split.table())
    partial = {id(p): p for p in (*tensor_parallel_partial_params(module, tp_plan), *(sequence_local_params(
        module, tp_plan, split, split.stage_indices(pp_rank), name) if settings.sp else ()))}
    on_loss = getattr(module, "on_pipeline_loss", None) or (lambda loss, batch, step: None)
    return PipelineLoop(split, stage_modules, pp_mesh.get_group(),
                        mesh["dp"].get_group() if dims.dp > 1 and not dims.fsdp_enabled else None,
                        settings.pp_microbatches or min_microbatches(settings.pp_schedule, dims.pp),
                        loss_fn, getattr(module, "pipeline_batch", _default_split_batch), on_loss, device,
                        expert_plan=expert_plan, overlap=settings.pp_overlap,
                        vocabulary_mesh=mesh["tp"] if settings.loss_parallel else None,
                        tp_partial=(list(partial.values()), mesh["tp"].get_group()) if partial else None)


def _shard_stages(split: PipelineSplit, pp_rank: int, stage_modules: list[nn.Module], dp_mesh: DeviceMesh,
                  reshard_after_forward: bool, edp_mesh: DeviceMesh | None = None) -> None:
    """FSDP2 on each stage over ``dp``: every block on its own, then the stage (embeddings, norm, head); torch's
    ``PipelineStage`` defers each stage's reduce-scatter to the end of the schedule's step. Tensor-parallel layers
    (``dp_mesh`` and their ``tp`` mesh cut from one world mesh) become 2-D DTensors, sharded over ``dp`` on top of
    their ``tp`` placement; their gradients are averaged over ``dp`` as the others' (a stage's ``tp`` ranks read
    one batch). Routed experts under expert parallelism (``edp_mesh``: the stage's ``edp`` ranks) first, each MoE
    layer's over ``edp``: their gradients, already summed over their ``ep`` group's batches, summed over ``edp`` and
    divided by the ``dp`` size (as :func:`.reduce_stage_gradients`)."""
    for index, stage in zip(split.stage_indices(pp_rank), stage_modules):
        for layer in find_expert_layers(stage) if edp_mesh is not None else ():
            fully_shard(layer.experts, mesh=edp_mesh, reshard_after_forward=reshard_after_forward)
            layer.experts.set_gradient_divide_factor(float(dp_mesh.size()))
            # gloo has no PREMUL_SUM; over one rank torch divides in place of the reduce-scatter (see .fsdp)
            layer.experts.set_force_sum_reduction_for_comms(edp_mesh.size() > 1)
        for name in split.stages[index].modules:
            if name.rpartition(".")[2].isdigit():  # a block of the list the split cut
                fully_shard(stage.get_submodule(name), mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
        fully_shard(stage, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
