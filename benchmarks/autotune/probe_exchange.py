"""Why is compression predicted faster than training measures it? (issue #16)

The cost model predicts some compressed candidates faster than training measures them on the 1 Gbit testbed. This
probe times DDP-wrapped copies of a model (fp32, int8, int4 exchange; the hook as training registers it), sharded as
a candidate shards them (``--shard tp=2``, ``ep=2``...; DDP ignores the shards as ``HybridParallelStrategy`` does),
several ways, on all 4 ranks, slowest rank's figures:

- ``aligned``: one forward + backward after a barrier, interleaved across the exchanges (what the setup once timed);
- ``consecutive``: ``--steps`` forward + backward + optimizer steps back to back after one barrier, the median step;
- ``training``: the same with the strategy's reduction of the shards' gradients after backward (a training step);
- ``alone``: the exchange of DDP's gradient bytes alone (the setup's ``measure_exchange``);
- ``setup`` (sharded only): the setup's own ``measure_copy_steps`` (compressed minus fp32), ``--repeats`` times;
- ``fit`` (``--fits N``): ``N`` interleaved Lightning fits of ``HybridParallelStrategy`` + ``GradientCompression``
  (20 steps, the first 3 dropped), what ``bench_cost_model.py``'s grid measures.

Run (root)::

    .venv/bin/python benchmarks/autotune/probe_exchange.py --testbed --rate 1gbit \
        [--model demo --shard tp=2]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

def worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    from benchmarks.autotune.bench_cost_model import MODELS
    from benchmarks.timed_gpt import TimedGPT
    from lightning_deepseek.autotune.auto_parallel import _shard_ep, _shard_tp
    from lightning_deepseek.autotune.cost_model import DEFAULT_BLOCK_SIZE
    from lightning_deepseek.autotune.measure import (
        MicroBatch,
        _Forward,
        first_optimizer,
        measure_copy_steps,
        measure_exchange,
    )
    from lightning_deepseek.compression import CompressionConfig, register_compression_hook
    from lightning_deepseek.models import GPTConfig
    from lightning_deepseek.models.gpt import PRESETS
    from lightning_deepseek.parallel.dims import ParallelDims
    from lightning_deepseek.parallel.expert import (
        ExpertParallelDims,
        apply_expert_parallel,
        build_expert_mesh,
        reduce_expert_gradients,
    )
    from lightning_deepseek.parallel.gradients import reduce_shard_gradients
    from lightning_deepseek.parallel.placement import candidate_mesh
    from lightning_deepseek.parallel.plan import decide_plan
    from lightning_deepseek.parallel.styles import apply_tensor_parallel
    from lightning_deepseek.parallel.topology import Topology

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    _, config, batch, seq = MODELS[args.model]
    config = GPTConfig(**{**PRESETS.get(config.get("preset", ""), {}),
                          **{k: v for k, v in config.items() if k != "preset"}})
    kind, size = args.shard.split("=") if "=" in args.shard else ("none", "1")
    size = int(size)
    pl.seed_everything(0, verbose=False)
    tokens = torch.randint(0, 256, (batch, seq + 1), generator=torch.Generator().manual_seed(dist.get_rank()))
    data = (tokens[:, :-1], tokens[:, 1:])
    variants = (None, 8, 4)
    wrapped, optimizers, reductions = {}, {}, {}
    for bits in variants:
        module = TimedGPT(config, torch.optim.AdamW, lr=1e-4)
        module.log = module.log_dict = lambda *a, **k: None
        reduce = lambda: None  # noqa: E731
        if kind == "tp":
            islands = Topology(tuple(tuple(range(r, r + 2)) for r in range(0, world, 2)))  # 2 ranks per host
            grid = candidate_mesh(args.placement, islands, world // size, size)
            mesh = ParallelDims(world, tp=size).build_mesh("cpu", grid)
            plan = decide_plan(module, "auto", world, size, False, 0)
            apply_tensor_parallel(module, plan.styles, mesh["tp"])

            def reduce(module=module, mesh=mesh) -> None:
                grads = [p.grad.to_local() for p in module.parameters()
                         if isinstance(p, DTensor) and p.grad is not None]
                reduce_shard_gradients(grads, mesh.get_group("dp"), world)
        elif kind == "ep":
            mesh = build_expert_mesh("cpu", ExpertParallelDims(world, size))
            apply_expert_parallel(module, mesh)
            reduce = lambda module=module, mesh=mesh: reduce_expert_gradients(module.parameters(), mesh)  # noqa: E731
        forward = _Forward(module, MicroBatch(data, False, "", batch * seq).step(module))
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            forward, [name for name, p in forward.named_parameters() if isinstance(p, DTensor)])
        ddp = DistributedDataParallel(forward)
        if bits is not None:
            register_compression_hook(ddp, CompressionConfig(bits=bits, block_size=DEFAULT_BLOCK_SIZE[bits],
                                                             warmup_steps=0))
        wrapped[bits], optimizers[bits], reductions[bits] = ddp, first_optimizer(module), reduce

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    def step(bits, optimize: bool, reduce: bool = False) -> None:
        wrapped[bits]().backward()
        if reduce:
            reductions[bits]()
        if optimize:
            optimizers[bits].step()
        optimizers[bits].zero_grad(set_to_none=True)

    def bucketed_exchange(num_bytes: int, repeats: int) -> dict:
        """The same exchange as ``alone``, in DDP's bucket layout (a 1 MiB first bucket, then the rest, each its
        own exchange launched back to back, the hook holding the first bucket's write as in training)."""
        from lightning_deepseek.autotune.measure import _exchange_settings
        from lightning_deepseek.compression.hook import CompressionState, compressed_average

        configs, second = _exchange_settings((8, 4))
        first = min(num_bytes, 2**20) // 4
        flat = torch.randn(num_bytes // 4, generator=torch.Generator().manual_seed(dist.get_rank()))
        states = {b: CompressionState(c, dist.group.WORLD, second) for b, c in configs.items()}
        times: dict = {b: [] for b in variants}
        for i in range(repeats + 1):
            for bits in variants:
                buckets = [t.clone() for t in (flat[:first], flat[first:]) if t.numel()]
                dist.barrier()
                start = time.perf_counter()
                if bits is None:
                    futures = [dist.all_reduce(b.div_(world), async_op=True).get_future() for b in buckets]
                else:
                    state = states[bits]
                    state.begin_step()
                    futures = [compressed_average(state, [b], [f"bucket{j}"], b, hold=j < len(buckets) - 1)
                               for j, b in enumerate(buckets)]
                    state.end_step()
                    state.release()
                for future in futures:
                    future.wait()
                if i:
                    times[bits].append(slowest(time.perf_counter() - start))
        return {b: statistics.median(v) for b, v in times.items()}

    out: dict[str, dict] = {"aligned": {}, "consecutive": {}, "training": {}, "alone": {}}
    for bits in variants:  # warm-up: DDP's bucket rebuild, the hook's plans, the optimizer states
        step(bits, True, True)
        step(bits, True, True)
    aligned = {b: [] for b in variants}
    for _ in range(args.repeats):
        for bits in variants:
            dist.barrier()
            start = time.perf_counter()
            step(bits, False)
            aligned[bits].append(slowest(time.perf_counter() - start))
    def spin(seconds: float) -> None:  # Python work between steps, as a training loop's own
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    timings = [("consecutive", False, 0.0), ("training", True, 0.0)]
    timings += [(f"training + {args.spin:g} ms of Python a step", True, args.spin / 1e3)] if args.spin else []
    for name, reduce, busy in timings:
        consecutive = {b: [] for b in variants}
        for _ in range(args.rounds):
            for bits in variants:
                dist.barrier()
                marks = [time.perf_counter()]
                for _ in range(args.steps):
                    spin(busy)
                    step(bits, True, reduce)
                    marks.append(time.perf_counter())
                steps = torch.tensor([b - a for a, b in zip(marks, marks[1:])])
                dist.all_reduce(steps, op=dist.ReduceOp.MAX)
                consecutive[bits] += steps.tolist()[1:]
        out[name] = {b: statistics.median(v) for b, v in consecutive.items()}
    grad_bytes = sum(p.numel() * 4 for p in wrapped[None].parameters() if not isinstance(p, DTensor))
    alone = measure_exchange([grad_bytes], (8, 4), torch.device("cpu"), repeats=args.repeats)
    label = {None: "fp32", 8: "int8", 4: "int4"}
    for bits in variants:
        out["aligned"][bits] = statistics.median(aligned[bits])
        out["alone"][bits] = slowest(alone[(grad_bytes, bits)])
    out["alone, DDP's buckets"] = bucketed_exchange(grad_bytes, args.repeats)
    skew = []  # how far apart the ranks finish a forward + backward started together (no exchange: no_sync)
    for i in range(2 * args.repeats + 1):
        dist.barrier()
        with wrapped[None].no_sync():
            wrapped[None]().backward()
        ends = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(ends, torch.tensor([time.perf_counter()], dtype=torch.float64))  # one clock: one host
        optimizers[None].zero_grad(set_to_none=True)
        if i:
            ends = [e.item() for e in ends]
            skew.append((max(ends) - statistics.mean(ends), max(ends) - min(ends)))
    if kind != "none":  # the setup's own measurement (measure_copy_steps), --repeats times on fresh copies
        fresh = TimedGPT(config, torch.optim.AdamW, lr=1e-4)
        fresh.log = fresh.log_dict = lambda *a, **k: None
        if kind == "tp":
            plan = decide_plan(fresh, "auto", world, size, False, 0)
            shard = functools.partial(_shard_tp, plan.styles, ParallelDims(world, tp=size), grid, "cpu")
        else:
            shard = functools.partial(_shard_ep, ExpertParallelDims(world, size), "cpu")
        copies = [(kind, size, b) for b in (None, 8, 4)]
        runs = [measure_copy_steps(fresh, MicroBatch(data, False, "", batch * seq), {(kind, size): shard}, copies,
                                   25 * 2**20) for _ in range(args.repeats)]
        runs = [{b: slowest(run[(kind, size, b)]) - slowest(run[(kind, size, None)]) for b in (8, 4)} for run in runs]
        out["setup"] = {None: 0.0, **{b: statistics.median(r[b] for r in runs) for b in (8, 4)}}
        out["setup runs"] = {b: [round(r[b] * 1e3, 1) for r in runs] for b in (8, 4)}
    if args.fits:  # the real thing: Lightning fits of the strategy + GradientCompression, as bench_cost_model's grid
        out["fit"] = fits(args, kind, size)
    runs = out.pop("setup runs", {})
    out = {kind: {label[b]: v for b, v in row.items()} for kind, row in out.items()}
    out["setup runs"] = {label[b]: v for b, v in runs.items()}
    out["skew"] = [statistics.median(x for x, _ in skew), statistics.median(y for _, y in skew)]
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(out))
    dist.destroy_process_group()


def fits(args: argparse.Namespace, kind: str, size: int) -> dict:
    """Median step of ``--fits`` interleaved Lightning fits of ``HybridParallelStrategy`` sharded as ``--shard`` with
    ``GradientCompression`` (fp32, int8, int4), 20 steps each, timed as ``bench_cost_model.py`` times its grid; the
    median over the fits."""
    from benchmarks.autotune.bench_cost_model import MODELS, fit_steps
    from lightning_deepseek import HybridParallelStrategy
    from lightning_deepseek.compression import GradientCompression

    _, config, batch, seq = MODELS[args.model]
    sizes = dict(tensor_parallel_size=size if kind == "tp" else 1, expert_parallel_size=size if kind == "ep" else 1)
    times: dict = {b: [] for b in (None, 8, 4)}
    for i in range(args.fits):
        for bits in ((None, 8, 4) if i % 2 == 0 else (4, 8, None)):
            strategy = HybridParallelStrategy(**sizes, min_shard_params=0, micro_batch_tokens=batch * seq,
                                              placement=args.placement)
            callbacks = [GradientCompression(bits=bits, warmup_steps=0)] if bits else []
            times[bits].append(fit_steps(config, batch, seq, 20, strategy, callbacks)[0])
    return {b: statistics.median(v) for b, v in times.items()}


def main(args: argparse.Namespace) -> None:
    from benchmarks.testbed import Testbed, run_ranks

    out = Path(tempfile.mkdtemp(prefix="ldsp-")) / "probe.json"
    common = [sys.executable, __file__, "--worker", "--out", str(out), "--steps", str(args.steps),
              "--rounds", str(args.rounds), "--repeats", str(args.repeats), "--model", args.model,
              "--shard", args.shard, "--placement", args.placement, "--fits", str(args.fits), "--spin", str(args.spin)]
    if args.testbed:
        with Testbed(num_hosts=2, rate=args.rate, prefix=args.prefix, subnet=args.subnet) as bed:
            run_ranks(common, 29752, args.timeout, ROOT, bed)
    else:
        run_ranks(common, 29751, args.timeout, ROOT)
    result = json.loads(out.read_text())
    placement = f", {args.placement}" if args.shard.startswith("tp") else ""
    print(f"{args.model}, {args.shard}{placement}, {'testbed ' + args.rate if args.testbed else 'loopback'}")
    print("| timing | fp32 | int8 | int4 | int8 - fp32 | int4 - fp32 |\n|---|---|---|---|---|---|")
    runs = result.pop("setup runs", {})
    skew = result.pop("skew")
    for kind, row in result.items():
        print(f"| {kind} | " + " | ".join(f"{row[k] * 1e3:.1f} ms" for k in ("fp32", "int8", "int4"))
              + f" | {(row['int8'] - row['fp32']) * 1e3:+.1f} ms | {(row['int4'] - row['fp32']) * 1e3:+.1f} ms |")
    print(f"ranks finishing a forward + backward started together (median): the last {skew[0] * 1e3:.1f} ms after "
          f"the mean, {skew[1] * 1e3:.1f} ms after the first")
    if runs:
        print("setup's runs, over fp32: " + "; ".join(f"{k} " + ", ".join(f"{v:+.1f}" for v in vs) + " ms"
                                                    for k, vs in runs.items()))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    from benchmarks.testbed import add_arguments
    add_arguments(parser, prefix="ldsp", subnet="10.213.76")
    parser.add_argument("--model", default="ffn", choices=("ffn", "demo", "moe"), help="bench_cost_model's models")
    parser.add_argument("--shard", default="none", help="none, tp=N or ep=N: the copies sharded as that candidate")
    parser.add_argument("--placement", default="tp_intra_node", choices=("tp_intra_node", "dp_intra_node"),
                        help="--shard tp=N: which of tp and dp stays inside a host (the strategy's auto places the "
                             "wide FFN dp_intra_node, the demo tp_intra_node)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--spin", type=float, default=0, help="also time training steps with this many ms of "
                        "Python (a busy loop) before each, as a training loop's own work")
    parser.add_argument("--fits", type=int, default=0, help="also time this many Lightning fits of each (20 steps)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out", default="")
    parsed = parser.parse_args()
    worker(parsed) if parsed.worker else main(parsed)
