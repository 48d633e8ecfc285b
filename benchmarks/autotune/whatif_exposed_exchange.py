"""What if DDP's fp32 exchange were not hidden by backward on busy CPU cores? Recomputed from recorded cost-model
runs (issue #16), nothing is run.

The cost model (``lightning_deepseek/autotune/cost_model.py``) hides the part of DDP's exchange that waits on a link
behind backward; on a host whose cores the ranks keep busy it counts only the host's share (the exchange's bytes at
the intra link's rate) as not hidden. On this project's 2-core machine its unsharded candidates are predicted too
fast (9-23 ms on loopback with 24 repetitions, in the runs this was written for), while the exchange of their
gradients alone, timed at setup (``exchange``), takes 5-31 ms. Here the fp32 candidate's exposed exchange ``E`` is
raised to ``alpha`` times that timed exchange, where it was timed (the unsharded candidates' size, and the sharded
ones' where a compressed sharded candidate had it timed), and the compressed candidates follow one of two rules:

- ``full``: the cost model's own rule with the raised ``E``: ``max(E + Tc - T32, E Tc / T32)`` unsharded,
  ``max(0, E + D)`` under sharding (``D`` measured in the sharded copies' steps);
- ``shift``: the same raise as their fp32 candidate (what compression saves is unchanged).

``--copy-ms`` (milliseconds per MiB and copy) adds DDP's copies of the gradients into its bucket and back
to the recorded exchanges, as ``measure_exchange`` now times them: one copy to the fp32 exchange (the copy in is
fused with the division, which was already timed), two to a compressed one. Runs recorded since those copies are
timed at setup have them already: give them with ``--copy-ms 0``.

Printed per variant: the model-runs whose Spearman reaches 0.8, the resolved pairs ordered alike, the predictions'
median absolute error by testbed, and per model-run the choice the cost model's rule (the simplest candidate the
fastest does not beat by 5%) makes among the grid's candidates on each repetition's predictions, as its measured
step against that repetition's best (median over repetitions). ``alpha = 0`` reproduces the recorded predictions.

Run: ``.venv/bin/python benchmarks/autotune/whatif_exposed_exchange.py RUN.json [RUN.json ...]`` (files recorded by
``bench_cost_model.py --json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.autotune.bench_cost_model import (  # noqa: E402
    _label,
    _medians,
    halves_agree,
    resolved_pairs,
    spearman,
)
from lightning_deepseek.autotune.cost_model import Candidate  # noqa: E402


def _parse(label: str) -> tuple[int, int, int | None]:
    tp, ep, bits = label.split()
    return int(tp[3:]), int(ep[3:]), None if bits == "fp32" else int(bits[3:])


def adjusted(row: dict, alpha: float, rule: str, copy_ms: float = 0.0) -> dict[str, float]:
    """``row``'s predictions with the fp32 exposed exchange raised to ``alpha`` x the timed one, the exchanges with
    DDP's bucket copies at ``copy_ms`` per MiB (module docstring)."""
    exchange = {}
    for key, seconds in row["exchange"].items():
        size, bits = key.split()
        copies = 1 if bits == "None" else 2
        exchange[(int(size), None if bits == "None" else int(bits))] = seconds + copies * copy_ms * 1e-3 * int(
            size) / 2**20
    sizes = sorted({size for size, _ in exchange})
    out = {}
    for label, seconds in row["predicted"].items():
        tp, ep, bits = _parse(label)
        dp = row["parts"][label]["dp"]
        # the grids shard one way at most: unsharded candidates exchange the larger timed size, sharded the smaller
        size = sizes[-1] if tp == ep == 1 else sizes[0] if len(sizes) > 1 else None
        t32 = exchange.get((size, None))
        if t32 is None:
            out[label] = seconds
            continue
        e = row["parts"][_label(tp, ep, None)]["dp"]
        raised = max(e, alpha * t32)
        if bits is None or rule == "shift":
            new = dp + raised - e
        elif tp > 1 or ep > 1:
            new = max(0.0, raised + row["in_backward"][f"{'tp' if ep == 1 else 'ep'}={max(tp, ep)} int{bits}"])
        else:
            tc = exchange[(size, bits)]
            new = max(raised + tc - t32, raised * tc / t32)
        out[label] = seconds - dp + new
    return out


def choose(predicted: dict[str, float], margin: float = 0.05) -> str:
    """The cost model's rule (``cost_model.decide``, every candidate fitting): the simplest candidate unless the
    fastest beats it by ``margin``, then the simplest of those the fastest does not beat by ``margin``."""
    def simplicity(label: str) -> tuple[int, int, int]:
        return Candidate(*_parse(label)).simplicity

    best = min(predicted.values())
    simplest = min(predicted, key=simplicity)
    if best >= (1 - margin) * predicted[simplest]:
        return simplest
    return min((k for k, v in predicted.items() if (1 - margin) * v <= best), key=simplicity)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="recorded bench_cost_model.py --json runs")
    parser.add_argument("--alphas", default="0,0.5,1")
    parser.add_argument("--copy-ms", type=float, default=0.0, help="DDP's bucket copies, ms per MiB and copy")
    args = parser.parse_args()
    runs = [(Path(p).stem.removeprefix("cost_model_"), json.loads(Path(p).read_text())) for p in args.files]
    for rule in ("full", "shift"):
        for alpha in (float(a) for a in args.alphas.split(",")):
            met = total = alike = resolved = stable = stable_met = 0
            errors: dict[str, list[float]] = {}
            lines = []
            for name, results in runs:
                where = name.split("_")[0] if name.startswith("loopback") else name.split("_")[1]
                for key in dict.fromkeys(r["model"] for r in results):
                    rows = [r for r in results if r["model"] == key]
                    labels = list(rows[0]["measured"])
                    per_rep = [adjusted(r, alpha, rule, args.copy_ms) for r in rows]
                    predicted = {k: statistics.median(p[k] for p in per_rep) for k in labels}
                    measured = _medians(rows, labels)
                    rho = spearman([predicted[k] for k in labels], measured)
                    n, wrong = resolved_pairs(rows, labels, predicted)
                    met, total = met + (rho >= 0.8 - 1e-9), total + 1
                    repeats = halves_agree(rows, labels) >= 0.8 - 1e-9
                    stable, stable_met = stable + repeats, stable_met + (repeats and rho >= 0.8 - 1e-9)
                    alike, resolved = alike + n - len(wrong), resolved + n
                    errors.setdefault(where, []).extend(abs(predicted[k] - m) / m for k, m in zip(labels, measured))
                    quality = statistics.median(min(r["measured"].values()) / r["measured"][choose(
                        {k: p[k] for k in labels})] for r, p in zip(rows, per_rep))
                    lines.append(f"{name} {key}: {rho:.2f}, choice {quality:.2f}x of the best")
            error = ", ".join(f"{k} {statistics.median(v):.0%}" for k, v in errors.items())
            print(f"{rule}, alpha {alpha:g}: Spearman >= 0.8 in {met} of {total} model-runs; resolved pairs ordered "
                  f"alike {alike} of {resolved}; where the measured ranking repeats (halves >= 0.8) {stable_met} of "
                  f"{stable}; median absolute error {error}")
            print("  " + "; ".join(lines))


if __name__ == "__main__":
    main()
