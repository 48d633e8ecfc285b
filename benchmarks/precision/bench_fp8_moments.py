"""DeepSeek-V3's precision options on the example GPT: an FP8 stage against BF16, BF16 AdamW moments against FP32.

Every run trains the same model from the same seed on the same batches for ``--steps`` optimizer steps and is
evaluated the same way (FP32, no autocast, fixed validation batches: ``bench_precision.fp32_val_loss``).

    part fp8:      BF16  StagedPrecision([Stage("bf16-mixed")])   against
                   FP8   StagedPrecision([Stage("fp8")])          (torchao float8, emulated on CPU)
    part moments:  FP32 moments  torch.optim.AdamW                against
                   BF16 moments  lightning_deepseek.optim.AdamW (stochastic rounding; and round-to-nearest)
                   (FP32 compute in this part, so that the moments are the only difference)

Optimizer-state bytes are the bytes of ``exp_avg`` and ``exp_avg_sq`` over all parameters after the run.
On CPU the FP8 GEMMs and BF16 autocast are emulated: the loss columns are the result, tokens/s is not.

CPU (correctness size): python benchmarks/precision/bench_fp8_moments.py
GPU (FP8 speed):        python benchmarks/precision/bench_fp8_moments.py --device cuda --size gpt2-124m --part fp8
"""

from __future__ import annotations

import argparse
import datetime
import platform
import shlex
import sys
import tempfile
from typing import Any

import lightning.pytorch as pl
import torch
from bench_precision import StepTimer, fp32_val_loss  # same directory

from lightning_deepseek import GPTConfig, LightningGPT, StagedPrecision, TextDataModule
from lightning_deepseek.models import PRESETS
from lightning_deepseek.optim import AdamW

PARTS = {"fp8": ("BF16", "FP8"), "moments": ("FP32 moments", "BF16 moments", "BF16 moments, nearest rounding")}
DEFAULTS = {  # per device: size, steps, batch size, block size
    "cpu": dict(size="tiny", steps=200, batch_size=16, block_size=64),
    "cuda": dict(size="gpt2-124m", steps=300, batch_size=16, block_size=1024),
}


class GPTWithMoments(LightningGPT):
    """The example's LightningGPT with its AdamW swapped for ours (same groups, lr, betas, schedule)."""

    moments: dict[str, Any] | None = None

    def configure_optimizers(self) -> Any:
        config = super().configure_optimizers()
        if self.moments is None:
            return config
        reference = config["optimizer"]
        groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in reference.param_groups]
        defaults = reference.defaults
        ours = AdamW(groups, lr=defaults["lr"], betas=defaults["betas"], eps=defaults["eps"], **self.moments)
        lr_lambda = config["lr_scheduler"]["scheduler"].lr_lambdas[0]
        config["optimizer"] = ours
        config["lr_scheduler"]["scheduler"] = torch.optim.lr_scheduler.LambdaLR(ours, lr_lambda)
        return config


def setting(name: str) -> tuple[StagedPrecision | None, dict[str, Any] | None]:
    return {
        "BF16": (StagedPrecision([("bf16-mixed",)]), None),
        "FP8": (StagedPrecision([("fp8",)]), None),
        "FP32 moments": (None, None),
        "BF16 moments": (None, {"moment_dtype": torch.bfloat16}),
        "BF16 moments, nearest rounding": (None, {"moment_dtype": torch.bfloat16, "stochastic_rounding": False}),
    }[name]


def moment_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(s[k].numel() * s[k].element_size() for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq"))


def run_one(name: str, args: argparse.Namespace, cache_dir: str) -> dict[str, Any]:
    pl.seed_everything(args.seed, verbose=False)
    model = GPTWithMoments(GPTConfig(vocab_size=256, **{**PRESETS[args.size], "block_size": args.block_size}),
                           learning_rate=args.lr, warmup_steps=max(1, args.steps // 10))
    plugin, model.moments = setting(name)
    data = TextDataModule(block_size=args.block_size, batch_size=args.batch_size, cache_dir=cache_dir)
    timer = StepTimer(args.skip_steps, cuda=args.device == "cuda")
    trainer = pl.Trainer(accelerator=args.device, devices=1, max_steps=args.steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0, gradient_clip_val=1.0, callbacks=[timer],
                         plugins=[plugin] if plugin else None)
    trainer.fit(model, data)
    return {
        "tokens_per_s": timer.tokens / timer.seconds,
        "val_loss": fp32_val_loss(model, data, args.val_batches, trainer.strategy.root_device),
        "moment_bytes": moment_bytes(trainer.optimizers[0]),
        "fp8_layers": len(plugin.float8_layers) if plugin is not None and plugin.float8 is not None else 0,
    }


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--part", choices=(*PARTS, "all"), default="all")
    parser.add_argument("--size", choices=sorted(PRESETS), default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--skip-steps", type=int, default=3, help="warm-up steps per run left out of throughput")
    parser.add_argument("--val-batches", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch.cuda.is_available() is False")
    torch.set_num_threads(args.threads)
    parts = list(PARTS) if args.part == "all" else [args.part]
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as cache_dir:
        for part in parts:
            for name in PARTS[part]:
                results[name] = run_one(name, args, cache_dir)
                print(f"{name}: {results[name]}", file=sys.stderr, flush=True)
    table = format_table(results, parts, args)
    print(table)
    return table


def format_table(results: dict[str, dict[str, Any]], parts: list[str], args: argparse.Namespace) -> str:
    device = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
    lines = [
        f"command: python {shlex.join(['benchmarks/precision/bench_fp8_moments.py', *sys.argv[1:]])}",
        f"machine: {args.device} ({device}), torch {torch.__version__}, {args.threads} CPU thread(s); "
        f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"model: {args.size} (block {args.block_size}), batch {args.batch_size}, {args.steps} steps, one run each "
        f"(deterministic on CPU); throughput leaves out the first {args.skip_steps} steps",
    ]
    for part in parts:
        base = PARTS[part][0]
        lines += ["", f"| {part} | tokens/s | speed vs {base} | final val loss (FP32 eval) | loss vs {base} | "
                      "moment bytes | bytes vs base | FP8 layers |", "|---|---|---|---|---|---|---|---|"]
        for name in PARTS[part]:
            r, b = results[name], results[base]
            lines.append(f"| {name} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / b['tokens_per_s']:.2f}x | "
                         f"{r['val_loss']:.4f} | {100 * (r['val_loss'] - b['val_loss']) / b['val_loss']:+.2f}% | "
                         f"{r['moment_bytes']:,} | {r['moment_bytes'] / b['moment_bytes']:.2f} | {r['fp8_layers']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
