"""``LayoutBounds``: what the layouts ``layout="auto"`` has planned so far bound of those it has not, so that
:func:`.search.search` skips a layout that cannot fit or cannot rank among the ``top`` fastest.

A layout is not planned when its model states alone exceed the device: at least those of every parameter at its most
sharded (:class:`ParameterShards`, from the model alone, before any plan); a pipelined one also when the least peak
of its largest pipeline rank does (:mod:`.pipeline_bound`: parameters, states, receive buffers and the block inputs
its schedule holds, from the split and the action table, before any step); or when its model states exceed those a
planned layout showed: the same layout under another activation checkpointing or micro-batch count (model states
depend on neither), or, for plain DDP, the same layout with ZeRO-1 (which holds fewer optimizer states and the same
parameters, gradients and buckets).
The later steps' peak holds the parameters, gradients, optimizer states and DDP's buckets at once (the optimizer
step), so such a layout would not fit. Nor does one whose same layout under more recomputation (full, then selective
checkpointing; the same micro-batches) was planned and peaked above the device: recomputing less keeps more
activations, so the peak is at least as high (``tests/planning/test_cache.py``); not under the V schedules, whose
split backward keeps what it recomputes from its input part to its weight part (it can hold more than none).

With ``top``, a layout is also not planned when its compute and exposed tensor- and expert-parallel collectives alone
(under a pipeline: the schedule's compute and bubble, and the least of its pipeline ranks' tp and ep collectives), per
token, exceed the seconds per token of the ``top``-th fastest fitting plan so far: those of a planned layout that
differs from it only in how the data-parallel ranks shard the model states (ZeRO-1, FSDP2's sizes: the same blocks run
on the same shapes and send the same activations), under the same activation checkpointing or one recomputing less
(none, selective, full); also the compute alone, per token, of any planned layout of the same ``tp`` (a rank's FLOPs
do not depend on ``ep`` under uniform routing, the sharding or the compression; under a pipeline the average rank's:
its stages' FLOPs summed do not depend on ``pp``, the schedule or the micro-batches); and the step time of the same
layout under less recomputation.

:func:`planning_order` plans full checkpointing first: where it does not fit, neither do the other modes (for a model
that fits few layouts, the most the search can skip), and where it does, no checkpointing next, whose step bounds
selective checkpointing's.

The bounds hold whatever has been planned, in whatever order: a search that plans layouts side by side
(:mod:`.pool`) prunes other layouts, never one that would have fit or ranked
(``tests/planning/test_cache.py``).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace

from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_deepseek.moe.protocol import find_expert_layers
from lightning_deepseek.parallel.dims import ParallelDims
from lightning_deepseek.parallel.plan import decide_plan
from lightning_deepseek.planning.layout import PlanLayout, StepShape
from lightning_deepseek.planning.models import ModelSpec
from lightning_deepseek.planning.pipeline import V_SCHEDULES
from lightning_deepseek.planning.pipeline_bound import PipelinePeaks
from lightning_deepseek.planning.report import GIB, PlanReport

# Checkpointing modes by what they recompute, each a superset of the previous one's: "selective" recomputes a block's
# cheap ops and half its matrix multiplies, "full" its whole forward.
RECOMPUTE_ORDER = ("none", "selective", "full")
PLANNED_FIRST = ("full", "none", "selective")  # planning_order's, see the module docstring
PARALLEL_OPS = ("all_gather", "reduce_scatter", "all_to_all")  # the tp and ep collectives of forward and backward

Bound = tuple[PlanLayout, int]  # a planned layout and its model states per rank (bytes)


class LayoutBounds:
    """The bounds the plans added so far give (see the module docstring), for a device of ``capacity`` bytes;
    ``shards``: the model's parameters; ``top`` as :func:`.search.search`'s."""

    def __init__(self, world_size: int, capacity: int, shards: ParameterShards, top: int | None,
                 peaks: PipelinePeaks | None = None) -> None:
        self.world_size, self.capacity, self.shards, self.top, self.peaks = world_size, capacity, shards, top, peaks
        self.closest: list[tuple[int, PlanLayout]] = []  # (bound, layout) of those pruned before any plan
        self._states: dict[PlanLayout, Bound] = {}  # by layout without checkpointing and micro-batches
        self._peaks: dict[PlanLayout, list[PlanReport]] = {}  # not fitting, by layout without checkpointing
        # planned reports by what bounds another layout's step (_least_step): _compute_key, _flops_key, the layout
        # without checkpointing
        self._computes: dict[tuple, list[PlanReport]] = {}
        self._fastest: list[float] = []  # the fitting plans' seconds per token per GPU, ascending

    def why_not(self, layout: PlanLayout) -> str | None:
        """Why ``layout`` cannot fit or rank, by the plans added so far; None: it must be planned."""
        device = f"the {self.capacity / GIB:.1f} GiB of a device"
        least = self.shards.least_states(layout)
        if least is not None and least > self.capacity:
            self.closest.append((least, layout))
            return (f"model states alone at least {least / GIB:.1f} GiB (every parameter at its most sharded) exceed "
                    f"{device}")
        least = self._least_peak(layout)
        if least is not None and least > self.capacity:
            self.closest.append((least, layout))
            return (f"peak at least {least / GIB:.1f} GiB on a pipeline rank (its parameters, states, receive buffers "
                    f"and the block inputs its schedule holds, before any step) exceeds {device}")
        bound = _states_bound(layout, self._states)
        if bound is not None and bound[1] > self.capacity:
            return (f"model states alone {bound[1] / GIB:.1f} GiB (those of {bound[0].describe(self.world_size)}) "
                    f"exceed {device}")
        mode = RECOMPUTE_ORDER.index(layout.activation_checkpointing)
        split = layout.pp_schedule in V_SCHEDULES  # their split backward keeps what it recomputes
        heavier = [] if split else [r for r in self._peaks.get(_without_checkpointing(layout), [])
                                    if RECOMPUTE_ORDER.index(r.layout.activation_checkpointing) > mode]
        if heavier:
            return (f"peak at least {heavier[0].memory.steady_peak / GIB:.1f} GiB (that of "
                    f"{heavier[0].layout.describe(self.world_size)}, which recomputes more and keeps fewer "
                    f"activations) exceeds {device}")
        if self.top is None or len(self._fastest) < self.top:
            return None
        slowest = self._fastest[self.top - 1]
        step = _least_step(layout, self._computes)
        if step is None or step[1] / _step_tokens(step[0]) <= slowest:
            return None
        sibling, least_time, what = step[0], step[1] / _step_tokens(step[0]), step[2]
        return (f"{what} at least {least_time * 1e6:.1f} us per token per GPU (those of "
                f"{sibling.layout.describe(self.world_size)}) exceed those of the {self.top} fastest fitting layouts "
                f"({slowest * 1e6:.1f} us at most)")

    def _least_peak(self, layout: PlanLayout) -> int | None:
        """A pipelined layout's least peak (:mod:`.pipeline_bound`); None without a pipeline, or where the split or
        the schedule refuses it (the plan reports the strategy's reason)."""
        if self.peaks is None or layout.pp == 1:
            return None
        try:
            return self.peaks.least_peak(layout)
        except ValueError:
            return None

    def add(self, report: PlanReport) -> None:
        """A planned layout's report: a bound of the layouts like it."""
        layout = report.layout
        for key in (_compute_key(layout), _flops_key(layout), ("step", _without_checkpointing(layout))):
            self._computes.setdefault(key, []).append(report)
        if report.fits:
            bisect.insort(self._fastest, 1 / report.tokens_per_second_per_gpu)
        else:
            self._peaks.setdefault(_without_checkpointing(layout), []).append(report)
        memory = report.memory
        self._states.setdefault(_states_key(layout),
                                (layout, memory.params + memory.grads + memory.states + memory.ddp_buckets))


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


def planning_order(layout: PlanLayout) -> tuple[int, bool, int]:
    """By checkpointing mode (:data:`PLANNED_FIRST`: full's peak bounds the other modes', none's step selective's,
    a mode's model states every mode's), ZeRO-1 first (its model states bound plain DDP's), FSDP2 over fewer ranks
    first (the set-up of FSDP2 over thousands of ranks is a plan's costliest part: its siblings, planned first, may
    prune it by time)."""
    return (PLANNED_FIRST.index(layout.activation_checkpointing), not layout.shard_optimizer_states,
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

    bounds = [(r, _least_seconds(r, layout), "compute and exposed tp / ep collectives alone")
              for r in computes.get(_compute_key(layout), []) if lighter(r)]
    bounds += [(r, _mean_compute(r), "compute alone") for r in computes.get(_flops_key(layout), []) if lighter(r)]
    bounds += [(r, r.step_seconds, "step time with less recomputation")
               for r in computes.get(("step", _without_checkpointing(layout)), []) if lighter(r)]
    return max(bounds, key=lambda bound: bound[1], default=None)


def _flops_key(layout: PlanLayout) -> tuple:
    """What decides the FLOPs per token of a rank (without a pipeline) or of a stage's micro-batches summed over the
    stages (under one): not ``ep`` (uniform routing), the sharding, the compression, nor, under a pipeline, ``pp``,
    the micro-batches or the schedule (the same blocks, split otherwise), but whether the schedule splits each
    backward (the V schedules: their input part recomputes a checkpointed forward again)."""
    return (layout.pp > 1, layout.tp, layout.sequence_parallel, layout.loss_parallel,
            layout.pp > 1 and layout.pp_schedule in V_SCHEDULES)


def _mean_compute(report: PlanReport) -> float:
    """The compute of a step on the average rank: without a pipeline every rank's; under one, every stage's forward
    and backward per micro-batch, summed, times the micro-batches over ``pp`` (the step is at least its busiest
    rank's, which is at least the average's). Per token, the same for every layout of the same :func:`_flops_key`."""
    if report.pipeline is None:
        return report.compute_seconds
    pipeline = report.pipeline
    per_microbatch = sum(s.forward_seconds + s.backward_seconds for s in pipeline.stages)
    return per_microbatch * pipeline.num_microbatches / pipeline.pp


def _least_seconds(report: PlanReport, layout: PlanLayout | None = None) -> float:
    """The step time of ``layout``, which differs from ``report``'s only in its sharding, is at least its compute
    and its tensor- and expert-parallel collectives of forward and backward (the same groups and bytes): without a
    pipeline, those exposed (they add to the compute, see :mod:`.estimate`); under one, the schedule replayed with
    its stages' compute alone (the same chunks in the same order: compute and bubble) and the least pipeline rank's
    collectives (exposed whole, :mod:`.pipeline_estimate`; the step's exchange is its most loaded rank's). Where
    FSDP2 computes in BF16 (``StepShape.fsdp_bf16``) in one of the two layouts only, their activations, and so the
    collectives' bytes, differ: the compute alone."""
    same_bytes = layout is None or not report.step.fsdp_bf16 or (layout.dp_shard > 1) == (report.layout.dp_shard > 1)
    if report.pipeline is not None:  # the replayed schedule without its transfers: the stages' compute and bubble
        compute = report.pipeline.makespan - report.pipeline.p2p_exposed_seconds
        parallel = report.pipeline.least_parallel_seconds
    else:
        compute = report.compute_seconds
        parallel = sum(t.exposed_seconds for t in report.traffic
                       if t.op in PARALLEL_OPS and set(t.dim.split("/")) <= {"tp", "ep"})
    return compute + (parallel if same_bytes else 0.0)


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
