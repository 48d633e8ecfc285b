"""The pipeline schedules' single-device path: a world of one rank, every stage on it (Interleaved1F1B and the V
schedules hold two), against the plain forward and backward of the same model: the first loss and gradients must
agree, and tokens/s says what the schedule's bookkeeping costs on one device (issue #47's GPU check).

Usage: python benchmarks/pipeline/one_device.py [--device cuda] [--size gpt2-124m] [--steps 20]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn import functional as F

from lightning_deepseek.models.config import PRESETS, GPTConfig
from lightning_deepseek.models.gpt import GPT
from lightning_deepseek.parallel.pipeline import SCHEDULES, PipelineRunner


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", default="gpt2-124m" if torch.cuda.is_available() else "small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29617")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=0, world_size=1)
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**PRESETS[args.size], "dropout": 0.0})).to(device)
    block = model.config.block_size
    data = torch.randint(0, model.config.vocab_size, (args.steps + 1, args.batch, block + 1), device=device)
    rows = []

    def timed(step) -> tuple[float, float]:
        step(0)
        first = None
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(1, args.steps + 1):
            loss = step(i)
            first = first if first is not None else float(loss)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return args.steps * args.batch * block / (time.perf_counter() - start), first

    def plain(i: int) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        losses = [_loss(model(x), y) for x, y in zip(data[i, :, :-1].chunk(args.microbatches),
                                                        data[i, :, 1:].chunk(args.microbatches))]
        for loss in losses:
            (loss / args.microbatches).backward()
        return torch.stack(losses).mean().detach()

    tokens, first = timed(plain)
    rows.append(("plain forward and backward", tokens, first, 0.0))
    plain(1)
    reference = {name: p.grad.clone() for name, p in model.named_parameters()}
    for schedule in SCHEDULES:
        microbatches = max(args.microbatches, 2 if schedule == "DualPipeV" else 1)
        runner = PipelineRunner.build(model, _loss, schedule=schedule, num_microbatches=microbatches, device=device)

        def piped(i: int, runner: PipelineRunner = runner) -> torch.Tensor:
            for p in runner.parameters():
                p.grad = None
            return runner.step(data[i, :, :-1], data[i, :, 1:])  # torch averages over micro-batches

        tokens, first = timed(piped)
        piped(1)
        grads = {name: p.grad for module in runner.modules for name, p in module.named_parameters()}
        if set(grads) != set(reference):
            raise SystemExit(f"{schedule}: the stages hold {sorted(set(grads) ^ set(reference))} unlike the model")
        error = max((grads[name] - grad).abs().max().item() for name, grad in reference.items())
        stages = runner.split.num_stages
        rows.append((f"{schedule} ({stages} stage{'s' * (stages > 1)} on one rank)", tokens, first, error))
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"| {name}, {args.size}, batch {args.batch} x {block} tokens, {args.microbatches} micro-batches, torch "
          f"{torch.__version__} | tokens/s | first loss | max abs grad error |\n|---|---|---|---|")
    for label, tokens, first, error in rows:
        print(f"| {label} | {tokens:,.0f} | {first:.6f} | {error:.2e} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
