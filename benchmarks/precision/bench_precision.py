"""Throughput and final validation loss of FP32, FP16, BF16 and the staged schedule on the example GPT.

Each configuration trains the same model from the same seed on the same batches for ``--steps`` optimizer steps;
configurations are interleaved (the order rotates every repetition) and the table reports medians and ratios to
FP32 measured in the same run. Throughput counts training steps only (forward, backward, optimizer), after
``--skip-steps`` warm-up steps per run, with ``torch.cuda.synchronize`` around each step on CUDA. The final
validation loss of every run is measured the same way for all: FP32 evaluation, no autocast, fixed batches.

    FP32    Trainer(precision="32-true")                        (on CUDA true FP32: TF32 off, torch's default)
    FP16    Lightning MixedPrecision("16-mixed") + GradScaler    (built directly: the flag means BF16 on CPU)
    BF16    Trainer(precision="bf16-mixed")
    staged  StagedPrecision() default: FP32 first 10%, FP16 to 80%, BF16 after

CPU (correctness size): python benchmarks/precision/bench_precision.py
GPU (real size):        python benchmarks/precision/bench_precision.py --device cuda --size gpt2-124m
"""

from __future__ import annotations

import argparse
import datetime
import platform
import shlex
import statistics
import sys
import tempfile
import time
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_deepseek import StagedPrecision
from lightning_deepseek.data import TextDataModule
from lightning_deepseek.models import PRESETS, GPTConfig, LightningGPT

CONFIGS = ("FP32", "FP16", "BF16", "staged")
DEFAULTS = {  # per device: size, steps, batch size, block size, repetitions
    "cpu": dict(size="tiny", steps=60, batch_size=16, block_size=64, reps=3),
    "cuda": dict(size="gpt2-124m", steps=300, batch_size=16, block_size=1024, reps=2),
}


class StepTimer(Callback):
    """Wall time and tokens of training steps after the first ``skip`` of a run."""

    def __init__(self, skip: int, cuda: bool) -> None:
        self.skip, self.cuda = skip, cuda
        self.seconds, self.tokens, self._start = 0.0, 0, 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        if trainer.global_step > self.skip:
            self.seconds += time.perf_counter() - self._start
            self.tokens += batch[0].numel()


def precision_setting(name: str, device: str) -> dict[str, Any]:
    if name == "FP32":
        return {"precision": "32-true"}
    if name == "FP16":
        return {"plugins": [MixedPrecision("16-mixed", device, torch.amp.GradScaler(device))]}
    if name == "BF16":
        return {"precision": "bf16-mixed"}
    return {"plugins": [StagedPrecision()]}


@torch.no_grad()
def fp32_val_loss(model: LightningGPT, data: TextDataModule, num_batches: int, device: torch.device) -> float:
    model.to(device).eval()  # on CUDA, Lightning's teardown moved the model back to the CPU
    losses = []
    for i, (x, y) in enumerate(data.val_dataloader()):
        if i == num_batches:
            break
        logits = model(x.to(device))
        losses.append(float(F.cross_entropy(logits.float().flatten(0, 1), y.to(device).flatten())))
    return sum(losses) / len(losses)


def train_and_measure(model: LightningGPT, args: argparse.Namespace, cache_dir: str,
                      **trainer_kwargs: Any) -> tuple[pl.Trainer, dict[str, float]]:
    """Train ``model`` for ``args.steps`` steps of the example text; tokens/s of its steps and its FP32 val loss."""
    data = TextDataModule(block_size=args.block_size, batch_size=args.batch_size, cache_dir=cache_dir)
    if args.compile:  # each block's forward in place (torchtitan's way): names and Parameters stay the same
        for block in model.model.blocks:
            block.compile()
    timer = StepTimer(args.skip_steps, cuda=args.device == "cuda")
    trainer = pl.Trainer(
        accelerator=args.device, devices=1, max_steps=args.steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        gradient_clip_val=1.0, callbacks=[timer], **trainer_kwargs,
    )
    trainer.fit(model, data)
    return trainer, {"tokens_per_s": timer.tokens / timer.seconds,
                     "val_loss": fp32_val_loss(model, data, args.val_batches, trainer.strategy.root_device)}


def example_config(args: argparse.Namespace) -> dict[str, Any]:
    """``LightningGPT`` arguments of the benchmark's model (seeded before it is built)."""
    pl.seed_everything(args.seed, verbose=False)
    return dict(config=GPTConfig(vocab_size=256, **{**PRESETS[args.size], "block_size": args.block_size,
                                                     **dim_overrides(args)}),
                learning_rate=args.lr, warmup_steps=max(1, args.steps // 10))


def dim_overrides(args: argparse.Namespace) -> dict[str, int]:
    """The size preset's dimensions the command line overrode (``--n-layer/--n-head/--n-embd``)."""
    return {k: getattr(args, k) for k in ("n_layer", "n_head", "n_embd") if getattr(args, k) is not None}


def model_label(args: argparse.Namespace) -> str:
    """The size preset and any dimension the command line overrode."""
    dims = ", ".join(f"{k} {v}" for k, v in dim_overrides(args).items())
    return f"{args.size}{' with ' + dims if dims else ''}"


def run_one(name: str, args: argparse.Namespace, cache_dir: str) -> dict[str, Any]:
    model = LightningGPT(**example_config(args))
    trainer, measured = train_and_measure(model, args, cache_dir, **precision_setting(name, args.device))
    plugin = trainer.precision_plugin
    return {
        **measured,
        "skipped": getattr(plugin, "num_skipped_steps", None),
        "fallbacks": len(getattr(plugin, "fallbacks", {})),
    }


def parser_with_common_options(description: str) -> argparse.ArgumentParser:
    """The options both precision benchmarks take (``None``: the device's default, see ``resolve``)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--size", choices=sorted(PRESETS), default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=None)
    for dim in ("n-layer", "n-head", "n-embd"):
        parser.add_argument(f"--{dim}", type=int, default=None, help=f"override the size preset's {dim}")
    parser.add_argument("--skip-steps", type=int, default=3, help="warm-up steps per run left out of throughput")
    parser.add_argument("--val-batches", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile each transformer block; compiling falls in the left-out warm-up steps")
    return parser


def resolve(parser: argparse.ArgumentParser, argv: list[str] | None,
            defaults: dict[str, dict[str, Any]]) -> argparse.Namespace:
    """Parse, fill unset options from the device's ``defaults``, check the device, set the CPU threads."""
    args = parser.parse_args(argv)
    for key, value in defaults[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch.cuda.is_available() is False")
    torch.set_num_threads(args.threads)
    return args


def machine_line(args: argparse.Namespace) -> str:
    device = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
    return (f"machine: {args.device} ({device}), torch {torch.__version__}, {args.threads} CPU thread(s); "
            f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
            f"{'; blocks compiled (torch.compile)' if args.compile else ''}")


def main(argv: list[str] | None = None) -> str:
    parser = parser_with_common_options(__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=None)
    args = resolve(parser, argv, DEFAULTS)
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory() as cache_dir:
        for rep in range(args.reps):
            order = CONFIGS[rep % len(CONFIGS):] + CONFIGS[:rep % len(CONFIGS)]
            for name in order:
                results[name].append(run_one(name, args, cache_dir))
                print(f"rep {rep} {name}: {results[name][-1]}", file=sys.stderr, flush=True)
    table = format_table(results, args)
    print(table)
    return table


def format_table(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> str:
    speed = {name: statistics.median(r["tokens_per_s"] for r in runs) for name, runs in results.items()}
    loss = {name: statistics.median(r["val_loss"] for r in runs) for name, runs in results.items()}
    lines = [
        f"command: python {shlex.join(['benchmarks/precision/bench_precision.py', *sys.argv[1:]])}",
        machine_line(args),
        f"model: {model_label(args)} (block {args.block_size}), batch {args.batch_size}, {args.steps} steps, "
        f"{args.reps} interleaved repetitions, medians; throughput leaves out the first {args.skip_steps} steps",
        "",
        "| precision | tokens/s | speed vs FP32 | final val loss (FP32 eval) | loss vs FP32 | skipped steps "
        "| fallbacks |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in CONFIGS:
        runs = results[name]
        skipped = "-" if runs[0]["skipped"] is None else str(statistics.median(r["skipped"] for r in runs))
        fallbacks = "-" if name != "staged" else str(max(r["fallbacks"] for r in runs))
        lines.append(f"| {name} | {speed[name]:,.0f} | {speed[name] / speed['FP32']:.2f}x | {loss[name]:.4f} | "
                     f"{100 * (loss[name] - loss['FP32']) / loss['FP32']:+.2f}% | {skipped} | {fallbacks} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
