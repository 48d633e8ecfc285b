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

Not planned: the warm-up steps (``warmup_steps``, fp32 as without compression: the plan is of a later step); the
hook's tile-sized work buffers (CPU) and per-chunk temporaries (accelerators); ``GradientCompression`` on FSDP2's
reduce-scatters (``data_parallel_shard_size > 1``) or a pipeline's ``dp`` exchange (``pipeline_parallel_size >
1``): refused by :func:`check_plannable`.
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
    if layout.pp > 1:
        raise ValueError(f"compression bits={layout.bits} with pipeline_parallel_size={layout.pp} is not planned: "
                         "the pipeline's compressed dp exchange (parallel/pipeline_exchange.py) is not modelled. Plan "
                         "it uncompressed (compression=none), or without a pipeline.")
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
    calls: list[CollectiveCall] = []
    held = codec = 0
    for bucket in buckets:
        num_bytes = sum(sizes[i] for i in bucket)
        values = [sizes[i] // FP32_BYTES for i in bucket]
        if (compression is None or sum(values) < compression.min_bucket_numel
                or all(ndims[i] <= 1 for i in bucket)):
            calls.append(CollectiveCall("all_reduce", group, num_bytes, "ddp"))
            continue
        plan = make_plan([str(i) for i in bucket], values, world_size, compression, META, {})
        if plan.single:
            calls.append(CollectiveCall("all_gather", group, _largest(plan.recv, plan.send), "ddp"))
        else:
            calls += [CollectiveCall("all_to_all", group, _largest(plan.send, plan.recv), "ddp"),
                      CollectiveCall("all_gather", group, _largest(plan.gathered, plan.send2), "ddp")]
        held += sum(_largest(t) for t in (plan.residual, plan.send, plan.recv, plan.send2, plan.gathered)
                    if t is not None)
        codec += CODEC_PASSES * world_size * plan.layout.chunk * FP32_BYTES
    return DDPExchange(tuple(calls), sum(sum(sizes[i] for i in b) for b in buckets), held, codec)


def _largest(*tensors: torch.Tensor) -> int:
    """Bytes of the largest of ``tensors`` (what ``CollectiveCounter`` counts of a collective)."""
    return max(t.numel() * t.element_size() for t in tensors)
