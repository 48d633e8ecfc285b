"""Does ``HybridParallelStrategy`` at the plain layout (tp=1, ep=1, nothing sharded) train slower than Lightning's
``"ddp"``? (issue #16; findings: benchmarks/hybrid/REPORT.md.) Two processes on loopback (or, ``--testbed``, 2
emulated nodes x 2 ranks) train the same model with ``"ddp"``, the strategy, and the strategy without its per-step
reduction of shards (an ablation; since the strategy skips that reduction itself where nothing is sharded, the same
code as the second arm: an A/A check of the noise), in the orders ABC then CBA, ``--pairs`` times ``--steps`` steps
(the first 3 dropped, the slowest rank's step); prints each round's medians and the ratios to ``"ddp"``, and with
``--profile`` the rank-0 functions whose cumulative time differs most between ``"ddp"`` and the strategy (cProfile
over one fit of each).

Run: ``.venv/bin/python benchmarks/autotune/probe_plain_layout.py [--model moe]
[--testbed --rate 10gbit]``.
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
    from lightning.pytorch.strategies import DDPStrategy

    from benchmarks.autotune.bench_cost_model import MODELS, fit_steps
    from lightning_deepseek import HybridParallelStrategy

    torch.set_num_threads(1)
    _, config, batch, seq = MODELS[args.model]
    rank0 = os.environ["RANK"] == "0"

    class WithoutShardReduction(HybridParallelStrategy):
        """The strategy with Lightning's ``DDPStrategy.optimizer_step`` (no per-step reduction of shards): an
        ablation, to tell that reduction's cost from the rest of the strategy's."""

        def optimizer_step(self, optimizer, closure, model=None, **kwargs):
            return DDPStrategy.optimizer_step(self, optimizer, closure, model, **kwargs)

    def strategy(name: str):
        if name == "ddp":
            return "ddp"
        kind = WithoutShardReduction if name == "hybrid-bare" else HybridParallelStrategy
        return kind(tensor_parallel_size=1, expert_parallel_size=1, min_shard_params=0)

    fit_steps(config, batch, seq, 5, "ddp", [])  # the group up, one-off costs paid
    arms = ["ddp", "hybrid", "hybrid-bare"]
    ratios: dict[str, list[float]] = {arm: [] for arm in arms[1:]}
    for pair in range(args.pairs):
        order = arms if pair % 2 == 0 else arms[::-1]  # ABC, CBA: a drift cannot favour one arm
        step = {name: fit_steps(config, batch, seq, args.steps, strategy(name), [])[0] for name in order}
        for arm in ratios:
            ratios[arm].append(step["ddp"] / step[arm])
        if rank0:
            print(f"pair {pair}: " + ", ".join(f"{a} {step[a] * 1e3:.1f} ms" for a in arms) + "; throughput of "
                  "ddp's: " + ", ".join(f"{a} {r[-1]:.3f}x" for a, r in ratios.items()), flush=True)
    if rank0:
        for arm, values in ratios.items():
            print(f"{arm}: median {statistics.median(values):.3f}x of ddp's, {sum(r < 1 for r in values)} of "
                  f"{len(values)} slower", flush=True)
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
    from benchmarks.testbed import add_arguments

    add_arguments(parser, prefix="ldsp", subnet="10.213.76")
    parser.add_argument("--model", default="moe", choices=["moe", "demo", "ffn"])
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--worker", action="store_true")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    from benchmarks.testbed import run_ranks_as_asked

    argv = [sys.executable, __file__, "--worker", "--model", args.model, "--pairs", str(args.pairs), "--steps",
            str(args.steps), *(["--profile"] if args.profile else [])]
    run_ranks_as_asked(args, argv, 29741, 1800, ROOT)


if __name__ == "__main__":
    main()
