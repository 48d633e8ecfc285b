"""DualPipeV with and without the overlapped forward-backward: exposed MoE all-to-all time and step time.

Run (loopback, 4 gloo ranks): ``.venv/bin/python benchmarks/moe_overlap/bench_overlap.py [--steps 6] [--repeats 3]``;
on the network testbed (needs root; 2 emulated nodes x 2 ranks joined by ``--rate``; namespaces ``--prefix``,
addresses ``--subnet``, unique per concurrent user): add ``--testbed [--rate 1gbit]``. pp=2 x ep=2: the ranks of
an ``ep`` pair hold the same two stages (DualPipeV's V) and shard the routed experts; on the testbed the ``ep`` pairs
cross the slow link (ranks 0+2 and 1+3) and the pipeline pairs stay inside a node. Model: the ``moe-small`` preset
(d=128, 16 routed experts top-2 + 1 shared, first block dense, ``--layers`` blocks: 4), sequences of ``--seq``
tokens, ``--batch`` sequences per rank in ``--micro`` micro-batches; each rank its own data;
the dense gradients averaged over the ``ep`` pair, SGD. In one run, ``plain`` and ``overlap``
(``pipeline_overlap=True``) alternate, ``--repeats`` times; each repetition builds the runner afresh, runs 2 warm-up
steps, then ``--steps`` timed steps. Per mode: the median step time (a whole training step, max over ranks), the
CPU time of a rank's process per step (all its threads, gloo's included; mean over ranks), and per rank and step the
time spent waiting on the row all-to-all handles (dispatch and combine, forward and backward; mean over ranks) with
their number and how many of them the other micro-batch computed behind. Both modes time the waits the same way
(:func:`record_exposed_all_to_all`: the asynchronous all-to-all, waited at once without overlap).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

MODES = ("plain", "overlap")


def run(rank: int, world: int, args: argparse.Namespace, out: str) -> None:
    """One rank: both modes, interleaved repetitions; rank 0 writes the results to ``out``."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor

    from lightning_deepseek.models import GPT, GPTConfig
    from lightning_deepseek.models.config import PRESETS
    from lightning_deepseek.parallel.dims import ParallelDims
    from lightning_deepseek.parallel.expert import apply_expert_parallel
    from lightning_deepseek.parallel.pipeline import PipelineRunner
    from lightning_deepseek.parallel.pipeline_overlap import record_exposed_all_to_all
    from lightning_deepseek.parallel.pipeline_split import build_stage_module, plan_pipeline_split

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    order = [0, 2, 1, 3] if args.testbed else None  # testbed: the ep pairs across the nodes
    mesh = ParallelDims(world, ep=2, pp=2).build_mesh("cpu", order)
    pp_group, ep_group = mesh["pp"].get_group(), mesh["ep"].get_group()
    config = GPTConfig(vocab_size=256, **{**PRESETS["moe-small"], "n_layer": args.layers, "block_size": args.seq})
    gen = torch.Generator().manual_seed(rank)
    data = torch.randint(0, 256, (args.steps + 2, args.batch, args.seq + 1), generator=gen)
    results: dict[str, dict] = {mode: {"step": [], "cpu": [], "exposed": [], "waits": [], "handovers": []}
                                for mode in MODES}
    for _ in range(args.repeats):
        for mode in MODES:
            torch.manual_seed(0)
            model = GPT(config)
            split = plan_pipeline_split(model, 2, "DualPipeV")
            modules = [build_stage_module(model, split, i) for i in split.stage_indices(dist.get_rank(pp_group))]
            for module in modules:
                apply_expert_parallel(module, mesh["edp", "ep"])
            runner = PipelineRunner.from_stage_modules(
                split, modules, lambda y, t: F.cross_entropy(y.flatten(0, 1), t.flatten()), pp_group, args.micro,
                pipeline_overlap=mode == "overlap")
            params = runner.parameters()
            dense = [p for p in params if not isinstance(p, DTensor)]
            opt = torch.optim.SGD(params, lr=0.01)
            times, cpu = [], []
            with record_exposed_all_to_all() as exposed:
                for step in range(args.steps + 2):
                    if step == 2:
                        exposed.seconds, exposed.count, exposed.handovers = 0.0, 0, 0
                    dist.barrier()
                    start, cpu_start = time.perf_counter(), time.process_time()
                    runner.step(data[step, :, :-1], data[step, :, 1:])
                    for p in dense:
                        dist.all_reduce(p.grad, group=ep_group)
                        p.grad.div_(2)
                    opt.step()
                    opt.zero_grad()
                    times.append(time.perf_counter() - start)
                    cpu.append(time.process_time() - cpu_start)
            stats = torch.tensor([statistics.median(times[2:]), statistics.median(cpu[2:]),
                                  exposed.seconds / args.steps, exposed.count / args.steps,
                                  exposed.handovers / args.steps], dtype=torch.float64)
            step_time = stats[:1].clone()
            dist.all_reduce(step_time, op=dist.ReduceOp.MAX)
            dist.all_reduce(stats)
            row = results[mode]
            row["step"].append(step_time.item())
            for key, value in zip(("cpu", "exposed", "waits", "handovers"), (stats[1:] / world).tolist()):
                row[key].append(value)
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def loopback(args: argparse.Namespace, out: Path) -> None:
    from benchmarks.testbed import spawn_loopback

    spawn_loopback(run, 4, args, out)


def testbed(args: argparse.Namespace, out: Path) -> None:
    """4 worker processes, 2 in each of 2 network namespaces joined by ``args.rate``."""
    from benchmarks.testbed import spawn_on_testbed

    argv = [sys.executable, __file__, "--worker", "--out", str(out), "--testbed", *_shared_argv(args)]
    spawn_on_testbed(args, argv, 29653, ROOT)


def _shared_argv(args: argparse.Namespace) -> list[str]:
    return ["--steps", str(args.steps), "--repeats", str(args.repeats), "--layers", str(args.layers),
            "--batch", str(args.batch), "--micro", str(args.micro), "--seq", str(args.seq)]


def report(res: dict, args: argparse.Namespace) -> None:
    where = f"testbed 2 nodes x 2 ranks, {args.rate}, ep across the link" if args.testbed else "loopback, 4 ranks"
    print(f"{where}; pp=2 x ep=2, DualPipeV, {args.micro} micro-batches; moe-small x {args.layers} layers; batch "
          f"{args.batch}x{args.seq} tokens per rank; steps={args.steps} repeats={args.repeats} (gloo, 1 thread per "
          f"rank); load: {os.getloadavg()}")
    print("| mode | step time, median (per repetition) | CPU time per rank and step | exposed all-to-all per step, "
          "median (per repetition) | waits / step | of them overlapped |")
    print("|---|---|---|---|---|---|")
    for mode, row in res.items():
        print(f"| {mode} | {statistics.median(row['step']) * 1e3:.0f} ms "
              f"({' / '.join(f'{t * 1e3:.0f}' for t in row['step'])}) | {statistics.median(row['cpu']) * 1e3:.0f} ms "
              f"| {statistics.median(row['exposed']) * 1e3:.1f} ms "
              f"({' / '.join(f'{t * 1e3:.1f}' for t in row['exposed'])}) "
              f"| {statistics.median(row['waits']):.0f} | {statistics.median(row['handovers']):.0f} |")
    plain, overlap = res["plain"], res["overlap"]
    step = [o / p for o, p in zip(overlap["step"], plain["step"])]
    exposed = [o / p for o, p in zip(overlap["exposed"], plain["exposed"])]
    print(f"overlap / plain, per repetition: step time {' '.join(f'{r:.2f}' for r in step)} (median "
          f"{statistics.median(step):.2f}); exposed all-to-all {' '.join(f'{r:.2f}' for r in exposed)} (median "
          f"{statistics.median(exposed):.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4, help="blocks (the moe-small preset's 4: one per stage)")
    parser.add_argument("--micro", type=int, default=8, help="micro-batches per step (DualPipeV: at least 4)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per rank and step")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--testbed", action="store_true")
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--prefix", default="ldso", help="testbed namespace prefix (unique per concurrent user)")
    parser.add_argument("--subnet", default="10.213.53", help="testbed /24 (unique per concurrent user)")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, args.out)
        return
    with tempfile.TemporaryDirectory(prefix="ldso-") as tmp:
        out = Path(tmp) / "results.json"
        (testbed if args.testbed else loopback)(args, out)
        report(json.loads(out.read_text()), args)


if __name__ == "__main__":
    main()
