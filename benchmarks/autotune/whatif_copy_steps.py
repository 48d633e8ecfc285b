"""What if each candidate were predicted by its layout's DDP-wrapped copy's training steps (session 28's replay)?

Reads ``bench_cost_model.py --json`` runs recorded with the fp32 copies' median steps (``copy_fp32_steps``: branch
``s28-direct``, ``*_s28_copysteps.json``) and ranks, against the same runs' grids, the cost model's predictions and
the copies' own: the layout's fp32 copy step plus the measured compression difference (``in_backward``); a layout
without a copy keeps the cost model's figure. Prints Spearman and the resolved pairs for both, and the choice each
repetition's copies would make (the cost model's rule: the simplest candidate within 5% of the fastest). The rule
landed in session 29 (``cost_model.predict``, ``measure.measure_copy_steps``); runs recorded since carry each copy's
step (``copy_steps``) and the parts' prediction (``by_parts``) and are compared by ``bench_cost_model.py --report``.
This replay stays for the session 28 runs it was judged on::

    .venv/bin/python benchmarks/autotune/whatif_copy_steps.py benchmarks/autotune/*_s28_copysteps.json
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cost_model import ROOT, _medians, resolved_pairs, spearman  # noqa: E402

sys.path.insert(0, str(ROOT))
from lightning_deepseek.autotune.cost_model import Candidate  # noqa: E402


def _layout(label: str) -> tuple[str, int | None]:
    tp, ep, bits = re.match(r"tp=(\d+) ep=(\d+) (\w+)", label).groups()
    return (f"ep={ep}" if ep != "1" else f"tp={tp}"), (None if bits == "fp32" else int(bits[3:]))


def copy_steps(row: dict) -> dict[str, float]:
    """Every candidate of ``row`` predicted from its layout's copies, else the cost model's figure."""
    out = {}
    for label, predicted in row["predicted"].items():
        key, bits = _layout(label)
        timed = key in row["copy_fp32_steps"] and (bits is None or f"{key} int{bits}" in row["in_backward"])
        out[label] = (row["copy_fp32_steps"][key] + (row["in_backward"][f"{key} int{bits}"] if bits else 0.0)
                      if timed else predicted)
    return out


def _simplicity(label: str) -> tuple[int, int, int]:
    tp, ep, bits = re.match(r"tp=(\d+) ep=(\d+) (\w+)", label).groups()
    return Candidate(int(tp), int(ep), None if bits == "fp32" else int(bits[3:])).simplicity


def choose(predicted: dict[str, float], margin: float = 0.05) -> str:
    """``cost_model.decide``'s rule on recorded figures (every candidate fits)."""
    best, simplest = min(predicted, key=predicted.get), min(predicted, key=_simplicity)
    if best != simplest and predicted[best] < (1 - margin) * predicted[simplest]:
        return min((k for k in predicted if (1 - margin) * predicted[k] <= predicted[best]), key=_simplicity)
    return simplest


def main(paths: list[str]) -> None:
    for path in paths:
        results = json.loads(Path(path).read_text())
        for model in dict.fromkeys(r["model"] for r in results):
            rows = [r for r in results if r["model"] == model]
            labels = list(rows[0]["measured"])
            measured = dict(zip(labels, _medians(rows, labels)))
            best = min(measured.values())
            for name, of_row in (("cost model", lambda r: r["predicted"]), ("copies' steps", copy_steps)):
                predicted = {k: statistics.median(of_row(r)[k] for r in rows) for k in labels}
                rho = spearman([predicted[k] for k in labels], [measured[k] for k in labels])
                resolved, wrong = resolved_pairs(rows, labels, predicted)
                choices = [choose(of_row(r)) for r in rows]
                shown = ", ".join(f"{c} x{choices.count(c)}" + (f" ({best / measured[c]:.2f}x of the best)"
                                                                if c in measured else " (outside the grid)")
                                  for c in dict.fromkeys(choices))
                print(f"{Path(path).stem} {model} {name}: Spearman {rho:.2f}, resolved pairs "
                      f"{resolved - len(wrong)} of {resolved}; choices {shown}")


if __name__ == "__main__":
    main(sys.argv[1:])
