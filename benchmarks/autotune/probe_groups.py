"""Does a process slow down as it accumulates idle gloo process groups? (issue #16: later fits in one process ran
slower.) Two processes on loopback time a plain DDP loop, then create 100 more ``dist.new_group`` and time it again,
five times; prints the step time and the thread count each round.

Run: ``.venv/bin/python benchmarks/autotune/probe_groups.py``.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def timed_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> float:
    """The mean of the middle 9 of 15 steps (seconds)."""
    times = []
    for _ in range(15):
        start = time.perf_counter()
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    return sum(sorted(times)[3:12]) / 9


def main(rank: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29613")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*[torch.nn.Linear(512, 512)
                                                                            for _ in range(8)]))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, 512)
    groups = []
    for _ in range(5):
        step = timed_steps(model, optimizer, x)
        if rank == 0:
            print(f"groups={len(groups)} threads={len(os.listdir('/proc/self/task'))} step={step * 1e3:.1f} ms",
                  flush=True)
        groups += [dist.new_group([0, 1]) for _ in range(100)]
    dist.destroy_process_group()


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    mp.spawn(main, nprocs=2)
