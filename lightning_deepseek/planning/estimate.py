"""The step time a plan predicts from what its fake step measured: compute from the counted FLOPs, communication
from the counted bytes per collective and the cluster's link figures (the strategy's ring formulas,
:mod:`lightning_deepseek.parallel.placement`), and which of it is exposed (the planner's docstring states the
assumptions; :data:`ASSUMPTIONS` prints them with every plan).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from lightning_deepseek.parallel.placement import LinkCost, all_reduce_seconds, all_to_all_seconds
from lightning_deepseek.planning.cluster import ClusterSpec
from lightning_deepseek.planning.counting import CollectiveCall
from lightning_deepseek.planning.ddp_exchange import CODEC_PASSES
from lightning_deepseek.planning.layout import PlanLayout, StepShape
from lightning_deepseek.planning.report import PlanReport, RankMemory, Traffic

FSDP_DIMS = ("dp_shard", "dp_replicate", "dp_shard_tp", "dp_replicate_tp", "edp_shard", "edp_replicate")
BACKWARD_SHARE = 2 / 3  # backward's share of forward + backward FLOPs, which DDP's all-reduce overlaps
ADAMW_BYTES_PER_ELEMENT = 28  # reads parameter, gradient, two moments (16 B); writes parameter and moments (12 B)
# torch.compile's gain on the compute: torchtitan's Llama 3.1 8B on 8 H100s, FSDP, eager 5,762 vs compiled 6,667
# tokens/s per GPU (benchmarks/llama3_h100_202412_torchtitan.md); the one pair it is calibrated on.
COMPILE_SPEEDUP = 6667 / 5762
ASSUMPTIONS = (
    "routed experts receive tokens evenly (uniform routing)",
    "compute at compute_efficiency x the dense peak of the step's dtype (fp8: the FP8 GEMMs at the fp8 peak, the "
    "rest at bf16's, the casts at the memory bandwidth; compiled: efficiency x COMPILE_SPEEDUP); AdamW memory-bound "
    "at the memory bandwidth",
    "tensor-parallel and all-to-all collectives exposed; DDP's all-reduce hidden behind backward but its last "
    "bucket; FSDP2's all-gathers, reduce-scatters and replica all-reduces hidden behind the compute (prefetched) but "
    "its first all-gather; shard reductions and ZeRO-1 broadcasts exposed",
    "ring all-reduce / all-gather / reduce-scatter / all-to-all, tree-latency broadcast; a group spanning nodes at "
    "the across-nodes link, one NIC per GPU",
    "memory: the step's tensors (what must fit; no CUDA context); the caching allocator's reserved memory estimated "
    "at ALLOCATOR_RESERVE x their later steps' peak (calibrated on torchtitan's Llama 3.1 8B FSDP rows)",
)
CODEC_ASSUMPTION = (f"gradient compression: a step past its warm-up; quantise and dequantise memory-bound "
                    f"({CODEC_PASSES} fp32 passes over each compressed bucket at the memory bandwidth) and exposed")


@dataclass(frozen=True)
class GroupInfo:
    """A process group of rank 0: its mesh dimension, size and link class."""

    dim: str
    size: int
    link: str


@dataclass(frozen=True)
class StepMeasurement:
    """What the fake step measured at rank 0; ``phase_peaks`` are the peaks of forward, backward and the optimizer
    step, ``param_sizes`` each replicated trainable parameter's bytes with the position of its block (``-1``: none)
    in the stepped copy (DDP's buckets are cut from them), ``param_ndims`` their dimensions likewise,
    ``buffer_bytes`` the buffers DDP broadcasts, ``fp8_flops`` the share of ``flops`` in FP8 GEMMs and
    ``cast_bytes`` the FP8 casts' traffic (``dtype="fp8"``), ``codec_bytes`` gradient compression's quantise and
    dequantise traffic (:mod:`.ddp_exchange`)."""

    memory: RankMemory
    flops: float
    calls: tuple[CollectiveCall, ...]
    groups: dict[str, GroupInfo]
    num_sharded_layers: int
    placement: str
    owned_state_elements: int
    phase_peaks: tuple[int, ...] = ()
    param_sizes: tuple[tuple[int, int], ...] = ()
    buffer_bytes: int = 0
    fp8_flops: float = 0.0
    cast_bytes: int = 0
    param_ndims: tuple[tuple[int, int], ...] = ()
    codec_bytes: int = 0


def is_fsdp_dim(dim: str) -> bool:
    """Whether a group label (``"dp/dp_shard/world"``) names one of FSDP2's views."""
    return any(part in FSDP_DIMS for part in dim.split("/"))


def collective_seconds(op: str, num_bytes: int, n: int, link: LinkCost) -> float:
    """One collective of ``num_bytes`` (the buffer at one rank) over ``n`` ranks."""
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return all_reduce_seconds(num_bytes, n, link)
    if op == "all_to_all":
        return all_to_all_seconds(num_bytes, n, link)
    if op == "broadcast":
        return num_bytes / link.bandwidth + math.ceil(math.log2(n)) * link.latency
    return (n - 1) / n * num_bytes / link.bandwidth + (n - 1) * link.latency  # all-gather, reduce-scatter


def compute_dtype(step: StepShape) -> str:
    """The dtype whose peak the step's FLOPs but the FP8 GEMMs run at (``"fp8"`` computes the rest in BF16)."""
    return "bf16" if step.dtype == "fp8" else step.dtype


def compute_seconds(flops: float, fp8_flops: float, cast_bytes: int, cluster: ClusterSpec, step: StepShape) -> float:
    """Seconds of ``flops`` of which ``fp8_flops`` in FP8 GEMMs (at the fp8 peak), at ``step.compute_efficiency``
    (times :data:`COMPILE_SPEEDUP` if compiled), and of ``cast_bytes`` of FP8 casts at the memory bandwidth."""
    efficiency = min(1.0, step.compute_efficiency * (COMPILE_SPEEDUP if step.compiled else 1.0))
    seconds = (flops - fp8_flops) / cluster.peak_flops(compute_dtype(step))
    if fp8_flops:
        seconds += fp8_flops / cluster.peak_flops("fp8")
    return seconds / efficiency + cast_bytes / (cluster.memory_bandwidth_gbs * 1e9)


def estimate(model: str, world_size: int, layout: PlanLayout, cluster: ClusterSpec, step: StepShape,
             measured: StepMeasurement, plan_seconds: float) -> PlanReport:
    """The report of a plan: traffic by mesh dimension and op, predicted step time, tokens/s per GPU and MFU."""
    peak = cluster.peak_flops(compute_dtype(step))
    compute = compute_seconds(measured.flops, measured.fp8_flops, measured.cast_bytes, cluster, step)
    optimizer = measured.owned_state_elements * ADAMW_BYTES_PER_ELEMENT / (cluster.memory_bandwidth_gbs * 1e9)
    codec = measured.codec_bytes / (cluster.memory_bandwidth_gbs * 1e9)  # compression's, exposed
    rows: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0, 0, 0.0, 0.0])
    ddp_seconds, last_bucket, fsdp_seconds, first_gather = 0.0, 0.0, 0.0, 0.0
    for call in measured.calls:
        info = measured.groups.get(call.group, GroupInfo("?", world_size, "inter"))
        seconds = collective_seconds(call.op, call.num_bytes, info.size, cluster.links[info.link])
        fsdp = call.phase == "forward_backward" and is_fsdp_dim(info.dim)
        exposed = 0.0 if call.phase == "ddp" or fsdp else seconds
        if call.phase == "ddp":
            ddp_seconds += seconds
            last_bucket = seconds if not last_bucket else last_bucket
        if fsdp:
            fsdp_seconds += seconds
            first_gather = seconds if not first_gather and call.op == "all_gather" else first_gather
        row = rows["ddp" if call.phase == "ddp" else info.dim, call.op, call.phase]
        row[0], row[1], row[2], row[3] = row[0] + 1, row[1] + call.num_bytes, row[2] + seconds, row[3] + exposed
    ddp_exposed = max(ddp_seconds - BACKWARD_SHARE * compute, last_bucket) if ddp_seconds else 0.0
    fsdp_exposed = max(fsdp_seconds - compute, first_gather) if fsdp_seconds else 0.0
    traffic = []
    for (dim, op, phase), (calls, num_bytes, seconds, exposed) in rows.items():
        group = next((g for g in measured.groups.values() if g.dim == dim), GroupInfo(dim, world_size, "inter"))
        if phase == "forward_backward" and is_fsdp_dim(dim):  # the exposed share, by each row's seconds
            exposed = fsdp_exposed * seconds / fsdp_seconds
        if dim == "ddp":
            world = next(g for g in measured.groups.values() if g.dim.endswith("world"))
            group, exposed = GroupInfo("ddp (world)", world.size, world.link), ddp_exposed * seconds / ddp_seconds
        traffic.append(Traffic(group.dim, op, group.size, group.link, int(calls), int(num_bytes), seconds, exposed))
    comm = sum(t.exposed_seconds for t in traffic)
    total = compute + optimizer + comm + codec
    return PlanReport(model=model, world_size=world_size, layout=layout, cluster=cluster.name, step=step,
                      placement=measured.placement, num_sharded_layers=measured.num_sharded_layers,
                      memory=measured.memory, memory_capacity=cluster.memory_bytes, traffic=tuple(traffic),
                      flops=measured.flops, compute_seconds=compute, optimizer_seconds=optimizer, comm_seconds=comm,
                      step_seconds=total, tokens_per_second_per_gpu=step.tokens / total,
                      mfu=measured.flops / total / peak, plan_seconds=plan_seconds, codec_seconds=codec,
                      assumptions=(*ASSUMPTIONS, f"compute_efficiency={step.compute_efficiency}",
                                   *([CODEC_ASSUMPTION] if codec else [])))
