"""Outage of a shrink (2 -> 1 nodes) and a grow (1 -> 2) of a running torchrun job, tuned vs torchrun defaults.

    .venv/bin/python benchmarks/elastic/outage.py --repeats 2

Each repetition starts ``examples/elastic_train.py`` under two ``LocalBackend`` agents (``--nnodes=1:2``,
c10d rendezvous on 127.0.0.1), waits for training at world size 2, SIGTERMs the second agent, waits for
training at world size 1, starts a new agent and waits for training at world size 2 again. The two rendezvous
settings (``RendezvousTuning()`` and ``RendezvousTuning.torchrun_defaults()``) alternate, repetition by
repetition. Times come from the job's own report records (one per optimizer step):

- shrink outage: from the SIGTERM to the first step trained at world size 1;
- grow outage: from the last step at world size 1 (training stops when the agents restart their workers for
  the newcomer) to the first step at world size 2; ``join`` is from starting the new agent to that step;
- worker start-up: seconds between a resumed worker's process start and its resume (import + restore);
- steps lost: steps trained before the resize minus the step the job resumed from.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from lightning_deepseek.elastic import Reports  # noqa: E402
from lightning_deepseek.elastic.controller.backend import JobSpec, LocalBackend, RendezvousTuning  # noqa: E402
from tests.helpers import free_port  # noqa: E402


class Timeline:
    """All report records of one job, read as they arrive."""

    def __init__(self, path: Path) -> None:
        self.reports = Reports(path)
        self.records: list[dict] = []
        self._next = 0

    def wait(self, predicate, timeout: float = 240.0) -> dict:
        """The next record (after the one returned last) that matches ``predicate``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.records += self.reports.read_new()
            while self._next < len(self.records):
                record = self.records[self._next]
                self._next += 1
                if predicate(record):
                    return record
            time.sleep(0.05)
        raise TimeoutError(f"no matching report within {timeout}s; last: {self.records[-3:]}")


def one_cycle(tuning: RendezvousTuning, work_dir: Path, checkpoint_every: int) -> dict[str, float]:
    run_dir = work_dir / f"run-{time.time_ns()}"
    command = [str(REPO / "examples" / "elastic_train.py"), "--run-dir", str(run_dir), "--max-steps", "100000",
               "--step-sleep", "0.05", "--checkpoint-every", str(checkpoint_every), "--block-size", "32"]
    job = JobSpec("bench", command, min_workers=1, max_workers=2, run_dir=run_dir)
    backend = LocalBackend(rdzv_port=free_port(), tuning=tuning, stop_timeout_s=90)
    timeline = Timeline(job.report_file)
    progress = lambda ws: lambda r: r["event"] == "progress" and r["world_size"] == ws  # noqa: E731
    try:
        backend.scale(job, 2)
        last_before = timeline.wait(lambda r: progress(2)(r) and r["step"] >= 5)["step"]
        sigterm_at = time.time()
        backend.scale(job, 1)
        resumed = timeline.wait(lambda r: r["event"] == "resumed" and r["world_size"] == 1)
        first_small = timeline.wait(progress(1))
        stop = next(r for r in timeline.records if r["event"] == "stopping")
        shrink = {"outage": first_small["time"] - sigterm_at, "startup": resumed.get("process_age_s") or 0.0,
                  "lost": stop["step"] - resumed["from_step"], "trained_after_signal": stop["step"] - last_before}
        timeline.wait(lambda r: progress(1)(r) and r["step"] >= first_small["step"] + 3)
        grow_at = time.time()
        backend.scale(job, 2)
        resumed = timeline.wait(lambda r: r["event"] == "resumed" and r["world_size"] == 2)
        first_big = timeline.wait(progress(2))
        last_small = max((r for r in timeline.records if progress(1)(r)), key=lambda r: r["time"])
        stop = [r for r in timeline.records if r["event"] == "stopping"][-1]
        grow = {"outage": first_big["time"] - last_small["time"], "join": first_big["time"] - grow_at,
                "startup": resumed.get("process_age_s") or 0.0, "lost": stop["step"] - resumed["from_step"]}
        return {**{f"shrink_{k}": v for k, v in shrink.items()}, **{f"grow_{k}": v for k, v in grow.items()}}
    finally:
        backend.kill(job)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--checkpoint-every", type=int, default=20)
    args = parser.parse_args()
    configs = {"tuned (RendezvousTuning())": RendezvousTuning(),
               "torchrun defaults": RendezvousTuning.torchrun_defaults()}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
    with tempfile.TemporaryDirectory(prefix="lds-elastic-bench-") as tmp:
        for rep in range(args.repeats):
            for name, tuning in configs.items():  # interleaved
                cycle = one_cycle(tuning, Path(tmp), args.checkpoint_every)
                print(f"# rep {rep} {name}: " + ", ".join(f"{k}={v:.1f}" for k, v in cycle.items()), flush=True)
                results[name].append(cycle)
    med = {name: {k: statistics.median(c[k] for c in cycles) for k in cycles[0]} for name, cycles in results.items()}
    print(f"\ncommand: {' '.join(sys.argv)}  (medians of {args.repeats} interleaved repetitions)\n")
    print("| rendezvous settings | shrink outage (s) | grow outage (s) | grow join (s) | worker start-up in outage (s) "
          "| steps lost (shrink / grow) |")
    print("|---|---|---|---|---|---|")
    for name, m in med.items():
        print(f"| {name} | {m['shrink_outage']:.1f} | {m['grow_outage']:.1f} | {m['grow_join']:.1f} | "
              f"{m['shrink_startup']:.1f} / {m['grow_startup']:.1f} | {m['shrink_lost']:.0f} / {m['grow_lost']:.0f} |")
    tuned, default = med["tuned (RendezvousTuning())"], med["torchrun defaults"]
    print(f"\nshrink outage ratio tuned/default: {tuned['shrink_outage'] / default['shrink_outage']:.2f}; "
          f"grow: {tuned['grow_outage'] / default['grow_outage']:.2f}")


if __name__ == "__main__":
    main()
