"""Where does a fit's speed vary on this machine: with the fit, or with the time? (issue #16: two fits of the same
configuration, back to back in the same processes, can differ by 5-10% for the whole fit, benchmarks/hybrid/REPORT.md,
and the measured rankings the "auto" settings are judged against disagree with themselves.)

The same configuration (A/A) trains ``--fits`` times in the same processes, ``--steps`` steps each (the first 3
dropped, the slowest rank's step). Each fit is split into its first and second half. If a fit's speed is a property
of the fit (its allocations, its set-up), the two halves of one fit agree better than the second half of a fit
and the first half of the next, which are as close in time; if it is the machine's drift, the two agree alike.
Printed: each fit's halves (medians), the correlation of the halves' log step times within fits and across the
boundary between fits, and the spread of the fits' mean log step times against what the steps' own spread
would give.

Run: ``.venv/bin/python benchmarks/autotune/probe_fit_noise.py [--model demo]
[--strategy ddp] [--testbed --rate 10gbit]``. Findings: benchmarks/autotune/REPORT.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def summarise(fits: list[list[float]]) -> list[str]:
    """The halves of each fit, their correlations within and across fits, and the fits' spread against the steps'."""
    first = [math.log(statistics.median(t[: len(t) // 2])) for t in fits]
    second = [math.log(statistics.median(t[len(t) // 2:])) for t in fits]
    within = statistics.correlation(first, second)
    across = statistics.correlation(second[:-1], first[1:])
    means = [statistics.fmean(math.log(x) for x in t) for t in fits]
    step_sd = statistics.fmean(statistics.stdev(math.log(x) for x in t) for t in fits)
    n = min(len(t) for t in fits)
    return [f"halves of a fit, correlation of their log medians: within a fit {within:.2f}, across the boundary "
            f"(a fit's second half, the next fit's first) {across:.2f}",
            f"fits' mean log step: spread {statistics.stdev(means) * 100:.1f}% between fits; the steps' own spread "
            f"{step_sd * 100:.1f}% / sqrt({n}) = {step_sd / math.sqrt(n) * 100:.1f}% if fits only differed by "
            f"their steps' noise"]


def worker(args: argparse.Namespace) -> None:
    import torch

    from benchmarks.autotune.bench_cost_model import MODELS, fit_step_times
    from lightning_deepseek import HybridParallelStrategy

    torch.set_num_threads(1)
    _, config, batch, seq = MODELS[args.model]
    rank0 = os.environ["RANK"] == "0"

    def strategy():
        if args.strategy == "ddp":
            return "ddp"
        return HybridParallelStrategy(tensor_parallel_size=2 if args.strategy == "tp2" else 1, min_shard_params=0,
                                      micro_batch_tokens=batch * seq)

    fit_step_times(config, batch, seq, 5, strategy(), [])  # the group up, one-off costs paid
    fits = []
    for i in range(args.fits):
        start = time.time()
        times, stolen = fit_step_times(config, batch, seq, args.steps, strategy(), [])
        fits.append(times)
        if rank0:
            half = len(times) // 2
            print(f"fit {i:2d} at {start % 1000:7.1f} s: halves {statistics.median(times[:half]) * 1e3:.1f} / "
                  f"{statistics.median(times[half:]) * 1e3:.1f} ms, steal {stolen:.0%}", flush=True)
    if rank0:
        print("\n".join(summarise(fits)), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(fits))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    from benchmarks.testbed import add_arguments

    add_arguments(parser, prefix="ldsn", subnet="10.213.77")
    parser.add_argument("--model", default="demo", choices=["moe", "demo", "ffn"])
    parser.add_argument("--strategy", default="ddp", choices=["ddp", "hybrid", "tp2"])
    parser.add_argument("--fits", type=int, default=16)
    parser.add_argument("--steps", type=int, default=43)
    parser.add_argument("--json", default="", help="write every fit's step times (seconds) to this file")
    parser.add_argument("--worker", action="store_true")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    from benchmarks.testbed import run_ranks_as_asked

    argv = [sys.executable, __file__, "--worker", "--model", args.model, "--strategy", args.strategy, "--fits",
            str(args.fits), "--steps", str(args.steps), "--json", os.path.abspath(args.json) if args.json else ""]
    run_ranks_as_asked(args, argv, 29751, 1800, ROOT)


if __name__ == "__main__":
    main()
