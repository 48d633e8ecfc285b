"""Why is compression predicted faster than training measures it? (issue #16, session 14)

On the 1 Gbit testbed the cost model predicts the wide FFN's tp=1 int8/int4 steps 12-28 ms faster than training
measures them, while its fp32 step comes out within a few percent. This probe times the same DDP-wrapped replicas
(fp32, int8, int4 exchange; the hook as training registers it) three ways, on all 4 ranks, slowest rank's figures:

- ``aligned``: one forward + backward after a barrier, interleaved across the exchanges (the setup's
  ``measure_exchange_in_backward``);
- ``consecutive``: ``--steps`` forward + backward + optimizer steps back to back after one barrier (as training
  runs them), the median step;
- ``alone``: the exchange of the whole gradient alone (the setup's ``measure_exchange``).

Run (root)::

    flock /work/wt/bench.lock .venv/bin/python benchmarks/autotune/probe_exchange.py --testbed --rate 1gbit
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

WIDE_FFN = (dict(vocab_size=256, block_size=16, n_layer=2, n_head=4, n_embd=256, mlp_ratio=16), 2, 16)


def worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from benchmarks.timed_gpt import TimedGPT
    from lightning_deepseek.autotune.cost_model import DEFAULT_BLOCK_SIZE
    from lightning_deepseek.autotune.measure import MicroBatch, _Forward, measure_exchange
    from lightning_deepseek.compression import CompressionConfig, register_compression_hook
    from lightning_deepseek.models import GPTConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    config, batch, seq = WIDE_FFN
    pl.seed_everything(0, verbose=False)
    tokens = torch.randint(0, 256, (batch, seq + 1), generator=torch.Generator().manual_seed(dist.get_rank()))
    data = (tokens[:, :-1], tokens[:, 1:])
    variants = (None, 8, 4)
    wrapped, optimizers = {}, {}
    for bits in variants:
        module = TimedGPT(GPTConfig(**config), torch.optim.AdamW, lr=1e-4)
        module.log = module.log_dict = lambda *a, **k: None
        ddp = DistributedDataParallel(_Forward(module, MicroBatch(data, False, "", batch * seq).step(module)))
        if bits is not None:
            register_compression_hook(ddp, CompressionConfig(bits=bits, block_size=DEFAULT_BLOCK_SIZE[bits],
                                                             warmup_steps=0))
        wrapped[bits], optimizers[bits] = ddp, torch.optim.AdamW(module.parameters(), lr=1e-4)

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    def step(bits, optimize: bool) -> None:
        wrapped[bits]().backward()
        if optimize:
            optimizers[bits].step()
        optimizers[bits].zero_grad(set_to_none=True)

    out: dict[str, dict] = {"aligned": {}, "consecutive": {}, "alone": {}}
    for bits in variants:  # warm-up: DDP's bucket rebuild, the hook's plans, the optimizer states
        step(bits, True)
        step(bits, True)
    aligned = {b: [] for b in variants}
    for _ in range(args.repeats):
        for bits in variants:
            dist.barrier()
            start = time.perf_counter()
            step(bits, False)
            aligned[bits].append(slowest(time.perf_counter() - start))
    consecutive = {b: [] for b in variants}
    for _ in range(args.rounds):
        for bits in variants:
            dist.barrier()
            marks = [time.perf_counter()]
            for _ in range(args.steps):
                step(bits, True)
                marks.append(time.perf_counter())
            steps = torch.tensor([b - a for a, b in zip(marks, marks[1:])])
            dist.all_reduce(steps, op=dist.ReduceOp.MAX)
            consecutive[bits] += steps.tolist()[1:]
    grad_bytes = sum(p.numel() * 4 for p in wrapped[None].parameters())
    alone = measure_exchange([grad_bytes], (8, 4), torch.device("cpu"), repeats=args.repeats)
    alone = {b: slowest(alone[(grad_bytes, b)]) for b in variants}
    name = {None: "fp32", 8: "int8", 4: "int4"}
    for bits in variants:
        out["aligned"][name[bits]] = statistics.median(aligned[bits])
        out["consecutive"][name[bits]] = statistics.median(consecutive[bits])
        out["alone"][name[bits]] = alone[bits]
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(out))
    dist.destroy_process_group()


def main(args: argparse.Namespace) -> None:
    from benchmarks.testbed import Testbed, run_ranks

    out = Path(tempfile.mkdtemp(prefix="ldsp-")) / "probe.json"
    common = [sys.executable, __file__, "--worker", "--out", str(out), "--steps", str(args.steps),
              "--rounds", str(args.rounds), "--repeats", str(args.repeats)]
    if args.testbed:
        with Testbed(num_hosts=2, rate=args.rate, prefix=args.prefix, subnet=args.subnet) as bed:
            run_ranks(common, 29752, args.timeout, ROOT, bed)
    else:
        run_ranks(common, 29751, args.timeout, ROOT)
    result = json.loads(out.read_text())
    print("| timing | fp32 | int8 | int4 | int8 - fp32 | int4 - fp32 |\n|---|---|---|---|---|---|")
    for kind, row in result.items():
        print(f"| {kind} | " + " | ".join(f"{row[k] * 1e3:.1f} ms" for k in ("fp32", "int8", "int4"))
              + f" | {(row['int8'] - row['fp32']) * 1e3:+.1f} ms | {(row['int4'] - row['fp32']) * 1e3:+.1f} ms |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    from benchmarks.testbed import add_arguments
    add_arguments(parser, prefix="ldsp", subnet="10.213.76")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out", default="")
    parsed = parser.parse_args()
    worker(parsed) if parsed.worker else main(parsed)
