"""``search``: ``layout="auto"`` for a world larger than this machine: every layout the strategy supports, each
planned (:func:`lightning_deepseek.planning.plan`), those that fit kept and ranked by predicted tokens/s per GPU.

Ranked by throughput, not step time: layouts differ in the tokens a step holds (a rank's ``micro_batch_size``
sequences without a pipeline; under one, the schedule's micro-batches, each shared by the ``tp`` ranks of a stage), so
a step's seconds per token per GPU compare them as steps of the same global batch would.

The axes: ``tensor_parallel_size`` (the divisors of the world size up to the GPUs of a node: a ``tp`` group
crossing nodes gathers activations over the slow link), ``expert_parallel_size`` (the divisors of the world size
that divide every MoE layer's expert count; 1 for dense models), the sharding (none, ZeRO-1, FSDP2 over a node with
replicas across nodes (HSDP), FSDP2 over the world), activation checkpointing (none, selective, full) and, where
DDP's buckets exist, ``GradientCompression``'s bits (none, 8, 4); placement is the strategy's ``"auto"``; pipeline
stages (``pp`` of 2, 4, 8), their schedule and micro-batches (:func:`pipelined_layouts`: the schedule's least, twice
and four times as many, :data:`MICROBATCH_FACTORS`) and,
with ``tp > 1`` on a model declaring its attention, sequence parallelism (:func:`sequence_parallel_sizes`). A
layout the strategy refuses (a ``tp`` dividing no feed-forward width) is listed as rejected with the strategy's
reason.

Costs: one plan per candidate (see :mod:`.planner`), each of a few representative blocks (:mod:`.depth`). With
``cache=True`` (the default) the candidates share what does not change between them (:mod:`.cache`: block kinds,
tensor-parallel plans, placements, ZeRO-1's whole-model optimizer step across checkpointing modes) and a candidate is
not planned when its model states alone exceed the device: at least those of every parameter at its most sharded
(:class:`ParameterShards`, from the model alone, before any plan), or those a planned layout showed: the same layout
under another activation checkpointing or micro-batch count (model states depend on neither), or, for plain DDP, the
same layout with ZeRO-1 (which holds fewer optimizer states and the same parameters, gradients and buckets). The later
steps' peak holds the parameters, gradients, optimizer states and DDP's buckets at once (the optimizer step), so a
pruned layout is one that would not fit: such layouts are listed in :attr:`SearchResult.pruned` with the bound, not
planned. With ``top``, a layout is also pruned when its compute and exposed tensor- and expert-parallel collectives
alone (compute and bubble under a pipeline), per token, exceed the seconds per token of the ``top``-th fastest fitting
plan so far: those of a planned layout that differs from it only in how the data-parallel ranks shard the model states
(ZeRO-1, FSDP2's sizes: the same blocks run on the same shapes and send the same activations), under the same activation
checkpointing or one recomputing less (none, selective, full); also the compute alone, per token, of any planned layout
of the same ``tp`` (a rank's FLOPs do not depend on ``ep`` under uniform routing, the sharding or the compression; under
a pipeline the average rank's: its stages' FLOPs summed do not depend on ``pp``, the schedule or the micro-batches);
layouts are planned in that order.
The fitting plans are those of ``cache=False``, the ``top`` fastest where ``top`` is given
(``tests/planning/test_cache.py``); the speed: benchmarks/planning/REPORT.md.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import warnings
from dataclasses import dataclass, replace
from itertools import product

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_deepseek.moe.protocol import find_expert_layers
from lightning_deepseek.parallel.activation_checkpointing import MODES as AC_MODES
from lightning_deepseek.parallel.activation_checkpointing import find_transformer_blocks
from lightning_deepseek.parallel.detection import cached_probes
from lightning_deepseek.parallel.dims import ParallelDims
from lightning_deepseek.parallel.pipeline import min_microbatches
from lightning_deepseek.parallel.pipeline_split import SCHEDULES
from lightning_deepseek.parallel.plan import Plan, add_attention_heads, decide_plan
from lightning_deepseek.planning.cache import PlanCache
from lightning_deepseek.planning.cluster import ClusterSpec
from lightning_deepseek.planning.layout import PlanLayout, StepShape
from lightning_deepseek.planning.models import ModelSpec
from lightning_deepseek.planning.planner import plan
from lightning_deepseek.planning.report import GIB, PlanReport

V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")  # FSDP2 under them needs reshard_after_forward=False
# Checkpointing modes by what they recompute, each a superset of the previous one's: "selective" recomputes a block's
# cheap ops and half its matrix multiplies, "full" its whole forward.
RECOMPUTE_ORDER = ("none", "selective", "full")
# Micro-batches per step under a pipeline, as multiples of the schedule's least: more shrink the bubble's share of a
# step and add the receive buffers torch keeps per micro-batch (each of ``StepShape.micro_batch_size`` sequences).
MICROBATCH_FACTORS = (1, 2, 4)
PARALLEL_OPS = ("all_gather", "reduce_scatter", "all_to_all")  # the tp and ep collectives of forward and backward

Bound = tuple[PlanLayout, int]  # a planned layout and its model states per rank (bytes)


@dataclass(frozen=True)
class SearchResult:
    """Every candidate's outcome: the plans that fit (most tokens/s per GPU first), those that do not (smallest peak
    first), the layouts the strategy refused, with its reason, and those not planned because their model states alone
    exceed the device (with the bound; see the module docstring)."""

    fitting: tuple[PlanReport, ...]
    not_fitting: tuple[PlanReport, ...]
    rejected: tuple[tuple[PlanLayout, str], ...]
    pruned: tuple[tuple[PlanLayout, str], ...] = ()

    def why(self, report: PlanReport) -> str:
        """One line: where its step time goes, its memory headroom, and how it compares with the fastest."""
        largest = max(report.traffic, key=lambda t: t.exposed_seconds, default=None)
        comm = (f"; most exposed: {largest.dim} {largest.op} {largest.exposed_seconds * 1e3:.1f} ms"
                if largest is not None and largest.exposed_seconds > 0 else "")
        headroom = (report.memory_capacity - report.memory.steady_peak) / GIB
        best = self.fitting[0] if self.fitting else report
        ratio = report.tokens_per_second_per_gpu / best.tokens_per_second_per_gpu
        versus = "fastest" if report is best else f"{ratio - 1:+.1%} tokens/s vs the fastest"
        return (f"{versus}; compute {report.compute_seconds:.3f} s, exposed communication "
                f"{report.comm_seconds:.3f} s{comm}; peak {report.memory.steady_peak / GIB:.1f} GiB, "
                f"{headroom:.1f} GiB free")


def expert_counts(model: ModelSpec) -> list[int]:
    """The routed-expert count of each MoE layer of ``model`` (built on fake tensors)."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        module = model.build()
    return [layer.num_experts for layer in find_expert_layers(module)]


def block_count(model: ModelSpec) -> int:
    """The transformer blocks of ``model`` (built on the meta device): what a pipeline splits."""
    with torch.device("meta"):
        module = model.build()
    return len(find_transformer_blocks(module))


def candidate_layouts(world_size: int, gpus_per_node: int, experts: list[int], num_blocks: int = 0,
                      sequence_parallel: tuple[int, ...] = (), vocab_size: int = 0) -> list[PlanLayout]:
    """Every layout of the axes the strategy has (see the module docstring), each with DDP's buckets (``dp > 1``
    unsharded) also compressed at 8 and 4 bits (``GradientCompression``); pipelined ones where the model has
    ``num_blocks`` transformer blocks to split, also with sequence parallelism at the ``tp`` sizes
    ``sequence_parallel`` (:func:`sequence_parallel_sizes`), and with ``loss_parallel`` at the ``tp`` sizes dividing
    ``vocab_size``."""
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    tps = [d for d in divisors if d <= gpus_per_node]
    eps = [d for d in divisors if experts and math.gcd(*experts) % d == 0] or [1]
    shards = sorted({d for d in (min(gpus_per_node, world_size), world_size) if d > 1 and world_size % d == 0})
    sharding = [(False, 1), (True, 1)] + [(False, d) for d in shards]  # ZeRO-1 and FSDP2 exclude each other
    return [PlanLayout(tp, ep, zero, dp_shard=shard, activation_checkpointing=ac, bits=bits)
            for tp, ep, (zero, shard), ac in product(tps, eps, sharding, AC_MODES)
            for bits in ((None, 8, 4) if shard == 1 and world_size // tp > 1 else (None,))] + pipelined_layouts(
        world_size, tps, num_blocks, sequence_parallel, vocab_size)


def pipelined_layouts(world_size: int, tps: list[int], num_blocks: int, sequence_parallel: tuple[int, ...] = (),
                      vocab_size: int = 0) -> list[PlanLayout]:
    """The pipelined candidates: ``pp`` a divisor of the world up to 8 whose stages the model's ``num_blocks`` fill,
    every schedule at each of :data:`MICROBATCH_FACTORS` times its least micro-batches, unsharded or FSDP2 over each
    stage's ``dp`` ranks, each checkpointing mode, and at the ``tp`` sizes in ``sequence_parallel`` also with sequence
    parallelism; the combinations the strategy refuses (its ``LayoutSettings``) are left out. With ``tp > 1`` dividing
    ``vocab_size``, ``loss_parallel`` is on (torchtitan's default, not an axis: it shards the stages' largest tensors,
    the logits, divides the head's compute by ``tp``, and adds all-reduces of one number per token)."""
    layouts = []
    for pp, schedule, tp, ac in product([d for d in (2, 4, 8) if world_size % d == 0], SCHEDULES, tps, AC_MODES):
        dp = world_size // (pp * tp)
        if world_size % (pp * tp) or pp * (1 if schedule == "1F1B" else 2) > num_blocks:
            continue
        for shard, sp, factor in product(sorted({1, dp}), (False, True) if tp in sequence_parallel else (False,),
                                         MICROBATCH_FACTORS):
            try:
                layouts.append(PlanLayout(tp, dp_shard=shard, activation_checkpointing=ac, pp=pp,
                                          pp_schedule=schedule, reshard_after_forward=schedule not in V_SCHEDULES,
                                          pp_microbatches=None if factor == 1 else factor * min_microbatches(schedule,
                                                                                                             pp),
                                          sequence_parallel=sp,
                                          loss_parallel=tp > 1 and vocab_size > 0 and vocab_size % tp == 0))
            except ValueError:
                continue
    return layouts


def sequence_parallel_sizes(model: ModelSpec, tps: list[int], min_shard_params: int) -> tuple[int, ...]:
    """The ``tp`` sizes (above 1) at which every transformer block of ``model`` (built on the meta device) holds an
    attention whose heads the strategy's pipelined tensor-parallel plan splits: what ``sequence_parallel`` needs
    (transformers' models declare their attention projections; the heads must divide by ``tp``)."""
    with torch.device("meta"):
        module = model.build()
    blocks = find_transformer_blocks(module)
    sizes = []
    for tp in (t for t in tps if t > 1):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the strategy's warning for heads that tp does not divide
            heads = [e.name for e in add_attention_heads(module, Plan(), tp, min_shard_params) if e.heads]
        if blocks and all(any(h.startswith(f"{block}.") for h in heads) for block in blocks):
            sizes.append(tp)
    return tuple(sizes)


def search(model: ModelSpec, world_size: int, cluster: ClusterSpec, step: StepShape,
           layouts: list[PlanLayout] | None = None, depth: str = "representative", cache: bool = True,
           top: int | None = None) -> SearchResult:
    """Plan every candidate layout (default: :func:`candidate_layouts`; ``depth`` as :func:`plan`'s) and rank them.

    Args:
        cache: share what does not change between layouts and prune those whose model states cannot fit (see the
            module docstring); False: every layout planned afresh, nothing pruned (the reference).
        top: with ``cache``, also prune the layouts that cannot rank among the ``top`` fastest fitting ones: whose
            compute alone exceeds, per token, the ``top``-th fastest step planned so far (see the module docstring);
            None: plan every layout that can fit.
    """
    if top is not None and top < 1:
        raise ValueError(f"top={top!r} must be a positive number of layouts, or None to plan every layout.")
    with cached_probes() if cache else contextlib.nullcontext():
        if layouts is None:
            tps = [d for d in range(1, cluster.gpus_per_node + 1) if world_size % d == 0]
            layouts = candidate_layouts(world_size, cluster.gpus_per_node, expert_counts(model), block_count(model),
                                        sequence_parallel_sizes(model, tps, step.min_shard_params), model.vocab_size)
        return _search(model, world_size, cluster, step, layouts, depth, PlanCache() if cache else None,
                       top if cache else None)


def _search(model: ModelSpec, world_size: int, cluster: ClusterSpec, step: StepShape, layouts: list[PlanLayout],
            depth: str, shared: PlanCache | None, top: int | None) -> SearchResult:
    cache = shared is not None
    reports, rejected, pruned = [], [], []
    closest: list[tuple[int, PlanLayout]] = []  # (model-state bound, layout) of those pruned by the bound alone
    states: dict[PlanLayout, Bound] = {}  # by layout without checkpointing: its model states
    # planned reports by what bounds another layout's step (_least_step): _compute_key, _flops_key, the layout
    # without checkpointing
    computes: dict[tuple, list[PlanReport]] = {}
    fastest: list[float] = []  # the fitting plans' seconds per token per GPU, ascending
    shards = ParameterShards.of(model, world_size, step, tuple({lay.tp for lay in layouts})) if cache else None
    for index in sorted(range(len(layouts)), key=lambda i: _planning_order(layouts[i])):
        layout = layouts[index]
        least = shards.least_states(layout) if shards is not None else None
        if least is not None and least > cluster.memory_bytes:
            closest.append((least, layout))
            pruned.append((index, layout, f"model states alone at least {least / GIB:.1f} GiB (every parameter at "
                           f"its most sharded) exceed the {cluster.memory_bytes / GIB:.1f} GiB of a device"))
            continue
        bound = _states_bound(layout, states) if cache else None
        if bound is not None and bound[1] > cluster.memory_bytes:
            pruned.append((index, layout, f"model states alone {bound[1] / GIB:.1f} GiB (those of "
                           f"{bound[0].describe(world_size)}) exceed the {cluster.memory_bytes / GIB:.1f} GiB of a "
                           "device"))
            continue
        slowest = fastest[top - 1] if top is not None and len(fastest) >= top else None
        bound = _least_step(layout, computes) if slowest is not None else None
        if bound is not None and bound[1] / _step_tokens(bound[0]) > slowest:
            sibling, least = bound[0], bound[1] / _step_tokens(bound[0])
            pruned.append((index, layout, f"{bound[2]} at least {least * 1e6:.1f} us per token per GPU (those of "
                           f"{sibling.layout.describe(world_size)}) exceed those of the {top} fastest fitting layouts "
                           f"({slowest * 1e6:.1f} us at most)"))
            continue
        try:
            report = plan(model, world_size, layout, cluster, step, depth, shared)
        except ValueError as exc:
            rejected.append((index, layout, str(exc)))
            continue
        reports.append(report)
        computes.setdefault(_compute_key(layout), []).append(report)
        computes.setdefault(_flops_key(layout), []).append(report)
        computes.setdefault(("step", _without_checkpointing(layout)), []).append(report)
        if report.fits:
            bisect.insort(fastest, 1 / report.tokens_per_second_per_gpu)
        memory = report.memory
        states.setdefault(_states_key(layout),
                          (layout, memory.params + memory.grads + memory.states + memory.ddp_buckets))
    if not reports and closest:  # every layout pruned by its bound: plan the least bounded, to say by how much
        with contextlib.suppress(ValueError):
            reports.append(plan(model, world_size, min(closest, key=lambda c: c[0])[1], cluster, step, depth, shared))
    fitting = sorted((r for r in reports if r.fits), key=lambda r: -r.tokens_per_second_per_gpu)
    not_fitting = sorted((r for r in reports if not r.fits), key=lambda r: r.memory.steady_peak)
    return SearchResult(tuple(fitting), tuple(not_fitting), tuple((lay, why) for _, lay, why in sorted(rejected)),
                        tuple((lay, why) for _, lay, why in sorted(pruned)))


@dataclass(frozen=True)
class ParameterShards:
    """The trainable parameters of a model by how far a layout can shard them, for a bound of a rank's model states
    that needs no plan: ``(bytes per element, elements)`` of the experts' parameters, of the tensor-parallel plan's
    layers per ``tp`` size (the strategy's own ``decide_plan``), and of the rest."""

    world_size: int
    experts: tuple[tuple[int, int], ...]
    planned: dict[int, tuple[tuple[int, int], ...]]
    other: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, model: ModelSpec, world_size: int, step: StepShape, tps: tuple[int, ...] = (1, 2, 4, 8)
           ) -> ParameterShards:
        """Built on fake tensors; ``planned`` for the ``tps`` the strategy can plan (a refused size is absent)."""
        with FakeTensorMode(allow_non_fake_inputs=True):
            module = model.build()
        expert_ids = {id(p) for layer in find_expert_layers(module) for p in layer.experts.parameters()}
        trainable = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        planned = {}
        for tp in (t for t in tps if world_size % t == 0 and t > 1):
            try:
                layers = set(decide_plan(module, "auto", world_size, tp, False, step.min_shard_params).names)
            except ValueError:
                continue
            planned[tp] = tuple((p.element_size(), p.numel()) for name, p in trainable
                                if name.rpartition(".")[0] in layers and id(p) not in expert_ids)
        experts = tuple((p.element_size(), p.numel()) for _, p in trainable if id(p) in expert_ids)
        return cls(world_size, experts, planned,
                   tuple((p.element_size(), p.numel()) for _, p in trainable if id(p) not in expert_ids))

    def least_states(self, layout: PlanLayout) -> int | None:
        """Bytes of parameters, gradients and AdamW states a rank holds at least under ``layout``: every parameter
        split over as many ranks as the layout can split it (experts over ``ep x tp x dp_shard``, the tensor-parallel
        layers over ``tp x dp_shard``, the rest over ``dp_shard``; ZeRO-1's states left out, rank 0 may own few);
        under a pipeline every parameter over ``tp x dp_shard`` (the stages also shard attention heads, and with
        ``loss_parallel`` the embedding and head, over ``tp``), and their mean over the ``pp`` stages' ranks (the
        most loaded one, which the plan reports, holds at least that); None for a ``tp`` the strategy refuses."""
        if layout.tp > 1 and layout.tp not in self.planned:
            return None
        try:  # sizes the strategy refuses are left to the plan, which reports its reason
            ParallelDims(self.world_size, tp=layout.tp, ep=layout.ep, dp_shard=layout.dp_shard, pp=layout.pp)
        except ValueError:
            return None
        planned = self.planned.get(layout.tp, ())
        copies = 2 if layout.shard_optimizer_states else 4  # parameter, gradient (and two AdamW moments)

        def held(params: tuple[tuple[int, int], ...], split: int) -> int:
            return sum(size * numel // split for size, numel in params)

        if layout.pp > 1:
            planned = self.other
        tp_bytes = held(planned, layout.tp * layout.dp_shard)
        rest = held(self.other, layout.dp_shard) - held(planned, layout.dp_shard)
        return copies * (held(self.experts, layout.ep * layout.tp * layout.dp_shard) + tp_bytes + rest) // layout.pp


def _planning_order(layout: PlanLayout) -> tuple[int, bool, int]:
    """By recomputation (:data:`RECOMPUTE_ORDER`: a mode's compute bounds the later modes', its model states all
    modes'), ZeRO-1 first (its model states bound plain DDP's), FSDP2 over fewer ranks first (the set-up of FSDP2
    over thousands of ranks is a plan's costliest part: its siblings, planned first, may prune it by time)."""
    return (RECOMPUTE_ORDER.index(layout.activation_checkpointing), not layout.shard_optimizer_states,
            layout.dp_shard)


def _compute_key(layout: PlanLayout) -> tuple:
    """What decides a rank's compute: not how the data-parallel ranks shard the model states (ZeRO-1, FSDP2)."""
    return (layout.tp, layout.ep, layout.pp, layout.pp_schedule, layout.num_microbatches, layout.placement,
            layout.bits, layout.sequence_parallel)


def _least_step(layout: PlanLayout, computes: dict[tuple, list[PlanReport]]
                   ) -> tuple[PlanReport, float, str] | None:
    """The largest lower bound of ``layout``'s step time that planned layouts give, the layout giving it, and what
    it counts: a layout the same but for the sharding (:func:`_least_seconds`: compute and
    exposed tp / ep collectives), any of the same :func:`_flops_key` (:func:`_mean_compute`: the compute alone), or
    the same layout (its step time: recomputation adds compute and repeats the forward's tp / ep collectives, and what
    compute hides of the data-parallel collectives at most equals what it adds, :mod:`.estimate`; a pipeline's
    replay is longer with longer backward chunks), each under the same checkpointing or one that recomputes less
    (:data:`RECOMPUTE_ORDER`); None: none planned."""
    mode = RECOMPUTE_ORDER.index(layout.activation_checkpointing)

    def lighter(report: PlanReport) -> bool:
        return RECOMPUTE_ORDER.index(report.layout.activation_checkpointing) <= mode

    bounds = [(r, _least_seconds(r), "compute and exposed tp / ep collectives alone")
              for r in computes.get(_compute_key(layout), []) if lighter(r)]
    bounds += [(r, _mean_compute(r), "compute alone") for r in computes.get(_flops_key(layout), []) if lighter(r)]
    bounds += [(r, r.step_seconds, "step time with less recomputation")
               for r in computes.get(("step", _without_checkpointing(layout)), []) if lighter(r)]
    return max(bounds, key=lambda bound: bound[1], default=None)


def _flops_key(layout: PlanLayout) -> tuple:
    """What decides the FLOPs per token of a rank (without a pipeline) or of a stage's micro-batches summed over the
    stages (under one): not ``ep`` (uniform routing), the sharding, the compression, nor, under a pipeline, ``pp``,
    the schedule or the micro-batches (the same blocks, split otherwise)."""
    return (layout.pp > 1, layout.tp, layout.sequence_parallel, layout.loss_parallel)


def _mean_compute(report: PlanReport) -> float:
    """The compute of a step on the average rank: without a pipeline every rank's; under one, every stage's forward
    and backward per micro-batch, summed, times the micro-batches over ``pp`` (the step is at least its busiest
    rank's, which is at least the average's). Per token, the same for every layout of the same :func:`_flops_key`."""
    if report.pipeline is None:
        return report.compute_seconds
    pipeline = report.pipeline
    per_microbatch = sum(s.forward_seconds + s.backward_seconds for s in pipeline.stages)
    return per_microbatch * pipeline.num_microbatches / pipeline.pp


def _least_seconds(report: PlanReport) -> float:
    """The step time of a layout that differs from ``report``'s only in its sharding is at least its compute and,
    without a pipeline, its exposed tensor- and expert-parallel collectives of forward and backward (the same
    groups and bytes; they add to the compute, see :mod:`.estimate`); under a pipeline the schedule replayed with
    its stages' compute alone (the same chunks in the same order: compute and bubble)."""
    if report.pipeline is not None:  # the replayed schedule without its transfers: the stages' compute and bubble
        return report.pipeline.makespan - report.pipeline.p2p_exposed_seconds
    return report.compute_seconds + sum(t.exposed_seconds for t in report.traffic
                                        if t.op in PARALLEL_OPS and set(t.dim.split("/")) <= {"tp", "ep"})


def _step_tokens(report: PlanReport) -> float:
    """Tokens per GPU in ``report``'s step: the same for the layouts differing from it only in their sharding (the
    same ``tp``, ``pp`` and micro-batches)."""
    return report.tokens_per_second_per_gpu * report.step_seconds


def _without_checkpointing(layout: PlanLayout) -> PlanLayout:
    return replace(layout, activation_checkpointing="none")


def _states_key(layout: PlanLayout) -> PlanLayout:
    """``layout`` but what its model states do not depend on: activation checkpointing and micro-batches."""
    return replace(layout, activation_checkpointing="none", pp_microbatches=None)


def _states_bound(layout: PlanLayout, states: dict[PlanLayout, Bound]) -> Bound | None:
    """A planned layout's model states that ``layout``'s are at least: the same layout under another activation
    checkpointing or micro-batches, or, for plain DDP (no ZeRO-1, no FSDP2), the same with ZeRO-1; None where none is
    planned yet."""
    same = _states_key(layout)
    if same in states:
        return states[same]
    if not layout.shard_optimizer_states and layout.dp_shard == 1 and layout.pp == 1:  # no ZeRO-1 under a pipeline
        return states.get(replace(same, shard_optimizer_states=True))
    return None
