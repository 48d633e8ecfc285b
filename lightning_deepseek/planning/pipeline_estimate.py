"""The step of a pipelined plan from its stepped ranks (:mod:`.pipeline`): each rank's memory walked over its
actions in the schedule's table, its collectives and point-to-point bytes per action, and the step time from the
tables of every rank replayed (:func:`.schedule.replay`) with the counted FLOPs and the links' transfers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from lightning_deepseek.compression.config import CompressionConfig
from lightning_deepseek.parallel.placement import LinkCost
from lightning_deepseek.parallel.topology import Topology
from lightning_deepseek.planning.cluster import ClusterSpec
from lightning_deepseek.planning.counting import CollectiveCall
from lightning_deepseek.planning.ddp_exchange import stage_exchange
from lightning_deepseek.planning.estimate import (
    ADAMW_BYTES_PER_ELEMENT,
    ASSUMPTIONS,
    CODEC_ASSUMPTION,
    GroupInfo,
    collective_seconds,
    compute_dtype,
    compute_seconds,
    is_fsdp_dim,
)
from lightning_deepseek.planning.layout import PlanLayout, StepShape
from lightning_deepseek.planning.models import ModelSpec
from lightning_deepseek.planning.report import (
    PipelinePlan,
    PipelineRankRow,
    PlanReport,
    RankMemory,
    StageRow,
    Traffic,
)
from lightning_deepseek.planning.schedule import Action, held_forwards, replay

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
    per micro-batch, the collectives of one forward (the first, and a later one) and one backward, and what a forward
    after a backward frees (FSDP2 resharding the blocks the backward gathered and kept; 0 without FSDP2); with
    ``dtype="fp8"`` the FLOPs of its FP8 GEMMs and the bytes of its FP8 casts, forward and backward; what the first
    forward leaves beyond a micro-batch's activations (FSDP2's gathered parameters it does not reshard: V schedules;
    ``first_backward_keeps`` includes it); under the V schedules, whose backward runs in two parts, the input part's
    peak above its start and what it leaves until the weight part (the layers' output gradients), and the weight
    part's peak, of a later and of the first backward."""

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
    released: int = 0
    forward_fp8_flops: float = 0.0
    backward_fp8_flops: float = 0.0
    forward_cast_bytes: int = 0
    backward_cast_bytes: int = 0
    first_forward_keeps: int = 0
    input_extra: int = 0
    input_keeps: int = 0
    weight_extra: int = 0
    first_input_extra: int = 0
    first_input_keeps: int = 0
    first_weight_extra: int = 0


@dataclass(frozen=True)
class RankStep:
    """One pipeline rank's stepped stages, model states, the exchange and optimizer step after the schedule (its
    calls and absolute peak), and the groups of the stepped rank; ``param_sizes``: the bytes and dimensions of each
    trainable parameter of the stepped copy in model order; with ``GradientCompression``, the bytes its exchange
    holds (residuals and message buffers) and its codec's bytes (:func:`.ddp_exchange.stage_exchange`)."""

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
    tp_layers: int = 0  # layers of its stages the tensor-parallel plan shards
    param_sizes: tuple[tuple[int, int], ...] = ()
    compression_bytes: int = 0
    codec_bytes: int = 0


def with_optimizer_of(rank: RankStep, whole: RankStep) -> RankStep:
    """``rank`` with the optimizer states, the owned elements, the optimizer step's collectives and the peak after the
    schedule of ``whole`` (the whole rank's ZeRO-1 step on the gradients a backward leaves)."""
    calls = [c for c in rank.exchange_calls if c.phase != "optimizer"] + [
        c for c in whole.exchange_calls if c.phase == "optimizer"]
    return dataclasses.replace(rank, states=whole.states, owned_state_elements=whole.owned_state_elements,
                               exchange_calls=tuple(calls), exchange_peak=whole.exchange_peak)


def with_compressed_exchange(rank: RankStep, sizes: tuple[tuple[int, int], ...],
                             config: CompressionConfig | None) -> RankStep:
    """``rank`` with ``GradientCompression``'s exchange (``config``; None: ``rank`` as it is) of the parameters of
    ``sizes`` (the whole rank's) over the stage's ``dp`` group in place of the strategy's fp32 all-reduce there
    (:func:`.ddp_exchange.stage_exchange`; compression composes with replicated stages only, whose exchange is that
    one all-reduce; none with one ``dp`` rank, where the callback compresses nothing)."""
    reduce = next((c for c in rank.exchange_calls if c.phase == "gradients" and c.op == "all_reduce"), None)
    if reduce is None or config is None:
        return rank
    exchange = stage_exchange([size for size, _ in sizes], [ndim for _, ndim in sizes],
                              rank.groups[reduce.group].size, reduce.group, config)
    calls = tuple(c for c in rank.exchange_calls if c is not reduce) + exchange.calls
    return dataclasses.replace(rank, exchange_calls=calls, compression_bytes=exchange.compression_bytes,
                               codec_bytes=exchange.codec_bytes)


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


def _compose(rank: RankStep, actions: list[Action], stage_rank: dict[int, int], num_microbatches: int,
             reshard_after_forward: bool = True) -> _Composed:
    """Memory walk, collectives and point-to-point bytes of one rank's actions (see the module docstring): a forward
    right after a forward of its stage gathers again what the first gathered when FSDP2 reshards after forward, and
    runs a later forward's collectives when it does not (the blocks stay gathered until the stage's reduction). A later
    step also holds the optimizer states; not the previous step's gradients, which the strategy drops before the
    schedule runs (Lightning would set them to None only after the training step, which runs the whole schedule)."""
    by_index = {s.index: s for s in rank.stages}
    last = max(stage_rank)
    buffers = sum(num_microbatches * (s.input_bytes + s.output_bytes) for s in rank.stages)
    split_backward = {stage for kind, stage, _ in actions if kind == "W"}
    held, most, acts, most_acts = 0, 0, 0, 0
    kept: set[int] = set()
    forwarded: set[int] = set()
    gathered: set[int] = set()  # stages whose blocks a backward gathered (FSDP2 keeps them until a forward)
    inputs_done: dict[int, list[tuple[int, bool]]] = {}  # per stage, what each input part left and if it was the first
    previous: dict[int, str] = {}
    calls: list[CollectiveCall] = []
    pp = rank.pp_group
    for kind, index, _ in actions:
        stage = by_index[index]
        if kind == "F":
            most = max(most, held + stage.forward_extra)
            resharded = stage.released if index in gathered else 0
            leaves = stage.first_forward_keeps if index not in forwarded else 0
            forwarded.add(index)
            held, acts = held + stage.activations - resharded + leaves, acts + stage.activations
            gathered.discard(index)
            most_acts = max(most_acts, acts)
            regathers = index not in previous or (previous[index] == "F" and reshard_after_forward)
            calls += stage.first_forward_calls if regathers else stage.forward_calls
            if index < last and stage_rank[index + 1] != rank.pp_rank:
                calls.append(CollectiveCall("send", pp, stage.output_bytes, "pipeline"))
            if index > 0 and stage_rank[index - 1] != rank.pp_rank:
                calls.append(CollectiveCall("recv", pp, stage.input_bytes, "pipeline"))
        if kind in ("B", "I"):
            first = index not in kept
            again = stage.released if index in gathered else 0  # gathered already: no second gather
            if kind == "I" and index in split_backward:  # the input part (the V schedules: FSDP2 never reshards)
                most = max(most, held + (stage.first_input_extra if first else stage.input_extra))
                leaves = stage.first_input_keeps if first else stage.input_keeps
                held += leaves
                inputs_done.setdefault(index, []).append((leaves, first))
            else:
                most = max(most, held + (stage.first_backward_extra if first else stage.backward_extra - again))
                held += stage.first_backward_keeps - stage.first_forward_keeps if first else stage.released - again
            kept.add(index)
            gathered.add(index)
            calls += stage.backward_calls if previous.get(index) == "F" else _recurring(stage.backward_calls,
                                                                                         rank.groups)
            if index > 0 and stage_rank[index - 1] != rank.pp_rank:
                calls.append(CollectiveCall("send", pp, stage.input_bytes, "pipeline"))
            if index < last and stage_rank[index + 1] != rank.pp_rank:
                calls.append(CollectiveCall("recv", pp, stage.output_bytes, "pipeline"))
        if kind == "W":  # the weight part: frees the activations and what the input part left
            leaves, first = inputs_done[index].pop(0)
            most = max(most, held + (stage.first_weight_extra if first else stage.weight_extra))
            held += stage.first_backward_keeps - stage.first_forward_keeps - leaves if first else -leaves
        if kind in ("B", "W") or (kind == "I" and index not in split_backward):
            held, acts = held - stage.activations, acts - stage.activations
        previous[index] = kind
    calls.append(CollectiveCall("broadcast", pp, LOSS_BYTES, "pipeline"))
    exchange = rank.exchange_peak + buffers + rank.compression_bytes  # compression's, held from its first step on
    first_peak = max(rank.params + buffers + most, exchange)
    peak = max(rank.params + rank.states + buffers + most + rank.compression_bytes, exchange)
    return _Composed(first_peak, peak, most_acts, buffers, tuple(calls) + rank.exchange_calls,
                     held_forwards(actions))


def _recurring(calls: tuple[CollectiveCall, ...], groups: dict[str, GroupInfo]) -> tuple[CollectiveCall, ...]:
    """The calls of a backward that a backward right after another backward of its stage runs too: all but FSDP2's
    gathers over the stage's ``dp`` or ``edp`` (the blocks stay gathered between backwards); the all-to-alls of
    expert parallelism and the all-reduces of tensor parallelism run in every backward."""
    return tuple(c for c in calls if not (c.op == "all_gather" and c.group in groups
                                          and groups[c.group].dim.split("/")[0] in ("dp", "edp")))


def _link(topology: Topology, cluster: ClusterSpec, a: int, b: int) -> LinkCost:
    return cluster.links["inter" if topology.spans_islands([a, b]) else "intra"]


def _stage_seconds(ranks: dict[int, RankStep], split: Any, cluster: ClusterSpec, step: StepShape
                   ) -> dict[int, tuple[float, float]]:
    """Each stage's forward and backward seconds per micro-batch."""
    seconds = {}
    for pp_rank, rank in ranks.items():
        for index, s in zip(split.stage_indices(pp_rank), rank.stages):
            forward = compute_seconds(s.forward_flops, s.forward_fp8_flops, s.forward_cast_bytes, cluster, step)
            backward = compute_seconds(s.backward_flops, s.backward_fp8_flops, s.backward_cast_bytes, cluster, step)
            seconds[index] = (forward, backward)
    return seconds


def pipeline_report(model: ModelSpec, world_size: int, layout: PlanLayout, cluster: ClusterSpec, step: StepShape,
                    topology: Topology, ranks: dict[int, RankStep], split: Any, order: dict[int, list[Action]],
                    together: dict[Action, Action], plan_seconds: float) -> PlanReport:
    """The report of a pipelined plan from its stepped ranks (see the module docstring)."""
    stage_rank = {s.index: s.rank for s in split.stages}
    num_microbatches = layout.num_microbatches
    # stage steps carry the stepped rank's stage indices; re-index them by this rank's stages
    ranks = {r: dataclasses.replace(rank, stages=tuple(dataclasses.replace(s, index=i) for s, i in
                                                      zip(rank.stages, split.stage_indices(r))))
             for r, rank in ranks.items()}
    composed = {r: _compose(rank, order[r], stage_rank, num_microbatches, layout.reshard_after_forward)
                for r, rank in ranks.items()}
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
    compute_only = replay(order, stage_rank, cost, together=together)
    with_p2p = replay(order, stage_rank, cost, transfer, together)
    worst = max(composed, key=lambda r: composed[r].peak)
    rank, mine = ranks[worst], composed[worst]
    traffic, exchange = _traffic(mine.calls, rank.groups, cluster, world_size,
                                 with_p2p.makespan - compute_only.makespan)
    optimizer = rank.owned_state_elements * ADAMW_BYTES_PER_ELEMENT / (cluster.memory_bandwidth_gbs * 1e9)
    codec = rank.codec_bytes / (cluster.memory_bandwidth_gbs * 1e9)  # compression's, exposed
    step_seconds = with_p2p.makespan + exchange + optimizer + codec
    flops = sum(num_microbatches * (s.forward_flops + s.backward_flops) for s in rank.stages)
    tokens = step.tokens * num_microbatches * (world_size // (layout.pp * layout.tp))
    stage_rows = tuple(StageRow(index, stage_rank[index], composed[stage_rank[index]].in_flight.get(index, 0),
                                next(s for s in ranks[stage_rank[index]].stages if s.index == index).activations,
                                *seconds[index]) for index in sorted(seconds))
    rank_rows = tuple(PipelineRankRow(r, split.stage_indices(r), ranks[r].params, ranks[r].grads, ranks[r].states,
                                      composed[r].activations, composed[r].buffers, composed[r].peak)
                      for r in sorted(ranks))
    memory = RankMemory(params=rank.params, grads=rank.grads, states=rank.states, states_max=rank.states,
                        activations=mine.activations, ddp_buckets=0, compression=rank.compression_bytes,
                        peak=mine.first_peak, steady_peak=mine.peak)
    parallel = min(_parallel_seconds(composed[r].calls, ranks[r].groups, cluster, world_size) for r in ranks)
    pipeline = PipelinePlan(layout.pp_schedule, layout.pp, num_microbatches, rank_rows, stage_rows,
                            with_p2p.makespan, compute_only.bubble, with_p2p.makespan - compute_only.makespan,
                            parallel)
    peak_flops = cluster.peak_flops(compute_dtype(step))
    return PlanReport(model=model.name, world_size=world_size, layout=layout, cluster=cluster.name, step=step,
                      placement="pp outermost (launch order)",
                      num_sharded_layers=sum(r.tp_layers for r in ranks.values()), memory=memory,
                      memory_capacity=cluster.memory_bytes, traffic=traffic, flops=flops,
                      compute_seconds=max(compute_only.busy.values()), optimizer_seconds=optimizer,
                      comm_seconds=sum(t.exposed_seconds for t in traffic), step_seconds=step_seconds,
                      tokens_per_second_per_gpu=tokens / step_seconds / world_size,
                      mfu=flops / step_seconds / peak_flops, plan_seconds=plan_seconds, codec_seconds=codec,
                      assumptions=(*ASSUMPTIONS, *PIPELINE_ASSUMPTIONS,
                                   f"compute_efficiency={step.compute_efficiency}",
                                   *([CODEC_ASSUMPTION] if codec else [])), pipeline=pipeline)


def _parallel_seconds(calls: tuple[CollectiveCall, ...], groups: dict[str, GroupInfo], cluster: ClusterSpec,
                      world_size: int) -> float:
    """Seconds of a rank's tensor- and expert-parallel collectives in its forwards and backwards: :func:`_traffic`
    exposes them whole."""
    seconds = 0.0
    for call in calls:
        info, call_seconds = _call_seconds(call, groups, cluster, world_size)
        if call.phase == "forward_backward" and call.op not in ("send", "recv") and set(info.dim.split("/")) <= {
                "tp", "ep"}:
            seconds += call_seconds
    return seconds


def _call_seconds(call: CollectiveCall, groups: dict[str, GroupInfo], cluster: ClusterSpec, world_size: int
                  ) -> tuple[GroupInfo, float]:
    """The group of ``call`` and its seconds on that group's link (a point-to-point transfer: bytes over bandwidth)."""
    info = groups.get(call.group, GroupInfo("?", world_size, "inter"))
    link = cluster.links[info.link]
    seconds = (call.num_bytes / link.bandwidth + link.latency if call.op in ("send", "recv")
               else collective_seconds(call.op, call.num_bytes, info.size, link))
    return info, seconds


def _traffic(calls: tuple[CollectiveCall, ...], groups: dict[str, GroupInfo], cluster: ClusterSpec, world_size: int,
             p2p_exposed: float) -> tuple[tuple[Traffic, ...], float]:
    """Rows by (mesh dimension, op) and the exposed seconds of the exchange after the schedule: FSDP2's gathers in
    the schedule hidden but the first, the point-to-point rows' share of ``p2p_exposed`` by bytes, the rest after
    the schedule exposed."""
    rows: dict[tuple[str, str, str], list[float]] = {}
    for call in calls:
        info, seconds = _call_seconds(call, groups, cluster, world_size)
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
