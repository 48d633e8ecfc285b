"""Placement benchmark: 2 emulated nodes x 2 ranks joined by a throttled link, step time of each placement.

Run as root: ``.venv/bin/python benchmarks/hybrid/bench_placement.py [--rate 1gbit] [--repeats 3] [--steps 12]``.
It builds the network testbed (namespaces ``ldh0``/``ldh1``, subnet ``10.213.1.0/24``), starts 4 Lightning
processes (2 per namespace, ``NODE_RANK`` 0/1), and in one run trains the same model with
``HybridParallelStrategy(tensor_parallel_size=2)`` under ``tp_intra_node``, ``dp_intra_node`` and ``auto``,
interleaved, several repetitions; reports median step times as ratios to the fastest, what ``auto`` chose and its
cost-model estimates, and per-rank parameter memory against DDP. The model is feed-forward heavy with few tokens
per micro-batch, so the dp gradient traffic of the sharded layers (about 8 MB per step) outweighs the
tensor-parallel activation traffic: where each crosses the slow link decides the step time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

POLICIES = ("tp_intra_node", "dp_intra_node", "auto")
MODEL = dict(vocab_size=256, block_size=4, n_layer=2, n_head=2, n_embd=128, mlp_ratio=64)
TOKENS = 4  # one sequence of 4 tokens per rank and micro-batch


def worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch
    from torch.distributed.tensor import DTensor
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks.timed_gpt import TimedGPT
    from lightning_deepseek import HybridParallelStrategy
    from lightning_deepseek.models import GPTConfig

    torch.set_num_threads(1)

    tokens = torch.randint(0, 256, (args.steps * 4, TOKENS + 1), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=1)
    results = []
    for repeat in range(args.repeats):
        for policy in POLICIES:
            pl.seed_everything(0, verbose=False)
            module = TimedGPT(GPTConfig(**MODEL), torch.optim.SGD, lr=1e-3)
            strategy = HybridParallelStrategy(tensor_parallel_size=2, placement=policy, micro_batch_tokens=TOKENS)
            trainer = pl.Trainer(accelerator="cpu", devices=2, num_nodes=2, strategy=strategy, max_steps=args.steps,
                                 logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                 enable_model_summary=False, use_distributed_sampler=True)
            trainer.fit(module, data)
            times = torch.tensor(module.step_times[2:])
            torch.distributed.all_reduce(times, op=torch.distributed.ReduceOp.MAX)  # a step ends on its last rank
            local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * 4 for p in module.parameters())
            full = sum(p.numel() * 4 for p in module.parameters())
            ff = [p for n, p in module.named_parameters() if isinstance(p, DTensor)]
            results.append(dict(repeat=repeat, policy=policy, chosen=strategy.layout.placement,
                                estimates=strategy.layout.estimates, median_s=times.median().item(),
                                param_bytes=local, ddp_param_bytes=full,
                                ff_bytes=sum(p.to_local().numel() * 4 for p in ff),
                                ff_ddp_bytes=sum(p.numel() * 4 for p in ff)))
    if torch.distributed.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results))


def report(results: list[dict], argv: list[str], rate: str) -> str:
    medians = {p: statistics.median(r["median_s"] for r in results if r["policy"] == p) for p in POLICIES}
    auto = next(r for r in results if r["policy"] == "auto")
    fastest = min(medians.values())
    rows = [f"Command: `{' '.join(argv)}` (2 namespaces x 2 ranks, {rate} link, "
            f"{len(results) // len(POLICIES)} interleaved repetitions, medians)", "",
            "| placement | mesh rule | step time / fastest | cost-model estimate (comm per step) |",
            "|---|---|---|---|"]
    rule = {"tp_intra_node": "tp groups inside a node", "dp_intra_node": "dp groups inside a node",
            "auto": f"chose `{auto['chosen']}`"}
    for policy in POLICIES:
        estimate = auto["estimates"].get(auto["chosen"] if policy == "auto" else policy, float("nan"))
        rows.append(f"| {policy} | {rule[policy]} | {medians[policy] / fastest:.2f}x | {estimate * 1e3:.1f} ms |")
    worst = max(medians.values())
    rows += ["", f"auto chose `{auto['chosen']}`; fastest measured: `{min(medians, key=medians.get)}`; "
             f"worst / auto = {worst / medians['auto']:.2f}x",
             "", "| parameters per rank | hybrid (tp=2) | DDP | ratio |", "|---|---|---|---|",
             f"| feed-forward | {auto['ff_bytes']:,} B | {auto['ff_ddp_bytes']:,} B | "
             f"{auto['ff_bytes'] / auto['ff_ddp_bytes']:.2f} |",
             f"| all | {auto['param_bytes']:,} B | {auto['ddp_param_bytes']:,} B | "
             f"{auto['param_bytes'] / auto['ddp_param_bytes']:.2f} |"]
    return "\n".join(rows)


def main(args: argparse.Namespace) -> None:
    from benchmarks.testbed import Testbed, workers

    out = Path(tempfile.mkdtemp(prefix="ldh-")) / "results.json"
    with Testbed(num_hosts=2, rate=args.rate, prefix="ldh", subnet="10.213.1") as bed:
        with workers(args.timeout) as procs:
            for rank in range(4):
                node, local = divmod(rank, 2)
                env = dict(MASTER_ADDR=bed.ip(0), MASTER_PORT="29613", RANK=str(rank), WORLD_SIZE="4",
                           LOCAL_RANK=str(local), NODE_RANK=str(node), LDS_TOPOLOGY="0,1;2,3",
                           PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
                argv = [sys.executable, __file__, "--worker", "--out", str(out), "--steps", str(args.steps),
                        "--repeats", str(args.repeats)]
                procs.append(subprocess.Popen(bed.command(node, argv, env), cwd=ROOT))
    print(report(json.loads(out.read_text()), [Path(sys.argv[0]).as_posix(), *sys.argv[1:]], args.rate))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out", default="")
    parsed = parser.parse_args()
    worker(parsed) if parsed.worker else main(parsed)
