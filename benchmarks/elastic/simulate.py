"""Several jobs sharing a fixed pool of workers: ``ScalingPolicy`` (elastic) against static allocation.

    .venv/bin/python benchmarks/elastic/simulate.py --seeds 5 --mean-gap-s 1200

The elastic side calls the very ``ScalingPolicy.decide`` that ``lds-elastic`` uses, every ``--tick-s``
simulated seconds, with ``JobStatus`` values computed from the simulated jobs; every start or resize pauses
the job for ``--outage-s`` seconds (the outage measured by ``benchmarks/elastic/outage.py``). The static side
runs each job at its requested size from start to end, first-come first-served, either strictly in order
(``FIFO``) or with backfilling (any queued job that fits starts: ``FIFO+backfill``).

Trace (synthetic, seeded; stated because the result depends on it): ``--jobs`` jobs arriving as a Poisson
process with mean gap ``--mean-gap-s``; requested size 4 or 8 workers (equal odds); the elastic job may use
``[size / 4, 2 x size]`` workers (capped at the pool); its duration at the requested size is
lognormal(mean ln 2400 s, sigma 0.8); a third of the jobs have a deadline of 1.5 x that duration after
arrival, the others none. Speed with ``w`` workers is ``w / (1 + 0.03 (w - 1))`` (3% communication cost
per extra worker), so growing a job costs some efficiency.

Utilisation: worker-seconds spent training (allocated and not paused by a resize) over pool size x time from
the first arrival to the last completion. With a fixed amount of work it can rise only by finishing the
trace sooner, which is why it is bounded by the offered load on lightly loaded traces.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_deepseek.elastic.controller.policy import JobStatus, ScalingPolicy  # noqa: E402

OVERHEAD = 0.03


def speed(workers: int) -> float:
    """Work per second with ``workers`` workers."""
    return workers / (1 + OVERHEAD * (workers - 1)) if workers else 0.0


@dataclass
class SimJob:
    name: str
    arrival: float
    max_workers: int
    min_workers: int
    work: float
    deadline_s: float | None
    requested: int = 0
    done: float = 0.0
    workers: int = 0
    paused_until: float = 0.0
    last_resize: float = -math.inf
    started: float | None = None
    finished: float | None = None


def make_trace(seed: int, num_jobs: int, mean_gap_s: float, pool: int) -> list[SimJob]:
    rng = random.Random(seed)
    jobs, now = [], 0.0
    for i in range(num_jobs):
        size = rng.choice([4, 8])
        duration = rng.lognormvariate(math.log(2400), 0.8)
        deadline = 1.5 * duration if rng.random() < 1 / 3 else None
        work = speed(size) * duration
        jobs.append(SimJob(f"job{i}", now, min(2 * size, pool), size // 4, work, deadline, requested=size))
        now += rng.expovariate(1 / mean_gap_s)
    return jobs


def _advance(jobs: list[SimJob], now: float, dt: float) -> float:
    """Train every running job for ``dt``; returns the busy worker-seconds."""
    busy = 0.0
    for job in jobs:
        if job.workers and job.finished is None:
            active = max(0.0, dt - max(0.0, job.paused_until - now))
            job.done += speed(job.workers) * active
            busy += job.workers * active
            if job.done >= job.work:
                job.finished, job.workers = now + dt, 0
    return busy


def run_static(jobs: list[SimJob], pool: int, dt: float, backfill: bool) -> tuple[float, float]:
    now, busy = 0.0, 0.0
    while any(job.finished is None for job in jobs):
        free = pool - sum(job.workers for job in jobs)
        for job in (j for j in jobs if j.arrival <= now and j.started is None):
            if job.requested > free:
                if backfill:
                    continue
                break
            job.workers, job.started = job.requested, now
            free -= job.requested
        busy += _advance(jobs, now, dt)
        now += dt
    return busy, now


def run_elastic(jobs: list[SimJob], pool: int, dt: float, outage_s: float, cooldown_s: float) -> tuple[float, float]:
    policy = ScalingPolicy(pool_size=pool, cooldown_s=cooldown_s)
    now, busy = 0.0, 0.0
    while any(job.finished is None for job in jobs):
        live = [job for job in jobs if job.arrival <= now and job.finished is None]
        statuses = [JobStatus(
            name=job.name, min_workers=job.min_workers, max_workers=job.max_workers, workers=job.workers,
            samples_per_s=speed(job.workers) if job.workers else None, fraction_done=job.done / job.work,
            elapsed_s=now - job.arrival, since_resize_s=now - job.last_resize, deadline_s=job.deadline_s,
        ) for job in live]
        for job, target in zip(live, policy.decide(statuses).values()):
            if target != job.workers and target > 0:
                # A start costs the same start-up as a resize; a resize stops the whole job meanwhile.
                job.paused_until, job.last_resize = now + outage_s, now
                job.started = now if job.started is None else job.started
                job.workers = target
        busy += _advance(jobs, now, dt)
        now += dt
    return busy, now


def summarize(jobs: list[SimJob], busy: float, end: float, pool: int) -> tuple[float, float, float]:
    first = min(job.arrival for job in jobs)
    utilisation = busy / (pool * (end - first))
    completion = statistics.mean(job.finished - job.arrival for job in jobs)
    met = [job.finished - job.arrival <= job.deadline_s for job in jobs if job.deadline_s is not None]
    return utilisation, completion, sum(met) / max(len(met), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pool", type=int, default=16)
    parser.add_argument("--jobs", type=int, default=30)
    parser.add_argument("--mean-gap-s", type=float, default=600.0)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--tick-s", type=float, default=10.0)
    parser.add_argument("--outage-s", type=float, default=20.0)
    parser.add_argument("--cooldown-s", type=float, default=300.0)
    args = parser.parse_args()
    runs = {
        "static FIFO": lambda jobs: run_static(jobs, args.pool, args.tick_s, backfill=False),
        "static FIFO+backfill": lambda jobs: run_static(jobs, args.pool, args.tick_s, backfill=True),
        "elastic (ScalingPolicy)": lambda jobs: run_elastic(jobs, args.pool, args.tick_s, args.outage_s,
                                                            args.cooldown_s),
    }
    results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in runs}
    for seed in range(args.seeds):
        for name, run in runs.items():
            jobs = make_trace(seed, args.jobs, args.mean_gap_s, args.pool)
            results[name].append(summarize(jobs, *run(jobs), args.pool))
    print(f"command: {' '.join(sys.argv)}  (medians over trace seeds 0..{args.seeds - 1})\n")
    print("| allocation | utilisation | mean completion time (s) | deadlines met |")
    print("|---|---|---|---|")
    for name, rows in results.items():
        util, completion, met = (statistics.median(column) for column in zip(*rows))
        print(f"| {name} | {util:.0%} | {completion:.0f} | {met:.0%} |")


if __name__ == "__main__":
    main()
