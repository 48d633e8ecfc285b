"""Does a configuration run slower in the first seconds after the processes start (issue #16's calibration)?

Times every step of plain DDP and ddp/int4 from the first fit on, no untimed steps, in three interleaved rounds
in the same processes (``lds-train tune=grid`` restricted to the two, ``tune.warmup_steps=0``), and writes the
run's ``tune.json`` (each row's ``step_seconds``: every step's time, the rounds one after the other, the slowest
rank's).

Run: ``.venv/bin/python benchmarks/autotune/probe_startup.py --out DIR [--testbed --rate 1gbit --prefix P --subnet
10.x.y]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "autotune"))

import bench_tune  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="where the run folder and tune.json go")
    parser.add_argument("--testbed", action="store_true")
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--model", default="small")
    parser.add_argument("--steps", type=int, default=16, help="timed steps of each configuration and round")
    parser.add_argument("--prefix", default="ldsg")
    parser.add_argument("--subnet", default="10.213.75")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    with bench_tune.where(args) as (bed, machine):
        run = bench_tune.Runner(bed, 400)
        began = time.perf_counter()
        run(args.out / "probe", f"model={args.model}", "tune=grid", "tune.strategies=[ddp]",
            "tune.compressions=[none,int4]", "tune.bucket_cap_mb=[null]", "tune.warmup_steps=0",
            "tune.first_warmup_steps=0", f"tune.steps={args.steps}", "tune.rounds=3", "trainer.max_steps=1",
            "trainer.val_check_interval=1")
        table = run.table(args.out / "probe")
    shutil.copy(args.out / "probe" / ("node0" if bed else "") / "tune.json", args.out / "tune.json")
    print(f"{machine}, model={args.model}: {time.perf_counter() - began:.0f} s, load {load:.1f} -> "
          f"{os.getloadavg()[0]:.1f}")
    for row in table["rows"]:
        steps = row["step_seconds"]
        rounds = [steps[i:i + args.steps] for i in range(0, len(steps), args.steps)]
        print(f"{row['name']}: median step by round {[round(statistics.median(r), 3) for r in rounds]} s; "
              f"first 4 steps {steps[:4]}")


if __name__ == "__main__":
    main()
