"""One process group of 4 CPU ranks on loopback fitting the wide-FFN model again and again (issue #16: later fits
in one process ran slower): each fit's median step (slowest rank), the process's RSS after it and its peak, threads,
gc objects, process groups, and the CPU jiffies the host stole meanwhile. Kinds: ``tp1``, ``tp2``, ``tp1int8``,
``tp2int8``, ``auto`` (the ``"auto"`` settings for tp and bits: timed copies).

Run: ``LDS_TOPOLOGY="0,1;2,3" .venv/bin/python benchmarks/autotune/probe_fits.py tp2int8,tp2int8,auto,tp2int8``
(A fit keeps no memory or process groups beyond the first two ``auto`` fits: the meshes and communicators are
reused across fits.)
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import sys

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from benchmarks.timed_gpt import TimedGPT  # noqa: E402
from lightning_deepseek import HybridParallelStrategy  # noqa: E402
from lightning_deepseek.app.tune.steal import cpu_times  # noqa: E402
from lightning_deepseek.compression import GradientCompression  # noqa: E402
from lightning_deepseek.models import GPTConfig  # noqa: E402

WIDE_FFN = dict(vocab_size=256, block_size=16, n_layer=2, n_head=4, n_embd=256, mlp_ratio=16)


def fit(kind: str) -> float:
    gc.collect()
    pl.seed_everything(0, verbose=False)
    module = TimedGPT(GPTConfig(**WIDE_FFN), torch.optim.AdamW, lr=1e-4)
    tokens = torch.randint(0, 256, (12 * 2 * 4, 17), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2)
    if kind == "auto":
        strategy = HybridParallelStrategy(tensor_parallel_size="auto", min_shard_params=0)
        callbacks = [GradientCompression(bits="auto", warmup_steps=0)]
    else:
        strategy = HybridParallelStrategy(tensor_parallel_size=2 if kind.startswith("tp2") else 1,
                                          min_shard_params=0, micro_batch_tokens=32)
        callbacks = [GradientCompression(bits=8, warmup_steps=0)] if kind.endswith("int8") else []
    trainer = pl.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=12, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=callbacks)
    trainer.fit(module, data)
    times = torch.tensor(module.step_times[3:])
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return times.median().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kinds", help="comma-separated fits, in order: tp1, tp2, tp1int8, tp2int8, auto")
    kinds = parser.parse_args().kinds
    torch.set_num_threads(1)
    for i, kind in enumerate(kinds.split(",")):
        before = cpu_times()
        step = fit(kind)
        stolen = cpu_times().steal - before.steal
        if dist.get_rank() == 0:
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            with open("/proc/self/statm") as statm:
                now = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
            print(f"fit {i} {kind}: {step * 1e3:.0f} ms  rss {now:.0f} MiB (peak {rss:.0f})  threads "
                  f"{len(os.listdir('/proc/self/task'))}  objects {len(gc.get_objects())}  groups "
                  f"{len(dist.distributed_c10d._world.pg_map)}  steal {stolen}", flush=True)


if __name__ == "__main__":
    main()
