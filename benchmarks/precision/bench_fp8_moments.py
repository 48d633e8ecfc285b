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
import shlex
import sys
import tempfile
from typing import Any

import torch
from bench_precision import (  # same directory
    example_config,
    machine_line,
    model_label,
    parser_with_common_options,
    resolve,
    train_and_measure,
)

from lightning_deepseek import StagedPrecision
from lightning_deepseek.models import LightningGPT
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
    model = GPTWithMoments(**example_config(args))
    plugin, model.moments = setting(name)
    trainer, measured = train_and_measure(model, args, cache_dir, plugins=[plugin] if plugin else None)
    return {
        **measured,
        "moment_bytes": moment_bytes(trainer.optimizers[0]),
        "fp8_layers": len(plugin.float8_layers) if plugin is not None and plugin.float8 is not None else 0,
    }


def main(argv: list[str] | None = None) -> str:
    parser = parser_with_common_options(__doc__.splitlines()[0])
    parser.add_argument("--part", choices=(*PARTS, "all"), default="all")
    args = resolve(parser, argv, DEFAULTS)
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
    lines = [
        f"command: python {shlex.join(['benchmarks/precision/bench_fp8_moments.py', *sys.argv[1:]])}",
        machine_line(args),
        f"model: {model_label(args)} (block {args.block_size}), batch {args.batch_size}, {args.steps} steps, one run "
        f"each (deterministic on CPU); throughput leaves out the first {args.skip_steps} steps",
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
