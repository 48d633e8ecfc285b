"""Calibration benchmark (issue #16): is ``lds-train``'s automatic choice as fast as the best of an exhaustive grid,
never slower than plain DDP, and how much of the demo does the calibration cost?

Run: ``.venv/bin/python benchmarks/autotune/bench_tune.py [--reps 2] [--steps 60] [--grid-steps 4]``. Loopback,
the demo model (``small``), 2 CPU processes. Each repetition runs, interleaved:

1. the exhaustive grid: ``lds-train tune=grid`` (ddp and hybrid tp=2 x none/int8/int4 x DDP buckets of 1, 25 and
   100 MB, every candidate measured twice, interleaved, in the same processes; ``--grid-steps`` timed steps each);
2. the default ``lds-train`` (``tune=auto``) for ``--steps`` steps: its choice, its calibration time, and the
   tokens/s of the training that follows;
3. plain DDP (``strategy=ddp compression=none tune=none``) for ``--steps`` steps: the baseline, measured by a
   separate run of its own (not by the calibration).

Reports medians over the repetitions with min-max spreads and the machine's load average before and after.
The grid's table (every configuration's median tokens/s) goes to ``--grid-out`` (default
``benchmarks/autotune/grid_loopback.json``) for a cost model's ranking check (Spearman).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LDS_TRAIN = ROOT / ".venv" / "bin" / "lds-train"
COMMON = ["plot=false", "trainer.enable_progress_bar=false", "trainer.limit_val_batches=2"]


def lds_train(run_dir: Path, *overrides: str) -> dict:
    subprocess.run([str(LDS_TRAIN), *COMMON, f"hydra.run.dir={run_dir}", *overrides], check=True,
                   capture_output=True, text=True, cwd=ROOT)
    return json.loads((run_dir / "summary.json").read_text())


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3g} ({min(values):.3g}-{max(values):.3g})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--grid-steps", type=int, default=4)
    parser.add_argument("--grid-buckets", default="[null,1,100]", help="tune.bucket_cap_mb of the grid")
    parser.add_argument("--grid-out", type=Path, default=ROOT / "benchmarks" / "autotune" / "grid_loopback.json")
    args = parser.parse_args()
    load_before = os.getloadavg()
    grid: dict[str, list[float]] = {}
    overrides: dict[str, list[str]] = {}
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            folder = Path(tmp) / str(rep)
            lds_train(folder / "grid", "tune=grid", f"tune.steps={args.grid_steps}", "trainer.max_steps=1",
                      f"tune.bucket_cap_mb={args.grid_buckets}",
                      "trainer.val_check_interval=1")
            table = json.loads((folder / "grid" / "tune.json").read_text())
            for row in table["rows"]:
                if row["tokens_per_s"] is not None:
                    grid.setdefault(row["name"], []).append(row["tokens_per_s"])
                    overrides[row["name"]] = row["overrides"]
            steps = [f"trainer.max_steps={args.steps}", f"trainer.val_check_interval={args.steps}"]
            auto = lds_train(folder / "auto", *steps)
            plain = lds_train(folder / "ddp", *steps, "strategy=ddp", "compression=none", "tune=none")
            runs.append({"choice": auto["tune_choice"], "tune_seconds": auto["tune_seconds"],
                         "calibrated_ratio": auto["tune_vs_plain_ddp"], "auto_tokens_per_s": auto["tokens_per_s"],
                         "ddp_tokens_per_s": plain["tokens_per_s"], "ddp_train_wall_s": plain["wall_time_s"],
                         "grid_best": max(table["rows"], key=lambda r: r["tokens_per_s"] or 0)["name"]})
            print(json.dumps(runs[-1]), flush=True)
    load_after = os.getloadavg()
    medians = {name: statistics.median(v) for name, v in grid.items()}
    best = max(medians, key=medians.get)
    args.grid_out.write_text(json.dumps(
        {"machine": "loopback, 2 CPU processes, model=small (the demo)", "reps": args.reps,
         "load_average_1min_before_after": [load_before[0], load_after[0]],
         "timed_steps_per_round": args.grid_steps, "rounds": 2,
         "configs": [{"name": n, "overrides": overrides[n], "tokens_per_s_median": medians[n], "per_rep": grid[n]}
                     for n in sorted(medians, key=medians.get, reverse=True)]}, indent=2) + "\n")
    print(f"\nload average before {load_before[0]:.1f}/{load_before[1]:.1f}, after {load_after[0]:.1f}/"
          f"{load_after[1]:.1f} (1/5 min; the machine has {os.cpu_count()} cores)")
    print(f"\n| configuration | grid tokens/s, median (min-max over {args.reps} reps) | vs plain DDP |")
    print("|---|---|---|")
    for name in sorted(medians, key=medians.get, reverse=True):
        print(f"| {name}{' (grid best)' if name == best else ''} | {spread(grid[name])} | "
              f"{medians[name] / medians['ddp/none']:.2f}x |")
    print("\n| rep | auto choice | choice vs grid best (grid medians) | auto training vs plain DDP run | "
          "calibration s |")
    print("|---|---|---|---|---|")
    for i, r in enumerate(runs):
        print(f"| {i} | {r['choice']} | {medians.get(r['choice'], 0) / medians[best]:.2f}x | "
              f"{r['auto_tokens_per_s'] / r['ddp_tokens_per_s']:.2f}x | {r['tune_seconds']} |")
    ratios = [r["auto_tokens_per_s"] / r["ddp_tokens_per_s"] for r in runs]
    calibration = spread([r["tune_seconds"] for r in runs])
    print(f"\nauto training vs plain DDP: {spread(ratios)}; calibration: {calibration} s; "
          f"plain DDP's {args.steps}-step run took {spread([r['ddp_train_wall_s'] for r in runs])} s of training")


if __name__ == "__main__":
    main()
