"""The plan against one real step on 2 and 4 gloo processes, for each layout of
``tests/planning/test_against_real_runs.py``: model-state bytes, bytes per (mesh dimension, collective) and the peak
of the step's allocations (torch's MemTracker on both sides), printed as one markdown row per layout for REPORT.md
(rank 0's figures; a collective whose bytes differ is printed with its relative error).
Usage: ``python benchmarks/planning/check_real_runs.py`` from the repository root.
"""

from __future__ import annotations

from tests.helpers import run_distributed
from tests.planning.test_against_real_runs import CASES, _planned, _real_steps

if __name__ == "__main__":
    print("| world | layout | params / grads / states, bytes | collectives (plan = real unless shown) "
          "| peak plan / real, bytes (error) |")
    print("|---|---|---|---|---|")
    for world_size in CASES:
        real = run_distributed(_real_steps, world_size, timeout=600)[0]
        for (name, spec, layout), measured in zip(CASES[world_size], real):
            memory, traffic = _planned(spec, layout, world_size)
            same = all(memory[k] == measured[k] for k in ("params", "grads", "states"))
            states = " / ".join(f"{memory[k]:,}" for k in ("params", "grads", "states"))
            calls = []
            for (dim, op), planned in sorted(traffic.items()):
                got = measured["traffic"].get((dim, op), 0)
                calls.append(f"{dim} {op} {planned:,}" if planned == got else
                             f"**{dim} {op} {planned:,} vs {got:,} ({(planned - got) / got:+.1%})**")
            missing = set(measured["traffic"]) - set(traffic)
            calls += [f"**not planned: {dim} {op}**" for dim, op in sorted(missing)]
            peak, real_peak = memory["peak"], measured["peak"]
            print(f"| {world_size} | {name} ({spec.name}) | {states} {'equal' if same else '**DIFFER**'} | "
                  f"{'; '.join(calls)} | {peak:,} / {real_peak:,} ({(peak - real_peak) / real_peak:+.3%}) |",
                  flush=True)
