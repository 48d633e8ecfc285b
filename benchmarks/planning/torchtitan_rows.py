"""Plans of torchtitan's published Llama 3.1 H100 rows (benchmarks/llama3_h100_202412_torchtitan.md in
pytorch/torchtitan) in the strategy's nearest layout, printed as JSON lines for REPORT.md.

Each row is planned at its world size, local batch and sequence length (8192), with the row's activation
checkpointing, on the h100 preset; FSDP2 units under StagedPrecision's BF16 stage policy (BF16 gathers, FP32
reduce: ``StepShape.fsdp_bf16``, as torchtitan's FSDP mixed precision), or plain autocast with ``--no-fsdp-bf16``.
What torchtitan ran: BF16 autocast, ``torch.compile`` as ``StepShape.compiled`` (the efficiency ratio calibrated on
the 8B FSDP8 eager/compiled pair), Float8 as ``dtype="fp8"`` (StagedPrecision's FP8 stage; its FSDP2 gathers stay
BF16, torchtitan's 405B config gathers FP8). torchtitan's FSDP32 x TP8 holds 1/256 of every parameter per rank; the
strategy's tensor parallelism without a pipeline shards the feed-forward layers only, so its nearest is tp=8 with
parameters sharded over all 256 ranks, and each rank its own 2 of the tp group's 16 sequences. 405B (FSDP8 x TP8 x
PP8): tp=8 x pp=8 with each stage's parameters FSDP2-sharded over its 8 dp ranks (torchtitan's layout over tp: attention
heads, feed-forward, the sequence (sequence_parallel), the embedding, head and loss (loss_parallel)), local batch 32
as torchtitan's default 8 micro-batches (its ``pipeline_parallel_microbatches`` unset: the pp degree) of 4 sequences;
``--microbatches-32``: 32 of one. Not planned: async TP. Calibration targets, not tuned to: compute_efficiency stays
the preset default.
Memory: torchtitan's figure is the caching allocator's peak reserved memory (``reserved_bytes.all.peak``, the
maximum over GPUs), compared with the plan's ``RankMemory.reserved`` (the tensors' later-steps peak, printed as
``tensors_gib``, times ``ALLOCATOR_RESERVE``, calibrated on the two 8B eager rows). The 70B row is the strategy's
layout, not torchtitan's: torchtitan's sequence-parallel Llama with loss parallel holds more at its peak (the loss
backward: its full exp(logits) and one-hot gradients in FP32, the head's sequence-gathered input), this layout holds
the embedding and head unsharded over tp.
Usage: ``python benchmarks/planning/torchtitan_rows.py [--no-fsdp-bf16] [--microbatches-32] [row name ...]``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

from lightning_deepseek.app.plan import resolve_cluster, resolve_model
from lightning_deepseek.planning import PlanLayout, StepShape, plan

ROWS = [  # (name, model, world, layout, sequences per micro-batch, dtype, compiled, published tokens/s/GPU, GiB)
    ("8B FSDP8 bs2 selective AC", "llama3-8b", 8, PlanLayout(dp_shard=8, activation_checkpointing="selective"), 2,
     "bf16", False, 5762, 82.4),
    ("8B FSDP8 compile", "llama3-8b", 8, PlanLayout(dp_shard=8, activation_checkpointing="selective"), 2,
     "bf16", True, 6667, 77.0),
    ("8B FSDP8 compile + Float8", "llama3-8b", 8, PlanLayout(dp_shard=8, activation_checkpointing="selective"), 2,
     "fp8", True, 8532, 76.8),
    ("8B FSDP128 bs2 selective AC", "llama3-8b", 128,
     PlanLayout(dp_shard=128, activation_checkpointing="selective"), 2, "bf16", False, 5605, 67.0),
    ("8B FSDP128 compile + Float8", "llama3-8b", 128,
     PlanLayout(dp_shard=128, activation_checkpointing="selective"), 2, "fp8", True, 8380, 61.8),
    ("70B FSDP32xTP8 bs16 full AC", "llama3-70b", 256,  # torchtitan's 16 sequences per tp group: 2 per rank here
     PlanLayout(tp=8, dp_shard=256, activation_checkpointing="full"), 2, "fp8", True, 829, 71.9),
    ("405B FSDP8xTP8xPP8 bs32 full AC 1F1B", "llama3-405b", 512,
     PlanLayout(tp=8, pp=8, dp_shard=8, pp_schedule="1F1B", pp_microbatches=8, sequence_parallel=True,
                loss_parallel=True, activation_checkpointing="full"), 4, "fp8", True, 100, 82.5),
    ("405B FSDP8xTP8xPP8 bs32 full AC Interleaved1F1B", "llama3-405b", 512,
     PlanLayout(tp=8, pp=8, dp_shard=8, pp_schedule="Interleaved1F1B", pp_microbatches=8, sequence_parallel=True,
                loss_parallel=True, activation_checkpointing="full"), 4, "fp8", True, 128, 72.7),
]

if __name__ == "__main__":
    cluster = resolve_cluster("h100")
    args = sys.argv[1:]
    fsdp_bf16 = "--no-fsdp-bf16" not in args
    wanted = [a for a in args if not a.startswith("--")] or [row[0] for row in ROWS]
    for name, model, world, layout, batch, dtype, compiled, tokens, gib in ROWS:
        if name not in wanted:
            continue
        if layout.pp > 1 and "--microbatches-32" in args:
            layout, batch = dataclasses.replace(layout, pp_microbatches=32), 1
        started = time.process_time()
        step = StepShape(batch, 8192, dtype, compiled=compiled, fsdp_bf16=fsdp_bf16)
        report = plan(resolve_model(model), world, layout, cluster, step)
        bubble = report.pipeline.bubble_seconds / report.pipeline.makespan if report.pipeline else None
        print(json.dumps({"row": name, "published_tokens": tokens, "published_gib": gib,
                          "planned_tokens": round(report.tokens_per_second_per_gpu),
                          "planned_gib": round(report.memory.reserved / 2**30, 1),
                          "tensors_gib": round(report.memory.steady_peak / 2**30, 1),
                          "first_step_gib": round(report.memory.peak / 2**30, 1), "fits": report.fits,
                          "layout": report.layout.describe(world), "dtype": dtype, "compiled": compiled,
                          "fsdp_bf16": fsdp_bf16, "bubble": bubble,
                          "plan_cpu_seconds": round(time.process_time() - started, 1),
                          "plan_wall_seconds": round(report.plan_seconds, 1),
                          "compute_s": report.compute_seconds, "comm_s": report.comm_seconds,
                          "step_s": report.step_seconds,
                          "activations_gib": round(report.memory.activations / 2**30, 1)}), flush=True)
