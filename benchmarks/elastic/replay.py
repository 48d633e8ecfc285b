"""One week of Microsoft's Philly GPU cluster replayed through ``ScalingPolicy`` against FIFO, FIFO+backfill and
Optimus' marginal-gain rule; the week's recorded node occupancy is the "before".

    .venv/bin/python benchmarks/elastic/replay.py --seeds 3

Trace: ``trace/philly-2017-11-01-7d-jobs.csv`` (3,871 jobs submitted 2017-11-01 .. 11-07: submission time, recorded
run duration, GPUs) and ``trace/philly-2017-11-01-7d-nodes.csv`` (Philly's nodes active per minute), derived by
``trace/derive_philly.py`` from the Pollux and Helios artifacts' extracts of the Philly trace (sources there). The
extract is a subset of Philly's jobs and has no start times, so the cluster that ran it is not known: the replay's
pool (``--pool``, default: calibrated) is sized so that the week's jobs, each started at submission with its
recorded duration, would keep it exactly as busy as Philly's nodes were recorded busy over the measured days.

Every policy sees the same jobs on ``--pool`` GPUs (one worker = one GPU), decides every ``--tick-s`` seconds, and
pays ``--outage-s`` of stopped training for every start and every resize (the outage measured by ``outage.py``):

- **FIFO** / **FIFO+backfill**: each job runs at its recorded GPU count from start to end, first-come first-served,
  strictly in order or letting any queued job that fits start;
- **ScalingPolicy**: the very ``ScalingPolicy.decide`` of ``lds-elastic`` (``cooldown_s=--cooldown-s``), fed the
  simulated jobs' ``JobStatus``;
- **Optimus**: the allocation rule of Optimus (Peng et al., EuroSys'18, section 4.1) as implemented in the Pollux
  artifact's ``simulator/optimus.py`` ("Optimus+Oracle"): every job gets its minimum (running jobs first, then
  waiting ones in submission order, while GPUs remain), then GPUs go one at a time to the job with the largest
  marginal gain, remaining work x (time per unit of work at w GPUs - at w + 1), up to its maximum; it knows the true
  speed function and remaining work (the oracle); jobs resized less than ``--cooldown-s`` ago keep their GPUs, as for
  ScalingPolicy. Pollux's own goodput rule needs each job's statistical efficiency (gradient noise scale over
  training), which a cluster trace does not record, so it is not replayed.

Elastic jobs may use ``[max(1, n // 4), min(2 n, pool)]`` GPUs for a recorded size ``n``; speed with ``w`` GPUs is
``w / (1 + 0.03 (w - 1))`` and a job's work is its recorded duration at ``n`` (both as in ``simulate.py``); a third
of the jobs (seeded) get a deadline of 1.5 x their recorded duration after submission (Philly records none).

Utilisation: GPU-seconds spent training (allocated and not stopped by a start or resize) over pool x time, measured
from day 2 to the end of the week (day 1 starts from an empty cluster, which Philly was not); useful utilisation
counts each GPU-second at the job's parallel efficiency (``speed(w) / w``), so a job grown into idle GPUs does not
count its communication overhead as use. JCT: completion -
submission, over every job of the week (each run continues until the last job finishes).
"""

from __future__ import annotations

import argparse
import csv
import heapq
import math
import random
import statistics
import sys
from collections import deque
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from simulate import SimJob, speed  # noqa: E402

from lightning_deepseek.elastic.controller.policy import JobStatus, ScalingPolicy  # noqa: E402

TRACE = Path(__file__).resolve().parent / "trace" / "philly-2017-11-01-7d"
DAY = 86400.0


def load_jobs(path: Path) -> list[tuple[float, float, int]]:
    """``(submit_s, duration_s, num_gpus)`` of every job in the derived trace."""
    with open(path) as handle:
        return [(float(r["submit_s"]), float(r["duration_s"]), int(r["num_gpus"])) for r in csv.DictReader(handle)]


def recorded_occupancy(path: Path, start_s: float, end_s: float) -> float:
    """Mean fraction of Philly's nodes recorded active between ``start_s`` and ``end_s``."""
    with open(path) as handle:
        rows = [r for r in csv.DictReader(handle) if start_s <= 60 * int(r["minute"]) < end_s]
    return statistics.mean(int(r["active"]) / int(r["total"]) for r in rows)


def calibrated_pool(trace: list[tuple[float, float, int]], occupancy: float, start_s: float, end_s: float) -> int:
    """Pool size at which the trace, started at submission, is busy ``occupancy`` of the time in the window."""
    busy = sum(gpus * max(0.0, min(s + d, end_s) - max(s, start_s)) for s, d, gpus in trace)
    return round(busy / (end_s - start_s) / occupancy)


def make_jobs(trace: list[tuple[float, float, int]], pool: int, seed: int) -> list[SimJob]:
    rng = random.Random(seed)
    jobs = []
    for i, (submit, duration, gpus) in enumerate(trace):
        gpus = min(gpus, pool)
        deadline = 1.5 * duration if rng.random() < 1 / 3 else None
        jobs.append(SimJob(f"job{i}", submit, min(2 * gpus, pool), max(1, gpus // 4), speed(gpus) * duration,
                           deadline, requested=gpus))
    return jobs


def resize(job: SimJob, workers: int, now: float, outage_s: float) -> None:
    """Give ``job`` ``workers`` GPUs; a start or resize stops its training for ``outage_s``."""
    job.paused_until, job.last_resize = now + outage_s, now
    job.started = now if job.started is None else job.started
    job.workers = workers


def static(backfill: bool, outage_s: float) -> Callable[[float, list[SimJob], int], int]:
    def allocate(now: float, live: list[SimJob], pool: int) -> int:
        free = pool - sum(job.workers for job in live)
        for job in (j for j in live if j.started is None):
            if job.requested <= free:
                resize(job, job.requested, now, outage_s)
                free -= job.requested
            elif not backfill:
                break
        return 0
    return allocate


def scaling_policy(cooldown_s: float, outage_s: float) -> Callable[[float, list[SimJob], int], int]:
    policies: dict[int, ScalingPolicy] = {}

    def allocate(now: float, live: list[SimJob], pool: int) -> int:
        policy = policies.setdefault(pool, ScalingPolicy(pool_size=pool, cooldown_s=cooldown_s))
        statuses = [JobStatus(
            name=job.name, min_workers=job.min_workers, max_workers=job.max_workers, workers=job.workers,
            samples_per_s=speed(job.workers) if job.workers else None, fraction_done=job.done / job.work,
            elapsed_s=now - job.arrival, since_resize_s=now - job.last_resize, deadline_s=job.deadline_s,
        ) for job in live]
        resizes = 0
        for job, target in zip(live, policy.decide(statuses).values()):
            if target != job.workers and target > 0:
                resizes += job.workers > 0
                resize(job, target, now, outage_s)
        return resizes
    return allocate


def optimus(cooldown_s: float, outage_s: float) -> Callable[[float, list[SimJob], int], int]:
    def gain(job: SimJob, workers: int) -> float:
        remaining = job.work - job.done
        return remaining * (1 / speed(workers) - 1 / speed(workers + 1)) if workers < job.max_workers else 0.0

    def allocate(now: float, live: list[SimJob], pool: int) -> int:
        frozen = [j for j in live if j.workers and now - j.last_resize < cooldown_s]
        target = {j.name: j.workers for j in frozen}
        free = pool - sum(target.values())
        movable = [j for j in live if j.workers and j.name not in target] + [j for j in live if not j.workers]
        for job in movable:  # minimums: running jobs first, then waiting ones in submission order
            target[job.name] = job.min_workers if job.min_workers <= free else 0
            free -= target[job.name]
        heap = [(-gain(j, target[j.name]), i) for i, j in enumerate(movable) if target[j.name]]
        heapq.heapify(heap)
        while free > 0 and heap and heap[0][0] < 0:
            _, i = heapq.heappop(heap)
            job = movable[i]
            target[job.name] += 1
            free -= 1
            heapq.heappush(heap, (-gain(job, target[job.name]), i))
        resizes = 0
        for job in movable:
            if target[job.name] != job.workers and target[job.name] > 0:
                resizes += job.workers > 0
                resize(job, target[job.name], now, outage_s)
            elif target[job.name] == 0 and job.workers:  # cannot happen: running jobs keep their minimum first
                raise AssertionError(f"{job.name} lost its minimum")
        return resizes
    return allocate


def replay(jobs: list[SimJob], pool: int, tick_s: float, allocate: Callable[[float, list[SimJob], int], int],
           window: tuple[float, float]) -> dict[str, float]:
    """Run every job to completion under ``allocate``; returns the metrics."""
    pending = deque(sorted(jobs, key=lambda j: j.arrival))
    live: list[SimJob] = []
    now, busy, useful, resizes = 0.0, 0.0, 0.0, 0
    while pending or live:
        if not live and pending[0].arrival > now:
            now = math.floor(pending[0].arrival / tick_s) * tick_s
        while pending and pending[0].arrival <= now:
            live.append(pending.popleft())
        resizes += allocate(now, live, pool)
        for job in live:
            if not job.workers:
                continue
            begin = max(now, job.paused_until)
            end = now + tick_s
            if begin >= end:
                continue
            rate = speed(job.workers)
            if job.done + rate * (end - begin) >= job.work:
                end = begin + (job.work - job.done) / rate
                job.finished = end
            job.done += rate * (end - begin)
            in_window = max(0.0, min(end, window[1]) - max(begin, window[0]))
            busy += job.workers * in_window
            useful += rate * in_window
        for job in live:
            if job.finished is not None:
                job.workers = 0
        live = [job for job in live if job.finished is None]
        now += tick_s
    jct = sorted(job.finished - job.arrival for job in jobs)
    met = [job.finished - job.arrival <= job.deadline_s for job in jobs if job.deadline_s is not None]
    capacity = pool * (window[1] - window[0])
    return {"utilisation": busy / capacity, "useful": useful / capacity, "mean_jct": statistics.mean(jct),
            "p50_jct": jct[len(jct) // 2], "p95_jct": jct[int(0.95 * len(jct))], "p99_jct": jct[int(0.99 * len(jct))],
            "deadlines": sum(met) / max(len(met), 1), "resizes": resizes,
            "makespan_days": max(job.finished for job in jobs) / DAY}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=TRACE, help="stem of the derived -jobs.csv and -nodes.csv")
    parser.add_argument("--pool", type=int, default=None, help="GPUs (default: calibrated to the recorded occupancy)")
    parser.add_argument("--seeds", type=int, default=3, help="deadline assignments; medians are reported")
    parser.add_argument("--tick-s", type=float, default=60.0)
    parser.add_argument("--outage-s", type=float, default=20.0)
    parser.add_argument("--cooldown-s", type=float, default=300.0)
    args = parser.parse_args()
    trace = load_jobs(Path(f"{args.trace}-jobs.csv"))
    window = (DAY, 7 * DAY)
    before = recorded_occupancy(Path(f"{args.trace}-nodes.csv"), *window)
    pool = args.pool or calibrated_pool(trace, before, *window)
    policies = {
        "FIFO": static(False, args.outage_s),
        "FIFO+backfill": static(True, args.outage_s),
        "ScalingPolicy (lds-elastic)": scaling_policy(args.cooldown_s, args.outage_s),
        "Optimus (marginal gain, oracle)": optimus(args.cooldown_s, args.outage_s),
    }
    results: dict[str, list[dict[str, float]]] = {name: [] for name in policies}
    for seed in range(args.seeds):
        for name, allocate in policies.items():
            results[name].append(replay(make_jobs(trace, pool, seed), pool, args.tick_s, allocate, window))
    print(f"command: {' '.join(sys.argv)}  ({len(trace)} jobs, pool {pool} GPUs, medians over deadline seeds "
          f"0..{args.seeds - 1}; utilisation over days 2-7)\n")
    print(f"before: Philly's nodes recorded active {before:.0%} of the time over days 2-7 (node occupancy)\n")
    print("| allocation | utilisation | useful utilisation | mean JCT (h) | p50 JCT (h) | p95 JCT (h) | p99 JCT (h) "
          "| deadlines met | resizes | makespan (days) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, rows in results.items():
        m = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
        print(f"| {name} | {m['utilisation']:.1%} | {m['useful']:.1%} | {m['mean_jct'] / 3600:.2f} | "
              f"{m['p50_jct'] / 3600:.2f} | {m['p95_jct'] / 3600:.1f} | {m['p99_jct'] / 3600:.1f} | "
              f"{m['deadlines']:.0%} | {m['resizes']:.0f} | {m['makespan_days']:.1f} |")


if __name__ == "__main__":
    main()
