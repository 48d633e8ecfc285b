"""Activation checkpointing: the activation bytes one training step keeps, and its peak RSS, for none/full/selective.

Run: ``.venv/bin/python benchmarks/activation_checkpointing/bench_memory.py [--n-layer 6 --n-embd 192 --seq 1024]``.
Each mode runs in a fresh process (one FP32 step of our GPT, widened, with a long sequence: AdamW state is not
involved). Measured per mode, deterministically:

- **saved**: bytes of the distinct storages autograd saves during the forward (``saved_tensors_hooks``), outside
  the checkpointed blocks (the checkpoint's own hooks drop what is inside);
- **kept**: bytes of the distinct storages the forward created that are alive when it returns: what backward will
  read, including what selective checkpointing caches (no saved-tensor hook sees that cache);
- **peak RSS**: the process's peak resident memory during one forward and backward, minus its resident memory
  just before (parameters and gradients already allocated): activations plus the transient memory of the step.

Also one run of ``none`` with a single block, from which one block's activations are derived; the target
(issue 51) is ``full`` keeping at most ``none / blocks + one block``. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

MODES = ("none", "full", "selective")


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure(mode: str, n_layer: int, n_embd: int, seq: int, batch: int) -> dict[str, Any]:
    """One mode in this process: saved and kept bytes of a counted step, then the peak RSS of a plain step."""
    import weakref

    import torch
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode  # no public dispatch-mode base class

    from lightning_deepseek.models import GPT, GPTConfig
    from lightning_deepseek.parallel.activation_checkpointing import apply_activation_checkpointing

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=seq, n_layer=n_layer, n_head=4, n_embd=n_embd))
    apply_activation_checkpointing(model, mode)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    tokens = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(1))

    def step() -> torch.Tensor:
        return F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())

    Path("/proc/self/clear_refs").write_text("5")  # resets the peak RSS (VmHWM) to the current RSS
    before = _rss_kib("VmRSS")
    step().backward()
    peak = _rss_kib("VmHWM") - before

    ignored = {id(t.untyped_storage()) for t in (*model.parameters(), *model.buffers())}
    saved: dict[int, int] = {}
    created: weakref.WeakSet = weakref.WeakSet()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor.untyped_storage()) not in ignored:
            saved[id(tensor.untyped_storage())] = tensor.untyped_storage().nbytes()
        return tensor

    class Created(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            for tensor in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(tensor, torch.Tensor) and id(tensor.untyped_storage()) not in ignored:
                    created.add(tensor.untyped_storage())
            return out

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), Created():
        loss = step()
    kept = sum({s.data_ptr(): s.nbytes() for s in created}.values())
    loss.backward()
    return dict(mode=mode, n_layer=n_layer, saved=sum(saved.values()), kept=kept, peak_rss=peak * 1024)


def run_child(mode: str, n_layer: int, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", mode, "--n-layer", str(n_layer), "--n-embd", str(args.n_embd),
           "--seq", str(args.seq), "--batch", str(args.batch)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--n-embd", type=int, default=192)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.n_layer, args.n_embd, args.seq, args.batch)))
        return
    runs = {mode: run_child(mode, args.n_layer, args) for mode in MODES}
    single = run_child("none", 1, args)
    blocks, none = args.n_layer, runs["none"]
    one_block = (none["kept"] - single["kept"]) / (blocks - 1)
    budget = none["kept"] / blocks + one_block
    mib = 2 ** 20
    print(f"GPT n_layer={blocks} n_embd={args.n_embd} seq={args.seq} batch={args.batch}, FP32, one step; "
          f"one block keeps {one_block / mib:.1f} MiB under none")
    print("| mode | saved (MiB) | kept (MiB) | kept vs none | peak RSS of the step (MiB) | peak RSS vs none |")
    print("|---|---|---|---|---|---|")
    for mode, run in runs.items():
        print(f"| {mode} | {run['saved'] / mib:.1f} | {run['kept'] / mib:.1f} | {run['kept'] / none['kept']:.3f} | "
              f"{run['peak_rss'] / mib:.1f} | {run['peak_rss'] / none['peak_rss']:.3f} |")
    met = "met" if runs["full"]["kept"] <= budget else "missed"
    print(f"\ntarget: full keeps <= none/{blocks} + one block = {budget / mib:.1f} MiB: "
          f"{runs['full']['kept'] / mib:.1f} MiB, {met}")


if __name__ == "__main__":
    main()
