"""DDP's gradient exchange in a plan: its buckets (DDP's rule) and, for each, the collectives that run, DDP's fp32
all-reduce or, under ``GradientCompression``, what its comm hook (:mod:`lightning_deepseek.compression.hook`) issues.

DDP's buckets: the replicated trainable parameters in reverse order, a first bucket of 1 MiB, then
``bucket_cap_mb``. The fake step does not run them (DDP's reducer calls the process group from C++).

Compressed (``PlanLayout.bits``), per bucket of N values over the W ranks of DDP's group, by the hook's own rules
and code: a bucket of fewer than ``min_bucket_numel`` values, or of 1-D parameters only, stays one fp32 all-reduce
(``compression_hook``); any other bucket's ``BucketPlan``, made by the hook's ``make_plan`` on the meta device (no
memory), holds the tensors its collectives take: up to ``single_exchange_max_world`` ranks one all-gather of every
rank's quantized bucket, above it an all-to-all of the quantized chunks and an all-gather of the re-quantized owned
chunks (on the hook's second communicator over the same ranks). Each is counted as ``CollectiveCounter`` counts a
collective (its largest tensor). Memory: each compressed bucket's plan, its fp32 error-feedback residual and its
four message buffers, held from the first compressed step on. Compute: quantise and dequantise are memory-bound,
``CODEC_PASSES`` fp32 passes over the padded bucket (the hook's count of its passes reaching DRAM) at the memory
bandwidth, all exposed (an upper bound: on CPU the hook's phase 1 overlaps the rest of backward).

A pipeline's exchange over each stage's ``dp`` ranks (:func:`stage_exchange`, after the schedule;
:mod:`lightning_deepseek.parallel.pipeline_exchange`) is the same hook's exchange on one bucket holding the stage's
matrices in model order, and one fp32 all-reduce of the rest; uncompressed, the pipeline planner counts the
strategy's own all-reduce.

Not planned: the warm-up steps (``warmup_steps``, fp32 as without compression: the plan is of a later step); the
hook's tile-sized work buffers (CPU) and per-chunk temporaries (accelerators); ``GradientCompression`` on FSDP2's
reduce-scatters (``data_parallel_shard_size > 1``): refused by :func:`check_plannable`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_deepseek.compression.config import CompressionConfig
from lightning_deepseek.compression.plan import make_plan
from lightning_deepseek.planning.counting import CollectiveCall
from lightning_deepseek.planning.layout import PlanLayout

FIRST_BUCKET_BYTES = 1 << 20  # DDP's first bucket (torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES)
FP32_BYTES = 4  # the plan's parameters and gradients are FP32
CODEC_PASSES = 5  # fp32 passes over a compressed bucket reaching memory (compression/hook.py's docstring)
META = torch.device("meta")


@dataclass(frozen=True)
class DDPExchange:
    """One step's DDP exchange at one rank: its collectives (phase ``"ddp"``), the bytes of DDP's buckets, the
    bytes the compression hook holds (residuals and message buffers) and the bytes its quantise and dequantise
    passes move."""

    calls: tuple[CollectiveCall, ...]
    bucket_bytes: int
    compression_bytes: int = 0
    codec_bytes: int = 0


def check_plannable(layout: PlanLayout) -> None:
    """Raise where ``layout`` compresses an exchange the planner does not model (see the module docstring)."""
    if layout.bits is None:
        return
    if layout.dp_shard > 1:
        raise ValueError(f"compression bits={layout.bits} with data_parallel_shard_size={layout.dp_shard} is not "
                         "planned: GradientCompression then compresses FSDP2's reduce-scatters "
                         "(compression/reduce_scatter.py), which the planner does not model. Plan it uncompressed "
                         "(compression=none), or with data_parallel_shard_size=1.")


def ddp_buckets(sizes: list[int], bucket_cap_bytes: int) -> list[list[int]]:
    """The indices into ``sizes`` (bytes of each replicated trainable parameter, in the model's order) of each DDP
    bucket (DDP's rule: reverse order, 1 MiB first)."""
    buckets: list[list[int]] = []
    current: list[int] = []
    filled, cap = 0, FIRST_BUCKET_BYTES
    for index in reversed(range(len(sizes))):
        current.append(index)
        filled += sizes[index]
        if filled >= cap:
            buckets.append(current)
            current, filled, cap = [], 0, bucket_cap_bytes
    return buckets + ([current] if current else [])


def ddp_exchange(sizes: list[int], ndims: list[int], world_size: int, bucket_cap_bytes: int, group: str,
                 compression: CompressionConfig | None) -> DDPExchange:
    """The exchange of DDP's buckets over ``group`` (``world_size`` ranks; none with one) of the parameters of
    ``sizes`` bytes and ``ndims`` dimensions: fp32 all-reduces, or ``compression``'s hook's collectives."""
    buckets = ddp_buckets(sizes, bucket_cap_bytes) if world_size > 1 else []
    exchanges = [_bucket([sizes[i] for i in bucket], world_size, group,
                         None if all(ndims[i] <= 1 for i in bucket) else compression, "ddp")  # the hook's rule
                 for bucket in buckets]
    calls = tuple(c for e in exchanges for c in e.calls)
    return DDPExchange(calls, sum(sum(sizes[i] for i in b) for b in buckets),
                       sum(e.compression_bytes for e in exchanges), sum(e.codec_bytes for e in exchanges))


def stage_exchange(sizes: list[int], ndims: list[int], world_size: int, group: str,
                   compression: CompressionConfig) -> DDPExchange:
    """A pipeline stage's compressed exchange over ``group`` (its ``world_size`` ``dp`` ranks) of the parameters of
    ``sizes`` bytes and ``ndims`` dimensions in model order: the matrices as one bucket through the hook's exchange
    (fp32 where fewer than ``min_bucket_numel`` values), then one fp32 all-reduce of the rest (phase
    ``"gradients"``); ``bucket_bytes`` is 0 (no DDP)."""
    matrices = [size for size, ndim in zip(sizes, ndims) if ndim > 1]
    if sum(matrices) // FP32_BYTES < compression.min_bucket_numel:
        matrices = []
    rest = sum(sizes) - sum(matrices)
    exchanges = [_bucket(matrices, world_size, group, compression, "gradients")] if matrices else []
    exchanges += [_bucket([rest], world_size, group, None, "gradients")] if rest else []
    return DDPExchange(tuple(c for e in exchanges for c in e.calls), 0, sum(e.compression_bytes for e in exchanges),
                       sum(e.codec_bytes for e in exchanges))


def _bucket(sizes: list[int], world_size: int, group: str, compression: CompressionConfig | None,
            phase: str) -> DDPExchange:
    """One bucket of parameters of ``sizes`` bytes: an fp32 all-reduce (no ``compression``, or fewer than its
    ``min_bucket_numel`` values), or the hook's collectives, the buffers its plan holds and its codec's bytes."""
    values = [size // FP32_BYTES for size in sizes]
    if compression is None or sum(values) < compression.min_bucket_numel:
        return DDPExchange((CollectiveCall("all_reduce", group, sum(sizes), phase),), 0)
    plan = make_plan([str(i) for i in range(len(sizes))], values, world_size, compression, META, {})
    if plan.single:
        calls = (CollectiveCall("all_gather", group, _largest(plan.recv, plan.send), phase),)
    else:
        calls = (CollectiveCall("all_to_all", group, _largest(plan.send, plan.recv), phase),
                 CollectiveCall("all_gather", group, _largest(plan.gathered, plan.send2), phase))
    held = sum(_largest(t) for t in (plan.residual, plan.send, plan.recv, plan.send2, plan.gathered) if t is not None)
    return DDPExchange(calls, 0, held, CODEC_PASSES * world_size * plan.layout.chunk * FP32_BYTES)


def _largest(*tensors: torch.Tensor) -> int:
    """Bytes of the largest of ``tensors`` (what ``CollectiveCounter`` counts of a collective)."""
    return max(t.numel() * t.element_size() for t in tensors)
