"""The plan against one real step on 2 and 4 gloo processes, for each layout of
``tests/planning/test_against_real_runs.py``: model-state bytes, bytes per (mesh dimension, collective) and the peak
of the step's allocations (torch's MemTracker on both sides), printed as one markdown row per layout for REPORT.md
(rank 0's figures, or under a pipeline one row per pipeline rank at the second step; a collective whose bytes differ
is printed with its relative error).
Usage: ``python benchmarks/planning/check_real_runs.py [case name ...]`` from the repository root (default: all).
"""

from __future__ import annotations

import sys
from typing import Any

from tests.helpers import run_distributed
from tests.planning.real_run import real_step
from tests.planning.test_against_real_runs import CASES, CLUSTER, MICRO, SEQ, _planned


def _steps(rank: int, world_size: int, names: list[str]) -> list[dict[str, Any]]:
    return [real_step(spec, layout, world_size, MICRO, SEQ, CLUSTER.gpus_per_node)
            for name, spec, layout in CASES[world_size] if name in names]


def _row(world_size: int, name: str, memory: dict[str, int], traffic: dict | None, measured: dict[str, Any]) -> str:
    same = all(memory[k] == measured[k] for k in ("params", "grads", "states"))
    states = " / ".join(f"{memory[k]:,}" if memory[k] == measured[k] else f"{memory[k]:,} vs {measured[k]:,}"
                        for k in ("params", "grads", "states"))
    calls = [] if traffic is not None else ["(the plan gives the most loaded pipeline rank's)"]
    for (dim, op), planned in sorted((traffic or {}).items()):
        got = measured["traffic"].get((dim, op), 0)
        calls.append(f"{dim} {op} {planned:,}" if planned == got else f"**not measured: {dim} {op} {planned:,}**"
                     if not got else f"**{dim} {op} {planned:,} vs {got:,} ({(planned - got) / got:+.1%})**")
    missing = set(measured["traffic"]) - set(traffic) if traffic is not None else set()
    calls += [f"**not planned: {dim} {op}**" for dim, op in sorted(missing)]
    peak, real_peak = memory["peak"], measured["peak"]
    return (f"| {world_size} | {name} | {states} {'equal' if same else '**DIFFER**'} | {'; '.join(calls)} | "
            f"{peak:,} / {real_peak:,} ({(peak - real_peak) / real_peak:+.3%}) |")


if __name__ == "__main__":
    wanted = sys.argv[1:] or sorted({name for cases in CASES.values() for name, _, _ in cases})
    print("| world | layout | params / grads / states, bytes | collectives (plan = real unless shown) "
          "| peak plan / real, bytes (error) |")
    print("|---|---|---|---|---|")
    for world_size in CASES:
        names = [name for name, _, _ in CASES[world_size] if name in wanted]
        if not names:
            continue
        real = run_distributed(_steps, world_size, names, timeout=900)
        cases = [case for case in CASES[world_size] if case[0] in names]
        for i, (name, spec, layout) in enumerate(cases):
            memory, traffic, report = _planned(spec, layout, world_size)
            if report.pipeline is None:
                print(_row(world_size, f"{name} ({spec.name})", memory, traffic, real[0][i]), flush=True)
                continue
            stride = world_size // layout.pp
            worst = max(report.pipeline.ranks, key=lambda r: r.peak).pp_rank
            for row in report.pipeline.ranks:
                measured = real[row.pp_rank * stride][i]
                planned = {"params": row.params, "grads": row.grads, "states": row.states, "peak": row.peak}
                print(_row(world_size, f"{name} pp rank {row.pp_rank} ({spec.name}), buffers {row.buffers:,} / "
                           f"{measured['buffers']:,}", planned, traffic if row.pp_rank == worst else None, measured),
                      flush=True)
