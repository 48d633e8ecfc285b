"""Pipeline across the slow link on the 1 Gbit testbed: pp=2 x dp=2 against Lightning's DDP and the best layout
without a pipeline, step time and tokens/s side by side, and the planner's predicted step for the same layouts.

Run as root: ``.venv/bin/python benchmarks/pipeline/bench_testbed.py [--rate 1gbit] [--repeats 3] [--steps 8]``.
It builds the network testbed (2 namespaces ``ldpp0``/``ldpp1`` x 2 ranks, subnet ``10.213.57.0/24`` unless
``--prefix``/``--subnet``) and in the same 4 processes fits our GPT (``LightningGPT``: AdamW, FP32) under each
configuration, interleaved within each repetition (order rotated), for each model:

- ``ddp``: Lightning's ``strategy="ddp"``; ``ddp+int8``: the same with ``GradientCompression(bits=8)``;
- ``hsdp``: ``HybridParallelStrategy(data_parallel_shard_size=2)``: FSDP2 inside a node, its replicas across;
- ``pp 1F1B`` / ``pp DualPipeV``: ``HybridParallelStrategy(pipeline_parallel_size=2)``, the pipeline (ranks 0-2,
  1-3) across the link, its ``dp`` replicas (0-1, 2-3) inside the nodes, ``--microbatches`` per batch.

Every configuration trains the same global batch per step (``MODELS``: sequences of tokens per rank under data
parallelism; a pipeline's replica reads twice that and splits it into micro-batches). A step's time is the
slowest rank's (batch start to batch end, optimizer included); the first 3 steps are dropped. The planner
(``lightning_deepseek.planning.plan``, what ``lds-plan`` runs) predicts the same layouts on the ``testbed`` cluster
preset; compression is not planned, pipelines only where the planner has them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

GPT = dict(vocab_size=256, n_head=4, n_embd=256)
# name: (GPTConfig fields, sequences per rank and step under data parallelism, tokens per sequence)
MODELS = {
    "deep": (dict(GPT, n_layer=16, block_size=32), 2, 32),
    "shallow": (dict(GPT, n_layer=4, block_size=32), 2, 32),
    "shallow-long": (dict(GPT, n_layer=4, block_size=128), 4, 128),
}
CONFIGS = ("ddp", "ddp+int8", "hsdp", "pp 1F1B", "pp DualPipeV")
SKIP = 3  # first steps dropped (allocations, DDP's bucket rebuild, the compression's first calls)


def _strategy(label: str, microbatches: int):
    from lightning_deepseek import HybridParallelStrategy
    from lightning_deepseek.compression import GradientCompression

    if label in ("ddp", "ddp+int8"):
        return "ddp", [GradientCompression(bits=8, warmup_steps=0)] if label == "ddp+int8" else []
    if label == "hsdp":
        return HybridParallelStrategy(data_parallel_shard_size=2), []
    return HybridParallelStrategy(pipeline_parallel_size=2, pipeline_schedule=label.split()[1],
                                  pipeline_microbatches=microbatches), []


def _groups(label: str, strategy) -> dict[str, list[int]]:
    """The ranks of the groups that decide what crosses the link (checked in the report)."""
    import torch.distributed as dist

    if label == "hsdp":
        mesh = strategy.world_mesh.sharding
        return {name: dist.get_process_group_ranks(mesh.get_group(name)) for name in mesh.mesh_dim_names}
    if label.startswith("pp"):
        return {"pp": dist.get_process_group_ranks(strategy.pipeline_group)}
    return {}


def worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_deepseek.models import GPTConfig
    from lightning_deepseek.models.lightning_gpt import LightningGPT

    class TimedGPT(LightningGPT):
        def on_train_batch_start(self, batch, batch_idx):
            self.started = time.perf_counter()

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.step_times.append(time.perf_counter() - self.started)
            self.losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))

    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    results: list[dict] = []
    configs = args.configs.split(",")
    for repeat in range(args.repeats):
        for model in args.models.split(","):
            shift = repeat % len(configs)
            for label in configs[shift:] + configs[:shift]:
                pl.seed_everything(0, verbose=False)
                config, batch, seq = MODELS[model]
                module = TimedGPT(GPTConfig(**config))
                module.step_times, module.losses = [], []
                params = sum(p.numel() for p in module.model.parameters())
                replicas = world // 2 if label.startswith("pp") else world
                tokens = torch.randint(0, 256, (args.steps * batch * world, seq + 1),
                                       generator=torch.Generator().manual_seed(0))
                data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch * world // replicas)
                strategy, callbacks = _strategy(label, args.microbatches)
                trainer = pl.Trainer(accelerator="cpu", devices=world // 2, num_nodes=2, strategy=strategy,
                                     max_steps=args.steps, logger=False, enable_checkpointing=False,
                                     enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
                trainer.fit(module, data)
                times = torch.tensor(module.step_times[SKIP:], dtype=torch.float64)
                dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step ends on its last rank
                results.append(dict(repeat=repeat, model=model, config=label, step_s=times.median().item(),
                                    steps=times.tolist(), loss=module.losses[-1],
                                    params=params,
                                    groups=_groups(label, trainer.strategy)))
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results))


def predictions(args: argparse.Namespace) -> dict[tuple[str, str], tuple[float, int] | str]:
    """The planner's (step seconds, bytes a rank hands to collectives and sends across nodes) per (model,
    configuration), or why there is none."""
    from lightning_deepseek.app.plan import resolve_cluster
    from lightning_deepseek.planning import ModelSpec, PlanLayout, StepShape, plan

    cluster = resolve_cluster("testbed")
    fields = {f.name for f in dataclasses.fields(PlanLayout)}
    out: dict[tuple[str, str], tuple[float, int] | str] = {}
    for model in args.models.split(","):
        config, batch, seq = MODELS[model]
        spec = ModelSpec(f"gpt-{model}", "lds", config)
        for label in args.configs.split(","):
            if label == "ddp+int8":
                out[model, label] = "not planned (compression)"
                continue
            if label.startswith("pp") and "pp" not in fields:
                out[model, label] = "not planned (no pipelines in the planner yet)"
                continue
            layout = {"ddp": PlanLayout(), "hsdp": PlanLayout(dp_shard=2)}.get(label)
            sequences = batch
            if layout is None:  # a replica's batch (2 x batch sequences) in micro-batches of StepShape's size
                layout = PlanLayout(pp=2, pp_schedule=label.split()[1], pp_microbatches=args.microbatches)
                sequences = 2 * batch // args.microbatches
            made = plan(spec, 4, layout, cluster, StepShape(sequences, seq, "fp32"))
            out[model, label] = made.step_seconds, sum(t.num_bytes for t in made.traffic if t.link == "inter")
    return out


def report(results: list[dict], planned: dict, args: argparse.Namespace, load: tuple[float, float],
           argv: list[str]) -> str:
    """One row per configuration; per model the measured step (median of the repetitions' medians, their range),
    tokens/s, the speed-up over ``ddp`` paired within each repetition (median, range), and the plan."""
    models, configs = args.models.split(","), args.configs.split(",")
    lines = [f"Command: `.venv/bin/python {' '.join(argv)}` (testbed 2 x 2, {args.rate}; load average "
             f"{load[0]:.1f} before, {load[1]:.1f} after; {1 + max(r['repeat'] for r in results)} interleaved "
             f"repetitions, {len(results[0]['steps'])} timed steps each)", ""]
    head = [f"{m} ({MODELS[m][0]['n_layer']} layers, {MODELS[m][1]}x{MODELS[m][2]} tokens/rank)" for m in models]
    lines += ["| configuration | " + " | ".join(f"{h}: step, tokens/s, vs ddp | plan: step (error), MiB across"
                                                for h in head) + " |", "|---|" + "---|---|" * len(models)]
    for label in configs:
        cells = []
        for model in models:
            runs = {r["repeat"]: r["step_s"] for r in results if r["model"] == model and r["config"] == label}
            ddp = {r["repeat"]: r["step_s"] for r in results if r["model"] == model and r["config"] == "ddp"}
            step = statistics.median(runs.values())
            paired = [ddp[k] / runs[k] for k in runs]
            _, batch, seq = MODELS[model]
            cells.append(f"{1e3 * step:.0f} ms ({1e3 * min(runs.values()):.0f}-{1e3 * max(runs.values()):.0f}), "
                         f"{4 * batch * seq / step:,.0f}, {statistics.median(paired):.2f}x "
                         f"({min(paired):.2f}-{max(paired):.2f})")
            pred = planned.get((model, label), "not planned")
            cells.append(pred if isinstance(pred, str) else
                         f"{1e3 * pred[0]:.0f} ms ({100 * (pred[0] - step) / step:+.0f}%), {pred[1] / 2**20:.2f}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    groups = {r["config"]: r["groups"] for r in results if r["groups"]}
    lines += ["", "groups: " + "; ".join(f"{c}: " + ", ".join(f"{k} {v}" for k, v in g.items())
                                         for c, g in groups.items())]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> None:
    from benchmarks.testbed import Testbed, run_ranks

    if args.results:  # report (and plan) a saved run
        saved = json.loads(Path(args.results).read_text())
        print(report(saved["results"], predictions(args), args, tuple(saved["load"]), saved["argv"]))
        return
    out = Path(tempfile.mkdtemp(prefix="ldpp-")) / "results.json"
    before = os.getloadavg()[0]
    print(f"start {time.strftime('%H:%M:%S', time.gmtime())} UTC, load {before:.1f}", flush=True)
    argv = [sys.executable, __file__, "--worker", "--out", str(out), "--steps", str(args.steps), "--repeats",
            str(args.repeats), "--models", args.models, "--configs", args.configs,
            "--microbatches", str(args.microbatches)]
    with Testbed(num_hosts=2, rate=args.rate, prefix=args.prefix, subnet=args.subnet) as bed:
        run_ranks(argv, 29757, args.timeout, ROOT, bed)
    after = os.getloadavg()[0]
    print(f"end {time.strftime('%H:%M:%S', time.gmtime())} UTC, load {after:.1f}", flush=True)
    results = json.loads(out.read_text())
    argv = [Path(sys.argv[0]).as_posix(), *sys.argv[1:]]
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "load": [before, after], "argv": argv}))
    planned = {} if args.no_plan else predictions(args)
    print(report(results, planned, args, (before, after), argv))


if __name__ == "__main__":
    from benchmarks.testbed import add_arguments

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, prefix="ldpp", subnet="10.213.57")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="steps per fit (the first 3 not timed)")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated: {', '.join(MODELS)}")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated: {', '.join(CONFIGS)}")
    parser.add_argument("--microbatches", type=int, default=4, help="a pipeline's micro-batches per batch")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--no-plan", action="store_true", help="skip the planner's predictions")
    parser.add_argument("--json", default=None, help="write the raw results here")
    parser.add_argument("--results", default=None, help="report a --json file of an earlier run (no run)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parsed = parser.parse_args()
    worker(parsed) if parsed.worker else main(parsed)
