"""Compression under ``HybridParallelStrategy`` (tensor / expert parallelism): step time split into phases.

Loopback (2 processes on this machine)::

    .venv/bin/python benchmarks/compression/bench_hybrid.py

Network testbed (root; 2 emulated nodes x 2 ranks, namespaces ``ldsb*``, subnet ``10.213.74.0/24`` unless
``--prefix``/``--subnet``)::

    .venv/bin/python benchmarks/compression/bench_hybrid.py --testbed --rate 1gbit

Each configuration (``--configs``: ``ddp`` is Lightning's plain ``"ddp"``; ``tp=T ep=E fp32|int8|int4`` a
``HybridParallelStrategy`` with ``GradientCompression(warmup_steps=0)`` where compressed) trains ``--steps`` steps
of the same model, interleaved within each repetition (order rotated each repetition), the first 3 steps dropped.
Every step is split on every rank into forward, backward compute (until the last gradient is accumulated: a
post-accumulate-grad hook on every parameter), backward wait (until DDP's backward returns: the exchange of its
last bucket, and whatever the hook still does then), shard reduction (the strategy's tensor- and expert-parallel
gradient all-reduce, after the closure) and optimizer, and the hook's own CPU seconds (quantize, dequantize,
writes: ``compress_seconds``). The table gives the slowest rank's step and rank 0's phases, medians over steps then
repetitions. Extra hook settings follow the label: ``"tp=2 ep=1 int8 single_exchange_max_world=4"``.
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

MODELS = {
    "ffn": (dict(vocab_size=256, block_size=16, n_layer=2, n_head=4, n_embd=256, mlp_ratio=16), 2, 16),
    "demo": (dict(preset="small", vocab_size=256), 8, 128),
    "moe": (dict(preset="moe-small", vocab_size=256), 4, 64),
}
PHASES = ("forward", "backward compute", "backward wait", "reduce", "optimizer", "hook CPU")


def _parse(label: str) -> tuple[int, int, int | None, dict] | None:
    """``"tp=2 ep=1 int8"`` and optional hook settings after it (``"... overlap=0 hold_writes=0"``)."""
    if label == "ddp":
        return None
    tp, ep, bits, *settings = label.split()
    extra = {k: bool(int(v)) if k in ("overlap", "hold_writes") else int(v)
             for k, v in (s.split("=") for s in settings)}
    return int(tp[3:]), int(ep[3:]), None if bits == "fp32" else int(bits[3:]), extra


def worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks.timed_gpt import TimedGPT
    from lightning_deepseek import HybridParallelStrategy
    from lightning_deepseek.compression import GradientCompression
    from lightning_deepseek.models import GPTConfig
    from lightning_deepseek.models.gpt import PRESETS

    class PhasedGPT(TimedGPT):
        def on_train_start(self):
            def last_grad(_):
                self.last_grad = time.perf_counter()
            self.last_grad = float("nan")
            if not args.no_split:
                for p in self.parameters():
                    p.register_post_accumulate_grad_hook(last_grad)

        def on_train_batch_start(self, batch, batch_idx):
            super().on_train_batch_start(batch, batch_idx)
            self.marks = [self._start]

        def on_before_backward(self, loss):
            self.marks.append(time.perf_counter())

        def on_after_backward(self):
            self.marks += [self.last_grad, time.perf_counter()]
            hook = next((c.hook_state for c in self.trainer.callbacks if isinstance(c, GradientCompression)), None)
            self.compress_ms = getattr(self, "compress_ms", [])
            self.compress_ms.append(hook.compress_seconds if hook is not None else 0.0)
            if args.no_split and hook is not None:  # the hook's own mark: DDP handed it the last bucket
                self.marks[-2] = hook.last_bucket_time

        def on_before_optimizer_step(self, optimizer):
            self.marks.append(time.perf_counter())

        def on_train_batch_end(self, outputs, batch, batch_idx):
            super().on_train_batch_end(outputs, batch, batch_idx)
            self.marks.append(self._start + self.step_times[-1])
            self.phases = getattr(self, "phases", [])
            self.phases.append([b - a for a, b in zip(self.marks, self.marks[1:])])

    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    nodes = int(os.environ.get("NUM_NODES", "1"))
    config, batch, seq = MODELS[args.model]
    configs = args.configs.split(",")
    results: dict[str, list] = {c: [] for c in configs}
    for repeat in range(args.repeats):
        shift = repeat % len(configs)
        for label in configs[shift:] + configs[:shift]:
            pl.seed_everything(0, verbose=False)
            preset = PRESETS.get(config.get("preset", ""), {})
            model_config = GPTConfig(**{**preset, **{k: v for k, v in config.items() if k != "preset"}})
            module = PhasedGPT(model_config, torch.optim.AdamW, lr=1e-4)
            tokens = torch.randint(0, 256, (args.steps * batch * world, seq + 1),
                                   generator=torch.Generator().manual_seed(0))
            data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch)
            parsed = _parse(label)
            if parsed is None:
                strategy, callbacks = "ddp", []
            else:
                tp, ep, bits, extra = parsed
                # the real micro-batch: the placement the cost model assumes (TimedGPT has no example_input_array)
                strategy = HybridParallelStrategy(tensor_parallel_size=tp, expert_parallel_size=ep,
                                                  min_shard_params=0, micro_batch_tokens=batch * seq)
                callbacks = [GradientCompression(bits=bits, warmup_steps=0, **extra)] if bits else []
            trainer = pl.Trainer(accelerator="cpu", devices=world // nodes, num_nodes=nodes, strategy=strategy,
                                 max_steps=args.steps, logger=False, enable_checkpointing=False,
                                 enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
            trainer.fit(module, data)
            times = torch.tensor(module.step_times[3:])
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            phases = torch.tensor([p + [c] for p, c in zip(module.phases, module.compress_ms)][3:])
            phases = phases.median(dim=0).values.tolist()
            results[label].append({"step": times.median().item(), "phases": phases})
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results))


def report(results: dict[str, list], where: str, argv: list[str], load: tuple[float, float]) -> str:
    lines = [f"Command: `.venv/bin/python {' '.join(argv)}` ({where}; load average "
             f"{load[0]:.1f} before, {load[1]:.1f} after)", "",
             "| configuration | step (slowest rank) | vs plain DDP | rank 0: " + " | ".join(PHASES)
             + " | steps per rep |",
             "|---|---|---|" + "---|" * len(PHASES) + "---|"]
    ddp = statistics.median(r["step"] for r in results["ddp"]) if "ddp" in results else None
    for label, runs in results.items():
        step = statistics.median(r["step"] for r in runs)
        phases = [statistics.median(r["phases"][i] for r in runs) for i in range(len(PHASES))]
        ratio = f"{ddp / step:.2f}x" if ddp else ""
        reps = ", ".join(f"{1e3 * r['step']:.0f}" for r in runs)
        lines.append(f"| {label} | {1e3 * step:.1f} ms | {ratio} | "
                     + " | ".join(f"{1e3 * p:.1f}" for p in phases) + f" | {reps} |")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> None:
    from benchmarks.testbed import Testbed, run_ranks

    out = Path(tempfile.mkdtemp(prefix="ldsb-")) / "results.json"
    before = os.getloadavg()[0]
    print(f"start {time.strftime('%H:%M:%S', time.gmtime())} UTC, load {before:.1f}", flush=True)
    common = [sys.executable, __file__, "--worker", "--out", str(out), "--steps", str(args.steps),
              "--repeats", str(args.repeats), "--model", args.model, "--configs", args.configs]
    common += ["--no-split"] if args.no_split else []
    if not args.testbed:
        run_ranks(common, 29741, args.timeout, ROOT)
        where = "loopback, 2 processes, 1 thread each"
    else:
        with Testbed(num_hosts=2, rate=args.rate, prefix=args.prefix, subnet=args.subnet) as bed:
            run_ranks(common, 29742, args.timeout, ROOT, bed)
        where = f"testbed, 2 emulated nodes x 2 ranks, {args.rate} link"
    results = json.loads(out.read_text())
    print(f"end {time.strftime('%H:%M:%S', time.gmtime())} UTC", flush=True)
    print(report(results, where, [Path(sys.argv[0]).as_posix(), *sys.argv[1:]], (before, os.getloadavg()[0])))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    from benchmarks.testbed import add_arguments
    add_arguments(parser, prefix="ldsb", subnet="10.213.74")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--model", default="ffn", choices=sorted(MODELS))
    parser.add_argument("--configs", default="ddp,tp=1 ep=1 fp32,tp=1 ep=1 int8,tp=2 ep=1 fp32,tp=2 ep=1 int8")
    parser.add_argument("--timeout", type=float, default=480)
    parser.add_argument("--no-split", action="store_true", help="no per-parameter hooks: split backward where DDP "
                        "hands the compression hook its last bucket (compressed runs only)")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out", default="")
    parsed = parser.parse_args()
    worker(parsed) if parsed.worker else main(parsed)
