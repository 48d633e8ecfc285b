"""ZeRO-1 step time side by side with the unsharded hybrid layout and plain DDP, on loopback or on the testbed.

Run: ``.venv/bin/python benchmarks/zero/step_time.py --network loopback|testbed [--rate 1gbit] [--repeats 3]
[--steps 12]`` (``testbed`` needs root). 4 processes: on loopback all on this host; on the testbed 2 emulated
nodes x 2 ranks (namespaces ``ldsz0``/``ldsz1``, subnet ``10.213.31.0/24``, each node's link throttled to
``--rate``). In one set of processes it trains the same GPT with AdamW (FP32) under Lightning's DDP and
``HybridParallelStrategy`` at ``tp=1`` and ``tp=2``, each with and without ``shard_optimizer_states``, the
configurations interleaved over the repetitions. A step's time is the slowest rank's (forward, backward, gradient
all-reduce, optimizer step and, with ZeRO-1, the parameter broadcast); the table gives each configuration's median
over steps and repetitions, as a ratio to DDP, and the machine's load average while it ran.
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

CONFIGS = {  # name: (strategy, tensor_parallel_size, shard_optimizer_states)
    "ddp": ("ddp", None, False),
    "hybrid tp=1": ("hybrid", 1, False),
    "hybrid tp=1 + ZeRO-1": ("hybrid", 1, True),
    "hybrid tp=2": ("hybrid", 2, False),
    "hybrid tp=2 + ZeRO-1": ("hybrid", 2, True),
}
MODEL = dict(vocab_size=256, block_size=16, n_layer=2, n_head=4, n_embd=192, mlp_ratio=4)
TOKENS = 16  # one sequence per rank and step


def worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks.timed_gpt import TimedGPT
    from lightning_deepseek import HybridParallelStrategy
    from lightning_deepseek.models import GPTConfig

    torch.set_num_threads(1)

    tokens = torch.randint(0, 256, (args.steps * 4, TOKENS + 1), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=1)
    results = []
    names = list(CONFIGS)
    for repeat in range(args.repeats):
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:  # the order rotates
            kind, tp, zero = CONFIGS[name]
            pl.seed_everything(0, verbose=False)
            module = TimedGPT(GPTConfig(**MODEL), torch.optim.AdamW, lr=1e-3)
            strategy = "ddp" if kind == "ddp" else HybridParallelStrategy(
                tensor_parallel_size=tp, min_shard_params=0, shard_optimizer_states=zero,
                placement="tp_intra_node")  # tp inside a node; no link probe
            trainer = pl.Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy=strategy, max_steps=args.steps,
                                 logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                 enable_model_summary=False)
            trainer.fit(module, data)
            times = torch.tensor(module.step_times[2:])  # the first two steps warm up
            torch.distributed.all_reduce(times, op=torch.distributed.ReduceOp.MAX)  # a step ends on its last rank
            results.append(dict(repeat=repeat, config=name, step_s=times.tolist(), load=os.getloadavg()[0],
                                param_bytes=sum(p.numel() * p.element_size() for p in module.parameters())))
    if torch.distributed.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results))


def report(results: list[dict], argv: list[str], network: str) -> str:
    medians = {name: statistics.median(t for r in results if r["config"] == name for t in r["step_s"])
               for name in CONFIGS}
    loads = [r["load"] for r in results]
    repeats = len(results) // len(CONFIGS)
    rows = [f"Command: `{' '.join(argv)}` ({network}; 4 processes; {repeats} interleaved repetitions; medians of "
            f"the slowest rank's step time; model {results[0]['param_bytes'] / 2**20:.1f} MiB of FP32 parameters, "
            f"AdamW; 1-minute load average during the run {min(loads):.1f}-{max(loads):.1f} on "
            f"{os.cpu_count()} CPUs)", "",
            "| configuration | step time (ms, median) | vs DDP | vs same layout without ZeRO-1 |", "|---|---|---|---|"]
    for name, median in medians.items():
        unsharded = name.replace(" + ZeRO-1", "")
        against = f"{median / medians[unsharded]:.2f}x" if unsharded != name else "-"
        rows.append(f"| {name} | {median * 1e3:.1f} | {median / medians['ddp']:.2f}x | {against} |")
    return "\n".join(rows)


def launch(args: argparse.Namespace, out: Path) -> None:
    """4 worker processes, 2 per (emulated) node, on loopback or inside the testbed's namespaces."""
    from contextlib import nullcontext

    from benchmarks.testbed import Testbed, workers

    bed = Testbed(num_hosts=2, rate=args.rate, prefix="ldsz", subnet="10.213.31") if args.network == "testbed" else None
    with bed if bed is not None else nullcontext():
        with workers(args.timeout) as procs:
            for rank in range(4):
                node, local = divmod(rank, 2)
                env = dict(MASTER_ADDR=bed.ip(0) if bed else "127.0.0.1", MASTER_PORT="29631", RANK=str(rank),
                           WORLD_SIZE="4", LOCAL_RANK=str(local), NODE_RANK=str(node), LDS_TOPOLOGY="0,1;2,3",
                           PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
                argv = [sys.executable, __file__, "--worker", "--out", str(out), "--steps", str(args.steps),
                        "--repeats", str(args.repeats)]
                if bed is not None:
                    procs.append(subprocess.Popen(bed.command(node, argv, env), cwd=ROOT))
                else:
                    procs.append(subprocess.Popen(argv, cwd=ROOT, env={**os.environ, **env}))


def main(args: argparse.Namespace) -> None:
    out = Path(tempfile.mkdtemp(prefix="ldsz-")) / "results.json"
    launch(args, out)
    network = f"testbed: 2 namespaces x 2 ranks, {args.rate} links" if args.network == "testbed" else "loopback"
    print(report(json.loads(out.read_text()), [Path(sys.argv[0]).as_posix(), *sys.argv[1:]], network))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--network", choices=("loopback", "testbed"), default="loopback")
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out", default="")
    parsed = parser.parse_args()
    worker(parsed) if parsed.worker else main(parsed)
