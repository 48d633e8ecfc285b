"""Decisions by a cost model: the predicted step time of each parallel candidate, from measured figures.

A candidate is a tensor-parallel size ``tp``, an expert-parallel size ``ep`` (MoE models) and a gradient
compression ``bits`` (``None``: fp32, 8 or 4). Per optimizer step of ``m`` micro-batches, on one rank, where the
candidate's layout (unsharded, or sharded one way: ``tp > 1`` or ``ep > 1``) was timed whole at setup (the default
of the ``"auto"`` settings):

    step = copy + (m - 1) / m (compute + tp_comm + ep_comm)

- ``copy``: the median training step of one micro-batch of a copy of the model sharded as the candidate would shard
  it (not at all, or its real tensor- or expert-parallel plan on the real mesh and links), wrapped in DDP as the
  strategy wraps it, with the candidate's exchange (fp32, or the compression hook registered as training registers
  it): forward, backward with DDP's exchange beside it, the sharding's collectives and its reduction of the shards'
  gradients, a step of the user's optimizer. The copies of every layout and exchange take turns, training steps
  back to back (:func:`~lightning_deepseek.autotune.measure.measure_copy_steps`). Why whole steps, not the
  parts below summed: the parts overlap in training in ways a sum cannot see (DDP's exchange and the all-to-all's
  waits share the cores; the MoE's ep=4 was predicted 10-20 ms too slow in every quiet run of session 28), and
  the parts' ranking reached Spearman >= 0.8 in 12 of 17 model-runs against the grid, whole steps in every one
  checked (benchmarks/RESULTS.md, "Session 28", "Session 29"). Cost: one more copy of the model per layout and
  exchange, and a few seconds of setup.
- further micro-batches (``m > 1``) add their compute and sharding by the parts below.

Otherwise (no room for the copies, a candidate sharded both ways, figures given, or ``repeats=0``), the parts:

    step = compute + optimizer + tp_comm + ep_comm + exposed_dp + after_backward + quantize + chain

- ``compute = m (F + B)``: the measured forward and backward seconds of the user's own model on a real micro-batch
  (:mod:`.measure`), the same for every candidate. A tensor-parallel rank runs the sharded layers on its ``tp``
  group's ``tp`` micro-batches at ``1/tp`` of their width and the replicated rest on its own micro-batch: the same
  arithmetic as under DDP. An expert-parallel rank runs ``E/ep`` experts on the tokens its group routes to them:
  the same expected arithmetic.
- ``tp_comm`` and ``ep_comm``, **measured** (the default of the ``"auto"`` settings): what sharding adds to a
  micro-batch, ``m (P_s - P_r)``, where ``P_s`` is the forward + backward seconds of a copy of the model sharded as
  the candidate would shard it (the real plan, on the real mesh and links: its collectives, DTensor's per-operation
  dispatch, and the ranks competing for the cores, all included) and ``P_r`` those of a replicated copy, the two
  timed interleaved at setup (:func:`~lightning_deepseek.autotune.measure.measure_sharded`). The sharding overhead
  of ``(tp, ep)`` is taken as the sum of the ``(tp, 1)`` and ``(1, ep)`` ones. Counting bytes and latencies alone
  predicted tensor parallelism ~150 ms per step too fast on the 1 Gbit testbed (benchmarks/RESULTS.md, "Decisions
  by a cost model"): a small GPT's 16 activation collectives cost far more in dispatch and in small gloo messages
  on busy cores than their bytes over the link.
- ``tp_comm``, **formula** (no measurement: memory too tight for a copy, or figures given): placement's
  :func:`~lightning_deepseek.parallel.placement.estimate_comm_seconds` tensor-parallel term (four ring collectives
  of one rank's activations per sharded pair and micro-batch); not overlapped, each layer waits for its input.
- ``ep_comm``, **formula**: ``m L (4 all_to_all(T k d s, ep) + all_to_all(0, ep))`` for ``L`` MoE layers:
  dispatch and combine of the routed tokens (``T`` tokens, top-``k``, width ``d``, ``s`` bytes a value) forward
  and backward, and the exchange of the per-expert counts before each dispatch;
  ``all_to_all(M, n) = (n - 1)/n M/B + (n - 1) a``; the ``ep`` group is ``ep`` consecutive ranks
  (:func:`~lightning_deepseek.parallel.expert.build_expert_mesh`).
- ``optimizer``: the measured seconds of one step of the user's optimizer on the replicated copy, plus what the
  sharded copies' steps add or save (DTensor parameters, fewer local bytes); 0 when not measured.
- ``exposed_dp``: DDP all-reduces the replicated gradients (everything tensor and expert parallelism leave whole)
  over the world while backward runs, one all-reduce per bucket:
  ``R = all_reduce(r(bits) * replicated bytes, world) + (buckets - 1) 2 (world - 1) a`` with
  ``all_reduce(S, n) = 2 (n - 1)/n S/B + 2 (n - 1) a`` and ``r(bits)`` the compressed payload over the fp32 bytes
  (:func:`~lightning_deepseek.compression.quantize.payload_bytes`): compression shrinks the bytes, not the
  latency. What backward hides: at most ``B`` seconds, and never the last bucket:
  ``exposed_dp = busy + max(H - overlap * m B, H * last / replicated bytes)`` with ``H = R - busy`` and ``last``
  the bytes of the last bucket DDP fills (its first bucket holds 1 MiB, the next ones ``bucket_cap_mb``; the last
  holds what is left). Counting the whole exchange as the last bucket below 25 MB put the demo's fp32 wait at
  43 ms on the 1 Gbit testbed, where training waits 29 ms after the last gradient: its first 1 MiB is exchanged
  while backward runs (benchmarks/RESULTS.md, "Session 15").
  ``busy = min(R, all_reduce(r(bits) * replicated bytes, world) at the intra link's rate)`` where the ranks keep
  every core of the host busy (CPU training, ``busy_cores``), else 0: gloo's copies and sums then take cores from
  backward rather than running beside it (on loopback, all of the exchange); only the wait on a slower link
  hides. Without this term the loopback predictions missed the whole all-reduce of an 11 MB MoE model. Where the
  fp32 exchange was timed at setup (below) and the cores are busy, the fp32 ``exposed_dp`` is at least that time:
  the intra link's rate counts gloo's copies and sums 2-6x short on this project's machine, and the formula
  predicted the unsharded candidates 9-23 ms too fast on loopback (benchmarks/RESULTS.md, "Session 21"; recomputed
  over 13 recorded runs: Spearman >= 0.8 in 30 of 39 model-runs against 28, median error 7% against 13% on
  loopback, 6% against 8% on the testbed). Where the cores are free (a GPU's host, or CPU ranks with cores to spare)
  the timed exchange takes the wire's place in the formula: ``exposed_dp`` is at least ``max(T - overlap * m B,
  T * last / replicated bytes)`` with ``T`` the timed fp32 exchange. The links' rates had the wide FFN's 19.5 MB
  exchange at 7 ms where it was timed at 21 ms, and its unsharded candidates 8-10 ms too fast, on 2 ranks with 8
  free cores (benchmarks/RESULTS.md, "Session 25").
- ``after_backward``: the tensor-parallel shards' all-reduce over ``dp`` and the experts' over ``world/ep`` run
  once per step after backward (the strategy's reduction), not overlapped; all groups at once, so those leaving one
  island share its link (:func:`~lightning_deepseek.parallel.placement.concurrent_link`). Counting one group alone
  predicted the MoE's ep=2 23-50 ms too fast on the 1 Gbit testbed, its two expert replica pairs crossing the link
  together (benchmarks/RESULTS.md, "Session 15").
- compression, **measured** (the default of the ``"auto"`` settings): the fp32 all-reduce DDP runs and the hook's own
  compressed exchange (quantize with the residual, the collectives, phase 2, the write) of the candidate's
  replicated gradient bytes, each with DDP's copies of the gradients into its bucket and back, timed at setup on the
  world's process group, all ranks at once, interleaved
  (:func:`~lightning_deepseek.autotune.measure.measure_exchange`): ``T32`` and ``Tc``. Then
  ``exposed_dp = max(E + Tc - T32, E Tc / T32)`` with ``E`` the fp32 candidate's ``exposed_dp`` (above), and no
  ``quantize`` or ``chain`` part (they are in ``Tc``): where the fp32 exchange is exposed the step moves by the measured
  difference; where backward hides it, compression saves at most its share of what is exposed, while an exchange that
  costs more than fp32 adds all of the extra (CPU work on the cores backward needs). Why: the kernels timed alone on one
  rank predicted compression ~100 ms too fast on the 1 Gbit testbed (4 ranks on 2 cores): for the wide FFN's 19.5 MB the
  hook spent 50-107 ms of CPU per exchange where the kernels alone took 19-41 ms (the ranks share the cores and gloo's
  threads run beside them), so tp=1 int4 was predicted 176 ms faster than fp32 where training measured 72-91 ms; the
  measured exchanges (fp32 263 ms, int4 203 ms, slowest rank) give ~55 ms (benchmarks/RESULTS.md, "Compression predicted
  from the exchange measured at setup"). Unsharded or under one sharding (``tp > 1`` or ``ep > 1``), where the
  layout's copies were timed, the compressed copy's whole step stands in for all of this (``copy``, above). Why
  compression needs it: the hook's quantize and collectives run beside backward and tensor or expert parallelism's
  collectives, on oversubscribed cores where a delay on one rank stalls its partners, which the exchange timed
  alone does not see: on the 1 Gbit testbed, where tp=2 and ep=2 leave DDP 1.3-2.4 MiB, the exchange alone saw int8
  save 7-21 ms while training measured it 7-18 ms slower, and single aligned passes (this measurement until session
  14) saw it save 6-16 ms (benchmarks/RESULTS.md, "Session 13", "Session 15"); unsharded, training measured
  compression 8-56 ms a step slower against fp32 than the exchange timed alone predicted, in all 17 compressed
  candidates of the 1 Gbit runs of sessions 25-27 (at 10 Gbit -4 to +16 ms; RESULTS.md, "Session 28").
- ``quantize = replicated bytes * (q + n dq)`` (the fallback without the measurement) with ``q``/``dq`` the measured
  seconds per fp32 byte of the quantize / dequantize kernels on this machine, ``n`` the payloads dequantized (DDP's
  ranks, the world, with the single all-gather exchange; 2 with the two-phase one); it runs in DDP's hook on
  backward's thread.
- ``chain = c (world - 1) a`` (compressed, fallback only), ``c`` the exchange's collectives (1: the single
  all-gather, 2: the two-phase all-to-all then all-gather): the compressed exchange of the last bucket is a chain
  the fp32 all-reduce does not have (quantize, collective, phase 2 on a callback thread, collective, write), each
  collective waiting for the previous step, so it pays its link latencies again after the ring's. Bytes alone
  predicted tp=2 and ep=2 with compression 15-20 ms faster than fp32 on the 1 Gbit testbed, where the replicated
  gradients are 1.4-2.6 MB; measured there, the time from the last gradient to the end of backward grew by 19-24 ms
  with int8 instead (``benchmarks/compression/bench_hybrid.py``; RESULTS.md, "Decisions by a cost model",
  06:00-06:12 UTC). On loopback (``a`` ~30 us) the term is negligible.

Memory per rank: ``params + grads + state_factor * params`` (optimizer states; Adam: 2) ``+ residual`` (fp32 error
feedback of the replicated gradients when compressed) ``+ activations`` (the bytes autograd saves for backward,
measured) must stay under ``headroom * device memory``; a candidate that does not fit is not allowed, and when none
fits :class:`NoCandidateFitsError` names the setting and the fixes.

Choice: the simplest fitting candidate (smallest ``tp``, ``ep``, no compression, in that order) that the fastest
prediction does not beat by ``margin`` or more: plain DDP's layout unless something is predicted clearly faster, and
then no compression on top of a sharding (or less sharding) unless that pays clearly too. Sharding and compressing
change numerics and add code paths, so they must pay clearly. The model is deliberately simple (contention between
ranks is measured, not modelled, except for ``busy``; no kernel efficiency change with width);
``benchmarks/autotune/bench_cost_model.py`` checks its ranking against measurements.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from lightning_deepseek.compression.quantize import payload_bytes
from lightning_deepseek.parallel.placement import (
    CommVolume,
    LinkCost,
    all_reduce_seconds,
    all_to_all_seconds,
    candidate_mesh,
    choose_placement,
    concurrent_link,
    estimate_comm_seconds,
    group_link,
)
from lightning_deepseek.parallel.topology import Topology

DEFAULT_BLOCK_SIZE = {8: 128, 4: 64}
_GIB = 2**30


class NoCandidateFitsError(ValueError):
    """No candidate's parameters, gradients, optimizer states and activations fit the device memory."""


@dataclass(frozen=True)
class Candidate:
    """One configuration: tensor-parallel size, expert-parallel size, compression bits (None: fp32)."""

    tp: int = 1
    ep: int = 1
    bits: int | None = None

    @property
    def label(self) -> str:
        return f"tp={self.tp} ep={self.ep} {'fp32' if self.bits is None else f'int{self.bits}'}"

    @property
    def layout(self) -> tuple[str, int] | None:
        """The one way it is sharded, as the copies' measurements key it: ``("tp", n)`` (``("tp", 1)``: not
        sharded) or ``("ep", n)``; None when sharded both ways."""
        return ("tp", self.tp) if self.ep == 1 else ("ep", self.ep) if self.tp == 1 else None

    @property
    def simplicity(self) -> tuple[int, int, int]:
        """Sort key: plain DDP first, then the least sharding, then the least compression."""
        return (self.tp, self.ep, 0 if self.bits is None else 16 - self.bits)


@dataclass(frozen=True)
class ComputeProfile:
    """Measured compute of one micro-batch on one rank, and what autograd keeps for backward.

    Args:
        forward_seconds: forward (with the loss) of one micro-batch.
        backward_seconds: its backward.
        activation_bytes: bytes of the tensors saved for backward.
        routed_bytes: bytes one rank dispatches to the experts per micro-batch and MoE layer, ``T k d s``.
        source: how it was measured, for the table.
        optimizer_seconds: one step of the optimizer on the replicated model (0: not measured).
        sharded: ``{("tp", size) or ("ep", size): (pass, optimizer)}``: the seconds a copy sharded that way adds to
            one micro-batch's forward + backward (its collectives included) and to an optimizer step, over a
            replicated copy timed interleaved with it (may be negative: noise, or less work). A size missing here
            is predicted by the formulas.
        copy_steps: ``{(kind, size, bits): seconds}`` (kind ``"tp"`` or ``"ep"``; ``("tp", 1)``: not sharded;
            ``bits`` None: the fp32 exchange): the median training step of one micro-batch of a copy sharded that
            way, wrapped in DDP as the strategy wraps it, with that exchange
            (:func:`~lightning_deepseek.autotune.measure.measure_copy_steps`). Where present, a candidate sharded
            that way (and only that way) is predicted from it.
    """

    forward_seconds: float
    backward_seconds: float
    activation_bytes: int = 0
    routed_bytes: int = 0
    source: str = "given"
    optimizer_seconds: float = 0.0
    sharded: Mapping[tuple[str, int], tuple[float, float]] = field(default_factory=dict)
    copy_steps: Mapping[tuple[str, int, int | None], float] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelFacts:
    """What the model holds and exchanges, per tensor-parallel size.

    Args:
        param_bytes: bytes of all parameters (one full replica).
        volumes: for each allowed ``tp``, placement's :class:`CommVolume` (``tp=1``: nothing sharded).
        expert_bytes: bytes of the routed-expert parameters (part of ``replicated_grad_bytes`` at ``ep=1``).
        num_moe_layers: MoE layers (each dispatches and combines).
        state_factor: optimizer state bytes per parameter byte (Adam, AdamW: 2).
    """

    param_bytes: int
    volumes: Mapping[int, CommVolume]
    expert_bytes: int = 0
    num_moe_layers: int = 0
    state_factor: float = 2.0


@dataclass(frozen=True)
class Machine:
    """The measured machine: topology, links, memory, compression kernels.

    Args:
        topology: islands of ranks.
        links: ``{"intra": LinkCost, "inter": LinkCost}`` (probed or configured).
        device_memory_bytes: memory one rank may use.
        quantize_seconds_per_byte: ``{bits: (q, dq)}`` seconds per fp32 byte of quantize and dequantize.
        bucket_bytes: DDP's bucket size (the last bucket is never hidden behind backward).
        first_bucket_bytes: DDP's first bucket (torch's ``_DEFAULT_FIRST_BUCKET_BYTES``).
        bucket_view: DDP's ``gradient_as_bucket_view``: the gradients are the buckets' storage, not copied into
            them and back (the exchange timed at setup leaves the copies out then).
        overlap: fraction of backward that can hide DDP's all-reduce (1: all of it).
        busy_cores: the ranks of a host keep all its cores busy (CPU training, a thread per core), so moving the
            gradient bytes through the host (``all_reduce`` at the intra link's rate) competes with backward
            instead of hiding behind it; only waiting on a slower link still can.
        headroom: fraction of ``device_memory_bytes`` a candidate may plan for.
        single_exchange_max_world: compression's one-all-gather exchange up to this many data-parallel ranks.
        placement: placement policy for the rank grid of each ``tp``.
        exchange_seconds: ``{(fp32 bytes, bits or None): seconds}`` of one gradient exchange of that many bytes over
            the world, measured on all ranks at once (:func:`~lightning_deepseek.autotune.measure.measure_exchange`):
            where a candidate's replicated bytes are here with its ``bits`` and with ``None``, its compression is
            predicted from them instead of from ``quantize_seconds_per_byte`` and the latencies.
    """

    topology: Topology
    links: Mapping[str, LinkCost]
    device_memory_bytes: int
    quantize_seconds_per_byte: Mapping[int, tuple[float, float]] = field(default_factory=dict)
    bucket_bytes: int = 25 * 2**20
    first_bucket_bytes: int = 2**20
    bucket_view: bool = False
    overlap: float = 1.0
    busy_cores: bool = False
    headroom: float = 0.9
    single_exchange_max_world: int = 2
    placement: str = "auto"
    exchange_seconds: Mapping[tuple[int, int | None], float] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.topology.world_size


@dataclass(frozen=True)
class Prediction:
    """One candidate's predicted step seconds, by part, and its memory per rank; ``by_parts``: where its layout's
    copy predicted it, what the parts' formula alone would have (``benchmarks/autotune`` compares the two)."""

    candidate: Candidate
    parts: Mapping[str, float]
    memory_bytes: int
    fits: bool
    by_parts: float | None = None

    @property
    def seconds(self) -> float:
        return sum(self.parts.values())

    def row(self) -> str:
        parts = " ".join(f"{k} {v * 1e3:.1f}" for k, v in self.parts.items())
        memory = f"{self.memory_bytes / _GIB:.2f} GiB" + ("" if self.fits else " (does not fit)")
        return f"{self.candidate.label:<18} {self.seconds * 1e3:>9.1f} ms  [{parts}]  {memory}"


@dataclass(frozen=True)
class Decision:
    """The chosen candidate, every prediction (fastest first), why, and the compute figures it was decided from."""

    chosen: Candidate
    predictions: tuple[Prediction, ...]
    reason: str
    compute: ComputeProfile | None = None
    tokens: int | None = None  # rows per rank and micro-batch the volumes were computed for (placement reuses it)
    exchange_seconds: Mapping[tuple[int, int | None], float] = field(default_factory=dict)  # Machine's, if measured

    def prediction(self, candidate: Candidate) -> Prediction:
        return next(p for p in self.predictions if p.candidate == candidate)

    def table(self) -> str:
        """The lines printed at setup: every candidate's predicted step time, parts in ms, memory; the choice."""
        lines = ["candidate          predicted step  [parts, ms]  memory per rank"]
        lines += [p.row() + ("  <- chosen" if p.candidate == self.chosen else "") for p in self.predictions]
        lines.append(f"choice: {self.chosen.label}: {self.reason}")
        return "\n".join(lines)

    def summary(self) -> dict[str, object]:
        """Entries for the run summary."""
        return {"autotune_choice": self.chosen.label,
                "autotune_predicted_ms": {p.candidate.label: round(p.seconds * 1e3, 2) for p in self.predictions},
                "autotune_reason": self.reason}


def compression_ratio(bits: int | None, block_size: int | None = None) -> float:
    """Bytes on the wire over fp32 bytes for ``bits`` (1 for fp32)."""
    if bits is None:
        return 1.0
    block = block_size or DEFAULT_BLOCK_SIZE[bits]
    return payload_bytes(block * 1024, bits, block) / (4 * block * 1024)


def memory_bytes(candidate: Candidate, facts: ModelFacts, compute: ComputeProfile) -> int:
    """Parameter, gradient, optimizer-state, residual and activation bytes of one rank under ``candidate``."""
    volume = facts.volumes[candidate.tp]
    expert_local = facts.expert_bytes // candidate.ep
    params = volume.replicated_grad_bytes - facts.expert_bytes + expert_local + volume.sharded_grad_bytes
    residual = (volume.replicated_grad_bytes - facts.expert_bytes) if candidate.bits is not None else 0
    return int(params * (2 + facts.state_factor) + residual + compute.activation_bytes)


def _ddp_volume(candidate: Candidate, facts: ModelFacts) -> CommVolume:
    """``facts.volumes[tp]`` with the expert gradients in DDP's all-reduce only at ``ep=1``."""
    volume = facts.volumes[candidate.tp]
    expert_in_ddp = facts.expert_bytes if candidate.ep == 1 else 0
    return CommVolume(volume.activation_bytes, volume.num_colwise, volume.num_rowwise, volume.sharded_grad_bytes,
                      volume.replicated_grad_bytes - facts.expert_bytes + expert_in_ddp, volume.micro_batches)


def exchange_bytes(candidate: Candidate, facts: ModelFacts) -> int:
    """The fp32 bytes of the gradients DDP exchanges under ``candidate`` (what tensor and expert parallelism leave
    replicated): the sizes :attr:`Machine.exchange_seconds` is measured at."""
    return _ddp_volume(candidate, facts).replicated_grad_bytes


def candidate_grid(candidate: Candidate, facts: ModelFacts, machine: Machine) -> list[list[int]]:
    """The ``dp x tp`` rank grid the strategy would build for ``candidate`` (its placement policy, or the
    cheaper one by placement's estimate under ``"auto"``)."""
    dp = machine.world_size // candidate.tp
    if machine.placement == "auto":
        return choose_placement("auto", machine.topology, dp, candidate.tp, _ddp_volume(candidate, facts),
                                dict(machine.links))[1]
    return candidate_mesh(machine.placement, machine.topology, dp, candidate.tp)


def last_bucket_bytes(num_bytes: int, machine: Machine) -> int:
    """The bytes of the last of the buckets DDP fills with ``num_bytes`` of gradients: the first holds
    ``first_bucket_bytes``, each next one ``bucket_bytes``, the last what is left."""
    if num_bytes <= machine.first_bucket_bytes:
        return num_bytes
    return (num_bytes - machine.first_bucket_bytes - 1) % machine.bucket_bytes + 1


def predict(candidate: Candidate, facts: ModelFacts, compute: ComputeProfile, machine: Machine) -> Prediction:
    """The predicted step seconds of ``candidate`` (by part) and whether it fits (see the module docstring)."""
    world, topology, links = machine.world_size, machine.topology, dict(machine.links)
    ddp_volume = _ddp_volume(candidate, facts)
    micro, ddp_bytes = ddp_volume.micro_batches, ddp_volume.replicated_grad_bytes
    mesh = candidate_grid(candidate, facts, machine)
    comm = estimate_comm_seconds(mesh, topology, ddp_volume, links)
    tp_measured = compute.sharded.get(("tp", candidate.tp)) if candidate.tp > 1 else (0.0, 0.0)
    ep_measured = compute.sharded.get(("ep", candidate.ep)) if candidate.ep > 1 else (0.0, 0.0)
    backward = micro * compute.backward_seconds
    world_link = group_link(topology, list(range(world)), links)
    num_buckets = 1 + -(-max(0, ddp_bytes - machine.first_bucket_bytes) // machine.bucket_bytes)
    last_bucket = last_bucket_bytes(ddp_bytes, machine) / max(ddp_bytes, 1)

    def exposed(bits: int | None) -> float:
        """The formula's exposed seconds of DDP's exchange of the replicated gradients compressed to ``bits``."""
        wire_bytes = int(ddp_bytes * compression_ratio(bits))
        wire = (all_reduce_seconds(wire_bytes, world, world_link)
                + max(0, num_buckets - 1) * all_reduce_seconds(0, world, world_link))
        busy = min(wire, all_reduce_seconds(wire_bytes, world, links["intra"])) if machine.busy_cores else 0.0
        hideable = wire - busy
        return busy + max(hideable - machine.overlap * backward, hideable * last_bucket) if ddp_bytes else 0.0

    fp32_exposed = exposed(None)
    timed_fp32 = machine.exchange_seconds.get((ddp_bytes, None))
    if timed_fp32 is not None and machine.busy_cores:  # gloo's exchange takes the cores backward needs: not hidden
        fp32_exposed = max(fp32_exposed, timed_fp32)
    elif timed_fp32 is not None:  # free cores: backward hides the exchange as timed, except its last bucket
        fp32_exposed = max(fp32_exposed, timed_fp32 - machine.overlap * backward, timed_fp32 * last_bucket)

    copy_step = compute.copy_steps.get((*candidate.layout, candidate.bits)) if candidate.layout is not None else None
    measured_exchange = [machine.exchange_seconds.get((ddp_bytes, b)) for b in (None, candidate.bits)]
    if candidate.bits is None or None in measured_exchange:
        measured_exchange = None
    parts = {
        "compute": micro * (compute.forward_seconds + compute.backward_seconds),
        "optimizer": compute.optimizer_seconds + sum(m[1] for m in (tp_measured, ep_measured) if m is not None),
        "tp": comm["tp"] if tp_measured is None else micro * tp_measured[0],
        "ep": 0.0 if ep_measured is None else micro * ep_measured[0],
        "dp": fp32_exposed,  # compressed: moved by the measured exchange below, or the formula's where not timed
        "after": comm["sharded"],
        "quantize": 0.0,
        "chain": 0.0,
    }
    if candidate.ep > 1:
        if ep_measured is None:
            ep_groups = [list(range(r, r + candidate.ep)) for r in range(0, world, candidate.ep)]
            ep_link = concurrent_link(topology, ep_groups, links)
            parts["ep"] = micro * facts.num_moe_layers * (
                4 * all_to_all_seconds(compute.routed_bytes, candidate.ep, ep_link)
                + all_to_all_seconds(0, candidate.ep, ep_link))
        replicas = [list(range(r, world, candidate.ep)) for r in range(candidate.ep)]  # the edp groups, at once
        parts["after"] += all_reduce_seconds(facts.expert_bytes // candidate.ep, world // candidate.ep,
                                             concurrent_link(topology, replicas, links))
    if measured_exchange is not None and ddp_bytes:
        fp32, compressed = measured_exchange  # the same bytes, both exchanges measured on the real group
        parts["dp"] = max(parts["dp"] + compressed - fp32, parts["dp"] * compressed / max(fp32, 1e-9))
    elif candidate.bits is not None and ddp_bytes:
        parts["dp"] = exposed(candidate.bits)
        q, dq = machine.quantize_seconds_per_byte[candidate.bits]
        single = world <= machine.single_exchange_max_world  # the hook runs on DDP's group: the world, not dp
        parts["quantize"] = ddp_bytes * (q + (world if single else 2) * dq)
        parts["chain"] = (1 if single else 2) * (world - 1) * world_link.latency
    by_parts = None
    if copy_step is not None:  # the layout's whole step, timed as training runs it; the parts add micro-batches
        by_parts = sum(parts.values())
        further = (micro - 1) / micro * (parts["compute"] + parts["tp"] + parts["ep"])
        parts = {"copy": copy_step, **({"micro-batches": further} if micro > 1 else {})}
    memory = memory_bytes(candidate, facts, compute)
    return Prediction(candidate, parts, memory, memory <= machine.headroom * machine.device_memory_bytes, by_parts)


def candidates(world_size: int, tp_sizes: Iterable[int] = (1,), ep_sizes: Iterable[int] = (1,),
               bits: Iterable[int | None] = (None,)) -> list[Candidate]:
    """Every combination whose sizes divide ``world_size``; with one data-parallel rank there is no exchange to
    compress, so such a ``tp`` comes uncompressed only."""
    out: list[Candidate] = []
    for tp in tp_sizes:
        for ep in ep_sizes:
            for b in bits:
                candidate = Candidate(tp, ep, b if world_size // max(tp, 1) > 1 else None)
                if not (world_size % tp or world_size % ep or candidate in out):
                    out.append(candidate)
    return out


def decide(options: Iterable[Candidate], facts: ModelFacts, compute: ComputeProfile, machine: Machine,
           setting: str = "tensor_parallel_size='auto'", margin: float = 0.05) -> Decision:
    """Predict every candidate and choose (see the module docstring).

    Args:
        options: the candidates (their ``tp`` sizes must be keys of ``facts.volumes``).
        setting: the user's setting that asked for the decision, named in errors.
        margin: a candidate other than the simplest fitting one must be predicted this much faster.

    Raises:
        NoCandidateFitsError: no candidate fits ``machine.device_memory_bytes``.
    """
    predictions = sorted((predict(c, facts, compute, machine) for c in options), key=lambda p: p.seconds)
    if not predictions:
        raise ValueError(f"{setting}: there is no candidate to decide between (world size {machine.world_size}).")
    fitting = [p for p in predictions if p.fits]
    if not fitting:
        smallest = min(predictions, key=lambda p: p.memory_bytes)
        budget = machine.headroom * machine.device_memory_bytes
        raise NoCandidateFitsError(
            f"{setting}: no candidate fits the device memory: the smallest, {smallest.candidate.label}, needs "
            f"{smallest.memory_bytes / _GIB:.2f} GiB per rank (parameters, gradients, optimizer states x"
            f"{facts.state_factor:g}, activations {compute.activation_bytes / _GIB:.2f} GiB) against "
            f"{budget / _GIB:.2f} GiB usable. Train on more devices per node (a larger tensor_parallel_size), "
            "use a smaller micro-batch, or shard the optimizer states (shard_optimizer_states=True).")
    best = fitting[0]
    simplest = min(fitting, key=lambda p: p.candidate.simplicity)
    needed = "" if simplest.candidate == min(predictions, key=lambda p: p.candidate.simplicity).candidate else (
        f"memory requires it ({min(predictions, key=lambda p: p.candidate.simplicity).candidate.label} does not fit)")
    if best.candidate != simplest.candidate and best.seconds < (1 - margin) * simplest.seconds:
        # the simplest of those the fastest does not beat by the margin either: sharding and compression each
        # must pay on their own (tp=2 + int8 predicted 1% faster than tp=2 fp32 measured 15-25% slower)
        near = min((p for p in fitting if (1 - margin) * p.seconds <= best.seconds),
                   key=lambda p: p.candidate.simplicity)
        reason = f"predicted {simplest.seconds / near.seconds:.2f}x faster than {simplest.candidate.label}"
        if near.candidate != best.candidate:
            reason += f" (and within {margin:.0%} of the fastest, {best.candidate.label})"
        chosen = near.candidate
    else:
        chosen = simplest.candidate
        reason = needed or (f"nothing is predicted to beat it by {margin:.0%} or more"
                            if len(fitting) > 1 else "the only candidate")
    if chosen != simplest.candidate and needed:
        reason = f"{needed}; {reason}"
    return Decision(chosen, tuple(predictions), reason, compute, exchange_seconds=dict(machine.exchange_seconds))
