"""The README's demo, old code against new code on one machine: ``lds-train trainer.max_steps=N``, interleaved.

Each repetition runs both trees with the same seed and settings, alternating which goes first (so a change of
the machine's load during the run does not favour one side), and reads ``tokens_per_s`` (training throughput of
both processes, from the run's ``summary.json``), the final losses, and the CPU seconds of the command's process
tree (read from ``/proc`` while it runs: on a shared machine wall-clock throughput follows the other jobs' load,
CPU time much less so). Both trees run on this venv's Python and
packages; ``PYTHONPATH`` picks the tree whose ``lightning_deepseek`` is imported (Lightning's second process
inherits it).

    git worktree add ../lds-old <revision>
    .venv/bin/python benchmarks/demo_ab.py --old ../lds-old --steps 150 --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


TICK = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(root: int) -> dict[int, float]:
    """user + system CPU seconds of ``root`` and each of its descendants now (from /proc; pid -> seconds)."""
    stats = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # exited meanwhile
                continue
            stats[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK)  # ppid, utime+stime
    tree, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        if pid in stats:
            tree[pid] = stats[pid][1]
            frontier += [child for child, (ppid, _) in stats.items() if ppid == pid]
    return tree


def run(tree: Path, steps: int, out: Path, extra: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [str(Path(sys.executable).parent / "lds-train"), f"trainer.max_steps={steps}", "plot=false",
           f"hydra.run.dir={out}", *extra]
    load = os.getloadavg()[0]
    start = time.perf_counter()
    with open(out.parent / f"{out.name}.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=out.parent, env=env, stdout=log, stderr=subprocess.STDOUT)
        cpu: dict[int, float] = {}
        while proc.poll() is None:  # last reading of each process, sampled every 0.2 s (its last 0.2 s are lost)
            cpu.update(_cpu_seconds(proc.pid))
            time.sleep(0.2)
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: lds-train failed, see {log.name}")
    summary = json.loads((out / "summary.json").read_text())
    return {"tokens_per_s": summary["tokens_per_s"], "train_loss_final": summary["train_loss_final"],
            "val_loss_final": summary["val_loss_final"], "command_s": round(time.perf_counter() - start, 1),
            "cpu_s": round(sum(cpu.values()), 1), "load_at_start": round(load, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=Path, required=True, help="source tree of the old code (a git worktree)")
    parser.add_argument("--new", type=Path, default=REPO, help="source tree of the new code (default: this one)")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("extra", nargs="*", help="more lds-train overrides, given to both")
    args = parser.parse_args()

    results: dict[str, list[dict]] = {"old": [], "new": []}
    with tempfile.TemporaryDirectory(prefix="demo_ab_") as scratch:  # run folders and logs, removed at the end
        for rep in range(args.reps):
            order = ("old", "new") if rep % 2 == 0 else ("new", "old")
            for label in order:
                res = run(getattr(args, label).resolve(), args.steps, Path(scratch) / f"{label}{rep}", args.extra)
                results[label].append(res)
                print(f"rep {rep} {label}: {res}", flush=True)
    median = {label: statistics.median(r["tokens_per_s"] for r in runs) for label, runs in results.items()}
    cpu = {label: statistics.median(r["cpu_s"] for r in runs) for label, runs in results.items()}
    print(json.dumps({"median_tokens_per_s": median, "ratio_new_over_old": round(median["new"] / median["old"], 3),
                      "median_cpu_s": cpu, "cpu_ratio_new_over_old": round(cpu["new"] / cpu["old"], 3),
                      "same_final_losses": {(r["train_loss_final"], r["val_loss_final"]) for r in results["old"]}
                      == {(r["train_loss_final"], r["val_loss_final"]) for r in results["new"]}}, indent=1))


if __name__ == "__main__":
    main()
