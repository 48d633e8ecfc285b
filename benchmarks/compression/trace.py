"""Where a compressed step's time goes: per-rank timelines of one configuration on the network testbed.

Run as root from the repository root::

    .venv/bin/python benchmarks/compression/trace.py [--rate 1gbit] [--batch-size 8] [--configs fp32,int8_ef]

Two ranks, one per emulated host, train the benchmark's GPT (``bench.py``'s model and 4 MB buckets) under each
configuration and print, per rank and for the last two of ``--steps`` steps, milliseconds since the step began:
``fwd`` (forward done), ``hookN>``/``hookN<`` (DDP handed bucket N to the communication hook / the hook returned:
for ours, phase 1 ran in between, on the autograd thread, and in the last bucket's hook also the final writes held
until then), ``doneN`` (bucket N's average is in the gradients) and
``bwd`` (``backward()`` returned: DDP waited for every bucket). Then the same step under ``no_sync`` (no
communication), the compute-only reference. Backward ending later than that reference is the cost of
communication sharing the cores; ``bwd`` after the last ``hook<`` is the exposed tail. fp32 runs torch's
``allreduce_hook`` (what DDP does without a hook) so that it can be timed the same way.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402


def traced(events: list, start: list[float], sizes: dict[int, int]):  # noqa: ANN201 - wraps any DDP comm hook
    """A comm-hook wrapper that records when each bucket enters, leaves and completes (and its size)."""
    def mark(tag: str) -> None:
        events.append((round((time.perf_counter() - start[0]) * 1e3, 1), tag))

    def wrapper(hook):  # noqa: ANN001, ANN202
        def run(state, bucket):  # noqa: ANN001, ANN202
            i = bucket.index()
            sizes[i] = bucket.buffer().numel()
            mark(f"hook{i}>")
            fut = hook(state, bucket)
            mark(f"hook{i}<")

            def done(f):  # noqa: ANN001, ANN202
                mark(f"done{i}")
                return f.value()
            return fut.then(done)
        return run
    return mark, wrapper


def rank_main(args: argparse.Namespace) -> None:
    import worker  # the benchmark's configurations, model and batches

    from lightning_deepseek.data.text import read_corpus
    from lightning_deepseek.models import GPT, GPTConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = GPTConfig(**json.loads(args.model))
    data = torch.frombuffer(bytearray(read_corpus(None)), dtype=torch.uint8)
    x, y = worker.batch(data, torch.Generator().manual_seed(rank), args.batch_size, cfg.block_size)
    out = {}
    for name in args.configs.split(","):
        events: list = []
        start = [0.0]
        sizes: dict[int, int] = {}
        mark, wrapper = traced(events, start, sizes)
        original = DistributedDataParallel.register_comm_hook

        def register(self, state, hook, original=original, wrapper=wrapper):  # noqa: ANN001, ANN202
            return original(self, state, wrapper(hook))
        DistributedDataParallel.register_comm_hook = register
        try:
            torch.manual_seed(0)
            ddp, _ = worker.wrap(GPT(cfg), name, args.bucket_mb)
            if name == "fp32":
                ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        finally:
            DistributedDataParallel.register_comm_hook = original
        timelines = []
        for _ in range(args.steps):
            dist.barrier()
            events.clear()
            start[0] = time.perf_counter()
            logits = ddp(x)
            mark("fwd")
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
            loss.backward()
            mark("bwd")
            ddp.zero_grad(set_to_none=True)
            timelines.append(list(events))
        dist.barrier()
        local = []
        with ddp.no_sync():
            for _ in range(3):
                t0 = time.perf_counter()
                worker.step(ddp, x, y)
                local.append(time.perf_counter() - t0)
                ddp.zero_grad(set_to_none=True)
        out[name] = {"timelines": timelines[-2:], "no_sync_ms": round(statistics.median(local) * 1e3, 1),
                     "bucket_numel": [sizes[i] for i in sorted(sizes)]}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out)
    if rank == 0:
        Path(args.out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--configs", default="fp32,int8_ef", help="comma-separated, as in bench.py")
    parser.add_argument("--steps", type=int, default=6, help="steps per configuration; the last two are printed")
    parser.add_argument("--model", default='{"n_layer": 4, "n_embd": 256, "n_head": 4, "block_size": 64}')
    parser.add_argument("--bucket-mb", default="4", help="as bench.py's: one cap, or one per bucket (4,4,2,1)")
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        return rank_main(args)
    from bench import run_two_hosts

    out = Path(tempfile.mkdtemp()) / "trace.json"
    run_two_hosts(args.rate, [sys.executable, __file__, "--rank-main", "--out", str(out), "--batch-size",
                              str(args.batch_size), "--configs", args.configs, "--steps", str(args.steps),
                              "--model", args.model, "--bucket-mb", args.bucket_mb])
    ranks = json.loads(out.read_text())
    print(f"{args.rate}, batch {args.batch_size}x{json.loads(args.model)['block_size']}: ms since the step began")
    for name in args.configs.split(","):
        for rank, result in enumerate(ranks):
            print(f"{name} rank {rank}: no_sync step {result[name]['no_sync_ms']} ms; bucket sizes "
                  f"{result[name]['bucket_numel']} values")
            for timeline in result[name]["timelines"]:
                print("  " + "  ".join(f"{t}:{tag}" for t, tag in timeline))


if __name__ == "__main__":
    main()
