"""Plans of pipelined layouts (``pipeline_parallel_size > 1``): the strategy's own split, each distinct pipeline rank
stepped on the fake world, composed over torch's action table of the schedule.

For each pipeline rank whose stages differ from those already stepped (the first, the last, and the middle ranks
whose stages hold other blocks; V schedules hold two stages per rank), the planner:

1. builds the model on fake tensors and hands it, as a LightningModule, to the strategy's ``split_lightning_module``
   at that rank of the fake world (activation checkpointing, the split, the rank's stage modules, FSDP2 over the
   stage's ``dp`` group: the strategy's code), then ``PipelineRunner.from_stage_modules`` (torch's stages and
   schedule object, whose action table is read, :mod:`.schedule`);
2. steps each of its stages for two micro-batches (forward, backward as torch's ``PipelineStage`` runs it: FSDP2's
   gradient synchronisation and resharding after backward off until the last micro-batch) under ``MemTracker``,
   the ``FlopCounter`` and the ``CollectiveCounter``: the first gives what the first backward leaves (gradients,
   FSDP2's unsharded parameters and gradients), the second one micro-batch's activations, transient peaks, FLOPs and
   collectives; then the stages' end-of-step reduction (torch's ``perform_reduce_grad``), the strategy's gradient
   exchange over ``dp`` (``PipelineLoop.reduce_gradients``) and AdamW's step;
3. composes the step (:mod:`.pipeline_estimate`): memory by walking the rank's actions (each forward adds one
   micro-batch's activations of its stage, each full backward, or weight gradient where the backward is split,
   frees them), plus the receive buffers
   torch's stages allocate for every micro-batch (inputs of every stage but the first, output gradients of every
   stage but the last); collectives per action; point-to-point bytes per action whose neighbouring stage is on
   another rank (the stage's output forward, its input gradient backward); the loss's broadcast over ``pp``;
4. replays every rank's actions (:func:`.schedule.replay`) with the chunk times of the counted FLOPs (input and
   weight gradient each half a full backward) and the transfers over the link the placement gives
   (ranks ``dp * tp`` apart in the launch order, torchtitan's ``[pp, dp, tp]``): the step is the replay's
   makespan (compute, bubble, exposed transfers) plus the exchange over ``dp`` and the optimizer step.

Reported per plan: the most loaded rank's memory (and every pipeline rank's and stage's rows), the bytes of that
rank by mesh dimension. Costs: two micro-batches of each distinct rank's stages; with ``depth="representative"``
of a base copy holding three blocks of each kind per stage, and one copy per kind and layout with one block more
(:mod:`.stage_depth`; a rank whose stages hold no more is stepped whole). ZeRO-1 and ``GradientCompression`` change
only the step after the schedule (ZeRO-1's owners are dealt over the whole rank's parameters; compression's bucket
holds all its matrices): their copies are the layout's without them, and the whole rank is set up once more for the
exchange and optimizer step alone (zero gradients, no forward), whatever its checkpointing. With
a :class:`.cache.PlanCache` the block kinds, the split, the action table and each copy's measurement are shared by
the plans of a search (a copy's key: the layout but its micro-batches and which V schedule, and its stages' kept
block kinds and ends; without FSDP2 and ZeRO-1 not its ``pp`` either, :func:`across_pp`: a copy of pp=2's first rank
serves pp=4's, 8's and 16's, its calls moved onto their groups). FSDP2's collectives under a pipeline are
counted per action from the two stepped micro-batches (the first forward's gathers repeat where a forward follows a
forward and FSDP2 reshards after forward). Not modelled: the point to point transfers are not overlapped with
compute (torch waits for them before the action that needs them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from lightning_deepseek.moe.protocol import find_expert_layers
from lightning_deepseek.parallel.activation_checkpointing import find_transformer_blocks
from lightning_deepseek.parallel.detection import cached_probes
from lightning_deepseek.parallel.dims import ParallelDims
from lightning_deepseek.parallel.memory import setup_optimizer_states
from lightning_deepseek.parallel.pipeline import PipelineRunner
from lightning_deepseek.parallel.pipeline_loop import split_lightning_module
from lightning_deepseek.parallel.pipeline_split import PipelineSplit, plan_pipeline_split
from lightning_deepseek.parallel.topology import Topology
from lightning_deepseek.planning.cache import PlanCache
from lightning_deepseek.planning.cluster import ClusterSpec
from lightning_deepseek.planning.counting import (
    CollectiveCounter,
    FlopCounter,
    LocalOpsOnly,
    RunningPeakTracker,
)
from lightning_deepseek.planning.depth import check_depth, layer_kinds
from lightning_deepseek.planning.estimate import GroupInfo
from lightning_deepseek.planning.fake_world import fake_world
from lightning_deepseek.planning.float8 import convert_float8
from lightning_deepseek.planning.fsdp_chunks import one_chunk_per_rank
from lightning_deepseek.planning.layout import PlanLayout, StepShape
from lightning_deepseek.planning.models import ModelSpec
from lightning_deepseek.planning.pipeline_estimate import (
    RankStep,
    StageStep,
    pipeline_report,
    with_compressed_exchange,
    with_optimizer_of,
)
from lightning_deepseek.planning.planner import (
    CPU,
    CPU_SDPA,
    _cache_key,
    _quiet_set_up,
    cluster_topology,
    local_bytes,
    mesh_groups,
    snapshot_bytes,
)
from lightning_deepseek.planning.report import (
    PlanReport,
)
from lightning_deepseek.planning.routing import uniform_routing
from lightning_deepseek.planning.schedule import Action, overlapped, schedule_order
from lightning_deepseek.planning.stage_depth import (
    BlockDelta,
    RankBlocks,
    block_delta,
    extrapolate_rank,
    rank_blocks,
    renamed_groups,
)
from lightning_deepseek.precision.fsdp_policy import fsdp_units, set_mixed_precision, stage_policy

Table = tuple[dict[int, list[Action]], dict[Action, Action]]  # every rank's actions and the overlapped pairs
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")  # the same split and stages per rank


class _Holder(pl.LightningModule):
    """The model as the LightningModule the strategy splits (the pipeline protocol's ``pipeline_loss``)."""

    def __init__(self, model: nn.Module, spec: ModelSpec) -> None:
        super().__init__()
        self.model = model
        self._spec = spec

    def pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self._spec.loss_from_logits(output, target)

    def training_step(self, batch: Any, batch_idx: int) -> None:  # Lightning requires one; the pipeline runs the model
        return None


def hidden_size_of(module: nn.Module) -> int:
    config = getattr(module, "config", None)
    return int(config.hidden_size) if hasattr(config, "hidden_size") else int(module.tok_emb.embedding_dim)


class _Peaks:
    """The tracker's current bytes, and its peak since the last ``reset`` (module boundaries, as ``MemTracker``
    takes it)."""

    def __init__(self, tracker: MemTracker) -> None:
        self.tracker = tracker

    def current(self) -> int:
        return snapshot_bytes(self.tracker.get_tracker_snapshot("current")[CPU], "Total")

    def reset(self) -> int:
        current = self.current()
        self.tracker._peak_mem[CPU] = current  # no public reset of MemTracker's running peak
        return current

    def peak(self) -> int:
        return max(self.tracker._peak_mem.get(CPU, 0), self.current())


def _gathered_bytes(stage: nn.Module) -> int:
    """Bytes FSDP2 holds gathered for the stage's units now: their all-gather outputs, whose storage FSDP2 frees when
    it reshards (read as torch's pipeline stages read FSDP2's state: no public API gives it). Not ``MemTracker``'s
    categories: it files what a unit first gathers in a forward (units of experts) as activations."""
    total = 0
    for module in stage.modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        for param in group.fsdp_params if group is not None else ():
            total += sum(t.untyped_storage().nbytes() for t in param.all_gather_outputs)
    return total


def _no_sync(stage: nn.Module) -> None:
    """What torch's ``PipelineStage`` sets on an FSDP2 stage before each backward but the end of the step's."""
    if isinstance(stage, FSDPModule):
        stage.set_is_last_backward(False)
        stage.set_reshard_after_backward(False)
        stage.set_requires_gradient_sync(False)


def _step_stage(loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], index: int, stage: nn.Module,
                is_last: bool, ids: torch.Tensor,
                hidden: torch.Tensor | None, peaks: _Peaks, flops: FlopCounter, counter: CollectiveCounter,
                autocast: Any, split: bool = False) -> StageStep:
    """Two micro-batches of one stage (see the module docstring); ``split``: each backward in torch's two parts (the
    V schedules): the inputs' gradient keeping the graph (``stage_backward_input``; none on the first stage), then the
    weights' (``stage_backward_weight``; the first stage's whole backward), each part's peak and what the first leaves
    measured apart."""
    records = []
    for _ in range(2):
        inputs = ids if hidden is None else hidden.detach().requires_grad_(True)
        before, flops_before, calls_before = peaks.reset(), flops.total, len(counter.calls)
        fp8_before, casts_before = flops.fp8, flops.cast_bytes
        gathered_before = _gathered_bytes(stage)
        with autocast:
            output = stage(inputs)
            loss = loss_fn(output, ids) if is_last else None  # the strategy's: vocabulary-parallel or not
        after_forward, forward_peak = peaks.current(), peaks.peak()
        released = gathered_before - _gathered_bytes(stage)  # FSDP2 resharding what a backward gathered and kept
        activations = after_forward - before + released  # what the forward holds until its backward
        flops_forward, calls_forward, fp8_forward, casts_forward = (flops.total, len(counter.calls), flops.fp8,
                                                                    flops.cast_bytes)
        _no_sync(stage)
        peaks.reset()
        outputs = [output if loss is None else loss]
        grads = None if loss is not None else [torch.zeros_like(output)]  # the received one: counted apart
        parts = (0, 0, 0)  # a split backward's: its input part's peak and what it leaves, its weight part's peak
        if split:
            groups = None  # the first stage's input part computes nothing, its weight part the whole backward
            if hidden is not None:
                groups = stage_backward_input(outputs, grads, [inputs], stage.parameters())[1]
            input_peak, after_input = peaks.peak(), peaks.current()
            peaks.reset()
            if groups is not None:
                stage_backward_weight(stage.parameters(), groups)
            else:
                torch.autograd.backward(outputs, grads)
            weight_peak = peaks.peak()
            parts = (max(input_peak - after_forward, 0), after_input - after_forward, max(weight_peak - after_input, 0))
            backward_peak = max(input_peak, weight_peak)
        else:
            torch.autograd.backward(outputs, grads)
            backward_peak = peaks.peak()
        output_bytes = 0 if is_last else output.numel() * output.element_size()
        del output, loss, outputs, grads
        inputs.grad = None
        records.append((before, after_forward, peaks.current(), forward_peak, backward_peak,
                        flops_forward - flops_before, flops.total - flops_forward,
                        tuple(counter.calls[calls_before:calls_forward]), tuple(counter.calls[calls_forward:]),
                        output_bytes, activations, released,
                        (fp8_forward - fp8_before, flops.fp8 - fp8_forward, casts_forward - casts_before,
                         flops.cast_bytes - casts_forward), parts))
    (first_before, first_forward, first_after, _, first_backward, *_, first_forward_calls, _, output_bytes,
     _, _, _, first_parts) = records[0]
    before, after_forward, _, forward_peak, backward_peak, forward_flops, backward_flops, forward_calls, \
        backward_calls, _, activations, released, low_precision, parts = records[1]
    return StageStep(index, forward_flops, backward_flops, activations, forward_peak - before,
                     max(backward_peak - after_forward, 0), first_after - first_before,
                     max(first_backward - first_forward, 0),
                     0 if hidden is None else hidden.numel() * hidden.element_size(), output_bytes,
                     first_forward_calls, forward_calls, backward_calls, max(released, 0), *low_precision,
                     max(first_forward - first_before - activations, 0), *parts, *first_parts)


def _step_rank(model: ModelSpec, world_size: int, layout: PlanLayout, step: StepShape, topology: Topology,
               pp_rank: int, split: PipelineSplit, drop: tuple[str, ...] = (),
               optimizer_only: bool = False) -> RankStep:
    """Set up pipeline rank ``pp_rank`` with the strategy's split on the fake world (which must be ``split``),
    remove the blocks ``drop`` from its stages, and step them; ``optimizer_only``: zero gradients in place of the
    stages' steps (no stage rows; the exchange and optimizer step after the schedule as on a stepped rank)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    module = built_model(model, step)
    hidden_size = hidden_size_of(module)
    layers = find_expert_layers(module)
    holder = _Holder(module, model)
    dims = ParallelDims(world_size, tp=layout.tp, ep=layout.ep, dp_shard=layout.dp_shard, pp=layout.pp)
    mesh = dims.build_mesh("cpu")
    settings = dataclasses.replace(layout.settings(), min_shard_params=step.min_shard_params)
    loop = split_lightning_module(holder, mesh, settings, CPU)
    if loop.split != split:
        raise RuntimeError(f"the strategy split {model.name} otherwise than the planner: {loop.split} != {split}.")
    _drop_blocks([holder.model, *loop.stage_modules], drop)
    if loop.tp_partial is not None:  # the removed blocks' partial parameters: no gradient to sum over tp
        held = {id(p) for p in holder.model.parameters()}
        loop.tp_partial = ([p for p in loop.tp_partial[0] if id(p) in held], loop.tp_partial[1])
    with mode:  # the strategy materialises only the rank's stages; here as fake tensors of this plan's mode
        holder.model.to_empty(device=CPU)
    if step.fsdp_bf16 and dims.fsdp_enabled:  # StagedPrecision's BF16 stage on the stages' units
        set_mixed_precision(fsdp_units(holder.model), stage_policy("bf16-mixed"))
    runner = PipelineRunner.from_stage_modules(loop.split, loop.stage_modules, loop.loss_fn, loop.pp_group,
                                               loop.num_microbatches, CPU)
    params = [p for p in holder.model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    setup_optimizer_states([optimizer], pp_rank * dims.dp * dims.tp, world_size, mesh, layout.shard_optimizer_states)
    split_backward = layout.pp_schedule in V_SCHEDULES  # each backward in two parts
    tracker = RunningPeakTracker(module_hooks=not split_backward)
    counter, flops = CollectiveCounter(), FlopCounter(CPU_SDPA)
    tracker.track_external(holder.model, optimizer)
    autocast = torch.autocast("cpu", torch.bfloat16) if step.dtype != "fp32" else contextlib.nullcontext()
    indices = loop.split.stage_indices(pp_rank)
    with mode:  # the stages' inputs: token ids, or the buffer torch receives hidden states into (counted apart)
        ids = torch.randint(0, model.vocab_size, (step.micro_batch_size, step.seq_len))
        residual = torch.bfloat16 if step.fsdp_bf16 and dims.fsdp_enabled else torch.float32  # parameters' dtype
        length = step.seq_len // layout.tp if layout.sequence_parallel else step.seq_len  # a sequence shard
        hidden = torch.empty(step.micro_batch_size, length, hidden_size, dtype=residual)
    peaks = _Peaks(tracker)
    with mode, uniform_routing(layers), tracker, counter, loop.loss_context():
        with flops, LocalOpsOnly(mode):
            stages = () if optimizer_only else tuple(
                _step_stage(loop.loss_fn, index, stage, index == loop.split.num_stages - 1, ids,
                            None if index == 0 else hidden, peaks, flops, counter, autocast, split_backward)
                for index, stage in zip(indices, loop.stage_modules))
            for param in params if optimizer_only else []:
                param.grad = torch.zeros_like(param)  # what a backward leaves
        counter.phase = "gradients"
        exchange_start = len(counter.calls)
        peaks.reset()
        with LocalOpsOnly(mode):
            for torch_stage in runner.stages:
                torch_stage.perform_reduce_grad(1)  # FSDP2's reduce-scatter at the end of the schedule
            loop.reduce_gradients()
            grads = local_bytes([p.grad for p in params if p.grad is not None])  # before ZeRO-1's step frees some
            counter.phase = "optimizer"
            optimizer.step()
        exchange_peak = peaks.peak()
    states = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    owned = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in optimizer.state)
    rank = RankStep(pp_rank, stages, local_bytes(list(holder.model.parameters())),
                    grads, local_bytes(states),
                    tuple(counter.calls[exchange_start:]), exchange_peak, owned,
                    mesh_groups(mesh, dims, topology), loop.pp_group.group_name,
                    sum(1 for m in holder.model.modules() if _tensor_parallel(getattr(m, "weight", None))),
                    tuple((local_bytes([p]), p.dim()) for p in params))
    return rank


def action_table(world_size: int, layout: PlanLayout, split: PipelineSplit) -> Table:
    """Every rank's actions and the overlapped pairs: torch's schedule object, over stand-ins of rank 0's stages
    (its table depends on the stages and micro-batches only)."""
    with fake_world(world_size):
        mesh = ParallelDims(world_size, pp=layout.pp).build_mesh("cpu")
        runner = PipelineRunner.from_stage_modules(split, [nn.Identity() for _ in split.stage_indices(0)],
                                                   lambda output, target: output.sum(), mesh["pp"].get_group(),
                                                   layout.num_microbatches, CPU)
    order = schedule_order(layout.pp_schedule, runner.schedule, layout.pp, layout.num_microbatches)
    return order, overlapped(runner.schedule.pipeline_order) if layout.pp_schedule != "1F1B" else {}


def _drop_blocks(roots: list[nn.Module], names: tuple[str, ...]) -> None:
    """Remove the blocks ``names`` from the rank module and each stage module (the split keeps blocks in
    ``nn.ModuleDict`` containers by their original index; a stage view holds copies of those containers)."""
    for root in roots:
        for name in names:
            parent, _, leaf = name.rpartition(".")
            with contextlib.suppress(AttributeError):
                root.get_submodule(parent)._modules.pop(leaf, None)


def _tensor_parallel(weight: object) -> bool:
    mesh = getattr(weight, "device_mesh", None)  # a DTensor's
    return mesh is not None and "tp" in (mesh.mesh_dim_names or ())


def plan_pipeline(model: ModelSpec, world_size: int, layout: PlanLayout, cluster: ClusterSpec, step: StepShape,
                  depth: str = "representative", cache: PlanCache | None = None) -> PlanReport:
    """The plan of a pipelined ``layout`` (see the module docstring); ``depth`` and ``cache`` as
    :func:`.planner.plan`'s."""
    check_depth(depth)
    started = time.perf_counter()
    cache = PlanCache() if cache is None else cache
    key = _cache_key(model, world_size, cluster, step)
    topology = cluster_topology(world_size, cluster.gpus_per_node)
    kinds = cache.get(("pipeline_kinds", key), lambda: _kinds_by_name(model, step))
    split = cache.get(("pipeline_split", key, layout.pp, layout.pp_schedule), lambda: _split(model, step, layout))
    table = cache.get(("pipeline_table", key, layout.pp, layout.pp_schedule, layout.num_microbatches),
                      lambda: action_table(world_size, layout, split))
    ranks: dict[int, RankStep] = {}
    deltas: dict[int, BlockDelta] = {}
    for pp_rank in range(layout.pp):
        blocks = rank_blocks(split, pp_rank, kinds)

        def measure(keep: tuple[str, ...], of: PlanLayout = layout, optimizer_only: bool = False,
                    pp_rank: int = pp_rank, blocks: RankBlocks = blocks) -> RankStep:
            """The copy keeping the blocks ``keep``, stepped once per shape (plan and search); one whose numbers
            do not depend on ``pp`` (:func:`across_pp`) is shared with the other ``pp`` sizes, on this rank's groups."""
            drop = tuple(name for name in blocks.names if name not in keep)
            settings = optimizer_settings(of) if optimizer_only else step_settings(of)
            shared = not optimizer_only and across_pp(of)
            if shared:
                groups, pp_group = cache.get(("pipeline_groups", key, of.tp, of.ep, of.pp, pp_rank),
                                             lambda: _groups_of(world_size, of, topology, pp_rank))
                settings = (*(item for item in settings if item[0] != "pp"), ("groups", group_structure(groups)))
            stepped = cache.get(("pipeline_rank", key, settings, optimizer_only, blocks.copy_shape(keep)),
                                lambda: _stepped(model, world_size, of, step, topology, pp_rank, split, drop,
                                                 optimizer_only))
            return _on_groups(stepped, groups, pp_group) if shared else stepped

        uncompressed = dataclasses.replace(layout, bits=None)  # compression: applied to the exchange below
        if depth == "full" or not blocks.worth_it:
            rank = whole = measure(blocks.names, uncompressed)
        else:  # ZeRO-1 and compression change the step after the schedule only: copies without them, shared
            copies = dataclasses.replace(uncompressed, shard_optimizer_states=False)
            base = measure(blocks.base, copies)
            for kind in blocks.extended:
                if kind not in deltas:
                    deltas[kind] = block_delta(base, measure(blocks.with_one_more(kind), copies), blocks, kind)
            rank = extrapolate_rank(base, blocks, {kind: deltas[kind] for kind in blocks.extended})
            if layout.shard_optimizer_states or layout.bits is not None:  # over the whole rank's parameters
                whole = measure(blocks.names, uncompressed, optimizer_only=True)
                rank = with_optimizer_of(rank, whole)
        if layout.bits is not None:
            rank = with_compressed_exchange(rank, whole.param_sizes, layout.compression())
        ranks[pp_rank] = dataclasses.replace(rank, pp_rank=pp_rank)
    return pipeline_report(model, world_size, layout, cluster, step, topology, ranks, split, *table,
                           time.perf_counter() - started)


def across_pp(layout: PlanLayout) -> bool:
    """Whether a stepped copy of ``layout`` measures what a copy of the same stages (their blocks' kinds, whether
    they hold the embedding or the head) measures at another ``pp``: without FSDP2 (whose shards divide by the
    stage's ``dp``, ``world / (pp x tp)``) and ZeRO-1 (its owners too), a stage's forward and backward, its
    ``tp`` and ``ep`` collectives, its gradients' exchange over ``dp`` (the same bytes, another group) and AdamW's
    step do not depend on ``pp``; the groups must have the same structure (:func:`group_structure`: a dimension of
    one rank runs no collective). ``tests/planning/test_cache.py`` checks such plans equal fresh ones."""
    return layout.dp_shard == 1 and not layout.shard_optimizer_states


def group_structure(groups: dict[str, GroupInfo]) -> tuple[tuple[str, bool], ...]:
    """The mesh dimensions of a rank's groups and which of them hold more than one rank."""
    return tuple(sorted((info.dim, info.size > 1) for info in groups.values()))


def _groups_of(world_size: int, layout: PlanLayout, topology: Topology, pp_rank: int) -> tuple[dict[str, GroupInfo],
                                                                                               str]:
    """The groups of pipeline rank ``pp_rank``'s first global rank under ``layout`` and its ``pp`` group's name:
    the strategy's mesh on the fake world, no model."""
    dims = ParallelDims(world_size, tp=layout.tp, ep=layout.ep, dp_shard=layout.dp_shard, pp=layout.pp)
    with fake_world(world_size, rank=pp_rank * (world_size // layout.pp)):
        mesh = dims.build_mesh("cpu")
        return mesh_groups(mesh, dims, topology), mesh["pp"].get_group().group_name


def _on_groups(rank: RankStep, groups: dict[str, GroupInfo], pp_group: str) -> RankStep:
    """``rank`` (stepped at another ``pp``, or at another pipeline rank) on ``groups``: its calls on the groups of
    the same dimensions (its stages' indices are set by :func:`.pipeline_estimate.pipeline_report`)."""
    by_dim = {info.dim: name for name, info in groups.items()}
    moved = renamed_groups(rank, {name: by_dim[info.dim] for name, info in rank.groups.items()})
    return dataclasses.replace(moved, groups=groups, pp_group=pp_group)


def step_settings(layout: PlanLayout) -> tuple:
    """What a stepped copy depends on: the layout but its micro-batches and which V schedule (the stages step alike;
    the split and the table are the schedule's)."""
    settings = dataclasses.asdict(layout)
    settings.pop("pp_microbatches")
    settings["pp_schedule"] = "V" if layout.pp_schedule in V_SCHEDULES else layout.pp_schedule
    return tuple(settings.items())


def optimizer_settings(layout: PlanLayout) -> tuple:
    """What the whole rank's exchange and optimizer step alone (ZeRO-1's owners, compression's parameter sizes)
    depend on: :func:`step_settings` but the activation checkpointing (it runs no forward)."""
    return tuple(item for item in step_settings(layout) if item[0] != "activation_checkpointing")


def _stepped(model: ModelSpec, world_size: int, layout: PlanLayout, step: StepShape, topology: Topology,
             pp_rank: int, split: PipelineSplit, drop: tuple[str, ...], optimizer_only: bool = False) -> RankStep:
    """:func:`_step_rank` on the fake world at pipeline rank ``pp_rank``'s first global rank."""
    with fake_world(world_size, rank=pp_rank * (world_size // layout.pp)), one_chunk_per_rank(), cached_probes(), \
            warnings.catch_warnings(), _quiet_set_up():
        warnings.simplefilter("ignore")  # the strategy's and torch's set-up warnings are for real runs
        return _step_rank(model, world_size, layout, step, topology, pp_rank, split, drop, optimizer_only)


def built_model(model: ModelSpec, step: StepShape) -> nn.Module:
    """The model on the meta device, as in a real run (the stage copies hold no storage)."""
    with torch.device("meta"):
        module = model.build()
        if step.dtype == "fp8":  # StagedPrecision's FP8 stage, converted before the set-up shards
            convert_float8(module)
    return module


def _kinds_by_name(model: ModelSpec, step: StepShape) -> dict[str, int]:
    """Each transformer block's kind (:func:`.depth.layer_kinds`), by its name in the model."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        module = model.build()
    with cached_probes():  # outside the fake mode: block detection probes norms with real tensors
        return dict(zip(find_transformer_blocks(module), layer_kinds(module).kinds))


def _split(model: ModelSpec, step: StepShape, layout: PlanLayout) -> PipelineSplit:
    """The strategy's split of the model (:func:`~lightning_deepseek.parallel.pipeline_split.plan_pipeline_split`,
    on the meta device; :func:`_step_rank` checks that the strategy's own equals it)."""
    return plan_pipeline_split(built_model(model, step), layout.pp, layout.pp_schedule)
