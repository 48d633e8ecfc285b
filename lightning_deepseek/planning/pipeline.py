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
3. composes the step: memory by walking the rank's actions (each forward adds one micro-batch's activations of its
   stage, each full backward, or weight gradient where the backward is split, frees them), plus the receive buffers
   torch's stages allocate for every micro-batch (inputs of every stage but the first, output gradients of every
   stage but the last); collectives per action; point-to-point bytes per action whose neighbouring stage is on
   another rank (the stage's output forward, its input gradient backward); the loss's broadcast over ``pp``;
4. replays every rank's actions (:func:`.schedule.replay`) with the chunk times of the counted FLOPs (input and
   weight gradient each half a full backward) and the transfers over the link the placement gives
   (ranks ``dp * tp`` apart in the launch order, torchtitan's ``[pp, dp, tp]``): the step is the replay's
   makespan (compute, bubble, exposed transfers) plus the exchange over ``dp`` and the optimizer step.

Reported per plan: the most loaded rank's memory (and every pipeline rank's and stage's rows), the bytes of that
rank by mesh dimension. Costs: two micro-batches of every block of each distinct rank (``depth`` is not used: a
stage is ``1 / pp`` of the model). Not modelled: FSDP2's collectives under a pipeline are counted per action from
the two stepped micro-batches (the first forward's gathers repeat wherever a forward follows a forward); the point
to point transfers are not overlapped with compute (torch waits for them before the action that needs them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.fsdp import FSDPModule

from lightning_deepseek.moe.protocol import find_expert_layers
from lightning_deepseek.parallel.dims import ParallelDims
from lightning_deepseek.parallel.pipeline import PipelineRunner
from lightning_deepseek.parallel.pipeline_loop import split_lightning_module
from lightning_deepseek.parallel.placement import LinkCost
from lightning_deepseek.parallel.topology import Topology
from lightning_deepseek.planning.cluster import ClusterSpec
from lightning_deepseek.planning.counting import (
    CollectiveCall,
    CollectiveCounter,
    FlopCounter,
    LocalOpsOnly,
    MicroBatchMemTracker,
)
from lightning_deepseek.planning.estimate import (
    ADAMW_BYTES_PER_ELEMENT,
    ASSUMPTIONS,
    GroupInfo,
    collective_seconds,
    is_fsdp_dim,
)
from lightning_deepseek.planning.fake_world import fake_world
from lightning_deepseek.planning.layout import PlanLayout, StepShape
from lightning_deepseek.planning.models import ModelSpec
from lightning_deepseek.planning.planner import (
    CPU,
    CPU_SDPA,
    _quiet_set_up,
    cluster_topology,
    local_bytes,
    mesh_groups,
    snapshot_bytes,
)
from lightning_deepseek.planning.report import (
    PipelinePlan,
    PipelineRankRow,
    PlanReport,
    RankMemory,
    StageRow,
    Traffic,
)
from lightning_deepseek.planning.routing import uniform_routing
from lightning_deepseek.planning.schedule import Action, held_forwards, replay, schedule_order
from lightning_deepseek.precision.fsdp_policy import fsdp_units, set_mixed_precision, stage_policy

LOSS_BYTES = 4  # the mean loss the last stage broadcasts over pp (an FP32 scalar)
PIPELINE_ASSUMPTIONS = (
    "pipeline: the schedule's action table replayed with the counted FLOPs per stage (input and weight gradient "
    "half a backward each); point-to-point transfers exposed where an action waits for them; the exchange over dp "
    "after the schedule exposed",
)


@dataclass(frozen=True)
class StageStep:
    """One stage's stepped micro-batch (see the module docstring): FLOPs, activations held in flight, the peaks
    above the start of a forward and of a backward, what the first backward leaves, the bytes received and sent
    per micro-batch, and the collectives of one forward (the first, and a later one) and one backward."""

    index: int
    forward_flops: float
    backward_flops: float
    activations: int
    forward_extra: int
    backward_extra: int
    first_backward_keeps: int
    first_backward_extra: int
    input_bytes: int
    output_bytes: int
    first_forward_calls: tuple[CollectiveCall, ...]
    forward_calls: tuple[CollectiveCall, ...]
    backward_calls: tuple[CollectiveCall, ...]


@dataclass(frozen=True)
class RankStep:
    """One pipeline rank's stepped stages, model states, the exchange and optimizer step after the schedule (its
    calls and absolute peak), and the groups of the stepped rank."""

    pp_rank: int
    stages: tuple[StageStep, ...]
    params: int
    grads: int
    states: int
    exchange_calls: tuple[CollectiveCall, ...]
    exchange_peak: int
    owned_state_elements: int
    groups: dict[str, GroupInfo]
    pp_group: str


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


def _hidden_size(module: nn.Module) -> int:
    config = getattr(module, "config", None)
    return int(config.hidden_size) if hasattr(config, "hidden_size") else int(module.tok_emb.embedding_dim)


def _signature(split: Any, pp_rank: int, kinds: dict[str, tuple]) -> tuple:
    """What makes two pipeline ranks step alike: per stage, whether it embeds or has the head, and its blocks'
    shapes."""
    out = []
    for index in split.stage_indices(pp_rank):
        modules = split.stages[index].modules
        out.append((index == 0, index == split.num_stages - 1, tuple(kinds.get(name, name) for name in modules
                                                                          if name in kinds)))
    return tuple(out)


def _block_kinds(module: nn.Module) -> dict[str, tuple]:
    return {name: (type(child).__name__, tuple((n, tuple(p.shape)) for n, p in child.named_parameters()))
            for name, child in module.named_modules() if name.rpartition(".")[2].isdigit()}


class _Peaks:
    """The tracker's current bytes, and its peak since the last ``reset`` (module boundaries, as ``MemTracker``
    takes it)."""

    def __init__(self, tracker: MemTracker) -> None:
        self.tracker = tracker

    def current(self) -> int:
        return snapshot_bytes(self.tracker.get_tracker_snapshot("current")[CPU], "Total")

    def activations(self) -> int:
        """What forwards hold for backward and their temporaries (not FSDP2's gathered or freed parameters)."""
        snapshot = self.tracker.get_tracker_snapshot("current")[CPU]
        return snapshot_bytes(snapshot, "Activation") + snapshot_bytes(snapshot, "Temp")

    def reset(self) -> int:
        current = self.current()
        self.tracker._peak_mem[CPU] = current  # no public reset of MemTracker's running peak
        return current

    def peak(self) -> int:
        return max(self.tracker._peak_mem.get(CPU, 0), self.current())


def _no_sync(stage: nn.Module) -> None:
    """What torch's ``PipelineStage`` sets on an FSDP2 stage before each backward but the end of the step's."""
    if isinstance(stage, FSDPModule):
        stage.set_is_last_backward(False)
        stage.set_reshard_after_backward(False)
        stage.set_requires_gradient_sync(False)


def _step_stage(spec: ModelSpec, index: int, stage: nn.Module, is_last: bool, ids: torch.Tensor,
                hidden: torch.Tensor | None, peaks: _Peaks, flops: FlopCounter, counter: CollectiveCounter,
                autocast: Any) -> StageStep:
    """Two micro-batches of one stage (see the module docstring)."""
    records = []
    for _ in range(2):
        inputs = ids if hidden is None else hidden.detach().requires_grad_(True)
        before, flops_before, calls_before = peaks.reset(), flops.total, len(counter.calls)
        activations_before = peaks.activations()
        with autocast:
            output = stage(inputs)
            loss = spec.loss_from_logits(output, ids) if is_last else None
        after_forward, forward_peak = peaks.current(), peaks.peak()
        activations = peaks.activations() - activations_before
        flops_forward, calls_forward = flops.total, len(counter.calls)
        _no_sync(stage)
        peaks.reset()
        if loss is not None:
            loss.backward()
        else:
            output.backward(torch.zeros_like(output))  # the received gradient: its buffer is counted apart
        backward_peak = peaks.peak()
        output_bytes = 0 if is_last else output.numel() * output.element_size()
        del output, loss
        inputs.grad = None
        records.append((before, after_forward, peaks.current(), forward_peak, backward_peak,
                        flops_forward - flops_before, flops.total - flops_forward,
                        tuple(counter.calls[calls_before:calls_forward]), tuple(counter.calls[calls_forward:]),
                        output_bytes, activations))
    (first_before, first_forward, first_after, _, first_backward, *_, first_forward_calls, _, output_bytes,
     _) = records[0]
    before, after_forward, _, forward_peak, backward_peak, forward_flops, backward_flops, forward_calls, \
        backward_calls, _, activations = records[1]
    return StageStep(index, forward_flops, backward_flops, activations, forward_peak - before,
                     max(backward_peak - after_forward, 0), first_after - first_before,
                     max(first_backward - first_forward, 0),
                     0 if hidden is None else hidden.numel() * hidden.element_size(), output_bytes,
                     first_forward_calls, forward_calls, backward_calls)


def _step_rank(model: ModelSpec, world_size: int, layout: PlanLayout, step: StepShape, topology: Topology,
               pp_rank: int) -> tuple[RankStep, Any, dict[int, list[Action]]]:
    """Set up pipeline rank ``pp_rank`` with the strategy's split on the fake world and step its stages; also the
    split and every rank's action table."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with torch.device("meta"):  # as a meta-device model in a real run: the stage copies hold no storage
        module = model.build()
    hidden_size = _hidden_size(module)
    layers = find_expert_layers(module)
    holder = _Holder(module, model)
    dims = ParallelDims(world_size, tp=layout.tp, ep=layout.ep, dp_shard=layout.dp_shard, pp=layout.pp)
    mesh = dims.build_mesh("cpu")
    loop = split_lightning_module(holder, mesh, layout.settings(), CPU)
    with mode:  # the strategy materialises only the rank's stages; here as fake tensors of this plan's mode
        holder.model.to_empty(device=CPU)
    if step.fsdp_bf16 and dims.fsdp_enabled:  # StagedPrecision's BF16 stage on the stages' units
        set_mixed_precision(fsdp_units(holder.model), stage_policy("bf16-mixed"))
    runner = PipelineRunner.from_stage_modules(loop.split, loop.stage_modules, loop.loss_fn, loop.pp_group,
                                               loop.num_microbatches, CPU)
    order = schedule_order(layout.pp_schedule, runner.schedule, layout.pp, loop.num_microbatches)
    params = [p for p in holder.model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    tracker, counter, flops = MicroBatchMemTracker(), CollectiveCounter(), FlopCounter(CPU_SDPA)
    tracker.track_external(holder.model, optimizer)
    autocast = torch.autocast("cpu", torch.bfloat16) if step.dtype == "bf16" else contextlib.nullcontext()
    indices = loop.split.stage_indices(pp_rank)
    with mode:  # the stages' inputs: token ids, or the buffer torch receives hidden states into (counted apart)
        ids = torch.randint(0, model.vocab_size, (step.micro_batch_size, step.seq_len))
        residual = torch.bfloat16 if step.fsdp_bf16 and dims.fsdp_enabled else torch.float32  # parameters' dtype
        hidden = torch.empty(step.micro_batch_size, step.seq_len, hidden_size, dtype=residual)
    peaks = _Peaks(tracker)
    with mode, uniform_routing(layers), tracker, counter:
        with flops, LocalOpsOnly(mode):
            stages = tuple(_step_stage(model, index, stage, index == loop.split.num_stages - 1, ids,
                                       None if index == 0 else hidden, peaks, flops, counter, autocast)
                           for index, stage in zip(indices, loop.stage_modules))
        counter.phase = "gradients"
        exchange_start = len(counter.calls)
        peaks.reset()
        with LocalOpsOnly(mode):
            for torch_stage in runner.stages:
                torch_stage.perform_reduce_grad(1)  # FSDP2's reduce-scatter at the end of the schedule
            loop.reduce_gradients()
            counter.phase = "optimizer"
            optimizer.step()
        exchange_peak = peaks.peak()
    states = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    owned = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in optimizer.state)
    rank = RankStep(pp_rank, stages, local_bytes(list(holder.model.parameters())),
                    local_bytes([p.grad for p in params if p.grad is not None]), local_bytes(states),
                    tuple(counter.calls[exchange_start:]), exchange_peak, owned,
                    mesh_groups(mesh, dims, topology), loop.pp_group.group_name)
    return rank, loop.split, order


@dataclass(frozen=True)
class _Composed:
    """One rank's step composed over its actions: the peak of the first step and of the later ones, the most
    activations held, the receive buffers, the collectives, the most micro-batches in flight per stage."""

    first_peak: int
    peak: int
    activations: int
    buffers: int
    calls: tuple[CollectiveCall, ...]
    in_flight: dict[int, int]


def _compose(rank: RankStep, actions: list[Action], stage_rank: dict[int, int], num_microbatches: int) -> _Composed:
    """Memory walk, collectives and point-to-point bytes of one rank's actions (see the module docstring). A later
    step also holds the optimizer states and the previous step's gradients: Lightning sets them to None after the
    training step, which runs the whole schedule."""
    by_index = {s.index: s for s in rank.stages}
    last = max(stage_rank)
    buffers = sum(num_microbatches * (s.input_bytes + s.output_bytes) for s in rank.stages)
    split_backward = {stage for kind, stage, _ in actions if kind == "W"}
    held, most, acts, most_acts = 0, 0, 0, 0
    kept: set[int] = set()
    previous: dict[int, str] = {}
    calls: list[CollectiveCall] = []
    pp = rank.pp_group
    for kind, index, _ in actions:
        stage = by_index[index]
        if kind == "F":
            most = max(most, held + stage.forward_extra)
            held, acts = held + stage.activations, acts + stage.activations
            most_acts = max(most_acts, acts)
            calls += stage.first_forward_calls if previous.get(index, "F") == "F" else stage.forward_calls
            if index < last and stage_rank[index + 1] != rank.pp_rank:
                calls.append(CollectiveCall("send", pp, stage.output_bytes, "pipeline"))
            if index > 0 and stage_rank[index - 1] != rank.pp_rank:
                calls.append(CollectiveCall("recv", pp, stage.input_bytes, "pipeline"))
        if kind in ("B", "I"):
            first = index not in kept
            most = max(most, held + (stage.first_backward_extra if first else stage.backward_extra))
            held += stage.first_backward_keeps if first else 0
            kept.add(index)
            calls += stage.backward_calls if previous.get(index) == "F" else ()
            if index > 0 and stage_rank[index - 1] != rank.pp_rank:
                calls.append(CollectiveCall("send", pp, stage.input_bytes, "pipeline"))
            if index < last and stage_rank[index + 1] != rank.pp_rank:
                calls.append(CollectiveCall("recv", pp, stage.output_bytes, "pipeline"))
        if kind == "W" or (kind in ("B", "I") and index not in split_backward):
            held, acts = held - stage.activations, acts - stage.activations
        previous[index] = kind
    calls.append(CollectiveCall("broadcast", pp, LOSS_BYTES, "pipeline"))
    first_peak = max(rank.params + buffers + most, rank.exchange_peak + buffers)
    peak = max(rank.params + rank.states + rank.grads + buffers + most, rank.exchange_peak + buffers)
    return _Composed(first_peak, peak, most_acts, buffers, tuple(calls) + rank.exchange_calls,
                     held_forwards(actions))


def _link(topology: Topology, cluster: ClusterSpec, a: int, b: int) -> LinkCost:
    return cluster.links["inter" if topology.spans_islands([a, b]) else "intra"]


def plan_pipeline(model: ModelSpec, world_size: int, layout: PlanLayout, cluster: ClusterSpec,
                  step: StepShape) -> PlanReport:
    """The plan of a pipelined ``layout`` (see the module docstring)."""
    started = time.perf_counter()
    topology = cluster_topology(world_size, cluster.gpus_per_node)
    stride = world_size // layout.pp  # the global rank of pipeline rank r (dp and tp coordinates 0): r * stride
    ranks: dict[int, RankStep] = {}
    stepped: dict[tuple, RankStep] = {}
    split, order = None, {}
    with FakeTensorMode(allow_non_fake_inputs=True):
        whole = model.build()
    kinds = _block_kinds(whole)
    del whole
    for pp_rank in range(layout.pp):
        if split is not None and (signature := _signature(split, pp_rank, kinds)) in stepped:
            ranks[pp_rank] = dataclasses.replace(stepped[signature], pp_rank=pp_rank)
            continue
        with fake_world(world_size, rank=pp_rank * stride), warnings.catch_warnings(), _quiet_set_up():
            warnings.simplefilter("ignore")  # the strategy's and torch's set-up warnings are for real runs
            rank, split, order = _step_rank(model, world_size, layout, step, topology, pp_rank)
        ranks[pp_rank] = stepped[_signature(split, pp_rank, kinds)] = rank
    assert split is not None
    return _report(model, world_size, layout, cluster, step, topology, ranks, split, order,
                   time.perf_counter() - started)


def _stage_seconds(ranks: dict[int, RankStep], split: Any, cluster: ClusterSpec, step: StepShape
                   ) -> dict[int, tuple[float, float]]:
    """Each stage's forward and backward seconds per micro-batch."""
    rate = cluster.peak_flops(step.dtype) * step.compute_efficiency
    seconds = {}
    for pp_rank, rank in ranks.items():
        for index, stage in zip(split.stage_indices(pp_rank), rank.stages):
            seconds[index] = (stage.forward_flops / rate, stage.backward_flops / rate)
    return seconds


def _report(model: ModelSpec, world_size: int, layout: PlanLayout, cluster: ClusterSpec, step: StepShape,
            topology: Topology, ranks: dict[int, RankStep], split: Any, order: dict[int, list[Action]],
            plan_seconds: float) -> PlanReport:
    stage_rank = {s.index: s.rank for s in split.stages}
    num_microbatches = layout.num_microbatches
    # stage steps carry the stepped rank's stage indices; re-index them by this rank's stages
    ranks = {r: dataclasses.replace(rank, stages=tuple(dataclasses.replace(s, index=i) for s, i in
                                                      zip(rank.stages, split.stage_indices(r))))
             for r, rank in ranks.items()}
    composed = {r: _compose(rank, order[r], stage_rank, num_microbatches) for r, rank in ranks.items()}
    seconds = _stage_seconds(ranks, split, cluster, step)
    cost: dict[tuple[str, int], float] = {}
    transfer: dict[tuple[str, int], float] = {}
    stride = world_size // layout.pp
    for index, (forward, backward) in seconds.items():
        cost["F", index], cost["B", index], cost["I", index], cost["W", index] = (forward, backward, backward / 2,
                                                                                  backward / 2)
        stage = next(s for r in ranks.values() for s in r.stages if s.index == index)
        here = stage_rank[index] * stride
        if index + 1 in stage_rank:
            link = _link(topology, cluster, here, stage_rank[index + 1] * stride)
            transfer["F", index] = stage.output_bytes / link.bandwidth + link.latency
        if index > 0:
            link = _link(topology, cluster, here, stage_rank[index - 1] * stride)
            transfer["I", index] = stage.input_bytes / link.bandwidth + link.latency
    compute_only = replay(order, stage_rank, cost)
    with_p2p = replay(order, stage_rank, cost, transfer)
    worst = max(composed, key=lambda r: composed[r].peak)
    rank, mine = ranks[worst], composed[worst]
    traffic, exchange = _traffic(mine.calls, rank.groups, cluster, world_size,
                                 with_p2p.makespan - compute_only.makespan)
    optimizer = rank.owned_state_elements * ADAMW_BYTES_PER_ELEMENT / (cluster.memory_bandwidth_gbs * 1e9)
    step_seconds = with_p2p.makespan + exchange + optimizer
    flops = sum(num_microbatches * (s.forward_flops + s.backward_flops) for s in rank.stages)
    tokens = step.tokens * num_microbatches * (world_size // (layout.pp * layout.tp))
    stage_rows = tuple(StageRow(index, stage_rank[index], composed[stage_rank[index]].in_flight.get(index, 0),
                                next(s for s in ranks[stage_rank[index]].stages if s.index == index).activations,
                                *seconds[index]) for index in sorted(seconds))
    rank_rows = tuple(PipelineRankRow(r, split.stage_indices(r), ranks[r].params, ranks[r].grads, ranks[r].states,
                                      composed[r].activations, composed[r].buffers, composed[r].peak)
                      for r in sorted(ranks))
    memory = RankMemory(params=rank.params, grads=rank.grads, states=rank.states, states_max=rank.states,
                        activations=mine.activations, ddp_buckets=0, peak=mine.first_peak, steady_peak=mine.peak)
    pipeline = PipelinePlan(layout.pp_schedule, layout.pp, num_microbatches, rank_rows, stage_rows,
                            with_p2p.makespan, compute_only.bubble, with_p2p.makespan - compute_only.makespan)
    peak_flops = cluster.peak_flops(step.dtype)
    return PlanReport(model=model.name, world_size=world_size, layout=layout, cluster=cluster.name, step=step,
                      placement="pp outermost (launch order)", num_sharded_layers=0, memory=memory,
                      memory_capacity=cluster.memory_bytes, traffic=traffic, flops=flops,
                      compute_seconds=max(compute_only.busy.values()), optimizer_seconds=optimizer,
                      comm_seconds=sum(t.exposed_seconds for t in traffic), step_seconds=step_seconds,
                      tokens_per_second_per_gpu=tokens / step_seconds / world_size,
                      mfu=flops / step_seconds / peak_flops, plan_seconds=plan_seconds,
                      assumptions=(*ASSUMPTIONS, *PIPELINE_ASSUMPTIONS,
                                   f"compute_efficiency={step.compute_efficiency}"), pipeline=pipeline)


def _traffic(calls: tuple[CollectiveCall, ...], groups: dict[str, GroupInfo], cluster: ClusterSpec, world_size: int,
             p2p_exposed: float) -> tuple[tuple[Traffic, ...], float]:
    """Rows by (mesh dimension, op) and the exposed seconds of the exchange after the schedule: FSDP2's gathers in
    the schedule hidden but the first, the point-to-point rows' share of ``p2p_exposed`` by bytes, the rest after
    the schedule exposed."""
    rows: dict[tuple[str, str, str], list[float]] = {}
    for call in calls:
        info = groups.get(call.group, GroupInfo("?", world_size, "inter"))
        link = cluster.links[info.link]
        seconds = (call.num_bytes / link.bandwidth + link.latency if call.op in ("send", "recv")
                   else collective_seconds(call.op, call.num_bytes, info.size, link))
        row = rows.setdefault((info.dim, call.op, call.phase), [0, 0, 0.0, info.size, info.link])
        row[0], row[1], row[2] = row[0] + 1, row[1] + call.num_bytes, row[2] + seconds
    p2p_bytes = sum(row[1] for (_, op, _), row in rows.items() if op == "send") or 1
    traffic, exchange, first_gather = [], 0.0, True
    for (dim, op, phase), (num_calls, num_bytes, seconds, size, link) in rows.items():
        if op in ("send", "recv"):
            exposed = p2p_exposed * num_bytes / p2p_bytes if op == "send" else 0.0
        elif phase == "forward_backward" and (is_fsdp_dim(dim) or dim.split("/")[0] == "dp"):  # FSDP2 over dp
            exposed = seconds / num_calls if first_gather and op == "all_gather" else 0.0
            first_gather = first_gather and op != "all_gather"
            exchange += exposed
        else:
            exposed = seconds
            exchange += exposed
        traffic.append(Traffic(dim, op, int(size), str(link), int(num_calls), int(num_bytes), seconds, exposed))
    return tuple(traffic), exchange
