"""Do process groups that cross the slow link at the same time share it? (issue #16)

On 2 emulated nodes x 2 ranks (``--testbed``; ranks 0, 1 on one node, 2, 3 on the other), all-reduces of the same
bytes timed four ways, slowest rank, median of ``--repeats``: one pair across the link alone (``{0, 2}``), two pairs
across it at once (``{0, 2}`` and ``{1, 3}``: the expert replicas of ep=2, the shard columns of tp=2), the world's
ring, and two pairs inside the nodes. If the two pairs take about twice one pair's time, they share the link's
bandwidth (``parallel.placement.concurrent_link``).

Run (root)::

    .venv/bin/python benchmarks/hybrid/probe_link_sharing.py --testbed --rate 1gbit
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
SIZES_MIB = (1.0, 4.5)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    groups = {ranks: dist.new_group(list(ranks)) for ranks in ((0, 2), (1, 3), (0, 1), (2, 3))}
    across = groups[(0, 2) if rank in (0, 2) else (1, 3)]
    within = groups[(0, 1) if rank in (0, 1) else (2, 3)]

    def timed(fn: Callable[[], None]) -> float:
        seconds = []
        for i in range(args.repeats + 1):  # the first is a warm-up
            dist.barrier()
            start = time.perf_counter()
            fn()
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i:
                seconds.append(elapsed.item())
        return statistics.median(seconds)

    def all_reduce(buf: torch.Tensor, group: dist.ProcessGroup | None, member: bool = True) -> Callable[[], None]:
        return lambda: dist.all_reduce(buf, group=group) if member else None

    out = {}
    for mib in SIZES_MIB:
        buf = torch.ones(int(mib * 2**20) // 4)
        out[f"{mib} MiB, one pair across"] = timed(all_reduce(buf, groups[(0, 2)], rank in (0, 2)))
        out[f"{mib} MiB, two pairs across at once"] = timed(all_reduce(buf, across))
        out[f"{mib} MiB, the world's ring"] = timed(all_reduce(buf, None))
        out[f"{mib} MiB, two pairs inside the nodes"] = timed(all_reduce(buf, within))
    if rank == 0:
        Path(args.out).write_text(json.dumps(out))
    dist.destroy_process_group()


def main(args: argparse.Namespace) -> None:
    from benchmarks.testbed import Testbed, run_ranks

    if not args.testbed:
        raise SystemExit("probe_link_sharing needs --testbed (two emulated nodes): on loopback nothing crosses a link")
    out = Path(tempfile.mkdtemp(prefix="ldsl-")) / "probe.json"
    argv = [sys.executable, __file__, "--worker", "--out", str(out), "--repeats", str(args.repeats)]
    with Testbed(num_hosts=2, rate=args.rate, prefix=args.prefix, subnet=args.subnet) as bed:
        run_ranks(argv, 29753, args.timeout, ROOT, bed)
    print(f"all_reduce, testbed {args.rate}, slowest rank, median of {args.repeats}")
    print("| groups | seconds |\n|---|---|")
    for label, seconds in json.loads(out.read_text()).items():
        print(f"| {label} | {seconds * 1e3:.1f} ms |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    from benchmarks.testbed import add_arguments
    add_arguments(parser, prefix="ldsl", subnet="10.213.78")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out", default="")
    parsed = parser.parse_args()
    worker(parsed) if parsed.worker else main(parsed)
