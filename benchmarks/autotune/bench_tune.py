"""Calibration benchmark (issue #16): is ``lds-train``'s automatic choice as fast as the best of an exhaustive grid,
never slower than plain DDP, and how much of the demo does the calibration cost?

Run (loopback, the demo model, 2 CPU processes):
``.venv/bin/python benchmarks/autotune/bench_tune.py [--reps 2] [--steps 60] [--grid-steps 4]``.
Run (testbed, as root: 2 emulated nodes x 2 processes, ``lds-train trainer.num_nodes=2`` started in each node's
network namespace with ``MASTER_ADDR``/``NODE_RANK``, the link throttled to ``--rate``):
``.venv/bin/python benchmarks/autotune/bench_tune.py --testbed --rate 1gbit [--model moe-tiny]``; the wide-FFN
model where tensor parallelism wins at 1 Gbit: ``--model wide-ffn --set data.batch_size=2``.
Two or more repetitions in a run of ~8 minutes on the testbed: ``--reps 3
--limit 490 --steps 12 --grid-steps 2 --grid-rounds 2 --grid-warmup 1 --grid-buckets "[null]" --skip-ddp-run``
(``--limit`` starts a repetition only when the longest so far still fits). A long run's paired rounds
(``tune.budget``): ``--set tune.planned_steps=20000`` (the grid's ``tune.budget`` is 0; the auto run calibrates as
for 20,000 steps and trains ``--steps``).

Each repetition runs, interleaved:

1. the exhaustive grid: ``lds-train tune=grid`` (every candidate of ``tune=grid``: ddp and hybrid at each tp, for
   MoE models each ep, x none/int8/int4 x the DDP buckets of ``--grid-buckets``; every candidate measured in
   ``--grid-rounds`` interleaved rounds in the same processes, every second one backward, ``--grid-steps`` timed
   steps each);
2. the default ``lds-train`` (``tune=auto``) for ``--steps`` steps: its choice, its calibration time, and the
   tokens/s of the training that follows;
3. plain DDP (``strategy=ddp compression=none tune=none``) for ``--steps`` steps: the baseline, measured by a
   separate run of its own (not by the calibration).

Reports medians over the repetitions with min-max spreads and the machine's load average before and after.
The grid's tokens/s of a configuration is its best round (as the calibration ranks); what a long run sustains is its
mean step time, so the report also ranks the grid by the mean of every timed step of each configuration (median over
the repetitions) and puts each choice against that best: the best round favours a configuration whose speed swings
more (benchmarks/autotune/REPORT.md). ``--report FILE`` prints that view of a recorded ``--grid-out`` file.
The grid's table (every configuration's median tokens/s) goes to ``--grid-out`` (default
``benchmarks/autotune/grid_<where>_<model>.json``) for a ranking check (Spearman).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from lightning_deepseek.app.tune.steal import cpu_times, stolen_share  # noqa: E402

LDS_TRAIN = ROOT / ".venv" / "bin" / "lds-train"
COMMON = ["plot=false", "trainer.enable_progress_bar=false", "trainer.limit_val_batches=2"]


class Runner:
    """Runs ``lds-train`` on loopback, or as 2 nodes x 2 processes in the testbed's namespaces."""

    def __init__(self, bed: object | None, timeout: float) -> None:
        self.bed, self.timeout, self.port = bed, timeout, 29700
        self.stolen: dict[str, float] = {}  # each run's share of the machine's CPU taken by the host

    def __call__(self, run_dir: Path, *overrides: str) -> dict:
        before = cpu_times()
        try:
            return self._run(run_dir, *overrides)
        finally:
            self.stolen[run_dir.name] = stolen_share(before, cpu_times())

    def _run(self, run_dir: Path, *overrides: str) -> dict:
        if self.bed is None:
            subprocess.run([str(LDS_TRAIN), *COMMON, f"hydra.run.dir={run_dir}", *overrides], check=True,
                           capture_output=True, text=True, cwd=ROOT, timeout=self.timeout)
            return json.loads((run_dir / "summary.json").read_text())
        from benchmarks.testbed import workers

        self.port += 1  # a fresh rendezvous port per run: the previous run's may linger in TIME_WAIT
        with workers(self.timeout) as procs:
            for node in range(2):
                env = {"MASTER_ADDR": self.bed.ip(0), "MASTER_PORT": str(self.port), "NODE_RANK": str(node),
                       "LDS_TOPOLOGY": "0,1;2,3", "OMP_NUM_THREADS": "1"}
                argv = [str(LDS_TRAIN), *COMMON, "trainer.num_nodes=2", f"hydra.run.dir={run_dir}/node{node}",
                        *overrides]
                log = open(run_dir.parent / f"{run_dir.name}-node{node}.log", "w")  # noqa: SIM115 - closed on exit
                procs.append(subprocess.Popen(self.bed.command(node, argv, env), cwd=ROOT, stdout=log,
                                              stderr=subprocess.STDOUT))
        return json.loads((run_dir / "node0" / "summary.json").read_text())

    def table(self, run_dir: Path) -> dict:
        return json.loads((run_dir / ("node0" if self.bed else "") / "tune.json").read_text())


def spread(values: list[float]) -> str:
    fmt = ",.0f" if statistics.median(values) >= 100 else ".3g"
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


@contextlib.contextmanager
def where(args: argparse.Namespace) -> Iterator[tuple[object | None, str]]:
    if not args.testbed:
        yield None, "loopback, 2 CPU processes"
        return
    from benchmarks.testbed import Testbed

    with Testbed(num_hosts=2, rate=args.rate, prefix=args.prefix, subnet=args.subnet) as bed:
        yield bed, f"testbed, 2 emulated nodes x 2 processes, {args.rate} link, OMP_NUM_THREADS=1"


def by_mean_step(runs: list[dict]) -> list[str]:
    """The grid ranked by each configuration's mean step time over all its timed steps (the median over the
    repetitions that recorded steps), and each repetition's choice against the best of it."""
    runs = [r for r in runs if r.get("grid_step_seconds")]
    if not runs:
        return []
    steps = {n: [statistics.fmean(r["grid_step_seconds"][n]) for r in runs if r["grid_step_seconds"].get(n)]
             for n in runs[0]["grid_step_seconds"]}
    seconds = {n: statistics.median(v) for n, v in steps.items() if v}
    best, plain = min(seconds, key=seconds.get), seconds["ddp/none"]
    lines = [f"\nby the mean of every timed step (what a long run sustains; median over {len(runs)} reps): the best "
             f"{best} at {plain / seconds[best]:.3f}x of plain DDP; "
             + ", ".join(f"{n} {plain / seconds[n]:.3f}x" for n in sorted(seconds, key=seconds.get)[1:4])]
    for i, r in enumerate(runs):
        choice = r["choice"].split(" ")[0]
        own = min(statistics.fmean(v) for v in r["grid_step_seconds"].values() if v)
        lines.append(f"rep {i}: {choice} {seconds[best] / seconds[choice]:.3f}x of that best (this repetition's "
                     f"grid: {own / statistics.fmean(r['grid_step_seconds'][choice]):.3f}x)")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", type=Path, default=None, help="print a recorded --grid-out file's mean-step view")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--grid-steps", type=int, default=4)
    parser.add_argument("--grid-buckets", default="[null,1,100]", help="tune.bucket_cap_mb of the grid")
    parser.add_argument("--grid-rounds", type=int, default=2, help="interleaved rounds of the grid (best round)")
    parser.add_argument("--grid-warmup", type=int, default=2, help="untimed steps of each grid candidate's fit")
    parser.add_argument("--limit", type=float, default=None,
                        help="seconds for the whole benchmark: a repetition starts only when the longest one so far "
                             "still fits (stop it with `timeout` a little above this)")
    parser.add_argument("--model", default="small", help="model preset (model=...)")
    parser.add_argument("--set", action="append", default=[], metavar="OVERRIDE",
                        help="an lds-train override for every run, repeatable (e.g. --set data.batch_size=2)")
    from benchmarks.testbed import add_arguments
    add_arguments(parser, prefix="ldsc", subnet="10.213.72")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--skip-ddp-run", action="store_true", help="no separate plain-DDP run (time-limited runs)")
    parser.add_argument("--grid-out", type=Path, default=None)
    args = parser.parse_args()
    if args.report is not None:
        print("\n".join(by_mean_step(json.loads(args.report.read_text())["auto_runs"])))
        return
    # `timeout` sends SIGTERM: leave through the context managers (kill the workers, tear the testbed down).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    name = f"{'testbed_' + args.rate if args.testbed else 'loopback'}_{args.model}"
    grid_out = args.grid_out or ROOT / "benchmarks" / "autotune" / f"grid_{name}.json"
    load_before = os.getloadavg()
    grid: dict[str, list[float]] = {}
    overrides: dict[str, list[str]] = {}
    runs = []
    model = [f"model={args.model}", *args.set]
    began, longest = time.perf_counter(), 0.0
    with where(args) as (bed, machine), tempfile.TemporaryDirectory() as tmp:
        lds_train = Runner(bed, args.timeout)
        for rep in range(args.reps):
            rep_began = time.perf_counter()
            if args.limit is not None and rep_began - began + longest > args.limit:
                print(f"rep {rep}: not started, the longest repetition ({longest:.0f} s) would pass --limit",
                      flush=True)
                break
            load_start = os.getloadavg()[0]
            folder = Path(tmp) / str(rep)
            folder.mkdir()
            lds_train(folder / "grid", *model, "tune=grid", f"tune.steps={args.grid_steps}", "trainer.max_steps=1",
                      f"tune.rounds={args.grid_rounds}", f"tune.warmup_steps={args.grid_warmup}",
                      f"tune.bucket_cap_mb={args.grid_buckets}", "trainer.val_check_interval=1")
            table = lds_train.table(folder / "grid")
            for row in table["rows"]:
                if row["tokens_per_s"] is not None:
                    grid.setdefault(row["name"], []).append(row["tokens_per_s"])
                    overrides[row["name"]] = row["overrides"]
            steps = [f"trainer.max_steps={args.steps}", f"trainer.val_check_interval={args.steps}"]
            auto = lds_train(folder / "auto", *model, *steps)
            auto_table = lds_train.table(folder / "auto")
            run = {"choice": auto["tune_choice"], "tune_seconds": auto["tune_seconds"],
                   "launch_seconds": round(auto_table["launch_seconds"], 1), "phases": auto_table["phases"],
                   "calibrated_ratio": auto["tune_vs_plain_ddp"], "reason": auto_table.get("reason"),
                   "margin": auto_table.get("margin"), "auto_tokens_per_s": auto["tokens_per_s"],
                   "auto_train_wall_s": auto["wall_time_s"],
                   "auto_table": {r["name"]: (r["state"], r["tokens_per_s"] and round(r["tokens_per_s"]))
                                  for r in auto_table["rows"]},
                   "grid_best": max(table["rows"], key=lambda r: r["tokens_per_s"] or 0)["name"],
                   "paired": auto_table.get("paired")}
            if not args.skip_ddp_run:
                plain = lds_train(folder / "ddp", *model, *steps, "strategy=ddp", "compression=none", "tune=none")
                run.update(ddp_tokens_per_s=plain["tokens_per_s"], ddp_train_wall_s=plain["wall_time_s"])
            longest = max(longest, time.perf_counter() - rep_began)
            run.update(load_1min_start_end=[round(load_start, 1), round(os.getloadavg()[0], 1)],
                       cpu_stolen_by_host=dict(lds_train.stolen),
                       rep_seconds=round(time.perf_counter() - rep_began),
                       auto_step_seconds={r["name"]: r["step_seconds"] for r in auto_table["rows"]},
                       grid_step_seconds={r["name"]: r["step_seconds"] for r in table["rows"]})
            runs.append(run)
            print(json.dumps(run), flush=True)
            # After every repetition: a run stopped by its time limit keeps the repetitions it finished.
            medians = {name: statistics.median(v) for name, v in grid.items()}
            grid_out.write_text(json.dumps(
                {"machine": f"{machine}, model={args.model} {' '.join(args.set)}".rstrip(), "reps": rep + 1,
                 "argv": sys.argv[1:],
                 "load_average_1min_before_after": [load_before[0], os.getloadavg()[0]],
                 "timed_steps_per_round": args.grid_steps, "rounds": args.grid_rounds, "auto_runs": runs,
                 "configs": [{"name": n, "overrides": overrides[n], "tokens_per_s_median": medians[n],
                              "per_rep": grid[n]} for n in sorted(medians, key=medians.get, reverse=True)]},
                indent=2) + "\n")
    load_after = os.getloadavg()
    best = max(medians, key=medians.get)
    print(f"\n{machine}, model={args.model}; load average before {load_before[0]:.1f}/{load_before[1]:.1f}, after "
          f"{load_after[0]:.1f}/{load_after[1]:.1f} (1/5 min; the machine has {os.cpu_count()} cores)")
    print(f"\n| configuration | grid tokens/s, median (min-max over {len(runs)} reps) | vs plain DDP |")
    print("|---|---|---|")
    for name in sorted(medians, key=medians.get, reverse=True):
        print(f"| {name}{' (grid best)' if name == best else ''} | {spread(grid[name])} | "
              f"{medians[name] / medians['ddp/none']:.2f}x |")
    print("\n| rep | auto choice | choice vs grid best (grid medians) | auto training vs plain DDP run | "
          "calibration s (launch s) | CPU stolen by the host: grid, auto, ddp runs |")
    print("|---|---|---|---|---|---|")
    for i, r in enumerate(runs):
        vs_ddp = f"{r['auto_tokens_per_s'] / r['ddp_tokens_per_s']:.2f}x" if "ddp_tokens_per_s" in r else "-"
        print(f"| {i} | {r['choice']} | {medians.get(r['choice'].split(' ')[0], 0) / medians[best]:.2f}x | "
              f"{vs_ddp} | {r['tune_seconds']} ({r['launch_seconds']}) | "
              f"{', '.join(f'{v:.0%}' for v in r['cpu_stolen_by_host'].values())} |")
    calibration = spread([r["tune_seconds"] for r in runs])
    print(f"\ncalibration: {calibration} s, against {spread([r['auto_train_wall_s'] for r in runs])} s for the "
          f"{args.steps} training steps of the same run")
    if not args.skip_ddp_run:
        print(f"auto training vs plain DDP: {spread([r['auto_tokens_per_s'] / r['ddp_tokens_per_s'] for r in runs])}")
    print("\n".join(by_mean_step(runs)))


if __name__ == "__main__":
    main()
