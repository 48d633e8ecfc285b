"""The plan against one real step on 2 and 4 gloo processes, for each layout of
``tests/planning/test_against_real_runs.py``: model-state bytes and bytes per (mesh dimension, collective), printed
as the markdown rows of REPORT.md (rank 0's figures; the all-to-all rows with their relative error).
Usage: ``python benchmarks/planning/check_real_runs.py`` from the repository root.
"""

from __future__ import annotations

from tests.helpers import run_distributed
from tests.planning.test_against_real_runs import CASES, _planned, _real_steps

if __name__ == "__main__":
    print("| world | layout | params / grads / states (plan = real, bytes) | collective | plan bytes | real bytes "
          "| error |")
    print("|---|---|---|---|---|---|---|")
    for world_size in CASES:
        real = run_distributed(_real_steps, world_size, timeout=600)[0]
        for (name, spec, layout), measured in zip(CASES[world_size], real):
            memory, traffic = _planned(spec, layout, world_size)
            same = all(memory[k] == measured[k] for k in memory)
            states = " / ".join(f"{memory[k]:,}" for k in ("params", "grads", "states"))
            for (dim, op), planned in sorted(traffic.items()):
                got = measured["traffic"].get((dim, op), 0)
                error = f"{(planned - got) / got:+.1%}" if got else "n/a"
                print(f"| {world_size} | {name} ({spec.name}) | {states} {'equal' if same else 'DIFFER'} | {dim} "
                      f"{op} | {planned:,} | {got:,} | {error} |", flush=True)
