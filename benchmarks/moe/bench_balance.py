"""Expert load with and without aux-loss-free bias balancing, on the embedded text (one CPU process).

Run: ``.venv/bin/python benchmarks/moe/bench_balance.py [--model moe-tiny] [--steps 200] [--rates 0 1e-3 1e-2]``.
Trains the same model (same seed, same batches: random windows of the built-in corpus, 8 x block_size tokens,
AdamW 1e-3) once per ``update_rate`` of the bias balancing (0 = none, the load only counted), with the counter and
bias update that ``ExpertLoadBalancing`` runs after each optimizer step, and reports the load imbalance (max over
experts of tokens / mean; max and mean over layers) of every step averaged over the last 100 steps (what a step's
slowest expert costs), the imbalance of the tokens summed over those 100 steps (worst layer), and the validation
loss on 20 held-out batches (the last 10% of the corpus). A plain loop rather than ``lds-train``: on this shared machine
the app's per-step overhead made 300-step runs take half an hour.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_deepseek.data.text import read_corpus  # noqa: E402
from lightning_deepseek.models import GPT, PRESETS, GPTConfig  # noqa: E402
from lightning_deepseek.moe.balancing import LoadCounter, update_biases  # noqa: E402
from lightning_deepseek.moe.protocol import find_expert_layers  # noqa: E402

BATCH = 8


def batches(tokens: torch.Tensor, block: int, count: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(tokens) - block - 1, (count, BATCH), generator=gen)
    return [(torch.stack([tokens[s:s + block] for s in row]), torch.stack([tokens[s + 1:s + block + 1] for s in row]))
            for row in starts]


def run(model_name: str, steps: int, rate: float, train: list, val: list) -> tuple[float, float, float, float]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**PRESETS[model_name]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    counter = LoadCounter(find_expert_layers(model))
    history, totals = [], []
    for x, y in train[:steps]:
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
        counts = counter.take()
        totals.append(counts)
        history.append(update_biases(counter.layers, counts, rate))
    last = torch.stack(history[-100:])
    summed = torch.stack(totals[-100:]).sum(0)
    window = (summed.max(dim=1).values / summed.mean(dim=1)).max().item()
    model.eval()
    with torch.no_grad():
        val_loss = sum(F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item() for x, y in val) / len(val)
    return last.max(dim=1).values.mean().item(), last.mean().item(), window, val_loss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="moe-tiny")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rates", type=float, nargs="+", default=[0.0, 1e-3, 1e-2])
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokens = torch.from_numpy(np.frombuffer(read_corpus(None), dtype=np.uint8).astype(np.int64))
    split = int(len(tokens) * 0.9)
    block = PRESETS[args.model]["block_size"]
    train, val = batches(tokens[:split], block, args.steps, 0), batches(tokens[split:], block, 20, 1)
    print(f"model={args.model} steps={args.steps} batch={BATCH}x{block} (1 CPU thread); imbalance over the last "
          "100 steps")
    print(f"{'update_rate':>11} {'max/mean, worst layer':>22} {'max/mean, layer mean':>21} "
          f"{'100-step sums, worst layer':>27} {'val_loss':>9}")
    for rate in args.rates:
        worst, mean, window, val_loss = run(args.model, args.steps, rate, train, val)
        print(f"{rate:>11g} {worst:>22.3f} {mean:>21.3f} {window:>27.3f} {val_loss:>9.4f}", flush=True)


if __name__ == "__main__":
    main()
