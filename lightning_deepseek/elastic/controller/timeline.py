"""What ``lds-elastic`` decided, for a person: each resize's reason in words, and the workers of each job over time.

``resize_reason`` explains one decision of ``ScalingPolicy`` from the same ``JobStatus`` values the policy saw (it
re-derives the policy's classification, it does not change it). ``Timeline`` records the size of every job at every
decision and plots it as a step chart (``workers.png``, matplotlib, imported only when plotting); it holds one
point per job and decision, a few bytes each.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from lightning_deepseek.elastic.controller.policy import JobStatus, ScalingPolicy

log = logging.getLogger(__name__)


def resize_reason(policy: ScalingPolicy, job: JobStatus, target: int, jobs: list[JobStatus],
                  targets: dict[str, int]) -> str:
    """Why ``policy`` moves ``job`` from ``job.workers`` to ``target`` workers, in one line.

    Args:
        policy: the policy that decided.
        job: the job's status at the decision.
        target: its new size.
        jobs: every job's status at the decision.
        targets: every job's new size.
    """
    pool = policy.pool_size if policy.pool_size is not None else "unlimited"
    if job.workers == 0:
        return f"start at min_workers={job.min_workers}, grown to {target} from idle workers (pool {pool})" \
            if target > job.min_workers else f"start at min_workers={job.min_workers} (pool {pool})"
    if not job.min_workers <= job.workers <= job.max_workers:
        return f"clamped to [min_workers={job.min_workers}, max_workers={job.max_workers}]"
    kind = policy.classify(job)
    if target > job.workers:
        if kind == "lagging" and job.target_samples_per_s is not None and job.samples_per_s is not None \
                and job.samples_per_s < job.target_samples_per_s:
            return f"lagging: {job.samples_per_s:.1f} samples/s below its target {job.target_samples_per_s:g}"
        if kind == "lagging":
            finish = job.elapsed_s / job.fraction_done if job.fraction_done else float("inf")
            return f"lagging: projected finish at {finish:.0f} s is past its deadline {job.deadline_s:.0f} s"
        return f"flexible: idle workers in the pool ({pool}), up to max_workers={job.max_workers}"
    gainers = [j.name for j in jobs if j.name != job.name and targets[j.name] > j.workers]
    if kind == "ahead":
        goal = f"target {job.target_samples_per_s:g} samples/s" if job.target_samples_per_s is not None \
            else f"deadline {job.deadline_s:.0f} s"
        return f"ahead: would still meet its {goal} with one worker fewer" + \
            (f"; the worker goes to {', '.join(gainers)}" if gainers else "")
    return f"workers needed by {', '.join(gainers)}" if gainers else "pool shrank"


@dataclass
class Timeline:
    """Workers of each job at each decision, and the resizes with their reasons."""

    start: float = field(default_factory=time.time)
    points: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    resizes: list[tuple[float, str, int, str]] = field(default_factory=list)

    def record(self, name: str, workers: int, reason: str | None = None) -> None:
        """Note that job ``name`` has ``workers`` now; with ``reason``, that it was resized to that."""
        now = time.time() - self.start
        self.points.setdefault(name, []).append((now, workers))
        if reason is not None:
            self.resizes.append((now, name, workers, reason))

    def plot(self, path: Path) -> Path | None:
        """Write the step chart of workers per job over time to ``path`` (PNG); ``None`` when nothing was recorded."""
        if not self.points:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axes = plt.subplots(figsize=(8, 3 + 0.3 * len(self.points)))
        for name, points in self.points.items():
            times, workers = zip(*points, (time.time() - self.start, points[-1][1]))
            axes.step(times, workers, where="post", label=name)
        for when, _name, workers, _reason in self.resizes:
            axes.plot(when, workers, "k.", markersize=4)
        axes.set_xlabel("seconds since lds-elastic started")
        axes.set_ylabel("workers (nodes)")
        axes.yaxis.get_major_locator().set_params(integer=True)
        axes.legend(loc="upper right", fontsize="small")
        axes.set_title("workers per job (dots: resizes)")
        figure.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path, dpi=100)
        plt.close(figure)
        return path
