"""Pipeline parallelism on ``torch.distributed.pipelining``: the stages of one rank and the schedule that runs them.

``PipelineRunner.build(model, loss_fn, group, schedule=..., num_microbatches=M)`` plans the split
(:mod:`.pipeline_split`), builds this rank's stage modules (copies of ``model`` holding only what each stage owns),
wraps them in torch's ``PipelineStage`` and builds the schedule; ``PipelineRunner.from_stage_modules`` does the last
two for stage modules the caller built and prepared itself (materialised from the meta device, parallelised).
``step(inputs, targets)`` runs one forward and backward of the whole batch, cut into ``M`` equal micro-batches, and
returns the mean micro-batch loss on every rank; ``eval_step`` runs the forwards only, ``predict_step`` too and
returns the last stage's output on every rank; ``clip_grad_norm_`` clips by the norm of all stages' gradients
together.

Supports: the schedules ``1F1B``, ``Interleaved1F1B`` (two stages per rank), ``ZBVZeroBubble`` and ``DualPipeV`` (two
stages per rank in V order), tested on gloo (CPU; NCCL runs the same torch code, untested here); gradient
accumulation across calls (``step`` adds to ``.grad``; ``grad_scale`` weights a call, e.g.
``1 / accumulate_grad_batches``). The clip reduces DTensor shards inside a stage over their meshes first (the
shared :func:`.clipping.total_grad_norm`: tested with tensor- and expert-parallel stages, ``test_pipeline_compose.py``).

Gradient scaling: the schedule divides the gradients by ``M`` after each step (torch's ``scale_grads=True``), so
gradients injected inside the forward (the MoE layer's auxiliary loss) are averaged over micro-batches like the
loss. Since torch divides the whole ``.grad``, a call that adds to gradients left by an earlier call first
multiplies them by ``M`` (one in-place multiply per parameter, only when accumulating); ``grad_scale`` multiplies
each micro-batch's loss.

Costs: one broadcast of the loss per call (from the rank holding the last stage), one all-reduce of a scalar per clip;
activations of up to ``P`` micro-batches per stage in flight (1F1B), ``P + 1`` for DualPipeV; V and interleaved
schedules hold two stage copies' worth of modules per rank (each a different half of the rank's blocks, not duplicates).
``ScheduleDualPipeV`` orders forwards and backwards as DualPipe does but runs them one after the other;
``pipeline_overlap=True`` overlaps one micro-batch's MoE all-to-alls with the other's compute
(:mod:`.pipeline_overlap`).

``eval_step`` does not run the schedule: it sends each micro-batch through the stages in stage order (see its
docstring), so it takes any batch shape; its bubble is that of a forward-only pass (GPipe's, or worse on V orders).

Does not support: training micro-batches of different shapes between calls (the stages infer their input shapes on the
first ``step`` and keep them), a schedule of the user's own, more than two stages per rank, outputs other than one
tensor per stage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

from lightning_deepseek.parallel.clipping import total_grad_norm
from lightning_deepseek.parallel.pipeline_overlap import check_pipeline_overlap, enable_pipeline_overlap
from lightning_deepseek.parallel.pipeline_split import (
    SCHEDULES,
    PipelineSplit,
    build_stage_module,
    plan_pipeline_split,
)

__all__ = ["SCHEDULES", "PipelineRunner", "check_pipeline_composition", "check_pipeline_settings", "min_microbatches"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64)
_SCHEDULE_CLASSES = {"1F1B": Schedule1F1B, "Interleaved1F1B": ScheduleInterleaved1F1B,
                     "ZBVZeroBubble": ScheduleZBVZeroBubble, "DualPipeV": ScheduleDualPipeV}


def min_microbatches(schedule: str, pp_size: int) -> int:
    """The fewest micro-batches accepted for ``schedule`` at ``pp_size`` ranks: torch's own minimum for 1F1B
    (``pp_size``) and DualPipeV (``2 * pp_size``, its stages), checked before any collective; ``pp_size`` for
    Interleaved1F1B and ZBVZeroBubble, ours: torch pads fewer with idle slots (a step that is mostly bubble), untested.
    """
    return 2 * pp_size if schedule == "DualPipeV" else pp_size


def check_pipeline_settings(world_size: int, pp_size: int, schedule: str, num_microbatches: int,
                            batch_size: int | None = None) -> None:
    """Validate the pipeline settings against the world and the batch; raise before any collective.

    Args:
        world_size: ranks in the job.
        pp_size: ``pipeline_parallel_size``.
        schedule: ``pipeline_schedule``, one of ``SCHEDULES``.
        num_microbatches: ``pipeline_microbatches``.
        batch_size: the global batch each ``step`` receives, when known (must split into equal micro-batches).

    Raises:
        ValueError: naming the setting, the value and the fix.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline_schedule={schedule!r} is not supported: use one of {SCHEDULES}.")
    if pp_size < 1 or world_size % pp_size:
        raise ValueError(
            f"pipeline_parallel_size={pp_size} does not divide the world of {world_size} ranks: use a divisor of "
            f"{world_size} ({', '.join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)}).")
    needed = min_microbatches(schedule, pp_size)
    if num_microbatches < needed:
        raise ValueError(
            f"pipeline_microbatches={num_microbatches} is too few for pipeline_schedule={schedule!r} at "
            f"pipeline_parallel_size={pp_size}: it needs at least {needed}. Raise pipeline_microbatches to {needed} "
            "or more (more micro-batches also shrink the bubble).")
    if schedule == "Interleaved1F1B":
        rounds = max(1, num_microbatches // pp_size)
        if num_microbatches % rounds:
            raise ValueError(
                f"pipeline_microbatches={num_microbatches} is not a multiple of its {rounds} rounds of "
                f"pipeline_parallel_size={pp_size} that 'Interleaved1F1B' runs: use a multiple of {pp_size}.")
    if batch_size is not None and batch_size % num_microbatches:
        raise ValueError(
            f"the batch of {batch_size} samples does not split into pipeline_microbatches={num_microbatches} equal "
            f"micro-batches: use a batch size that is a multiple of {num_microbatches}.")


def check_pipeline_composition(pp_size: int, schedule: str, num_microbatches: int | None,
                               **settings: object) -> None:
    """Validate ``HybridParallelStrategy``'s pipeline arguments on their own (no world size yet) and the other
    settings they compose with: inside a pipeline stage, data parallelism (replicated, or sharded by FSDP2 over all
    the stage's ``dp`` ranks), activation checkpointing, ZeRO-1 (over the stage's ``dp`` ranks),
    ``GradientCompression`` (of the replicated stages' ``dp`` exchange, :mod:`.pipeline_exchange`), and tensor or
    expert parallelism (either with FSDP2 or ZeRO-1, not with each other or compression).

    Args:
        pp_size, schedule, num_microbatches: ``pipeline_parallel_size``, ``pipeline_schedule``,
            ``pipeline_microbatches`` (None: the schedule's least).
        settings: the strategy's other arguments by name (``tensor_parallel_size=...``), and ``bits`` asked by a
            ``GradientCompression`` (8 or 4 on replicated stages); those not yet composed with a pipeline must be at
            their off value, ``activation_checkpointing="selective"`` needs one backward per block (1F1B,
            Interleaved1F1B), and
            ``data_parallel_shard_size`` (FSDP2 over all of a stage's ``dp`` ranks) needs it or
            ``reshard_after_forward=False``.

    Raises:
        ValueError: naming the setting, the value and the fix.
    """
    if not isinstance(pp_size, int) or isinstance(pp_size, bool) or pp_size < 1:
        raise ValueError(f"pipeline_parallel_size={pp_size!r} must be a positive integer (1: no pipeline).")
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline_schedule={schedule!r} is not supported: use one of {SCHEDULES}.")
    if num_microbatches is not None and (not isinstance(num_microbatches, int) or num_microbatches < 1):
        raise ValueError(f"pipeline_microbatches={num_microbatches!r} must be a positive integer or None (the "
                         "schedule's least).")
    if pp_size == 1:
        return
    check_pipeline_settings(pp_size, pp_size, schedule, num_microbatches or min_microbatches(schedule, pp_size))
    if settings.pop("activation_checkpointing", "none") == "selective" and schedule in ("ZBVZeroBubble", "DualPipeV"):
        raise ValueError(
            f"activation_checkpointing='selective' with pipeline_schedule={schedule!r} is not supported: the schedule "
            "runs each block's backward in two parts (inputs, then weights), and torch's selective checkpointing "
            "allows one backward per region. Use activation_checkpointing='full', or the schedule '1F1B' or "
            "'Interleaved1F1B'.")
    shard = settings.get("data_parallel_shard_size", 1)
    if settings.pop("reshard_after_forward", False) and shard != 1 and schedule in ("ZBVZeroBubble", "DualPipeV"):
        raise ValueError(
            f"data_parallel_shard_size={shard!r} with pipeline_schedule={schedule!r} needs "
            "reshard_after_forward=False: the schedule runs each block's backward in two parts (inputs, then "
            "weights), and FSDP2 resharding after the forward gave gradients that drift from one process. Set "
            "reshard_after_forward=False, or use '1F1B' or 'Interleaved1F1B'.")
    bits = settings.pop("bits", None)
    if bits == "auto":
        raise ValueError(
            f"GradientCompression(bits='auto') with pipeline_parallel_size={pp_size}: the timed copies that decide "
            "the bits do not run a pipeline. Pass bits=8 or bits=4 (lds-train: compression=int8 or int4).")
    if bits is not None and shard != 1:
        raise ValueError(
            f"GradientCompression(bits={bits!r}) with data_parallel_shard_size={shard!r} and pipeline_parallel_size="
            f"{pp_size} is not supported yet: FSDP2 reduce-scatters each stage's gradients itself, and its compressed "
            "reduce-scatter is not composed with a pipeline. Set data_parallel_shard_size=1 (the stages' dp exchange "
            "is then compressed), or remove the callback.")
    settings.pop("shard_optimizer_states", None)  # over the stage's dp or edp ranks (not with FSDP2: LayoutSettings)
    _check_stage_model_parallel(pp_size, settings.pop("tensor_parallel_size", 1),
                                settings.pop("expert_parallel_size", 1), bits)
    for name, value in settings.items():  # data_parallel_shard_size
        if not isinstance(value, int):
            raise ValueError(
                f"pipeline_parallel_size={pp_size} with {name}={value!r} is not supported yet (a pipeline stage "
                "composes with data parallelism, FSDP2 and activation checkpointing). Set "
                f"{name} to a number, or pipeline_parallel_size=1.")


def _check_stage_model_parallel(pp_size: int, tp: object, ep: object, bits: object) -> None:
    """Tensor or expert parallelism inside the stages (:mod:`.pipeline_stage_parallel`): a size or ``"auto"`` (which
    a pipeline resolves to 1), not both above 1, without compression of the stages' exchange. Either composes with
    FSDP2 (shards 2-D over ``(dp, tp)`` or ``(edp, ep)``) and ZeRO-1 (states over the stage's ``dp`` or ``edp``)."""
    sizes = {"tensor_parallel_size": tp, "expert_parallel_size": ep}
    for name, value in sizes.items():
        if value == "per_node":
            raise ValueError(f"pipeline_parallel_size={pp_size} with {name}='per_node' is not supported: give the "
                             f"size as a number (dividing the ranks of one stage), or {name}=1.")
    used = [f"{name}={value}" for name, value in sizes.items() if value not in (1, "auto")]
    if len(used) == 2:
        raise ValueError(f"pipeline_parallel_size={pp_size} with {used[0]} and {used[1]}: a pipeline stage composes "
                         "with tensor or expert parallelism, not both yet. Set one of them to 1.")
    if used and bits is not None:
        raise ValueError(f"pipeline_parallel_size={pp_size} with {used[0]} and GradientCompression(bits={bits!r}) is "
                         "not supported yet: the compressed exchange averages plain gradients, not the stages' tensor- "
                         f"or expert-parallel shards. Remove the callback, or set {used[0].split('=')[0]}=1.")


_inferring_shapes = [False]


def is_inferring_shapes() -> bool:
    """Whether a stage runs torch's metadata inference: from 2.13 the real forward (with grad, on placeholder inputs)
    before the first step; what counts routed tokens (``ExpertLoadBalancing``) skips it."""
    return _inferring_shapes[0]


def _flag_shape_inference(stage: PipelineStage) -> None:
    infer = getattr(stage, "_forward_metadata_inference", None)
    if infer is None:  # torch < 2.13 infers shapes on meta tensors without grad
        return

    def flagged(*args: object, **kwargs: object) -> object:
        _inferring_shapes[0] = True
        try:
            return infer(*args, **kwargs)
        finally:
            _inferring_shapes[0] = False

    stage._forward_metadata_inference = flagged


def _skip_sends_to_itself(stage: PipelineStage, rank: int) -> None:
    """torch < 2.13 warms up every neighbour's link before the first step, its own rank included where a V schedule
    keeps two adjacent stages on one rank (stages P-1 and P); gloo has no link to itself ("Pair is not connected").
    Drop those self-sends and receives (in pairs): the stages on one rank hand over tensors without communication."""
    warm_up = getattr(stage, "_get_init_p2p_neighbors_ops", None)
    if warm_up is not None:
        stage._get_init_p2p_neighbors_ops = lambda: [op for op in warm_up() if op.group_peer != rank]


@dataclass
class PipelineRunner:
    """This rank's pipeline stages and the schedule that runs them (build it with :meth:`build`).

    ``modules`` are the stage modules (what the optimizer steps and checkpoints save: their names are the whole
    model's); ``split`` is the plan every rank shares.
    """

    split: PipelineSplit
    modules: list[nn.Module]
    stages: list[PipelineStage]
    schedule: object
    group: dist.ProcessGroup | None
    num_microbatches: int
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    grad_scale: float = 1.0
    _losses: list[torch.Tensor] = field(default_factory=list, repr=False)

    @classmethod
    def build(cls, model: nn.Module, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
              group: dist.ProcessGroup | None = None, schedule: str = "1F1B", num_microbatches: int = 4,
              split_points: Sequence[str] | None = None, device: torch.device | str = "cpu",
              pipeline_overlap: bool = False) -> PipelineRunner:
        """Split ``model``, build this rank's stages and the schedule.

        Args:
            model: the whole model (see :mod:`.pipeline_split` for the families supported). Not changed.
            loss_fn: ``loss_fn(output, target)`` -> the mean loss of one micro-batch (run on the last stage).
            group: the pipeline process group (default: the whole world).
            schedule: one of ``SCHEDULES``.
            num_microbatches: micro-batches per ``step``.
            split_points: names of the modules where stages begin, instead of the balanced split.
            device: where the stages run.
            pipeline_overlap: DualPipeV only: overlap each MoE all-to-all of one micro-batch with another's compute
                (:mod:`.pipeline_overlap`).

        Raises:
            ValueError: bad settings (see :func:`check_pipeline_settings`, :func:`.plan_pipeline_split`), before any
                collective.
        """
        pp_size, pp_rank = dist.get_world_size(group), dist.get_rank(group)
        check_pipeline_settings(pp_size, pp_size, schedule, num_microbatches)
        check_pipeline_overlap(pipeline_overlap, schedule)
        split = plan_pipeline_split(model, pp_size, schedule, split_points)
        modules = [build_stage_module(model, split, i).to(device) for i in split.stage_indices(pp_rank)]
        return cls.from_stage_modules(split, modules, loss_fn, group, num_microbatches, device, pipeline_overlap)

    @classmethod
    def from_stage_modules(cls, split: PipelineSplit, modules: list[nn.Module],
                           loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                           group: dist.ProcessGroup | None, num_microbatches: int,
                           device: torch.device | str = "cpu", pipeline_overlap: bool = False) -> PipelineRunner:
        """Wrap stage modules built and prepared by the caller (materialised from meta, tensor-parallel, sharded).

        Args:
            split: the split the modules were built from (:func:`.plan_pipeline_split`).
            modules: this rank's stage modules, in the order of ``split.stage_indices(pp_rank)``.
            loss_fn: ``loss_fn(output, target)`` -> the mean loss of one micro-batch.
            group: the pipeline process group (default: the whole world).
            num_microbatches: micro-batches per ``step``.
            device: where the stages run.
            pipeline_overlap: see :meth:`build`.
        """
        pp_rank = dist.get_rank(group)
        check_pipeline_settings(split.pp_size, split.pp_size, split.schedule, num_microbatches)
        check_pipeline_overlap(pipeline_overlap, split.schedule)
        device = torch.device(device)
        indices = split.stage_indices(pp_rank)
        if len(modules) != len(indices):
            raise ValueError(f"pipeline rank {pp_rank} runs stages {indices} of the split, but {len(modules)} stage "
                             "modules were given: pass one module per stage, in that order.")
        stages = [PipelineStage(module, i, split.num_stages, device, group=group)
                  for module, i in zip(modules, indices)]
        for stage in stages:
            _skip_sends_to_itself(stage, pp_rank)
            _flag_shape_inference(stage)
        runner = cls(split, modules, stages, None, group, num_microbatches, loss_fn)
        runner.schedule = _SCHEDULE_CLASSES[split.schedule](stages if split.stages_per_rank > 1 else stages[0],
                                                            num_microbatches, loss_fn=runner._scaled_loss(loss_fn))
        if pipeline_overlap:
            enable_pipeline_overlap(runner.schedule)
        return runner

    def _scaled_loss(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                     ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        def scaled(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            loss = loss_fn(output, target)
            self._losses.append(loss.detach())
            return loss * self.grad_scale if self.grad_scale != 1.0 else loss
        return scaled

    @property
    def holds_first_stage(self) -> bool:
        return 0 in self.split.stage_indices(self._pp_rank)

    @property
    def holds_last_stage(self) -> bool:
        return self.split.num_stages - 1 in self.split.stage_indices(self._pp_rank)

    @property
    def _pp_rank(self) -> int:
        return dist.get_rank(self.group)

    def parameters(self) -> list[nn.Parameter]:
        """The parameters of this rank's stages (what its optimizer steps)."""
        return [p for module in self.modules for p in module.parameters()]

    def _stage_rank(self, stage_index: int) -> int:
        return self.split.stages[stage_index].rank

    def _broadcast_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        loss = torch.stack(losses).mean() if losses else torch.zeros((), device=self.stages[0].device)
        dist.broadcast(loss, group_src=self._stage_rank(-1), group=self.group)
        return loss

    def _send(self, tensor: torch.Tensor, stage_index: int) -> None:
        header = torch.zeros(8, dtype=torch.int64, device=tensor.device)
        header[:2 + tensor.dim()] = torch.tensor([_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape])
        dist.send(header, group_dst=self._stage_rank(stage_index), group=self.group)
        dist.send(tensor.contiguous(), group_dst=self._stage_rank(stage_index), group=self.group)

    def _recv(self, stage_index: int) -> torch.Tensor:
        device = self.stages[0].device
        header = torch.empty(8, dtype=torch.int64, device=device)
        dist.recv(header, group_src=self._stage_rank(stage_index), group=self.group)
        dtype, ndim, *shape = header.tolist()
        tensor = torch.empty(shape[:ndim], dtype=_DTYPES[dtype], device=device)
        dist.recv(tensor, group_src=self._stage_rank(stage_index), group=self.group)
        return tensor

    def step(self, inputs: torch.Tensor | None, targets: torch.Tensor | None, grad_scale: float = 1.0
             ) -> torch.Tensor:
        """Forward and backward of one batch through the pipeline; gradients add to ``.grad``.

        Args:
            inputs: the whole batch's model inputs (read on the rank of the first stage; others may pass ``None``).
            targets: the whole batch's targets (read on the rank of the last stage; others may pass ``None``).
            grad_scale: weight of this call's gradients (``1 / k`` when accumulating over ``k`` calls).

        Returns:
            The mean micro-batch loss (unscaled), the same on every rank of the pipeline group.
        """
        self.grad_scale = grad_scale
        self._losses.clear()
        with torch.no_grad():  # torch divides the whole .grad by M after the step: keep what earlier calls left
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.mul_(self.num_microbatches)
        for module in self.modules:
            module.train()
        args = (inputs.contiguous(),) if self.holds_first_stage else ()  # torch 2.11's stages check input strides
        self.schedule.step(*args, target=targets if self.holds_last_stage else None)
        # The first call's shape inference also calls the loss function (on placeholder outputs): keep the last M.
        return self._broadcast_loss(self._losses[-self.num_microbatches:])

    @torch.no_grad()
    def eval_step(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> torch.Tensor:
        """Forwards only (modules in eval mode, no gradients); returns the mean micro-batch loss on every rank.

        Runs the micro-batches through the stages in stage order with plain sends and receives (any batch shape):
        torch's ``schedule.eval()`` replays the training schedule's actions, whose backward ones fail without a
        backward on the V schedules ("can't steal_bwd_input if this stage doesn't have backward").
        """
        for module in self.modules:
            module.eval()
        num = self.num_microbatches
        inputs_mb = torch.tensor_split(inputs, num) if self.holds_first_stage else [None] * num
        targets_mb = torch.tensor_split(targets, num) if self.holds_last_stage else [None] * num
        losses = []
        for hidden, target in zip(inputs_mb, targets_mb):
            hidden = self._through_local_stages(hidden)
            if self.holds_last_stage:
                losses.append(self.loss_fn(hidden, target))
        return self._broadcast_loss(losses)

    def _through_local_stages(self, hidden: torch.Tensor | None) -> torch.Tensor:
        """One micro-batch through this rank's stages in stage order, received from the previous stage's rank and
        sent to the next's with plain sends and receives (any shape); the output of this rank's last stage."""
        last = self.split.num_stages - 1
        for index, module in sorted(zip(self.split.stage_indices(self._pp_rank), self.modules), key=lambda s: s[0]):
            if index > 0 and self._stage_rank(index - 1) != self._pp_rank:
                hidden = self._recv(index - 1)
            hidden = module(hidden)
            if index < last and self._stage_rank(index + 1) != self._pp_rank:
                self._send(hidden, index + 1)
        return hidden

    @torch.no_grad()
    def predict_step(self, inputs: torch.Tensor) -> torch.Tensor:
        """Forwards only, as :meth:`eval_step`; returns the last stage's output for the whole batch (the micro-batches'
        outputs concatenated), broadcast from the last stage's rank to every rank of the pipeline group.

        Args:
            inputs: the whole batch's model inputs, the same on every rank of the group (its size sets the
                micro-batches: ``num_microbatches``, or one per sample for a smaller batch).
        """
        for module in self.modules:
            module.eval()
        outputs = []
        for hidden in torch.tensor_split(inputs, min(self.num_microbatches, inputs.size(0))):
            hidden = self._through_local_stages(hidden)
            if self.holds_last_stage:
                outputs.append(hidden)
        return self._broadcast_output(torch.cat(outputs) if self.holds_last_stage else None)

    def _broadcast_output(self, output: torch.Tensor | None) -> torch.Tensor:
        """``output`` (given on the last stage's rank only) on every rank of the group: a header, then the tensor."""
        device, source = self.stages[0].device, self._stage_rank(-1)
        header = torch.zeros(8, dtype=torch.int64, device=device)
        if output is not None:
            output = output.contiguous()
            header[:2 + output.dim()] = torch.tensor([_DTYPES.index(output.dtype), output.dim(), *output.shape])
        dist.broadcast(header, group_src=source, group=self.group)
        if output is None:
            dtype, ndim, *shape = header.tolist()
            output = torch.empty(shape[:ndim], dtype=_DTYPES[dtype], device=device)
        dist.broadcast(output, group_src=source, group=self.group)
        return output

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale every stage's gradients so that the norm over all stages is at most ``max_norm``; return that norm.

        Collective over the pipeline group (every rank must call it). DTensor shards inside a stage are reduced over
        their own meshes first (:func:`.clipping.total_grad_norm`).
        """
        parameters = self.parameters()
        local = total_grad_norm(parameters, norm_type).to(self.stages[0].device)
        is_inf = norm_type == float("inf")
        local = local if is_inf else local.pow(norm_type)
        dist.all_reduce(local, op=dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM, group=self.group)
        norm = local if is_inf else local.pow(1.0 / norm_type)
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in parameters:
            if p.grad is not None:
                p.grad.mul_(scale.to(p.grad.device, p.grad.dtype))
        return norm
