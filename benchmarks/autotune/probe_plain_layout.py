"""Does ``HybridParallelStrategy`` at the plain layout (tp=1, ep=1, nothing sharded) train slower than Lightning's
``"ddp"``? (issue #16: the loopback MoE measured 0.95-0.97x in 6 of 8 recorded runs, benchmarks/RESULTS.md
"Session 19".) Two processes on loopback train the same model with each, alternating, ``--pairs`` times
``--steps`` steps (the first 3 dropped, the slowest rank's step); prints each pair's medians and their ratio, and
with ``--profile`` the rank-0 functions whose cumulative time differs most between the two (cProfile over one fit
of each).

Run: ``flock /work/wt/bench.lock .venv/bin/python benchmarks/autotune/probe_plain_layout.py [--model moe]``.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def worker(args: argparse.Namespace) -> None:
    import torch

    from benchmarks.autotune.bench_cost_model import MODELS, fit_steps
    from lightning_deepseek import HybridParallelStrategy

    torch.set_num_threads(1)
    _, config, batch, seq = MODELS[args.model]
    rank0 = os.environ["RANK"] == "0"

    def strategy(name: str):
        return "ddp" if name == "ddp" else HybridParallelStrategy(tensor_parallel_size=1, expert_parallel_size=1,
                                                                  min_shard_params=0)

    fit_steps(config, batch, seq, 5, "ddp", [])  # the group up, one-off costs paid
    ratios = []
    for pair in range(args.pairs):
        order = ["ddp", "hybrid"] if pair % 2 == 0 else ["hybrid", "ddp"]
        step = {name: fit_steps(config, batch, seq, args.steps, strategy(name), [])[0] for name in order}
        ratios.append(step["ddp"] / step["hybrid"])
        if rank0:
            print(f"pair {pair}: ddp {step['ddp'] * 1e3:.1f} ms, hybrid {step['hybrid'] * 1e3:.1f} ms, "
                  f"hybrid's throughput {ratios[-1]:.3f}x of ddp's", flush=True)
    if rank0:
        print(f"median {statistics.median(ratios):.3f}x, {sum(r < 1 for r in ratios)} of {len(ratios)} slower",
              flush=True)
    if not args.profile:
        return
    stats = {}
    for name in ("ddp", "hybrid"):
        profiler = cProfile.Profile()
        profiler.enable()
        fit_steps(config, batch, seq, args.steps, strategy(name), [])
        profiler.disable()
        stats[name] = {f"{k[0].split('site-packages/')[-1]}:{k[1]}({k[2]})": v[3]
                       for k, v in pstats.Stats(profiler).stats.items()}
    if rank0:
        names = set(stats["ddp"]) | set(stats["hybrid"])
        diff = sorted(names, key=lambda k: stats["hybrid"].get(k, 0) - stats["ddp"].get(k, 0), reverse=True)
        print("cumulative seconds, hybrid - ddp (one fit each):")
        for key in diff[:25]:
            print(f"  {stats['hybrid'].get(key, 0) - stats['ddp'].get(key, 0):+.3f}  {key}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="moe", choices=["moe", "demo", "ffn"])
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--worker", action="store_true")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    from benchmarks.testbed import run_ranks

    argv = [sys.executable, __file__, "--worker", "--model", args.model, "--pairs", str(args.pairs), "--steps",
            str(args.steps), *(["--profile"] if args.profile else [])]
    run_ranks(argv, 29741, 1800, ROOT)


if __name__ == "__main__":
    main()
