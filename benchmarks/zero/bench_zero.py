"""ZeRO-1 benchmark: optimizer-state bytes per rank, step time and final loss, side by side with plain DDP.

Run: ``.venv/bin/python benchmarks/zero/bench_zero.py [--steps 150] [--repeats 2]``. Each configuration is one
``lds-train`` run (the ``small`` GPT, 2 CPU processes on loopback, AdamW, FP32, no compression), interleaved over
the repetitions; it reads each run's ``summary.json``. Configurations: Lightning's DDP (the baseline), hybrid at
``tp=1`` (= DDP's layout) with and without ZeRO-1, hybrid at ``tp=2`` with and without ZeRO-1. Prints a Markdown
table: tokens/s as a ratio to DDP (medians), optimizer-state bytes per rank (rank 0, measured) as a ratio to the
same layout without ZeRO-1, and the final train/validation losses. Step time on loopback and on the 1 Gbit
testbed, 4 processes: ``benchmarks/zero/step_time.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LDS_TRAIN = ROOT / ".venv" / "bin" / "lds-train"

CONFIGS = {
    "ddp": ["strategy=ddp"],
    "hybrid tp=1": ["strategy.tensor_parallel_size=1"],
    "hybrid tp=1 + ZeRO-1": ["strategy.tensor_parallel_size=1", "strategy.shard_optimizer_states=true"],
    "hybrid tp=2": ["strategy.tensor_parallel_size=2"],
    "hybrid tp=2 + ZeRO-1": ["strategy.tensor_parallel_size=2", "strategy.shard_optimizer_states=true"],
}
UNSHARDED = {"hybrid tp=1 + ZeRO-1": "hybrid tp=1", "hybrid tp=2 + ZeRO-1": "hybrid tp=2"}


def run(name: str, steps: int, folder: Path) -> dict[str, float]:
    run_dir = folder / name.replace(" ", "_").replace("=", "").replace("+", "")
    cmd = [str(LDS_TRAIN), f"trainer.max_steps={steps}", "compression=none", "plot=false",
           "trainer.val_check_interval=50", f"hydra.run.dir={run_dir}", *CONFIGS[name]]
    subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
    return json.loads((run_dir / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for name in CONFIGS:
                results[name].append(run(name, args.steps, Path(tmp) / f"rep{rep}"))
    base = statistics.median(r["tokens_per_s"] for r in results["ddp"])
    print(f"| configuration | tokens/s vs DDP (median of {args.repeats}) | optimizer-state bytes per rank | "
          "vs same layout without ZeRO-1 | train loss | val loss |")
    print("|---|---|---|---|---|---|")
    for name, runs in results.items():
        speed = statistics.median(r["tokens_per_s"] for r in runs) / base
        state = runs[0].get("hybrid_optimizer_state_bytes")
        ref = results[UNSHARDED[name]][0].get("hybrid_optimizer_state_bytes") if name in UNSHARDED else None
        ratio = f"{state / ref:.3f}" if state and ref else "-"
        state_text = f"{state:,}" if state else "- (Lightning DDP: as hybrid tp=1)"
        each = ", ".join(f"{r['tokens_per_s']:.0f}" for r in runs)
        print(f"| {name} | {speed:.3f} ({each}) | {state_text} | "
              f"{ratio} | {runs[0]['train_loss_final']:.4f} | {runs[0]['val_loss_final']:.4f} |")


if __name__ == "__main__":
    main()
