"""The ``"auto"`` settings' ranking (each candidate's timed copy) against the measured grid; the auto choice.

Loopback (2 processes on this machine)::

    .venv/bin/python benchmarks/autotune/bench_cost_model.py [--models demo,ffn,moe]

Network testbed (root; 2 emulated nodes x 2 ranks, namespaces ``ldsm*``, subnet ``10.213.73.0/24``)::

    .venv/bin/python benchmarks/autotune/bench_cost_model.py --testbed --rate 1gbit

Run nothing else on the machine meanwhile (on a shared machine, wrap the command in ``flock LOCKFILE``).

For each model, every candidate of its grid (dense GPTs: ``tensor_parallel_size`` x compression fp32/int8/int4;
the MoE GPT: ``expert_parallel_size`` x compression fp32/int8; each as ``HybridParallelStrategy`` +
``GradientCompression``) and Lightning's plain ``"ddp"`` train ``--steps`` steps, interleaved within each repetition
(the order rotated by one each repetition); a step's time is the slowest rank's, the first 3 steps are dropped, the
table reports medians over steps and then over repetitions. One run with the ``"auto"`` settings per repetition
records the training step of each candidate's DDP-wrapped copy timed at setup (its prediction of training's step),
its choice and its own step time. Reported: Spearman's rank correlation of predicted and measured step times over
the grid (target >= 0.8), the same between the repetitions' measured rankings and between the medians of the first
and the second half of the repetitions (how reliable the measured side is: no prediction can be expected to agree
with it much better), the pairs of candidates whose order the repetitions agree on (a sign test within repetitions) and
how many of them the prediction orders the same way (a near-tie that flips between repetitions counts in Spearman
but no prediction can call it), the auto choice against the measured best and plain DDP, and the load average
before and after. ``--report FILE`` prints a recorded ``--json`` run's report again (this version's statistics);
``--tally FILE...`` pools recorded runs: per model-run the Spearman and the resolved pairs, how many reach the target,
and the ceiling the measurement itself sets (below, :func:`tally`).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

MODELS = {
    # the demo's model (lds-train model=small), 8 sequences of 128 tokens per rank
    "demo": ("demo (small GPT)", dict(preset="small", vocab_size=256), 8, 128),
    # feed-forward heavy: 17 MB of gradients, few tokens: the gradient exchange matters
    "ffn": ("wide FFN", dict(vocab_size=256, block_size=16, n_layer=2, n_head=4, n_embd=256, mlp_ratio=16), 2, 16),
    # DeepSeekMoE (moe-small: 16 routed experts top-2 + 1 shared, first layer dense), 4 x 64 tokens per rank
    "moe": ("MoE (moe-small)", dict(preset="moe-small", vocab_size=256), 4, 64),
}


def _label(tp: int, ep: int, bits: int | None) -> str:
    return f"tp={tp} ep={ep} {'fp32' if bits is None else f'int{bits}'}"


def grid(key: str, world: int) -> list[tuple[int, int, int | None]]:
    """The candidates ``(tp, ep, bits)`` of model ``key``: dense: tp x fp32/int8/int4; MoE: ep x fp32/int8."""
    if key == "moe":
        return [(1, ep, b) for ep in (1, 2, 4) if world % ep == 0 for b in (None, 8)]
    return [(tp, 1, b) for tp in (1, 2) for b in (None, 8, 4) if not (world // tp < 2 and b is not None)]


def fit_steps(config: dict, batch: int, seq: int, steps: int, strategy, callbacks) -> tuple[float, float]:
    """Train a ``TimedGPT`` of ``config`` (a ``MODELS`` entry's) for ``steps`` steps on every rank of the process
    group with ``strategy`` and ``callbacks``; the median step (the slowest rank's, the first 3 dropped) and the share
    of the machine's CPU the host took meanwhile (collective)."""
    times, stolen = fit_step_times(config, batch, seq, steps, strategy, callbacks)
    return statistics.median_low(times), stolen  # torch.median's lower middle, as before


def fit_step_times(config: dict, batch: int, seq: int, steps: int, strategy, callbacks) -> tuple[list[float], float]:
    """:func:`fit_steps`, with every step's time (the slowest rank's, the first 3 dropped) instead of their median."""
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks.timed_gpt import TimedGPT
    from lightning_deepseek.app.tune.steal import cpu_times, stolen_share
    from lightning_deepseek.models import GPTConfig
    from lightning_deepseek.models.gpt import PRESETS

    # the group is up after the first fit, and Lightning's environment deletes WORLD_SIZE at its teardown
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"])
    nodes = int(os.environ.get("NUM_NODES", "1"))
    gc.collect()  # the earlier fits' garbage, outside the timing (lds-train's calibration does the same)
    before = cpu_times()
    pl.seed_everything(0, verbose=False)
    preset = PRESETS.get(config.get("preset", ""), {})
    model_config = GPTConfig(**{**preset, **{k: v for k, v in config.items() if k != "preset"}})
    module = TimedGPT(model_config, torch.optim.AdamW, lr=1e-4)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (steps * batch * world, seq + 1), generator=generator)
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=batch)
    trainer = pl.Trainer(accelerator="cpu", devices=world // nodes, num_nodes=nodes, strategy=strategy,
                         max_steps=steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(module, data)
    times = torch.tensor(module.step_times[3:], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step ends on its last rank
    return times.tolist(), stolen_share(before, cpu_times())


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from lightning_deepseek import HybridParallelStrategy
    from lightning_deepseek.compression import GradientCompression

    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])

    def fit(config: dict, batch: int, seq: int, strategy, callbacks) -> tuple[float, float]:
        return fit_steps(config, batch, seq, args.steps, strategy, callbacks)

    results = []
    for repeat in range(args.repeats):
        for key in args.models.split(","):
            name, config, batch, seq = MODELS[key]
            row: dict = {"repeat": repeat, "model": key, "measured": {}, "steal": {}}
            cells: list = [*grid(key, world), "ddp", "auto"]
            # Counterbalanced: every other repetition in reverse, so that a drift during the run (the host's steal
            # comes and goes) does not always fall on the same neighbours (a rotation kept tp=2 int8 right after
            # tp=2 fp32 in every repetition); rotated by one every two repetitions. Plain DDP and the auto run take
            # their turns too (they used to run last: their ratios then carried the drift of the run).
            shift = repeat // 2 % len(cells)
            order = cells[shift:] + cells[:shift]
            for cell in (order if repeat % 2 == 0 else order[::-1]):
                if cell == "ddp":
                    row["ddp"], row["steal"]["ddp"] = fit(config, batch, seq, "ddp", [])
                    continue
                if cell == "auto":
                    sizes = dict(tensor_parallel_size=1, expert_parallel_size="auto") if key == "moe" else dict(
                        tensor_parallel_size="auto")
                    auto = HybridParallelStrategy(**sizes, min_shard_params=0)
                    compression = GradientCompression(bits="auto", warmup_steps=0)
                    row["auto"], row["steal"]["auto"] = fit(config, batch, seq, auto, [compression])
                    continue
                tp, ep, bits = cell
                callbacks = [GradientCompression(bits=bits, warmup_steps=0)] if bits else []
                # The micro-batch's real token count: the placement then assumes the batch the auto settings timed
                # (TimedGPT has no example_input_array, so the default would be 2048).
                strategy = HybridParallelStrategy(tensor_parallel_size=tp, expert_parallel_size=ep, min_shard_params=0,
                                                  micro_batch_tokens=batch * seq)
                label = _label(tp, ep, bits)
                row["measured"][label], row["steal"][label] = fit(config, batch, seq, strategy, callbacks)
            decision = auto.layout.decision
            row["chosen"] = decision.chosen.label
            row["predicted"] = {e.candidate.label: e.seconds for e in decision.entries if e.seconds is not None}
            row["source"] = decision.source
            row["tokens_per_step"] = batch * seq * world
            results.append(row)
            if dist.get_rank() == 0:  # after every row: a run cut short (its timeout, Ctrl-C) keeps what it measured
                partial = Path(args.out).with_suffix(".part")
                partial.write_text(json.dumps(results))
                partial.replace(args.out)


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        for r, i in enumerate(order):
            out[i] = float(r)
        return out
    ra, rb = ranks(a), ranks(b)
    n = len(a)
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else float("nan")


def resolved_pairs(rows: list[dict], labels: list[str], predicted: dict[str, float]) -> tuple[int, list[str]]:
    """The pairs of candidates whose measured order the repetitions agree on (compared within each repetition; a
    two-sided sign test, p < 0.1: 7 of 8 repetitions, 12 of 16), and those of them the prediction orders the other
    way. A near-tie whose order flips between repetitions is left out: no prediction can call it."""
    n, resolved, wrong = len(rows), 0, []
    for i, a in enumerate(labels):
        for b in labels[i + 1:]:
            faster = sum(r["measured"][a] < r["measured"][b] for r in rows)
            k = max(faster, n - faster)
            if 2 * sum(math.comb(n, j) for j in range(k, n + 1)) / 2**n < 0.1:
                resolved += 1
                if (predicted[a] < predicted[b]) != (faster > n - faster):
                    wrong.append(f"{a} / {b} ({k} of {n})")
    return resolved, wrong


def _medians(rows: list[dict], labels: list[str]) -> list[float]:
    return [statistics.median(r["measured"][k] for r in rows) for k in labels]


def halves_agree(rows: list[dict], labels: list[str]) -> float:
    """The measured ranking's own reliability: Spearman of the first half of the repetitions' medians against the
    second half's; from 0.8 on, the measured ranking repeats and a prediction can fairly be asked to match it."""
    half = len(rows) // 2
    return spearman(_medians(rows[:half], labels), _medians(rows[half:], labels))


def tally(paths: list[str]) -> str:
    """Recorded runs pooled: each model-run's Spearman and resolved pairs, the model-runs at >= 0.8, and how often a
    measurement agrees with another one of the same size: each run's repetitions split in halves twice (first /
    second, odd / even), the prediction ranked against each half, and each half against the other. Where the
    prediction agrees with a half as often as the other half does, what is left of its misses is the measurement's
    own noise, which no prediction can remove."""
    lines = ["| run | model | Spearman | half against half | resolved pairs ordered alike |", "|---|---|---|---|---|"]
    met = runs = alike = resolved = model_vs_half = half_vs_half = halves = stable = stable_met = 0
    for path in paths:
        results = json.loads(Path(path).read_text())
        for key in dict.fromkeys(r["model"] for r in results):
            rows = [r for r in results if r["model"] == key]
            labels = list(rows[0]["measured"])
            predicted = {k: statistics.median(r["predicted"][k] for r in rows) for k in labels}
            rho = spearman([predicted[k] for k in labels], _medians(rows, labels))
            n, wrong = resolved_pairs(rows, labels, predicted)
            met, runs, alike, resolved = met + (rho >= 0.8 - 1e-9), runs + 1, alike + n - len(wrong), resolved + n
            half = len(rows) // 2
            split = halves_agree(rows, labels)
            repeats = split >= 0.8 - 1e-9
            stable, stable_met = stable + repeats, stable_met + (repeats and rho >= 0.8 - 1e-9)
            lines.append(f"| {Path(path).stem} | {key} | {rho:.2f} | {split:.2f} | {n - len(wrong)} of {n} |")
            for first, second in ((rows[:half], rows[half:]), (rows[0::2], rows[1::2])):
                a, b = _medians(first, labels), _medians(second, labels)
                agree = spearman(a, b) >= 0.8 - 1e-9
                for side in (a, b):
                    model_vs_half += spearman([predicted[k] for k in labels], side) >= 0.8 - 1e-9
                    half_vs_half += agree
                    halves += 1
    lines += ["", f"Spearman >= 0.8 in **{met} of {runs}** model-runs; resolved pairs ordered alike {alike} of "
              f"{resolved}. Against half of a run's repetitions (two splits, both halves): the prediction >= 0.8 in "
              f"**{model_vs_half} of {halves}**, the other half >= 0.8 in **{half_vs_half} of {halves}**. Where the "
              f"measured ranking repeats (the first half of the repetitions against the second >= 0.8): the "
              f"prediction >= 0.8 in **{stable_met} of {stable}** model-runs."]
    return "\n".join(lines)


def stolen(rows: list[dict], key: str) -> str:
    shares = [r["steal"][key] for r in rows if key in r.get("steal", {})]
    return f"{statistics.median(shares):.0%} ({min(shares):.0%}-{max(shares):.0%})" if shares else "-"


def report(results: list[dict], argv: list[str], where: str, load: tuple[float, float]) -> str:
    repeats = max(r["repeat"] for r in results) + 1
    lines = [f"Command: `{' '.join(argv)}` ({where}; {repeats} interleaved repetitions, medians; load average "
             f"{load[0]:.1f} before, {load[1]:.1f} after)", ""]
    pooled_pred, pooled_meas, summary = [], [], []
    for key in dict.fromkeys(r["model"] for r in results):
        rows = [r for r in results if r["model"] == key]
        labels = list(rows[0]["measured"])
        measured = dict(zip(labels, _medians(rows, labels)))
        predicted = {k: statistics.median(r["predicted"][k] for r in rows) for k in labels}
        ddp = statistics.median(r["ddp"] for r in rows)
        auto = statistics.median(r["auto"] for r in rows)
        # each repetition's auto run against its own plain DDP run (the two in the same counterbalanced order): a
        # drift over the run (loopback's steps have gone 47 -> 60 ms in one run) does not enter the ratio
        paired = sorted(r["ddp"] / r["auto"] for r in rows)
        choices = [r["chosen"] for r in rows]
        rho = spearman([predicted[k] for k in labels], [measured[k] for k in labels])
        stability = [spearman([a["measured"][k] for k in labels], [b["measured"][k] for k in labels])
                     for i, a in enumerate(rows) for b in rows[i + 1:]]
        # the measured ranking's own reliability: the first half of the repetitions' medians against the second's
        # (each half holds forward and reversed orders alike); no prediction can agree with it much better
        split = float("nan")
        if len(rows) >= 2:
            split = spearman(_medians(rows[:len(rows) // 2], labels), _medians(rows[len(rows) // 2:], labels))
        resolved, misordered = resolved_pairs(rows, labels, predicted)
        pooled_pred += [predicted[k] / min(predicted.values()) for k in labels]
        pooled_meas += [measured[k] / min(measured.values()) for k in labels]
        best = min(measured, key=measured.get)
        # a choice outside the grid (the MoE grid has no int4) counts by the auto run's own step time
        chosen = statistics.median(measured.get(c, r["auto"]) for c, r in zip(choices, rows))
        lines += [f"**{MODELS[key][0]}**, {rows[0]['tokens_per_step']} tokens per step", "",
                  "| candidate | predicted step | measured step | tokens/s vs plain DDP | measured rank | CPU stolen "
                  "by the host (median) |",
                  "|---|---|---|---|---|---|"]
        order = sorted(labels, key=measured.get)
        outside = sorted(set(choices) - set(labels))
        for k in labels:
            mark = f" (auto's choice, {choices.count(k)} of {len(rows)})" if k in choices else ""
            lines.append(f"| {k}{mark} | {predicted[k] * 1e3:.1f} ms | {measured[k] * 1e3:.1f} ms | "
                         f"{ddp / measured[k]:.2f}x | {order.index(k) + 1} | {stolen(rows, k)} |")
        lines += [f"| plain DDP (`strategy=\"ddp\"`) | | {ddp * 1e3:.1f} ms | 1.00x | | {stolen(rows, 'ddp')} |",
                  f"| auto run (its own step time, setup excluded) | | {auto * 1e3:.1f} ms | {ddp / auto:.2f}x | | "
                  f"{stolen(rows, 'auto')} |",
                  "", f"Spearman predicted vs measured ({len(labels)} candidates): **{rho:.2f}**; measured vs "
                  f"measured between repetitions: {', '.join(f'{x:.2f}' for x in stability) or 'n/a'}; the first half "
                  f"of the repetitions' medians against the second half's: {split:.2f}. Auto chose "
                  f"{', '.join(sorted(set(choices)))}; measured best {best}; the choice's measured step / the best's: "
                  f"{chosen / measured[best]:.2f}x (tokens/s {measured[best] / chosen:.2f}x of the best, "
                  f"{ddp / chosen:.2f}x of DDP); the auto run itself {ddp / auto:.2f}x of DDP (paired, each "
                  f"repetition's against its own DDP run: median {statistics.median(paired):.2f}x, "
                  f"{paired[0]:.2f}x-{paired[-1]:.2f}x)."
                  + (f" ({', '.join(outside)}: not in the grid, counted by the auto run's own steps)" if outside
                     else ""), "",
                  f"Pairs of candidates the repetitions order alike (sign test within repetitions, two-sided p < "
                  f"0.1): {resolved} of {len(labels) * (len(labels) - 1) // 2}; the prediction orders "
                  f"**{resolved - len(misordered)} of {resolved}** the same way"
                  + (f" (not: {', '.join(misordered)})" if misordered else ""), ""]
        if all(k in r.get("steal", {}) for r in rows for k in labels):
            # A rough correction, not the target's figure: 4 ranks on 2 vCPUs are CPU-bound, so a step takes about
            # 1 / (1 - s) longer when the host takes a share s of the machine's CPU (autotune/steal.py).
            def unstolen(row: dict, k: str) -> float:
                return row["measured"][k] * (1 - row["steal"][k])
            adjusted = {k: statistics.median(unstolen(r, k) for r in rows) for k in labels}
            adjusted_stability = [spearman([unstolen(a, k) for k in labels], [unstolen(b, k) for k in labels])
                                  for i, a in enumerate(rows) for b in rows[i + 1:]]
            lines += [f"With every measured step scaled by the CPU share the host left it (t x (1 - stolen)): "
                      f"Spearman {spearman([predicted[k] for k in labels], [adjusted[k] for k in labels]):.2f}; "
                      f"measured vs measured {', '.join(f'{x:.2f}' for x in adjusted_stability) or 'n/a'}", ""]
        summary.append(f"{key} {rho:.2f} (measured half against half {split:.2f}; resolved pairs ordered "
                       f"{resolved - len(misordered)} of {resolved})")
    lines.append(f"Spearman per model: {', '.join(summary)}; pooled over the models (step times relative to each "
                 f"model's fastest): {spearman(pooled_pred, pooled_meas):.2f}")
    return "\n".join(lines)


def launch(args: argparse.Namespace, out: Path) -> str:
    """Start the workers (on loopback, or in the testbed's namespaces); return where they ran."""
    from benchmarks.testbed import Testbed, run_ranks

    common = [sys.executable, __file__, "--worker", "--out", str(out), "--steps", str(args.steps),
              "--repeats", str(args.repeats), "--models", args.models]
    if not args.testbed:
        run_ranks(common, 29731, args.timeout, ROOT)
        return "loopback, 2 processes, 1 thread each"
    with Testbed(num_hosts=2, rate=args.rate, prefix=args.prefix, subnet=args.subnet) as bed:
        run_ranks(common, 29732, args.timeout, ROOT, bed)
    return f"testbed, 2 emulated nodes x 2 ranks, {args.rate} link"


def main(args: argparse.Namespace) -> None:
    if args.tally:
        print(tally(args.tally))
        return
    if args.report:  # a recorded run's report again, with this version's statistics
        print(report(json.loads(Path(args.report).read_text()), [f"(recorded: {args.report})"], "recorded run",
                     (float("nan"), float("nan"))))
        return
    out = Path(tempfile.mkdtemp(prefix="ldsm-")) / "results.json"
    before = os.getloadavg()[0]
    print(f"start {time.strftime('%H:%M:%S', time.gmtime())} UTC, load {before:.1f}", flush=True)
    try:
        where = launch(args, out)
    except BaseException as exc:  # the timeout, Ctrl-C, a failed rank: keep and report the rows written so far
        if not out.is_file():
            raise
        where = f"cut short ({type(exc).__name__}): the repetitions finished before it"
        print(f"bench_cost_model: {where}", file=sys.stderr, flush=True)
        failed: BaseException | None = exc
    else:
        failed = None
    results = json.loads(out.read_text())
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(f"end {time.strftime('%H:%M:%S', time.gmtime())} UTC", flush=True)
    print(report(results, [Path(sys.argv[0]).as_posix(), *sys.argv[1:]], where, (before, os.getloadavg()[0])))
    if failed is not None:
        raise SystemExit(f"bench_cost_model: cut short by {type(failed).__name__}; {len(results)} model-repetitions "
                         "kept (a longer --timeout runs them all)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    from benchmarks.testbed import add_arguments
    add_arguments(parser, prefix="ldsm", subnet="10.213.73")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--models", default="demo,ffn,moe", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--timeout", type=float, default=2700)
    parser.add_argument("--json", default="")
    parser.add_argument("--report", default="", help="report a recorded --json file again; run nothing")
    parser.add_argument("--tally", nargs="+", default=[], help="pool recorded --json files (see tally); run nothing")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out", default="")
    parsed = parser.parse_args()
    worker(parsed) if parsed.worker else main(parsed)
