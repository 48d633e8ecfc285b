"""``ScalingPolicy``: how many workers each elastic job should have, from the jobs' own reports.

One decision for all jobs sharing a pool of workers (``pool_size``), in this order:

1. every running job keeps at least ``min_workers``; a job that has not started gets ``min_workers`` when
   that many are free, in submission order (otherwise it waits with 0);
2. a job is **lagging** when its throughput is below ``target_samples_per_s`` or its projected finish
   (elapsed time / fraction done) is past ``deadline_s``; it is **ahead** when it would still meet its
   target or deadline with one worker fewer; jobs without a target are **flexible**;
3. a waiting job's workers come from jobs that are ahead, then from flexible jobs above their minimum;
   a lagging job may take workers from flexible jobs above their minimum; nobody takes from a lagging job;
4. free workers go one at a time to lagging jobs (the furthest behind first), then to flexible ones, up to
   each job's ``max_workers``; jobs that are ahead give one worker back per decision;
5. a job resized less than ``cooldown_s`` ago keeps its size (each resize stops training for a few seconds),
   and a job that reported a non-finite loss is never grown (more workers do not cure divergence).

It is a pure function of ``JobStatus`` values: the controller feeds it live reports, the simulation in
``benchmarks/elastic`` feeds it simulated ones. Not modelled: placement (which node), priorities, preemption
cost beyond the cooldown.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class JobStatus:
    """What the policy knows about one job.

    Args:
        name: job id.
        min_workers: fewest workers the job runs with.
        max_workers: most workers it may use.
        workers: workers it has now (0: not started).
        samples_per_s: latest measured throughput, ``None`` before the first report.
        fraction_done: completed fraction of the job (0..1).
        elapsed_s: seconds since the job was submitted.
        since_resize_s: seconds since its last resize.
        target_samples_per_s: throughput it should reach, or ``None``.
        deadline_s: seconds after submission by which it should finish, or ``None``.
        healthy: False after a non-finite loss.
    """

    name: str
    min_workers: int
    max_workers: int
    workers: int = 0
    samples_per_s: float | None = None
    fraction_done: float = 0.0
    elapsed_s: float = 0.0
    since_resize_s: float = float("inf")
    target_samples_per_s: float | None = None
    deadline_s: float | None = None
    healthy: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.min_workers <= self.max_workers:
            raise ValueError(f"job {self.name!r}: need 1 <= min_workers ({self.min_workers}) <= max_workers "
                             f"({self.max_workers}) (lds-elastic: --min-workers, --max-workers); set both to at "
                             "least 1, min no larger than max.")


@dataclass
class ScalingPolicy:
    """Decides target sizes for jobs sharing ``pool_size`` workers.

    Args:
        pool_size: workers shared by all jobs; ``None``: unlimited (each job is bounded by its own maximum).
        tolerance: relative slack before a job counts as lagging or ahead.
        cooldown_s: seconds after a resize during which a job is not resized again.
    """

    pool_size: int | None = None
    tolerance: float = 0.1
    cooldown_s: float = 30.0

    def __post_init__(self) -> None:
        if self.pool_size is not None and self.pool_size < 1:
            raise ValueError(f"pool_size={self.pool_size} must be a positive number of workers, or None.")
        if not 0 <= self.tolerance < 1:
            raise ValueError(f"tolerance={self.tolerance} must lie in [0, 1), e.g. 0.1.")

    def classify(self, job: JobStatus) -> str:
        """``"lagging"``, ``"ahead"`` or ``"flexible"``."""
        if job.workers == 0 or (job.target_samples_per_s is None and job.deadline_s is None):
            return "flexible"
        per_worker = job.samples_per_s / job.workers if job.samples_per_s else None
        lagging, ahead = False, True
        if job.target_samples_per_s is not None and per_worker is not None:
            lagging |= job.samples_per_s < job.target_samples_per_s * (1 - self.tolerance)
            ahead &= per_worker * (job.workers - 1) >= job.target_samples_per_s * (1 + self.tolerance)
        if job.deadline_s is not None and job.fraction_done > 0:
            remaining = job.elapsed_s * (1 - job.fraction_done) / job.fraction_done
            lagging |= job.elapsed_s + remaining > job.deadline_s * (1 + self.tolerance)
            slower = remaining * job.workers / max(job.workers - 1, 1e-9)
            ahead &= job.elapsed_s + slower <= job.deadline_s * (1 - self.tolerance)
        if lagging:
            return "lagging"
        return "ahead" if ahead and per_worker is not None and job.workers > job.min_workers else "flexible"

    def _behind(self, job: JobStatus) -> float:
        """How far behind a lagging job is (larger is worse), to order the grants."""
        if job.target_samples_per_s is not None and job.samples_per_s is not None:
            return job.target_samples_per_s / max(job.samples_per_s, 1e-9)
        if job.deadline_s is not None and job.fraction_done > 0:
            return job.elapsed_s / job.fraction_done / job.deadline_s
        return 1.0

    def decide(self, jobs: list[JobStatus]) -> dict[str, int]:
        """Target number of workers per job name (0 for a job that must keep waiting)."""
        target = {job.name: job.workers for job in jobs}
        frozen = {job.name for job in jobs if job.workers and job.since_resize_s < self.cooldown_s}
        kind = {job.name: self.classify(job) for job in jobs}
        pool = self.pool_size if self.pool_size is not None else sum(job.max_workers for job in jobs)
        for job in jobs:  # running jobs are clamped to their bounds even in cooldown
            if job.workers:
                target[job.name] = min(max(job.workers, job.min_workers), job.max_workers)

        def free() -> int:
            return pool - sum(target.values())

        def movable(job: JobStatus) -> bool:
            return job.name not in frozen and target[job.name] > job.min_workers

        donors = [j for j in jobs if kind[j.name] == "ahead"] + [j for j in jobs if kind[j.name] == "flexible"]
        for job in (j for j in jobs if j.workers == 0):
            before = dict(target)
            for donor in donors:
                while free() < job.min_workers and donor.workers and movable(donor):
                    target[donor.name] -= 1
            if free() >= job.min_workers:
                target[job.name] = job.min_workers
            else:  # cannot start it yet: shrinking the donors would only cost them a resize
                target = before
        for job in jobs:
            if kind[job.name] == "ahead" and movable(job) and target[job.name] == job.workers:
                target[job.name] -= 1
        lagging = sorted((j for j in jobs if kind[j.name] == "lagging"), key=self._behind, reverse=True)
        for job in lagging:  # a lagging job also takes from flexible jobs (ahead ones already gave one back)
            if job.name in frozen or not job.healthy:
                continue
            for donor in (j for j in jobs if kind[j.name] == "flexible"):
                while target[job.name] < job.max_workers and donor.workers and movable(donor):
                    target[donor.name] -= 1
                    target[job.name] += 1
        flexible = [j for j in jobs if kind[j.name] == "flexible" and target[j.name] > 0]
        for group in (lagging, flexible):
            growing = [j for j in group if j.name not in frozen and j.healthy]
            while free() > 0 and growing:
                for job in list(growing):
                    if free() > 0 and target[job.name] < job.max_workers:
                        target[job.name] += 1
                    else:
                        growing.remove(job)
        return target
