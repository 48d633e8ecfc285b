"""Time for ``lds-train`` to report a configuration error: one git revision against another, side by side.

Each case is a typical mistake (``data.path`` missing, ``trainer.max_steps=0``, ``data.batch_size=abc``,
``resume=README.md``); each run is the entry point in a fresh Python process, as the console script runs it. The
revisions' ``lightning_deepseek`` trees are exported with ``git archive`` and put first on ``PYTHONPATH`` (ahead of
the editable install), so both run with this ``.venv``. Runs are interleaved (case, then revision, repeated), the
table gives the median wall time and the median CPU time (user + system of the process: what the machine's load
changes least) and the exit code, which must be 2.

    .venv/bin/python benchmarks/cli/bench_config_errors.py --before d640e7c --after HEAD --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CASES = ["data.path=/nonexistent.txt", "trainer.max_steps=0", "data.batch_size=abc", f"resume={ROOT / 'README.md'}"]
# The revision's own entry point: console.train where it exists (it installs the signal handling first), else
# cli.train (the console script's target before console.py existed).
ENTRY = """
import sys
sys.argv[0] = "lds-train"
try:
    from lightning_deepseek.app.console import train
except ImportError:
    from lightning_deepseek.app.cli import train
train()
"""


def export(revision: str, into: Path) -> Path:
    """``lightning_deepseek`` of ``revision`` under ``into``."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision, "lightning_deepseek"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def run_once(tree: Path, case: str, cwd: Path) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds (user + system) and the exit code of one ``lds-train <case>``."""
    before = os.times()
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", ENTRY, case, "hydra.run.dir=run"], cwd=cwd, capture_output=True,
                            text=True, env={**os.environ, "PYTHONPATH": str(tree)})
    wall = time.perf_counter() - started
    after = os.times()
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    if result.returncode != 2 or "lds-train: error:" not in result.stderr:
        print(f"unexpected: {case} exited {result.returncode}: {result.stderr[-500:]}", file=sys.stderr)
    return wall, cpu, result.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="d640e7c", help="git revision to compare against")
    parser.add_argument("--after", default="HEAD", help="git revision measured")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trees = {name: export(rev, Path(tmp) / name) for name, rev in (("before", args.before), ("after", args.after))}
        times: dict[tuple[str, str], list[tuple[float, float, int]]] = {}
        load = [os.getloadavg()[0]]
        for _ in range(args.repeats):
            for case in CASES:
                for name, tree in trees.items():
                    cwd = Path(tmp) / "cwd"
                    cwd.mkdir(exist_ok=True)
                    times.setdefault((case, name), []).append(run_once(tree, case, cwd))
            load.append(os.getloadavg()[0])
    print(f"before={args.before} after={args.after} repeats={args.repeats} "
          f"load average (1 min) {min(load):.1f}-{max(load):.1f}")
    print("| case | before: wall / CPU s | after: wall / CPU s | after/before wall | exit codes |")
    print("|---|---|---|---|---|")
    for case in CASES:
        row = []
        for name in ("before", "after"):
            runs = times[(case, name)]
            row.append((statistics.median(w for w, _, _ in runs), statistics.median(c for _, c, _ in runs)))
        codes = sorted({code for name in ("before", "after") for _, _, code in times[(case, name)]})
        shown = case.replace(str(ROOT) + "/", "")
        print(f"| `{shown}` | {row[0][0]:.2f} / {row[0][1]:.2f} | {row[1][0]:.2f} / {row[1][1]:.2f} | "
              f"{row[1][0] / row[0][0]:.2f} | {codes} |")


if __name__ == "__main__":
    main()
