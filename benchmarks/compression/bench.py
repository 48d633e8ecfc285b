"""Gradient-compression benchmark: 2 emulated hosts (network namespaces, ``tc``) at 1 Gbit and 10 Gbit.

Run as root from the repository root::

    .venv/bin/python benchmarks/compression/bench.py [--points 1gbit:8:64,1gbit:2:64,...] [--reps 3] [--seeds 4]

Per link rate, one rank per namespace trains the same GPT under every configuration, interleaved (fresh DDP module per
configuration and repetition, medians). Every configuration uses the same DDP buckets (``--bucket-mb``, 4 MB: a 3.3
M-parameter model then has four buckets, so exchanges can overlap with backward; with DDP's 25 MB default it has one,
and nothing can; ``--bucket-mb 4,4,2,1`` gives one cap per bucket in gradient-ready order, the last repeating, through
DDP's ``bucket_cap_mb_list``: smaller last buckets, a shorter exposed tail). Communication share = (step - same step
under ``no_sync``) / step, both measured in the same process one after the other, so compression compute that is not
hidden counts as communication. It has two parts, each also a share of the step: the wait after the step's last gradient
is accumulated (the last buckets' exchange, and what the hook still does then, while backward has nothing left to
compute: the exposed communication proper) and the compute slowed (how much later that last gradient comes than under
``no_sync``: communication work taking the cores from forward and backward). The default points: 1 Gbit at batch 7x64
(fp32 communicates about a third of the step: 31-35% measured) and 8x64 (22-31%: the share moves with the machine's
noise), 2x64 and 1x16 (communication-bound), 10 Gbit at 2x64. Validation loss: the example GPT trained the same number
of steps per configuration and seed (2 local ranks; numerics do not depend on the link), reported as the mean over seeds
of the ratio to fp32 of the same seed. Kernel throughput: see ``kernels.py``. ``--configs`` also takes
``wire_int8``/``wire_int4``: a timing oracle that sends our exchange's bytes with no compression compute
(``worker.WireOnly``). Prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.testbed import Testbed  # noqa: E402

WORKER = str(Path(__file__).with_name("worker.py"))
PORT = 29731


def run_two_hosts(rate: str, argv: list[str]) -> None:
    """Run ``argv`` once per emulated host (ranks 0 and 1 of a gloo world), the hosts joined at ``rate``."""
    with Testbed(num_hosts=2, rate=rate, prefix="ldc", subnet="10.213.2") as bed:
        env = {"MASTER_ADDR": bed.ip(0), "MASTER_PORT": str(PORT), "WORLD_SIZE": "2", "PYTHONPATH": str(ROOT),
               "OMP_NUM_THREADS": "1"}
        procs = [subprocess.Popen(bed.command(h, argv, env={**env, "RANK": str(h)}), cwd=ROOT) for h in range(2)]
        try:
            codes = [p.wait(timeout=900) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    if any(codes):
        raise RuntimeError(f"benchmark workers failed at {rate}: exit codes {codes}")


def run_on_testbed(rate: str, extra: list[str]) -> dict:
    """Timing workers, one per emulated host, for one link rate."""
    out = Path(tempfile.mkdtemp()) / "time.json"
    run_two_hosts(rate, [sys.executable, WORKER, "--mode", "time", "--out", str(out), *extra])
    return json.loads(out.read_text())


def run_local_loss(extra: list[str]) -> dict:
    out = Path(tempfile.mkdtemp()) / "loss.json"
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(PORT + 1), "WORLD_SIZE": "2",
           "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, WORKER, "--mode", "loss", "--out", str(out), *extra],
                              env={**env, "RANK": str(r)}, cwd=ROOT) for r in range(2)]
    if any(p.wait(timeout=900) for p in procs):
        raise RuntimeError("loss workers failed")
    return json.loads(out.read_text())


def physical_limit(c: float, b: float) -> float:
    """Best step-time ratio when a share ``c`` of the fp32 step is exposed communication and bytes shrink by b."""
    return (1 - c) + c * b


def loss_ratios(losses: dict[str, list[float]]) -> dict[str, list[float]]:
    """Per seed, each configuration's final validation loss over fp32's of the same seed."""
    return {name: [v / f for v, f in zip(values, losses["fp32"])] for name, values in losses.items()}


def table(results: dict[str, dict], losses: dict[str, list[float]]) -> str:
    ratios = loss_ratios(losses) if losses else {}
    lines = ["| link | configuration | comm share of step | of which: wait after the last gradient | compute slowed "
             "| step time vs fp32 | physical limit | bytes/step vs fp32 | final val loss vs fp32 (mean of seeds) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for rate, res in results.items():
        step, local, nbytes = res["step_s"], res["no_comm_s"], res["bytes"]
        c32 = max(0.0, 1 - local["fp32"] / step["fp32"])
        for name in step:
            share = max(0.0, 1 - local[name] / step[name])
            wait = res["wait_s"][name] / step[name]
            slowed = (res["compute_s"][name] - res["no_comm_compute_s"][name]) / step[name]
            b = nbytes[name] / nbytes["fp32"]
            loss_key = name.replace("_nooverlap", "").replace("_eager", "").replace("_nohold", "")  # same numerics
            loss = f"{statistics.mean(ratios[loss_key]):.4f}x" if loss_key in ratios else "-"
            lines.append(f"| {rate} | {name} | {share:.0%} | {wait:.0%} | {slowed:.0%} | "
                         f"{step[name] / step['fp32']:.2f}x | {physical_limit(c32, b):.2f}x | {b:.3f}x | {loss} |")
    return "\n".join(lines)


def loss_table(losses: dict[str, list[float]]) -> str:
    """Final validation loss over fp32, per configuration: mean, standard error, median and worst seed."""
    lines = ["| configuration | mean | standard error | median | worst seed | seeds |", "|---|---|---|---|---|---|"]
    for name, values in loss_ratios(losses).items():
        n, mean = len(values), statistics.fmean(values)
        sem = (sum((v - mean) ** 2 for v in values) / (n - 1) / n) ** 0.5 if n > 1 else float("nan")
        lines.append(f"| {name} | {mean - 1:+.2%} | {sem:.2%} | "
                     f"{statistics.median(values) - 1:+.2%} | {max(values) - 1:+.2%} | {len(values)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--points", default="1gbit:7:64,1gbit:8:64,1gbit:2:64,1gbit:1:16,10gbit:2:64",
                        help="comma-separated rate:batch_size:sequence_length measurement points")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16, help="batch of the validation-loss runs")
    parser.add_argument("--model", default='{"n_layer": 4, "n_embd": 256, "n_head": 4, "block_size": 64}')
    parser.add_argument("--loss-model", default='{"n_layer": 2, "n_embd": 64, "n_head": 4, "block_size": 64}',
                        help="the example model of the validation-loss runs (the 'tiny' preset)")
    parser.add_argument("--train-steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, default=4, help="validation-loss runs per configuration")
    parser.add_argument("--bucket-mb", default="4",
                        help="DDP bucket cap of every configuration in MB (several buckets, so that overlap can "
                             "happen), or one cap per bucket in gradient-ready order, e.g. 4,4,2,1 (the last repeats)")
    parser.add_argument("--configs", help="comma-separated subset of the configurations (fp32 included); default all")
    parser.add_argument("--skip-loss", action="store_true", help="timing only")
    args = parser.parse_args()
    results = {}
    for point in args.points.split(","):
        rate, batch_size, seq = point.split(":")
        model = json.dumps({**json.loads(args.model), "block_size": int(seq)})
        extra = ["--reps", str(args.reps), "--steps", str(args.steps), "--batch-size", batch_size, "--model", model,
                 "--bucket-mb", args.bucket_mb] + (["--configs", args.configs] if args.configs else [])
        results[f"{rate}, batch {batch_size}x{seq}"] = run_on_testbed(rate, extra)
    losses = {}
    if not args.skip_loss:
        losses = run_local_loss(["--model", args.loss_model, "--train-steps", str(args.train_steps),
                                 "--batch-size", str(args.batch_size), "--seeds", str(args.seeds)])["val_loss"]
    num_params = next(iter(results.values()))["num_params"]
    print(f"command: {' '.join(sys.argv)}")
    print(f"model: GPT {args.model} ({num_params / 1e6:.2f} M parameters), 2 ranks (one per emulated host), "
          f"medians of {args.reps} x {args.steps} steps per configuration (interleaved); validation loss with "
          f"batch {args.batch_size}\n")
    print(table(results, losses))
    if losses:
        print(f"\nfinal validation loss over fp32, GPT {args.loss_model} after {args.train_steps} steps, seeds "
              f"0..{args.seeds - 1}:\n")
        print(loss_table(losses))
        print("\nraw:", json.dumps({k: [round(v, 4) for v in vs] for k, vs in losses.items()}))


if __name__ == "__main__":
    main()
