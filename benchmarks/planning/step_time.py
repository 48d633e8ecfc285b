"""The plan's step time against measured steps on loopback gloo and on the 1 Gbit testbed (issue #48 part 5), side
by side in one run.

For each layout of ``check_real_runs.py`` (ddp, tp=2, zero1, ep=2, fsdp, hsdp; 2 and 4 processes on this machine's 2
cores, gloo over loopback; with ``--testbed``, the 4-process layouts on 2 emulated nodes x 2 ranks joined by a
``--rate`` link, ``benchmarks/testbed.py``, root), a Lightning fit of ``WARMUP + STEPS`` steps times each step on
every rank (training step, backward, gradient exchange, optimizer step: ``on_train_batch_start`` to
``on_train_batch_end``); a step's time is its slowest rank's, reported as the median of the ``STEPS`` after the
warm-up of ``ROUNDS`` rounds over the layouts and their spread (min-max). The machine is shared: each fit is
preceded by its own calibration (below), so that the figures a plan uses were measured under the load its steps ran
under.

The plans: ``lds-plan``'s planner with two sets of figures for the same processes,
- ``calibrated``: measured in the same processes just before each fit (nothing fitted to the steps): the FP32
  matmul rate of one rank while every rank runs one (``CALIBRATION_GEMM``, the peak; ``compute_efficiency=1``), a
  copy's bytes per second (the memory bandwidth AdamW's term uses), and gloo all-reduce times of 4 KiB and 4 MiB over
  the world, solved for the ring formula's latency and bandwidth (one link class: every rank on this host); on the
  testbed the same all-reduces inside each node (ranks 0-1 and 2-3 at once: the loopback link) and across (0-2 and
  1-3 at once, sharing each node's throttled link as a 4-rank collective's crossings do: the ``inter`` link);
- ``cpu preset``: ``lds-plan cluster=cpu`` as shipped (its figures and ``compute_efficiency=0.4``, the default);
  on the testbed ``cluster=testbed``.

Models: this package's GPT (``n_embd=256``, 4 blocks) and a Mixtral of the same width with 4 experts for ep=2,
4 x 128 tokens per rank, FP32, AdamW (sized so that compute, not Python, dominates a step).
Usage: ``PYTHONPATH=. .venv/bin/python benchmarks/planning/step_time.py [--testbed [--rate 1gbit]]`` from the
repository root (~5 min each).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lightning_deepseek import HybridParallelStrategy
from lightning_deepseek.models.config import PRESETS
from lightning_deepseek.parallel.placement import LinkCost
from lightning_deepseek.planning import ModelSpec, PlanLayout, StepShape, plan
from lightning_deepseek.planning.cluster import ClusterSpec
from tests.helpers import run_distributed
from tests.planning.real_run import PlannedModule

ROOT = Path(__file__).resolve().parents[2]

DENSE = ModelSpec("lds-256x4", "lds", {**PRESETS["small"], "n_embd": 256})
MOE = ModelSpec("mixtral-256", "hf", dict(model_type="mixtral", hidden_size=256, intermediate_size=512,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          vocab_size=256, max_position_embeddings=128, num_local_experts=4,
                                          num_experts_per_tok=2))
CASES = {
    2: [("ddp", DENSE, PlanLayout()), ("tp=2", DENSE, PlanLayout(tp=2)),
        ("zero1", DENSE, PlanLayout(shard_optimizer_states=True)), ("ep=2", MOE, PlanLayout(ep=2)),
        ("fsdp=2", DENSE, PlanLayout(dp_shard=2))],
    4: [("ddp", DENSE, PlanLayout()), ("tp=2", DENSE, PlanLayout(tp=2)),
        ("zero1", DENSE, PlanLayout(shard_optimizer_states=True)), ("ep=2 zero1", MOE, PlanLayout(
            ep=2, shard_optimizer_states=True)), ("fsdp=4", DENSE, PlanLayout(dp_shard=4)),
        ("hsdp=2x2", DENSE, PlanLayout(dp_shard=2))],
}
MICRO, SEQ, WARMUP, STEPS, ROUNDS = 4, 128, 2, 5, 2
CALIBRATION_GEMM = (512, 256, 1024)  # (tokens, n_embd, 4 n_embd): the dense model's up-projection
ALL_REDUCE_BYTES = (4 << 10, 4 << 20)


class StepTimer(pl.Callback):
    """Seconds of each training step at this rank."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.started = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self.started = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           idx: int) -> None:
        self.seconds.append(time.perf_counter() - self.started)


def _median_seconds(work: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def calibrate(links: dict[str, Any]) -> dict[str, float]:
    """This rank's matmul FLOP/s and copy bandwidth while every rank runs the same, and the all-reduce seconds per
    size on each of ``links`` (name: this rank's group, None for the world; collective: call on every rank)."""
    tokens, width, hidden = CALIBRATION_GEMM
    a, b = torch.randn(tokens, width), torch.randn(width, hidden)
    gemm = _median_seconds(lambda: [a @ b for _ in range(20)], 5) / 20
    source, target = torch.randn(16 << 20), torch.empty(16 << 20)  # 64 MiB each
    copy = _median_seconds(lambda: target.copy_(source), 5)
    out = {"flops": 2 * tokens * width * hidden / gemm, "copy_bytes_per_s": 2 * source.nbytes / copy}
    for name, group in links.items():
        for size in ALL_REDUCE_BYTES:
            buffer = torch.zeros(size // 4)
            out[f"{name}_{size}"] = _median_seconds(lambda b=buffer, g=group: dist.all_reduce(b, group=g), 20)
    return out


def _testbed_links() -> dict[str, Any]:
    """This rank's groups inside its node (0-1, 2-3) and across (0-2, 1-3) on the 2 x 2 testbed (collective)."""
    rank = dist.get_rank()
    inside = [dist.new_group(ranks) for ranks in ([0, 1], [2, 3])]
    across = [dist.new_group(ranks) for ranks in ([0, 2], [1, 3])]
    return {"intra": inside[rank // 2], "inter": across[rank % 2]}


def timed_steps(rank: int, world_size: int, nodes: int = 1) -> list[list[dict[str, Any]]]:
    """Per round, per case of ``world_size``: a calibration, then ``WARMUP + STEPS`` timed steps (this rank's); on
    ``nodes`` > 1 (the testbed) the calibration measures the links inside and across the nodes."""
    links = _testbed_links() if nodes > 1 else {"all_reduce": None}
    return [[_timed_case(spec, layout, world_size, nodes, links) for _, spec, layout in CASES[world_size]]
            for _ in range(ROUNDS)]


def _timed_case(spec: ModelSpec, layout: PlanLayout, world_size: int, nodes: int,
                links: dict[str, Any]) -> dict[str, Any]:
    calibration = calibrate(links)
    pl.seed_everything(0, verbose=False)
    timer = StepTimer()
    strategy = HybridParallelStrategy(tensor_parallel_size=layout.tp, expert_parallel_size=layout.ep,
                                      shard_optimizer_states=layout.shard_optimizer_states, min_shard_params=0,
                                      data_parallel_shard_size=layout.dp_shard)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=world_size // nodes, num_nodes=nodes,
                         max_steps=WARMUP + STEPS,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, callbacks=[timer])
    tokens = torch.randint(0, spec.vocab_size, (world_size * MICRO * (WARMUP + STEPS), SEQ))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=MICRO)
    trainer.fit(PlannedModule(spec), data)
    return {"calibration": calibration, "steps": timer.seconds}


def _ring_link(calibration: list[dict[str, float]], name: str, n: int) -> LinkCost:
    """The link from the ring all-reduce's ``2 (n - 1) / n * S / B + 2 (n - 1) a`` over ``n`` ranks at the two sizes
    (the median over ranks and rounds of each)."""
    small, large = ALL_REDUCE_BYTES
    t_small = statistics.median(c[f"{name}_{small}"] for c in calibration)
    t_large = statistics.median(c[f"{name}_{large}"] for c in calibration)
    bandwidth = 2 * (n - 1) / n * (large - small) / (t_large - t_small)
    latency = max(t_small - 2 * (n - 1) / n * small / bandwidth, 0.0) / (2 * (n - 1))
    return LinkCost(bandwidth, latency)


def calibrated_cluster(world_size: int, calibration: list[dict[str, float]], nodes: int = 1) -> ClusterSpec:
    """``nodes`` nodes of ``world_size / nodes`` ranks with the median (over ranks and rounds) of each figure: one
    link on one node (the world's all-reduce), else the pairs' inside and across the nodes."""
    if nodes == 1:
        intra = inter = _ring_link(calibration, "all_reduce", world_size)
    else:
        intra, inter = _ring_link(calibration, "intra", 2), _ring_link(calibration, "inter", 2)
    flops = statistics.median(c["flops"] for c in calibration)
    return ClusterSpec(f"calibrated-{world_size}", world_size // nodes, {"fp32": flops / 1e12}, 23.5 / nodes,
                       statistics.median(c["copy_bytes_per_s"] for c in calibration) / 1e9, intra, inter)


def _report(world_size: int, ranks: list[list[list[dict[str, Any]]]], preset: ClusterSpec, nodes: int,
            notes: list[str]) -> None:
    """A table row per case of ``world_size``: the measured steps, the plans with calibrated figures and with
    ``preset``'s; each case's calibration appended to ``notes``."""
    for index, (name, spec, layout) in enumerate(CASES[world_size]):
        runs = [[rank[round_][index] for rank in ranks] for round_ in range(ROUNDS)]
        cluster = calibrated_cluster(world_size, [r["calibration"] for run in runs for r in run], nodes)
        links = [cluster.intra] if nodes == 1 else [cluster.intra, cluster.inter]
        notes.append(f"{world_size} {name}: {cluster.peak_tflops['fp32'] * 1e3:.0f} GFLOP/s, "
                     f"{cluster.memory_bandwidth_gbs:.1f} GB/s, " + " / ".join(
                         f"{link.bandwidth / 1e9:.3f} GB/s {link.latency * 1e6:.0f} us" for link in links))
        seconds = [max(r["steps"][i] for r in run) for run in runs for i in range(WARMUP, WARMUP + STEPS)]
        measured = statistics.median(seconds)
        row = [f"{measured * 1e3:.0f} ({min(seconds) * 1e3:.0f}-{max(seconds) * 1e3:.0f})"]
        for figures, efficiency in ((cluster, 1.0), (preset, 0.4)):
            step = StepShape(MICRO, SEQ, "fp32", compute_efficiency=efficiency, min_shard_params=0)
            planned = plan(spec, world_size, layout, figures, step).step_seconds
            row.append(f"{planned * 1e3:.0f} ({(planned - measured) / measured:+.0%})")
        print(f"| {world_size} | {name} ({spec.name}) | {' | '.join(row)} |", flush=True)


def worker(out: str) -> None:
    """One rank of the testbed's world (``RANK``, ``WORLD_SIZE``, ``NUM_NODES`` and ``MASTER_*`` set by
    ``benchmarks/testbed.py``): the 4-rank cases timed, this rank's results written to ``out.<rank>``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    results = timed_steps(rank, world_size, int(os.environ["NUM_NODES"]))
    Path(f"{out}.{rank}").write_text(json.dumps(results))


def main(args: argparse.Namespace) -> None:
    from benchmarks.planning.step_time import timed_steps as by_reference  # picklable from the ranks
    from benchmarks.testbed import Testbed, run_ranks
    from lightning_deepseek.app.plan import resolve_cluster

    print(f"start {time.strftime('%H:%M:%S', time.gmtime())} UTC, load {os.getloadavg()[0]:.1f}", flush=True)
    print("| world | layout | measured ms, median (min-max) | planned ms, calibrated (error) "
          f"| planned ms, {'testbed' if args.testbed else 'cpu'} preset (error) |")
    print("|---|---|---|---|---|")
    notes: list[str] = []
    if args.testbed:
        out = Path(tempfile.mkdtemp(prefix="ldst-")) / "ranks"
        with Testbed(num_hosts=2, rate=args.rate, prefix=args.prefix, subnet=args.subnet) as bed:
            run_ranks([sys.executable, __file__, "--worker", str(out)], 29761, 1800, ROOT, bed)
        ranks = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(4)]
        _report(4, ranks, resolve_cluster("testbed"), 2, notes)
    else:
        for world_size in CASES:
            _report(world_size, run_distributed(by_reference, world_size, timeout=1800), resolve_cluster("cpu"), 1,
                    notes)
    print(f"end {time.strftime('%H:%M:%S', time.gmtime())} UTC, load {os.getloadavg()[0]:.1f}", flush=True)
    print("\nCalibration per case (GEMM rate per rank, copy, all-reduce link" + (" inside / across the nodes"
          if args.testbed else "") + "): " + "; ".join(notes))


if __name__ == "__main__":
    from benchmarks.testbed import add_arguments

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, prefix="ldst", subnet="10.213.59")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    parsed = parser.parse_args()
    if parsed.worker:
        worker(parsed.worker)
    else:
        main(parsed)
