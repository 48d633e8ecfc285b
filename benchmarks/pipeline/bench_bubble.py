"""Bubble of each pipeline schedule at P ranks and M micro-batches: measured idle time against the formulas.

Each rank runs ``PipelineRunner`` (gloo, one process per rank) on a chain of 2P equal blocks: 1F1B puts two blocks on
each of its P stages, the two-stages-per-rank schedules one block on each of their 2P stages, so every rank holds the
same work. ``--compute`` picks the blocks' work:

- ``sleep``: each block's chunks are fixed sleeps (``--sleep-ms F I W``): forward F, input gradient I, weight gradient
  W (the part the zero-bubble schedules defer), on an activation path and a weight path that torch's
  ``stage_backward_input`` / ``stage_backward_weight`` split as they split real layers. The schedule, the stage split,
  the gloo transfers and the processes are real; the ranks do not compete for cores, so this measures the schedule
  on a machine with fewer cores than ranks.
- ``matmul`` (default): MLP blocks of real matmuls; needs a core per rank (``benchmarks/gpu_checks.sh`` pins 4 cores).

Every forward, backward, input-gradient and weight-gradient chunk of the stages is timed; per rank, idle = 1 -
compute / wall of the step (first rank's start to last rank's end). Three figures per schedule:

- measured: the mean over ranks of the idle fraction (median over steps, then over repetitions; schedules
  interleaved per repetition);
- table: torch's own action table of the schedule (``pipeline_order``; 1F1B's written out here) replayed with the
  measured chunk times and no communication cost: what the schedule's order costs on an ideal machine;
- formula (DeepSeek's DualPipe README table, chunk times F, B = full backward, W = weight gradient, PP stages):
  1F1B (P-1)(F+B); Interleaved1F1B (P-1)(F+B) over chunks of half the work (Megatron's (P-1)/(vM+P-1), v=2);
  ZBVZeroBubble the ZB1P row (P-1)(F+B-2W); DualPipeV (PP/2-1)(F&B+B-3W) with PP=2P and F&B=F+B (torch's
  schedule runs the paired forward and backward one after the other). Fraction = bubble / (bubble + M x per-rank
  compute).

Also printed: excess ms, (measured - table) x the step's wall, the idle time the ideal replay does not explain
(transfers, wake-ups, uneven chunks); formula and table with unit chunk times F = I = W (B = 2F), the formulas' own
assumption. The first stage's split backward is timed but left out of the chunk means: torch skips its I (the
micro-batch needs no gradient) and runs the full backward as its W.

Run: ``.venv/bin/python benchmarks/pipeline/bench_bubble.py --compute sleep --microbatches 8 16 32 --repeats 3
--steps 1`` (18 minutes; prints the table and writes ``--json``). What the formulas do not count (transfers, wake-ups:
some ms per micro-batch on a loaded machine) shrinks against the bubble as the sleeps grow. With ``matmul`` on fewer
cores than ranks the measured idle time is not the schedule's: ranks that wait give their core to ranks that compute.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

from lightning_deepseek.parallel.pipeline import PipelineRunner
from lightning_deepseek.parallel.pipeline_split import SCHEDULES

UNIT = {"F": 1.0, "B": 0.0, "I": 1.0, "W": 1.0}  # the formulas' usual assumption: F = I = W (B = I + W = 2F)
_KINDS = {"forward_one_chunk": "F", "backward_one_chunk": "B", "backward_weight_one_chunk": "W"}


class Chain(nn.Module):
    """2P equal MLP blocks in an ``nn.ModuleList``: split evenly by the counted cost."""

    def __init__(self, num_blocks: int, width: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                                    for _ in range(num_blocks))


class _SleepActivation(torch.autograd.Function):
    """The activation path: forward sleeps F, backward (the input gradient, torch's I) sleeps I."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_s: float, input_s: float) -> torch.Tensor:
        ctx.input_s = input_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.input_s)
        return grad, None, None


class _SleepWeight(torch.autograd.Function):
    """The weight path: identity forward, backward (the weight gradient, torch's W) sleeps W."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, weight_s: float) -> torch.Tensor:
        ctx.weight_s = weight_s
        return weight.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(ctx.weight_s)
        return grad, None


class SleepBlock(nn.Module):
    """``x * w`` whose chunks take fixed times: forward F, input gradient I, weight gradient W (seconds).

    The product joins the two paths, so ``stage_backward_input`` runs only the activation path's backward (I) and
    ``stage_backward_weight`` only the weight path's (W); a full backward runs both. An input without gradient (the
    first stage's micro-batch) is made a leaf that takes one, so every block does F + I + W on every stage.
    """

    def __init__(self, width: int, times: tuple[float, float, float]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.times = times

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        forward_s, input_s, weight_s = self.times
        if not x.requires_grad:
            x = x.detach().requires_grad_()
        return _SleepActivation.apply(x, forward_s, input_s) * _SleepWeight.apply(self.weight, weight_s)


class SleepChain(nn.Module):
    """2P ``SleepBlock``s in an ``nn.ModuleList``: equal chunk times on every stage."""

    def __init__(self, num_blocks: int, width: int, times: tuple[float, float, float]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(SleepBlock(width, times) for _ in range(num_blocks))


def _timed(stage: Any, totals: dict[str, list[float]]) -> None:
    """Time every chunk of ``stage`` into ``totals`` by kind. The first stage's split backward goes to ``"first"``:
    torch skips its I (the micro-batch needs no gradient) and runs the full backward as its W."""
    for method, kind in _KINDS.items():
        original = getattr(stage, method)

        def run(*args: Any, _original: Any = original, _kind: str = kind, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                key = "I" if _kind == "B" and not kwargs.get("full_backward", True) else _kind
                totals["first" if stage.is_first and key in "IW" else key].append(time.perf_counter() - start)

        setattr(stage, method, run)


def _measure(schedule: str, num_microbatches: int, args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    ranks = dist.get_world_size()
    per_stage = 2 if schedule == "1F1B" else 1
    split_points = [f"blocks.{i}" for i in range(per_stage, 2 * ranks, per_stage)]
    model = (SleepChain(2 * ranks, args.width, tuple(t / 1e3 for t in args.sleep_ms)) if args.compute == "sleep"
             else Chain(2 * ranks, args.width))
    runner = PipelineRunner.build(model, F.mse_loss, schedule=schedule, num_microbatches=num_microbatches,
                                  split_points=split_points)
    totals: dict[str, list[float]] = {k: [] for k in (*"FBIW", "first")}
    for stage in runner.stages:
        _timed(stage, totals)
    batch = torch.randn(num_microbatches * args.rows, args.width)
    blocks = [m for stage in runner.stages for m in stage.submod.modules() if isinstance(m, SleepBlock)]
    for block in blocks:
        block.times = (0.0, 0.0, 0.0)
    runner.step(batch, batch)  # shape inference, first allocations (without the sleeps)
    for block in blocks:
        block.times = tuple(t / 1e3 for t in args.sleep_ms)
    spans, computes = [], []
    for _ in range(args.steps):
        for values in totals.values():
            values.clear()
        dist.barrier()
        start = time.perf_counter()
        runner.step(batch, batch)
        spans.append((start, time.perf_counter()))
        computes.append(sum(sum(v) for v in totals.values()))
        for p in runner.parameters():
            p.grad = None
    order = action_order(runner, schedule, ranks, num_microbatches)
    means = {k: statistics.mean(v) if v else 0.0 for k, v in totals.items() if k != "first"}
    return {"spans": spans, "computes": computes, "chunk": means,
            "order": order, "stage_rank": {s.index: s.rank for s in runner.split.stages}}


def action_order(runner: PipelineRunner, schedule: str, ranks: int, num_microbatches: int) -> dict[int, list]:
    """Per rank, the schedule's actions as ``(kind, stage, micro-batch, sub-actions)`` (torch's ``pipeline_order``)."""
    if schedule == "1F1B":
        return _one_f_one_b(ranks, num_microbatches)
    return {rank: [(a.computation_type.value if hasattr(a.computation_type, "value") else str(a.computation_type),
                    a.stage_index, a.microbatch_index, [str(s) for s in (getattr(a, "sub_actions", None) or ())])
                   for a in actions if a is not None]
            for rank, actions in runner.schedule.pipeline_order.items()}


def spawn(worker: Any, args: argparse.Namespace, timeout: float = 3600) -> dict[int, Any]:
    """Run ``worker(rank, world_size, port, args, queue)`` on ``args.ranks`` processes; what each puts, by rank."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args.ranks, port, args, queue)) for r in range(args.ranks)]
    for proc in procs:
        proc.start()
    by_rank = dict(queue.get(timeout=timeout) for _ in procs)
    for proc in procs:
        proc.join()
    return by_rank


def _one_f_one_b(ranks: int, num_microbatches: int) -> dict[int, list]:
    """1F1B's order per rank (torch's ``Schedule1F1B`` runs it in code; its ``pipeline_order`` is a drawing aid)."""
    order = {}
    for rank in range(ranks):
        warmup = min(ranks - 1 - rank, num_microbatches)
        actions = [("F", rank, mb, []) for mb in range(warmup)]
        for mb in range(num_microbatches - warmup):
            actions += [("F", rank, warmup + mb, []), ("B", rank, mb, [])]
        actions += [("B", rank, mb, []) for mb in range(num_microbatches - warmup, num_microbatches)]
        order[rank] = actions
    return order


def _worker(rank: int, world_size: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    results = []
    for repeat in range(args.repeats):
        for num_microbatches in args.microbatches:
            for schedule in args.schedules:
                results.append({"schedule": schedule, "M": num_microbatches, "repeat": repeat,
                                **_measure(schedule, num_microbatches, args)})
    queue.put((rank, results))
    dist.barrier()
    dist.destroy_process_group()


def _idle(ranks: list[dict[str, Any]]) -> dict[str, float]:
    """The step's wall runs from the first rank's start to the last rank's end (one machine, one clock), as in
    ``replay``; measured = the mean over ranks of 1 - compute / wall, median over steps."""
    walls = [max(r["spans"][s][1] for r in ranks) - min(r["spans"][s][0] for r in ranks)
             for s in range(len(ranks[0]["spans"]))]
    idle = [statistics.mean(1 - r["computes"][s] / wall for r in ranks) for s, wall in enumerate(walls)]
    return {"measured": statistics.median(idle), "wall": statistics.median(walls)}


def replay(order: dict[int, list], stage_rank: dict[int, int], chunk: dict[str, float]) -> float:
    """Idle fraction of torch's action table run with ``chunk`` times and free communication (mean over ranks)."""
    full = chunk["I"] + chunk["W"] if chunk["I"] else chunk["B"]
    cost = {"F": chunk["F"], "B": full, "I": chunk["I"] or full, "W": chunk["W"]}
    last = max(stage_rank)
    done: dict[tuple[str, int, int], float] = {}
    queues = {rank: [a for a in actions if a[0] in cost or a[3]] for rank, actions in order.items()}
    clock = dict.fromkeys(queues, 0.0)
    busy = dict.fromkeys(queues, 0.0)

    def deps(kind: str, stage: int, mb: int) -> list[tuple[str, int, int]]:
        if kind == "F":
            return [("F", stage - 1, mb)] if stage > 0 else []
        if kind in ("B", "I"):
            return [("F", stage, mb)] + ([("I", stage + 1, mb)] if stage < last else [])
        return [("I", stage, mb)]

    while any(queues.values()):
        progressed = False
        for rank, queue in queues.items():
            while queue:
                kind, stage, mb, subs = queue[0]
                items = [_parse(sub) for sub in subs] if subs else [(kind, stage, mb)]
                needed = [d for k, s, m in items for d in deps(k, s, m)]
                if any(d not in done for d in needed):
                    break
                start = max([clock[rank], *(done[d] for d in needed)])
                for k, s, m in items:
                    start += cost[k]
                    busy[rank] += cost[k]
                    for key in ((k, s, m), ("I", s, m)) if k == "B" else ((k, s, m),):
                        done[key] = start
                clock[rank] = start
                queue.pop(0)
                progressed = True
        if not progressed:
            heads = {rank: queue[0] for rank, queue in queues.items() if queue}
            raise RuntimeError(f"the action table does not progress with these dependencies: {heads}")
    end = max(clock.values())
    return statistics.mean(1 - busy[r] / end for r in queues)


def _parse(text: str) -> tuple[str, int, int]:
    """``"2F5"`` -> (``"F"``, stage 2, micro-batch 5)."""
    i = 0
    while text[i].isdigit():
        i += 1
    j = i
    while not text[j].isdigit():
        j += 1
    return text[i:j], int(text[:i]), int(text[j:])


def formula(schedule: str, ranks: int, num_microbatches: int, chunk: dict[str, float]) -> float:
    f, w = chunk["F"], chunk["W"]
    b = chunk["I"] + w if chunk["I"] else chunk["B"]
    compute = num_microbatches * (f + b) * (1 if schedule == "1F1B" else 2)
    bubble = {"1F1B": (ranks - 1) * (f + b), "Interleaved1F1B": (ranks - 1) * (f + b),
              "ZBVZeroBubble": (ranks - 1) * (f + b - 2 * w),
              "DualPipeV": (ranks - 1) * ((f + b) + b - 3 * w)}[schedule]
    return bubble / (bubble + compute)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    parser.add_argument("--compute", choices=("matmul", "sleep"), default="matmul",
                        help="a block's work: real matmuls, or fixed sleeps (F, I, W of --sleep-ms)")
    parser.add_argument("--sleep-ms", type=float, nargs=3, default=(200.0, 200.0, 200.0), metavar=("F", "I", "W"),
                        help="--compute sleep: a block's forward, input-gradient and weight-gradient times")
    parser.add_argument("--width", type=int, default=256, help="block width (matmul: 4x hidden)")
    parser.add_argument("--rows", type=int, default=32, help="rows per micro-batch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per schedule and repetition")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--json", default=None, help="write the raw results here")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    by_rank = spawn(_worker, args)
    rows = []
    for i, first in enumerate(by_rank[0]):
        chunk = {k: statistics.mean(by_rank[r][i]["chunk"][k] for r in by_rank) for k in "FBIW"}
        rows.append({"schedule": first["schedule"], "M": first["M"], "repeat": first["repeat"], "chunk": chunk,
                     **_idle([by_rank[r][i] for r in by_rank]),
                     "table": replay({int(k): v for k, v in first["order"].items()}, first["stage_rank"], chunk),
                     "formula": formula(first["schedule"], args.ranks, first["M"], chunk),
                     "table_unit": replay({int(k): v for k, v in first["order"].items()}, first["stage_rank"], UNIT),
                     "formula_unit": formula(first["schedule"], args.ranks, first["M"], UNIT)})
    work = (f"sleeps F:I:W {':'.join(f'{t:g}' for t in args.sleep_ms)} ms per block" if args.compute == "sleep"
            else "matmuls")
    print(f"P={args.ranks} ranks, {work}, width {args.width}, {args.rows} rows per micro-batch, {args.repeats} "
          f"repetitions of {args.steps} steps, "
          f"torch {torch.__version__}, {os.cpu_count()} cores, load {load_before:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"{'schedule':<16} {'M':>3} {'F:I:W (F:B) ms':>17} {'formula':>8} {'table':>7} {'measured':>9} "
          f"{'spread':>13} {'meas/form':>9} {'excess ms':>9} {'formula@F=I=W':>13} {'table@F=I=W':>11}")
    for schedule in args.schedules:
        for m in args.microbatches:
            group = [r for r in rows if r["schedule"] == schedule and r["M"] == m]
            measured = statistics.median(r["measured"] for r in group)
            form = statistics.median(r["formula"] for r in group)
            table = statistics.median(r["table"] for r in group)
            excess = statistics.median((r["measured"] - r["table"]) * r["wall"] for r in group)
            ch = group[0]["chunk"]
            times = (f"{1e3 * ch['F']:.1f}:{1e3 * ch['I']:.1f}:{1e3 * ch['W']:.1f}" if ch["I"]
                     else f"{1e3 * ch['F']:.1f}:{1e3 * ch['B']:.1f}")
            spread = f"{min(r['measured'] for r in group):.3f}-{max(r['measured'] for r in group):.3f}"
            print(f"{schedule:<16} {m:>3} {times:>17} {form:>8.3f} {table:>7.3f} {measured:>9.3f} {spread:>13} "
                  f"{measured / form:>9.2f} {1e3 * excess:>9.0f} {group[0]['formula_unit']:>13.3f} "
                  f"{group[0]['table_unit']:>11.3f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"args": vars(args), "rows": rows}, out, indent=1)


if __name__ == "__main__":
    main()
