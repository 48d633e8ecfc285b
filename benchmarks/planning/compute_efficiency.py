"""The compute term of ``lds-plan`` on a real device: a 1B-class Llama-shaped model (Llama 3.2 1B's widths: 2048
hidden, 16 layers, 32 query and 8 key/value heads, SwiGLU 8192, 128,256 tokens), BF16 autocast over FP32 weights,
AdamW, one device, eager and compiled per block. The FLOPs of one step are counted by the planner's own counter
(:class:`lightning_deepseek.planning.counting.FlopCounter`, torch's formulas); the efficiency is those FLOPs over the
measured step time and the cluster preset's dense BF16 peak: what ``compute_efficiency`` (default 0.4) stands for.

Written here rather than with transformers' ``LlamaForCausalLM`` because the device machine's image has torch and
Lightning only; the shapes and the ops (RMSNorm, rotary, grouped-query SDPA, SwiGLU, untied head) are Llama's.

Usage: python benchmarks/planning/compute_efficiency.py [--device cuda] [--layers 16] [--batch 2] [--seq 2048]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import yaml
from torch import nn
from torch.nn import functional as F

from lightning_deepseek.planning.counting import FlopCounter

PRESETS = Path(__file__).resolve().parents[2] / "lightning_deepseek/app/conf/plan/presets/cluster"


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.attn_norm, self.mlp_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.attn_norm(x)
        q = self.q(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(h).view(b, t, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = (torch.cat([u[..., ::2] * cos - u[..., 1::2] * sin, u[..., ::2] * sin + u[..., 1::2] * cos], -1)
                for u in (q, k))
        group = self.heads // self.kv_heads  # repeated, as HF's Llama does (torch < 2.13's FLOP formula wants it)
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(attn.transpose(1, 2).reshape(b, t, -1))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)


class Llama(nn.Module):
    def __init__(self, layers: int, dim: int = 2048, heads: int = 32, kv_heads: int = 8, hidden: int = 8192,
                 vocab: int = 128256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads, hidden) for _ in range(layers))
        self.norm, self.head = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)
        self.head_dim = dim // heads

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.size(1)
        freq = 1.0 / 500000 ** (torch.arange(0, self.head_dim, 2, device=idx.device) / self.head_dim)
        angle = torch.outer(torch.arange(t, device=idx.device), freq)
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, angle.cos(), angle.sin())
        return self.head(self.norm(x))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--cluster", default=None, help="preset for the peak (default: from the device's name)")
    parser.add_argument("--modes", default="eager,compiled")
    args = parser.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    cluster = args.cluster or next((c for c in ("h200", "h100", "h800", "a100") if c in name.lower()), "cpu")
    peak = yaml.safe_load((PRESETS / f"{cluster}.yaml").read_text())["peak_tflops"]["bf16"] * 1e12
    torch.manual_seed(0)
    model = Llama(args.layers, vocab=args.vocab).to(device)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    data = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device=device)

    def step() -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = F.cross_entropy(model(data[:, :-1]).flatten(0, 1).float(), data[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    counter = FlopCounter()
    with counter:
        step()
    print(f"| {name} ({cluster}: {peak / 1e12:.0f} TFLOP/s BF16), {params / 1e9:.2f}B parameters, {args.batch} x "
          f"{args.seq} tokens, torch {torch.__version__} | step s | tokens/s | TFLOP/s | efficiency |")
    print("|---|---|---|---|---|")
    for mode in args.modes.split(","):
        if mode == "compiled":
            for block in model.blocks:
                block.compile()
        for _ in range(3):  # warm-up (compilation)
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.steps):
            loss = step()
        float(loss)
        seconds = (time.perf_counter() - start) / args.steps
        print(f"| {mode}, {counter.total / 1e12:.1f} TFLOP a step | {seconds:.3f} | "
              f"{args.batch * args.seq / seconds:,.0f} | {counter.total / seconds / 1e12:.1f} | "
              f"{counter.total / seconds / peak:.3f} |")
    if device.type == "cuda":
        print(f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
