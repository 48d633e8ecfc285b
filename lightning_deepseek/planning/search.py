"""``search``: ``layout="auto"`` for a world larger than this machine: every layout the strategy supports, each
planned (:func:`lightning_deepseek.planning.plan`), those that fit kept and ranked by predicted tokens/s per GPU.

Ranked by throughput, not step time: layouts differ in the tokens a step holds (a rank's ``micro_batch_size``
sequences without a pipeline; under one, the schedule's micro-batches, each shared by the ``tp`` ranks of a stage), so
a step's seconds per token per GPU compare them as steps of the same global batch would.

The axes: ``tensor_parallel_size`` (the divisors of the world size up to the GPUs of a node: a ``tp`` group
crossing nodes gathers activations over the slow link), ``expert_parallel_size`` (the divisors of the world size
that divide every MoE layer's expert count; 1 for dense models), the sharding (none, ZeRO-1, FSDP2 over a node with
replicas across nodes (HSDP), FSDP2 over the world), activation checkpointing (none, selective, full) and, where
DDP's buckets or replicated pipeline stages exist, ``GradientCompression``'s bits (none, 8, 4); placement is the
strategy's ``"auto"``; pipeline stages (``pp`` of 2, 4, 8, 16) with ``tp`` or ``ep`` inside them, unsharded, ZeRO-1
or FSDP2, their schedule and micro-batches (:func:`pipelined_layouts`: the schedule's least, twice and four times as
many, :data:`MICROBATCH_FACTORS`) and, with ``tp > 1`` on a model declaring its attention, sequence parallelism
(:func:`sequence_parallel_sizes`). A layout the strategy refuses (a ``tp`` dividing no feed-forward width) is listed
as rejected with the strategy's reason.

Costs: one plan per candidate (see :mod:`.planner`), each of a few representative blocks (:mod:`.depth`). With
``cache=True`` (the default) the candidates share what does not change between them (:mod:`.cache`: block kinds,
tensor-parallel plans, placements, ZeRO-1's whole-model optimizer step across checkpointing modes, a pipelined rank's
stepped copies across micro-batch counts, ZeRO-1 and compression) and a candidate is not planned when the plans so
far show that it cannot fit, or, with ``top``, cannot rank among the ``top`` fastest (:mod:`.bounds`): such layouts
are listed in :attr:`SearchResult.pruned` with the bound. With ``workers > 1`` the layouts are planned side by side
in that many processes (:mod:`.pool`): the same ``top`` fastest plans (every fitting one without ``top``); which
layouts are pruned depends on the order the plans finish in (a layout may be planned before the plan that would have
pruned it). With ``time_limit``, no layout is planned after that many seconds: those left are bounded as above
or listed in :attr:`SearchResult.unplanned` (the ranking then covers the planned layouts only; Optuna's
``timeout`` for a study, here for a search).
The fitting plans are those of ``cache=False``, the ``top`` fastest where ``top`` is given
(``tests/planning/test_cache.py``); the speed: benchmarks/planning/REPORT.md.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
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
from lightning_deepseek.parallel.plan import Plan, add_attention_heads
from lightning_deepseek.planning.bounds import LayoutBounds, ParameterShards, planning_order
from lightning_deepseek.planning.cache import PlanCache
from lightning_deepseek.planning.cluster import ClusterSpec
from lightning_deepseek.planning.layout import PlanLayout, StepShape
from lightning_deepseek.planning.models import ModelSpec
from lightning_deepseek.planning.pipeline import V_SCHEDULES  # FSDP2 under them needs reshard_after_forward=False
from lightning_deepseek.planning.pipeline_bound import PipelinePeaks
from lightning_deepseek.planning.planner import plan
from lightning_deepseek.planning.pool import Outcome, PlanPool
from lightning_deepseek.planning.report import GIB, PlanReport

# Micro-batches per step under a pipeline, as multiples of the schedule's least: more shrink the bubble's share of a
# step and add the receive buffers torch keeps per micro-batch (each of ``StepShape.micro_batch_size`` sequences).
MICROBATCH_FACTORS = (1, 2, 4)
MAX_PP = 16  # pipeline stages up to 16 (DeepSeek-V3's 2,048 H800s ran 16; torchtitan's Llama 3.1 405B rows 8)


@dataclass(frozen=True)
class SearchResult:
    """Every candidate's outcome: the plans that fit (most tokens/s per GPU first), those that do not (smallest peak
    first), the layouts the strategy refused, with its reason, and those not planned because their model states alone
    exceed the device (with the bound; see the module docstring), and those the ``time_limit`` left neither planned
    nor bounded."""

    fitting: tuple[PlanReport, ...]
    not_fitting: tuple[PlanReport, ...]
    rejected: tuple[tuple[PlanLayout, str], ...]
    pruned: tuple[tuple[PlanLayout, str], ...] = ()
    unplanned: tuple[PlanLayout, ...] = ()

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
        world_size, tps, num_blocks, sequence_parallel, vocab_size, tuple(eps))


def pipelined_layouts(world_size: int, tps: list[int], num_blocks: int, sequence_parallel: tuple[int, ...] = (),
                      vocab_size: int = 0, eps: tuple[int, ...] = (1,)) -> list[PlanLayout]:
    """The pipelined candidates: ``pp`` a divisor of the world up to :data:`MAX_PP` whose stages the model's
    ``num_blocks`` fill, every schedule at each of :data:`MICROBATCH_FACTORS` times its least micro-batches, inside the
    stages ``tp`` or one of the expert-parallel sizes ``eps``, unsharded, ZeRO-1 or FSDP2 over each stage's ``dp``
    ranks, each checkpointing mode, and at the ``tp`` sizes in ``sequence_parallel`` also with sequence parallelism;
    the combinations the strategy refuses (its ``LayoutSettings``, e.g. ``tp`` with ``ep`` in a stage) are left out.
    Stages replicated over 2 or more ``dp`` ranks (no ``tp``, ``ep`` or FSDP2) are also planned with their exchange
    compressed at 8 and 4 bits (``GradientCompression``). With ``tp > 1`` dividing
    ``vocab_size``, ``loss_parallel`` is on (torchtitan's default, not an axis: it shards the stages' largest tensors,
    the logits, divides the head's compute by ``tp``, and adds all-reduces of one number per token)."""
    layouts = []
    sizes = [d for d in range(2, MAX_PP + 1) if world_size % d == 0 and d & (d - 1) == 0]
    for pp, schedule, tp, ep, ac in product(sizes, SCHEDULES, tps, eps, AC_MODES):
        dp = world_size // (pp * tp)
        if world_size % (pp * tp) or pp * (1 if schedule == "1F1B" else 2) > num_blocks:
            continue
        sharding = [(False, 1), (True, 1)] + ([(False, dp)] if dp > 1 else [])  # unsharded, ZeRO-1, FSDP2
        for (zero, shard), sp, factor in product(sharding, (False, True) if tp in sequence_parallel else (False,),
                                                 MICROBATCH_FACTORS):
            replicated = shard == 1 and tp == 1 and ep == 1 and dp > 1  # the stages GradientCompression composes with
            try:
                ParallelDims(world_size, tp=tp, ep=ep, dp_shard=shard, pp=pp)
                layouts += [PlanLayout(tp, ep, zero, dp_shard=shard, activation_checkpointing=ac, pp=pp,
                                       pp_schedule=schedule, reshard_after_forward=schedule not in V_SCHEDULES,
                                       pp_microbatches=None if factor == 1 else factor * min_microbatches(schedule, pp),
                                       sequence_parallel=sp,
                                       loss_parallel=tp > 1 and vocab_size > 0 and vocab_size % tp == 0, bits=bits)
                            for bits in ((None, 8, 4) if replicated else (None,))]
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
           top: int | None = None, workers: int = 1,
           progress: Callable[[PlanReport], None] | None = None, time_limit: float | None = None) -> SearchResult:
    """Plan every candidate layout (default: :func:`candidate_layouts`; ``depth`` as :func:`plan`'s) and rank them.

    Args:
        cache: share what does not change between layouts and prune those whose model states cannot fit (see the
            module docstring); False: every layout planned afresh, nothing pruned (the reference).
        top: with ``cache``, also prune the layouts that cannot rank among the ``top`` fastest fitting ones: whose
            compute alone exceeds, per token, the ``top``-th fastest step planned so far (:mod:`.bounds`);
            None: plan every layout that can fit.
        workers: processes planning layouts side by side (:mod:`.pool`); 1: plan in this process.
        progress: called with each plan as it is made (``lds-plan`` prints a line per plan).
        time_limit: seconds after which no further layout is planned (the plans in flight end); the layouts left
            are pruned by their bounds or listed in :attr:`SearchResult.unplanned`. None: plan until done.
    """
    if top is not None and top < 1:
        raise ValueError(f"top={top!r} must be a positive number of layouts, or None to plan every layout.")
    if workers < 1:
        raise ValueError(f"workers={workers!r} must be a positive number of processes.")
    if time_limit is not None and not time_limit > 0:
        raise ValueError(f"time_limit={time_limit!r} must be a positive number of seconds, or None to plan every "
                         "layout.")
    deadline = math.inf if time_limit is None else time.monotonic() + time_limit
    unplanned: list[int] = []
    with cached_probes() if cache else contextlib.nullcontext():
        if layouts is None:
            tps = [d for d in range(1, cluster.gpus_per_node + 1) if world_size % d == 0]
            layouts = candidate_layouts(world_size, cluster.gpus_per_node, expert_counts(model), block_count(model),
                                        sequence_parallel_sizes(model, tps, step.min_shard_params), model.vocab_size)
        peaks = PipelinePeaks(model, world_size, step) if cache and any(lay.pp > 1 for lay in layouts) else None
        bounds = LayoutBounds(world_size, cluster.memory_bytes, ParameterShards.of(
            model, world_size, step, tuple({lay.tp for lay in layouts})), top, peaks) if cache else None
        order = sorted(range(len(layouts)), key=lambda i: planning_order(layouts[i]))
        outcomes: list[tuple[int, PlanLayout, Outcome | str]] = []  # a plan, a refusal, or why not planned
        if workers == 1 or len(order) < 2:  # nothing to plan side by side
            shared = PlanCache() if cache else None
            for index in order:
                why = bounds.why_not(layouts[index]) if bounds is not None else None
                if why is None and time.monotonic() > deadline:
                    unplanned.append(index)
                    continue
                outcome = why or _plan_or_refusal(model, world_size, layouts[index], cluster, step, depth, shared)
                _record(outcomes, index, layouts[index], outcome, bounds, progress)
        else:
            with PlanPool(min(workers, len(order)), model, world_size, cluster, step, depth, cache) as pool:
                _plan_side_by_side(pool, layouts, order, bounds, outcomes, progress, deadline, unplanned)
        if bounds is not None and bounds.closest and not unplanned and not any(
                isinstance(o, PlanReport) for *_, o in outcomes):
            # every layout pruned by its bound: plan the least bounded, to say by how much
            least = min(bounds.closest, key=lambda c: c[0])[1]
            with contextlib.suppress(ValueError):
                outcomes.append((-1, least, plan(model, world_size, least, cluster, step, depth)))
    return _result(outcomes, tuple(layouts[i] for i in sorted(unplanned)))


def _plan_or_refusal(model: ModelSpec, world_size: int, layout: PlanLayout, cluster: ClusterSpec, step: StepShape,
                     depth: str, cache: PlanCache | None) -> Outcome:
    try:
        return plan(model, world_size, layout, cluster, step, depth, cache)
    except ValueError as exc:
        return exc


def _record(outcomes: list, index: int, layout: PlanLayout, outcome: Outcome | str, bounds: LayoutBounds | None,
            progress: Callable[[PlanReport], None] | None) -> None:
    outcomes.append((index, layout, outcome))
    if isinstance(outcome, PlanReport):
        if bounds is not None:
            bounds.add(outcome)
        if progress is not None:
            progress(outcome)


def _plan_side_by_side(pool: PlanPool, layouts: list[PlanLayout], order: list[int], bounds: LayoutBounds | None,
                       outcomes: list, progress: Callable[[PlanReport], None] | None, deadline: float = math.inf,
                       unplanned: list[int] | None = None) -> None:
    """Each idle worker takes the first layout in planning order that it plans (:meth:`PlanPool.takes`), pruning
    on the way those the plans so far bound; then the next plan to finish is recorded. After ``deadline``
    (``time.monotonic()``) the layouts left are pruned or added to ``unplanned`` and the plans in flight end."""
    pending = list(order)
    while pending or pool.busy:
        if pending and time.monotonic() > deadline:
            for index in pending:
                why = bounds.why_not(layouts[index]) if bounds is not None else None
                if why is not None:
                    _record(outcomes, index, layouts[index], why, bounds, progress)
                elif unplanned is not None:
                    unplanned.append(index)
            pending.clear()
        for worker in pool.idle():
            for index in list(pending):
                why = bounds.why_not(layouts[index]) if bounds is not None else None
                if why is not None:
                    pending.remove(index)
                    _record(outcomes, index, layouts[index], why, bounds, progress)
                elif pool.takes(worker, layouts[index]):
                    pending.remove(index)
                    pool.submit(worker, index, layouts[index])
                    break
        if pool.busy:
            _record(outcomes, *pool.result(), bounds, progress)


def _result(outcomes: list[tuple[int, PlanLayout, Outcome | str]], unplanned: tuple[PlanLayout, ...] = ()
            ) -> SearchResult:
    reports = [o for _, _, o in outcomes if isinstance(o, PlanReport)]
    fitting = sorted((r for r in reports if r.fits), key=lambda r: -r.tokens_per_second_per_gpu)
    not_fitting = sorted((r for r in reports if not r.fits), key=lambda r: r.memory.steady_peak)
    rejected = sorted((i, lay, str(o)) for i, lay, o in outcomes if isinstance(o, ValueError))
    pruned = sorted((i, lay, o) for i, lay, o in outcomes if isinstance(o, str))
    return SearchResult(tuple(fitting), tuple(not_fitting), tuple((lay, why) for _, lay, why in rejected),
                        tuple((lay, why) for _, lay, why in pruned), unplanned)
