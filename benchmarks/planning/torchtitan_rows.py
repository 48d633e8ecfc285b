"""Plans of the nearest layouts the strategy supports today to torchtitan's published Llama 3.1 H100 rows
(benchmarks/llama3_h100_202412_torchtitan.md in pytorch/torchtitan), printed as JSON lines for REPORT.md.

The published rows use FSDP, activation checkpointing, pipelines, torch.compile and Float8, none of which the
strategy has yet: each row here is planned at its world size, local batch and sequence length (8192) with the
closest supported layout (ZeRO-1 for FSDP, the same tp), BF16 autocast, on the h100 preset. Calibration targets,
not tuned to: compute_efficiency stays the preset default. Usage: ``python benchmarks/planning/torchtitan_rows.py``.
"""

from __future__ import annotations

import json
import sys
import time

from lightning_deepseek.app.plan import resolve_cluster, resolve_model
from lightning_deepseek.planning import PlanLayout, StepShape, plan

ROWS = [  # (name, model, world, layout, local batch, published tokens/s/GPU, published GiB)
    ("8B FSDP8 bs2 selective AC", "llama3-8b", 8, PlanLayout(shard_optimizer_states=True), 2, 5762, 82.4),
    ("8B FSDP128 bs2 selective AC", "llama3-8b", 128, PlanLayout(shard_optimizer_states=True), 2, 5605, 67.0),
    ("70B FSDP32xTP8 bs16 full AC", "llama3-70b", 256, PlanLayout(tp=8, shard_optimizer_states=True), 16, 829, 71.9),
]

if __name__ == "__main__":
    cluster = resolve_cluster("h100")
    wanted = sys.argv[1:] or [row[0] for row in ROWS]
    for name, model, world, layout, batch, tokens, gib in ROWS:
        if name not in wanted:
            continue
        started = time.process_time()
        report = plan(resolve_model(model), world, layout, cluster, StepShape(batch, 8192, "bf16"))
        print(json.dumps({"row": name, "published_tokens": tokens, "published_gib": gib,
                          "planned_tokens": round(report.tokens_per_second_per_gpu),
                          "planned_gib": round(report.memory.peak / 2**30, 1), "fits": report.fits,
                          "layout": report.layout.describe(world),
                          "plan_cpu_seconds": round(time.process_time() - started, 1),
                          "plan_wall_seconds": round(report.plan_seconds, 1),
                          "compute_s": report.compute_seconds, "comm_s": report.comm_seconds,
                          "activations_gib": round(report.memory.activations / 2**30, 1)}), flush=True)
