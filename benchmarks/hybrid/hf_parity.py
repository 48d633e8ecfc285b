"""HF families under ``strategy="hybrid"`` (tp=2) against Lightning's DDP: the parity table of
benchmarks/hybrid/REPORT.md.

Runs the scenario of ``tests/parallel/test_hf_families.py`` (one 2-process gloo spawn, every family in one module,
10 SGD steps, DDP then hybrid) and prints, per family, the sharded layers, where the plan came from, the largest
relative difference of a step's loss and the relative difference of the final weights.

Usage (from the repository root): ``.venv/bin/python benchmarks/hybrid/hf_parity.py``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.helpers import run_distributed  # noqa: E402
from tests.parallel.common import relative_error  # noqa: E402
from tests.parallel.test_hf_families import FAMILIES, STEPS, hf_family_scenarios  # noqa: E402


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    result = run_distributed(hf_family_scenarios, 2, timeout=600)[0]
    ddp, hybrid = result["ddp"], result["hybrid"]
    print(f"| family | sharded layers (tp=2) | plan source | max relative loss difference ({STEPS} steps) "
          "| relative weight difference |")
    print("|---|---|---|---|---|")
    for family in FAMILIES:
        prefix = f"models.{family}."
        sharded = {n[len(prefix):]: s for n, s in hybrid["plan"].items() if n.startswith(prefix)}
        names = ", ".join(n.rsplit(".", 2)[-2] + "." + n.rsplit(".", 1)[-1] for n in sharded) or "none"
        sources = ", ".join(sorted(set(sharded.values()))) or "-"
        loss = max(abs(a - b) / abs(b) for a, b in zip(hybrid["losses"][family], ddp["losses"][family]))
        weights = relative_error(hybrid["state"][family], ddp["state"][family])
        print(f"| {family} | {len(sharded)}: {names} | {sources} | {loss:.1e} | {weights:.1e} |")


if __name__ == "__main__":
    main()
