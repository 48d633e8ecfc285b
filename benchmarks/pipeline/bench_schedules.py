"""The schedule table of docs/pipeline.md: per schedule, parameter copies and activations held per rank (measured) and
the bubble of torch's action table (computed), at P ranks and several micro-batch counts.

Each rank runs ``PipelineRunner`` (gloo) on ``bench_bubble``'s chain of 2P equal MLP blocks (1F1B: two blocks per
stage; the other schedules one block on each of their 2P stages), so every rank holds the same layers.

- parameter copies: the parameter bytes a rank holds over the whole model's bytes / P (1.00: each layer once);
- held activations: one training step runs under ``torch.autograd.graph.saved_tensors_hooks`` that count the bytes
  of every tensor saved for backward (parameters excluded, views of the same bytes counted once) from when it is
  saved until autograd frees it; the peak over the step, in units of one micro-batch's activations through the
  rank's layers (measured the same way on a local forward of two blocks: DeepSeek's DualPipe README's unit).
  Exact and deterministic: it does not depend on timing or the allocator;
- bubble: torch's action table (``pipeline_order``; 1F1B's written out) replayed with F = I = W and free
  communication (``bench_bubble.replay``), next to the formula of DeepSeek's table (``bench_bubble.formula``).

Run: ``.venv/bin/python benchmarks/pipeline/bench_schedules.py --ranks 4 --microbatches 8 16 32`` (seconds;
nothing is timed, so the machine's load does not matter).
"""

from __future__ import annotations

import argparse
import os
import sys
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_bubble import UNIT, Chain, action_order, formula, replay, spawn  # noqa: E402

from lightning_deepseek.parallel.pipeline import PipelineRunner, min_microbatches  # noqa: E402
from lightning_deepseek.parallel.pipeline_split import SCHEDULES  # noqa: E402


class HeldActivations:
    """Bytes of the tensors autograd holds for backward (parameters excluded), now and at the peak."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.param_storages = {p.untyped_storage().data_ptr() for p in params}
        self.refs: dict[tuple[int, int], int] = {}
        self.live = self.peak = 0

    def _release(self, key: tuple[int, int], nbytes: int) -> None:
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.live -= nbytes

    def pack(self, tensor: torch.Tensor) -> Any:
        if tensor.untyped_storage().data_ptr() in self.param_storages:
            return tensor
        nbytes = tensor.numel() * tensor.element_size()
        key = (tensor.data_ptr(), nbytes)  # a view of the same bytes counts once; a micro-batch's slice its own
        held = _Held(tensor)
        if key not in self.refs:
            self.refs[key] = 0
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self.refs[key] += 1
        weakref.finalize(held, self._release, key, nbytes)
        return held

    @staticmethod
    def unpack(held: Any) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _Held:
    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def _unit(args: argparse.Namespace) -> int:
    """Held bytes of one micro-batch through the two blocks every rank holds (one forward, before backward)."""
    chain = Chain(2, args.width)
    meter = HeldActivations(list(chain.parameters()))
    x = torch.randn(args.rows, args.width, requires_grad=True)
    with meter.hooks():
        out = x
        for block in chain.blocks:
            out = block(out)
    return meter.peak


def _measure(schedule: str, num_microbatches: int, args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    ranks = dist.get_world_size()
    model = Chain(2 * ranks, args.width)
    split_points = [f"blocks.{i}" for i in range(2, 2 * ranks, 2)] if schedule == "1F1B" else None
    runner = PipelineRunner.build(model, F.mse_loss, schedule=schedule, num_microbatches=num_microbatches,
                                  split_points=split_points)
    batch = torch.randn(num_microbatches * args.rows, args.width)
    runner.step(batch, batch)  # shape inference and first allocations outside the count
    params = list(runner.parameters())
    meter = HeldActivations(params)
    with meter.hooks():
        runner.step(batch, batch)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    order = action_order(runner, schedule, ranks, num_microbatches)
    return {"peak": meter.peak, "stages": len(runner.stages),
            "copies": sum(p.numel() * p.element_size() for p in params) / (whole / ranks),
            "order": order, "stage_rank": {s.index: s.rank for s in runner.split.stages}}


def _worker(rank: int, world_size: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    results = [{"schedule": s, "M": m, **_measure(s, m, args)} for s in args.schedules for m in args.microbatches
               if m >= min_microbatches(s, world_size)]
    queue.put((rank, results))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    parser.add_argument("--width", type=int, default=256, help="block width (4x hidden)")
    parser.add_argument("--rows", type=int, default=32, help="rows per micro-batch")
    args = parser.parse_args()
    by_rank = spawn(_worker, args)
    unit = _unit(args)
    print(f"P={args.ranks}, chain of {2 * args.ranks} MLP blocks {args.width} -> {4 * args.width} -> {args.width}, "
          f"{args.rows} rows per micro-batch, torch {torch.__version__}; activation unit {unit:,} B "
          "(one micro-batch through a rank's layers)")
    print("| schedule | M | stages per rank | parameter copies | held activations per rank, units (rank 0 .. P-1) "
          "| max | bubble: table (F=I=W) | formula |")
    print("|---|---|---|---|---|---|---|---|")
    for i, first in enumerate(by_rank[0]):
        held = [by_rank[r][i]["peak"] / unit for r in sorted(by_rank)]
        copies = max(by_rank[r][i]["copies"] for r in by_rank)
        order = {int(k): v for k, v in first["order"].items()}
        table = replay(order, first["stage_rank"], UNIT)
        form = formula(first["schedule"], args.ranks, first["M"], UNIT)
        print(f"| {first['schedule']} | {first['M']} | {first['stages']} | {copies:.2f}x | "
              f"{' / '.join(f'{h:.1f}' for h in held)} | {max(held):.1f} | {table:.3f} | {form:.3f} |")


if __name__ == "__main__":
    main()
