"""The speed of ``lds-plan layout=auto`` (:func:`lightning_deepseek.planning.search.search`): wall seconds and
CPU seconds (this process and its workers: the machine is shared, so both are printed) and layouts per wall second,
for the searches of benchmarks/planning/REPORT.md; with ``--uncached`` also the same search planning every layout
afresh (``cache=False``) and a check that both give the same fastest ``--top`` plans.

Usage: ``PYTHONPATH=. .venv/bin/python benchmarks/planning/bench_search.py CASE [--pipelined] [--uncached]
[--sequence-parallel] [--top K] [--workers N]`` with CASE one of ``llama3-8b``, ``llama3-70b``, ``deepseek-v3``;
``--pipelined``: the pipelined candidates (pp > 1) instead of the others; ``--sequence-parallel``: with the
sequence-parallel ones (left out by default, as in REPORT.md's rows); ``--top``: as ``lds-plan``'s ``top`` (5; 0:
every layout planned); ``--workers``: as ``lds-plan``'s ``workers`` (default 2: this machine's cores); ``--budget``:
wall seconds after which the search is stopped and its rate so far printed (default: none).
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import time
from typing import Any

from lightning_deepseek.app.plan import resolve_cluster, resolve_model
from lightning_deepseek.planning import StepShape
from lightning_deepseek.planning.bounds import ParameterShards
from lightning_deepseek.planning.search import (
    block_count,
    candidate_layouts,
    expert_counts,
    search,
    sequence_parallel_sizes,
)

CASES = {  # model, world size, cluster, step
    "llama3-8b": ("llama3-8b", 64, "h100", StepShape(2, 8192)),
    "llama3-70b": ("llama3-70b", 256, "h100", StepShape(2, 8192)),
    "deepseek-v3": ("deepseek-v3", 2048, "h800", StepShape(1, 4096)),
}


class OutOfBudget(Exception):
    """The ``--budget`` of wall seconds is spent."""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("case", choices=sorted(CASES))
    parser.add_argument("--pipelined", action="store_true")
    parser.add_argument("--uncached", action="store_true")
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--budget", type=float, default=None)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    name, world_size, cluster_name, step = CASES[args.case]
    model, cluster = resolve_model(name), resolve_cluster(cluster_name)
    tps = [d for d in range(1, cluster.gpus_per_node + 1) if world_size % d == 0]
    layouts = [layout for layout in candidate_layouts(world_size, cluster.gpus_per_node, expert_counts(model),
                                                      block_count(model),
                                                      sequence_parallel_sizes(model, tps, step.min_shard_params),
                                                      model.vocab_size)
               if (layout.pp > 1) == args.pipelined and (args.sequence_parallel or not layout.sequence_parallel)]
    shards = ParameterShards.of(model, world_size, step, tuple({layout.tp for layout in layouts}))
    bounded = sum((shards.least_states(layout) or 0) > cluster.memory_bytes for layout in layouts)
    print(f"{len(layouts)} layouts, {bounded} over the device by the bound before planning, {args.workers} workers",
          flush=True)

    def cpu() -> float:  # this process's and its reaped workers' CPU seconds
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        return time.process_time() + children.ru_utime + children.ru_stime

    def progress(report: Any) -> None:  # a line per plan: a long search's rate so far
        done.append(report)
        print(f"  planned {report.layout.describe(world_size)}: {report.plan_seconds:.1f} s wall, "
              f"{time.perf_counter() - started:.1f} s so far", flush=True)
        if args.budget is not None and time.perf_counter() - started > args.budget:
            raise OutOfBudget

    runs = [True, False] if args.uncached else [True]
    done: list[Any] = []
    results = {}
    for cache in runs:
        started, cpu_started = time.perf_counter(), cpu()
        done.clear()
        try:
            result = search(model, world_size, cluster, step, layouts, cache=cache, top=args.top or None,
                            workers=args.workers, progress=progress)
        except OutOfBudget:
            seconds = time.perf_counter() - started
            print(f"| {args.case} x {world_size} | stopped after {len(done)} plans ({len(done) / seconds:.3f} plans / "
                  f"s), {seconds:.1f} s wall, {cpu() - cpu_started:.1f} CPU s |")
            return
        seconds = time.perf_counter() - started
        results[cache] = result
        planned = len(result.fitting) + len(result.not_fitting)
        by_compute = sum("fastest fitting" in why for _, why in result.pruned)  # the compute bound's reason
        print(f"| {args.case} x {world_size} {'pp>1' if args.pipelined else 'pp=1'} | "
              f"{'cached' if cache else 'uncached'}, {args.workers} workers | {len(layouts)} | {planned} planned, "
              f"{len(result.pruned)} pruned ({by_compute} by compute), {len(result.rejected)} refused, "
              f"{len(result.fitting)} fit | {seconds:.1f} s wall, {cpu() - cpu_started:.1f} CPU s | "
              f"{len(layouts) / seconds:.3f} |", flush=True)
    if args.uncached:
        top = args.top or None
        same = [dataclasses.replace(r, plan_seconds=0.0) for r in results[True].fitting[:top]] == [
            dataclasses.replace(r, plan_seconds=0.0) for r in results[False].fitting[:top]]
        print(f"fastest plans equal with and without the cache: {same}")
    for report in results[True].fitting[:3]:
        print(f"  {report.layout.describe(world_size)}: {report.step_seconds:.3f} s, "
              f"{report.tokens_per_second_per_gpu:,.0f} tokens/s/GPU")


if __name__ == "__main__":
    main()
