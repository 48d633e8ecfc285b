"""Expert load with and without aux-loss-free bias balancing, on the embedded text (one CPU process, 1 thread).

Run: ``.venv/bin/python benchmarks/moe/bench_balance.py [--model moe-tiny] [--steps 400] [--batch 8]
[--rates 0 3e-3 1e-2] [--seeds 0 1] [--schedule constant|cosine] [--oracle]``.

Trains the same model (per seed: same init, same batches of ``--batch`` random windows of the built-in corpus, AdamW
1e-3, constant or ``lds-train``'s warm-up + cosine schedule) once per ``update_rate`` of the bias balancing (0 = none,
the load only counted), with the counter and bias update that ``ExpertLoadBalancing`` runs after each optimizer step,
and reports, over the last 100 steps: the load imbalance of every step (max over experts of tokens / mean; worst layer
and mean over layers) averaged over the steps (what a step's slowest expert costs), the imbalance of the tokens summed
over the 100 steps (worst layer), and the validation loss on 20 held-out batches (the last 10% of the corpus). Means
over the seeds, the range in brackets.

``--oracle`` then asks what ANY bias could reach on the trained router (the last rate's model, first seed), on the
last 100 training batches with the model frozen: the final bias as it is; the fixed bias that balances the load summed
over those batches; the fixed bias that minimises the per-step imbalance itself (fitted post hoc, layer by layer:
balance the sum, then coordinate search), also on 100 held-out batches; the same oracle at larger batches (refitted);
and the sampling floor of a perfectly balanced router whose tokens choose independently (top-k of E uniformly).
The ratio of the per-expert count variance across batches to a multinomial's shows how much the text's correlation
(tokens of one window route alike) adds to the noise of a step. A plain loop rather than ``lds-train``: on this shared
machine the app's per-step overhead made 300-step runs take half an hour.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_deepseek.data.text import read_corpus  # noqa: E402
from lightning_deepseek.models import GPT, PRESETS, GPTConfig  # noqa: E402
from lightning_deepseek.models.moe import Router  # noqa: E402
from lightning_deepseek.moe.balancing import LoadCounter, update_biases  # noqa: E402
from lightning_deepseek.moe.protocol import find_expert_layers  # noqa: E402

Batches = list[tuple[torch.Tensor, torch.Tensor]]


def batches(tokens: torch.Tensor, block: int, batch: int, count: int, seed: int) -> Batches:
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(tokens) - block - 1, (count, batch), generator=gen)
    return [(torch.stack([tokens[s:s + block] for s in row]), torch.stack([tokens[s + 1:s + block + 1] for s in row]))
            for row in starts]


def lr_factor(schedule: str, steps: int, warmup: int = 20, min_ratio: float = 0.1):  # noqa: ANN201
    """lds-train's schedule (LightningGPT): linear warm-up, cosine decay to ``min_ratio``; or constant."""
    def factor(step: int) -> float:
        if schedule == "constant":
            return 1.0
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def train(model_name: str, rate: float, train_batches: Batches, val: Batches, seed: int, schedule: str,
          rule: str = "sign", clip: float = 0.0) -> tuple[GPT, dict[str, float]]:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**PRESETS[model_name]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(schedule, len(train_batches)))
    counter = LoadCounter(find_expert_layers(model))
    history, totals = [], []
    for x, y in train_batches:
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        counts = counter.take()
        totals.append(counts)
        history.append(update_biases(counter.layers, counts, rate, rule))
        if len(history) % 50 == 0:  # progress (stderr): the worst layer's per-step figure over the last 50 steps
            recent = torch.stack(history[-50:]).max(dim=1).values.mean().item()
            print(f"  seed {seed} rate {rate:g} step {len(history)}: per-step max/mean {recent:.3f}", file=sys.stderr,
                  flush=True)
    counter.remove()
    last = torch.stack(history[-100:])
    summed = torch.stack(totals[-100:]).sum(0)
    model.eval()
    with torch.no_grad():
        val_loss = sum(F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item() for x, y in val) / len(val)
    return model, {"worst": last.max(dim=1).values.mean().item(), "mean": last.mean().item(),
                   "summed": (summed.max(dim=1).values / summed.mean(dim=1)).max().item(), "val": val_loss}


# --- the oracle: what a fixed bias can reach on a frozen router ----------------------------------------------------

def step_counts(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> torch.Tensor:
    """Per-batch expert counts (N, E) of scores (N, T, E) routed top-k with ``bias``."""
    n, t, e = scores.shape
    index = torch.topk(scores + bias, top_k, dim=-1).indices.reshape(n, -1)
    return torch.zeros(n, e).scatter_add_(1, index, torch.ones(n, t * top_k))


def per_step(counts: torch.Tensor) -> torch.Tensor:
    return counts.max(dim=-1).values / counts.mean(dim=-1)


def fit_bias(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the fixed bias balancing the summed load, the fixed bias minimising the mean per-step imbalance)."""
    b = bias.clone()
    for lr in (1e-2, 3e-3, 1e-3, 3e-4):  # proportional steps on the summed load: its balance point
        for _ in range(100):
            total = step_counts(scores, b, top_k).sum(0)
            b -= lr * (total / total.mean() - 1)
    balanced, best_value = b.clone(), per_step(step_counts(scores, b, top_k)).mean().item()
    for size in (3e-2, 1e-2, 3e-3, 1e-3, 3e-4, 1e-4):  # then coordinate search on the per-step objective itself
        for _ in range(3):
            improved = False
            for e in range(b.numel()):
                for delta in (size, -size):
                    trial = b.clone()
                    trial[e] += delta
                    value = per_step(step_counts(scores, trial, top_k)).mean().item()
                    if value < best_value - 1e-6:
                        best_value, b, improved = value, trial, True
            if not improved:
                break
    return balanced, b


@torch.no_grad()
def router_scores(model: GPT, data: Batches) -> list[torch.Tensor]:
    """Every router's scores (N, T, E) on ``data``, with the routers' current biases."""
    routers = [m for m in model.modules() if isinstance(m, Router)]
    logits: list[list[torch.Tensor]] = [[] for _ in routers]
    hooks = [r.gate.register_forward_hook(lambda m, a, out, i=i: logits[i].append(out.float()))
             for i, r in enumerate(routers)]
    for x, _ in data:
        model(x)
    for hook in hooks:
        hook.remove()
    return [torch.sigmoid(torch.stack(z)) if r.score_func == "sigmoid" else torch.softmax(torch.stack(z), dim=-1)
            for r, z in zip(routers, logits)]


def worst_and_mean(ratios: list[torch.Tensor]) -> str:
    stacked = torch.stack(ratios)  # (L, N)
    return f"worst layer {stacked.max(dim=0).values.mean():.3f}, layer mean {stacked.mean():.3f}"


def fit_all(model: GPT, data: Batches) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Fit layer by layer (a layer's choice changes the next layer's input); leaves the oracle biases set."""
    routers = [m for m in model.modules() if isinstance(m, Router)]
    balanced, oracle = [], []
    for i, router in enumerate(routers):
        b, o = fit_bias(router_scores(model, data)[i], router.expert_bias, router.top_k)
        balanced.append(b)
        oracle.append(o)
        router.expert_bias.copy_(o)
    return balanced, oracle


def oracle(model: GPT, tokens: torch.Tensor, block: int, train_batches: Batches, scan: list[int]) -> None:
    routers = [m for m in model.modules() if isinstance(m, Router)]
    top_k, experts = routers[0].top_k, routers[0].num_experts
    last = train_batches[-100:]
    final = [r.expert_bias.clone() for r in routers]
    scores = router_scores(model, last)
    ratios = [per_step(step_counts(s, b, top_k)) for s, b in zip(scores, final)]
    print(f"  final bias, frozen router:        {worst_and_mean(ratios)}")
    balanced, fitted = fit_all(model, last)
    for r, b in zip(routers, balanced):  # the summed-balanced biases, applied together
        r.expert_bias.copy_(b)
    scores = router_scores(model, last)
    counts = [step_counts(s, b, top_k) for s, b in zip(scores, balanced)]
    summed = max((c.sum(0).max() / c.sum(0).mean()).item() for c in counts)
    print(f"  fixed bias balancing the sum:     {worst_and_mean([per_step(c) for c in counts])} (summed {summed:.3f})")
    for r, b in zip(routers, fitted):
        r.expert_bias.copy_(b)
    scores = router_scores(model, last)
    counts = [step_counts(s, b, top_k) for s, b in zip(scores, fitted)]
    summed = max((c.sum(0).max() / c.sum(0).mean()).item() for c in counts)
    print(f"  oracle fixed bias (fitted):       {worst_and_mean([per_step(c) for c in counts])} (summed {summed:.3f})")
    held = batches(tokens, block, len(last[0][0]), 100, 999)
    held_counts = [step_counts(s, b, top_k) for s, b in zip(router_scores(model, held), fitted)]
    print(f"  oracle fixed bias (held-out):     {worst_and_mean([per_step(c) for c in held_counts])}")
    effect = []
    for c in held_counts:
        p = c.sum(0) / c.sum()
        effect.append((c.var(0) / (c.sum(1).mean() * p * (1 - p))).mean().item())
    print(f"  count variance across steps / multinomial variance, per layer: {[round(v, 2) for v in effect]}")
    for batch in scan:
        tokens_per_step = batch * block
        iid = per_step(torch.zeros(2000, experts).scatter_add_(
            1, torch.rand(2000, tokens_per_step, experts).topk(top_k, dim=-1).indices.reshape(2000, -1),
            torch.ones(2000, tokens_per_step * top_k))).mean().item()
        for r, b in zip(routers, final):
            r.expert_bias.copy_(b)
        data = batches(tokens, block, batch, 100, 1000 + batch)
        _, fitted = fit_all(model, data)
        ratios = [per_step(step_counts(s, b, top_k)) for s, b in zip(router_scores(model, data), fitted)]
        print(f"  batch {batch:>3} x {block} = {tokens_per_step:>5} tokens: oracle fixed bias {worst_and_mean(ratios)};"
              f" independent-token floor {iid:.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="moe-tiny")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (all ranks together)")
    parser.add_argument("--rates", type=float, nargs="+", default=[0.0, 3e-3, 1e-2])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--schedule", choices=["constant", "cosine"], default="constant")
    parser.add_argument("--rule", choices=["sign", "proportional"], default="sign", help="the bias update rule")
    parser.add_argument("--clip", type=float, default=0.0, help="gradient-norm clip (lds-train: 1.0); 0: none")
    parser.add_argument("--oracle", action="store_true", help="fit the best fixed bias to the last rate's router")
    parser.add_argument("--scan", type=int, nargs="*", default=[8, 16, 32], help="--oracle's batch sizes")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokens = torch.from_numpy(np.frombuffer(read_corpus(None), dtype=np.uint8).astype(np.int64))
    split = int(len(tokens) * 0.9)
    block = PRESETS[args.model]["block_size"]
    val = batches(tokens[split:], block, 8, 20, 1)
    print(f"model={args.model} steps={args.steps} batch={args.batch}x{block} schedule={args.schedule} "
          f"seeds={args.seeds} rule={args.rule} clip={args.clip} (1 CPU thread); over the last 100 steps; "
          "mean over seeds [min-max]")
    print(f"{'update_rate':>11} {'per-step max/mean, worst layer':>31} {'layer mean':>11} "
          f"{'100-step sums, worst layer':>27} {'val_loss':>9}")
    model = train_batches = None
    base_val = None
    for rate in args.rates:
        rows = []
        for seed in args.seeds:
            train_batches = batches(tokens[:split], block, args.batch, args.steps, seed)
            trained, row = train(args.model, rate, train_batches, val, seed, args.schedule, args.rule, args.clip)
            model = trained if seed == args.seeds[0] else model
            rows.append(row)
        worst = np.array([r["worst"] for r in rows])
        mean, summed, val_loss = (float(np.mean([r[k] for r in rows])) for k in ("mean", "summed", "val"))
        base_val = val_loss if rate == 0 else base_val
        delta = f" ({100 * (val_loss / base_val - 1):+.2f}%)" if base_val and rate else ""
        print(f"{rate:>11g} {worst.mean():>10.3f} [{worst.min():.3f}-{worst.max():.3f}] {'':>5} {mean:>11.3f} "
              f"{summed:>27.3f} {val_loss:>9.4f}{delta}", flush=True)
    if args.oracle and model is not None:
        print(f"oracle on the router trained with update_rate={args.rates[-1]:g}, seed {args.seeds[0]}:")
        oracle(model, tokens[:split], block, batches(tokens[:split], block, args.batch, args.steps, args.seeds[0]),
               args.scan)


if __name__ == "__main__":
    main()
