"""``ElasticController`` and ``lds-elastic``: run elastic jobs and resize them from their reports.

Every ``interval_s`` the controller reads each job's report file (``report.py``), turns it into a
``JobStatus``, asks ``ScalingPolicy.decide`` for target sizes and applies them through a ``Backend``. It
never touches training processes itself, so it can die without harming the jobs: the agents run in their
own sessions and keep training at their current size (``LocalBackend`` records their pids in
``<run_dir>/agents.json``). A job that reports ``fatal`` (e.g. a checkpoint of another model) is stopped
and the controller exits with its message; a job that reports ``done`` is left to finish. A resize holds its job
from the decision until the job reports training at the new size (on a cluster manager that takes the queue and
the start-up), and ``cooldown_s`` counts from then; after ``RESIZE_TIMEOUT_S`` it holds no more. Each resize is
printed with its reason; at the end ``<run_dir>/workers.png`` plots the workers of every job over time.

    lds-elastic --min-workers 1 --max-workers 2 --run-dir runs/demo -- examples/elastic_train.py --run-dir runs/demo
    lds-elastic --backend slurm --partition gpu --min-workers 1 --max-workers 4 --run-dir /shared/runs/demo -- ...
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from lightning_deepseek.elastic.controller.backend import Backend, BackendError, JobSpec, LocalBackend, RendezvousTuning
from lightning_deepseek.elastic.controller.policy import JobStatus, ScalingPolicy
from lightning_deepseek.elastic.controller.timeline import Timeline, resize_reason
from lightning_deepseek.elastic.report import Reports

log = logging.getLogger(__name__)

# A resize that has not taken effect after this long (e.g. a node the cluster never scheduled) stops holding its job.
RESIZE_TIMEOUT_S = 600.0


class JobFailed(RuntimeError):
    """A job reported a fatal error or stopped without finishing."""


class ElasticController:
    """Keeps every job within ``[min_workers, max_workers]`` at the size the policy decides.

    Args:
        backend: starts and stops the jobs' nodes.
        policy: decides the sizes.
        jobs: the jobs, in submission order.
        interval_s: seconds between decisions.
    """

    def __init__(self, backend: Backend, policy: ScalingPolicy, jobs: list[JobSpec], interval_s: float = 5.0) -> None:
        names = [job.name for job in jobs]
        if len(set(names)) != len(names):
            raise ValueError(f"job names must be unique, got {names}.")
        self.backend = backend
        self.policy = policy
        self.jobs = jobs
        self.interval_s = interval_s
        self.reports = {job.name: Reports(job.report_file) for job in jobs}
        self.last_resize = {job.name: 0.0 for job in jobs}
        self.done: set[str] = set()
        self.started: set[str] = set()
        self.healthy = {job.name: True for job in jobs}
        self.timeline = Timeline()
        self.in_flight: dict[str, tuple[int, float]] = {}  # job name -> (nodes decided, when), until it trains so

    def status(self, job: JobSpec) -> JobStatus:
        """The policy's view of ``job`` from its latest reports."""
        reports = self.reports[job.name]
        for record in reports.read_new():
            if record.get("event") == "fatal":
                raise JobFailed(f"job {job.name!r} failed: {record.get('message')}")
            if record.get("event") == "done":
                self.done.add(job.name)
            if record.get("non_finite_loss"):
                self.healthy[job.name] = False
        progress = reports.latest_progress or {}
        max_steps = progress.get("max_steps") or 0
        now = time.time()
        target, decided = self.in_flight.get(job.name, (0, now))
        if job.name in self.in_flight and (progress.get("world_size") == target * job.nproc_per_node
                                           or now - decided > RESIZE_TIMEOUT_S):
            del self.in_flight[job.name]
            self.last_resize[job.name] = now  # the cooldown runs from the resize's end, not from its decision
        return JobStatus(
            name=job.name, min_workers=job.min_workers, max_workers=job.max_workers, workers=self.backend.size(job),
            samples_per_s=progress.get("samples_per_s"),
            fraction_done=min(progress.get("step", 0) / max_steps, 1.0) if max_steps > 0 else 0.0,
            elapsed_s=now - job.started_at,
            since_resize_s=0.0 if job.name in self.in_flight else now - self.last_resize[job.name],
            target_samples_per_s=job.target_samples_per_s, deadline_s=job.deadline_s, healthy=self.healthy[job.name],
        )

    def step(self) -> dict[str, int]:
        """One decision: read reports, decide, resize. Returns the targets."""
        active = [job for job in self.jobs if job.name not in self.done]
        statuses = [self.status(job) for job in active]
        for job in active:
            if job.name in self.started and job.name not in self.done and not self.backend.alive(job):
                raise JobFailed(f"job {job.name!r} stopped without finishing; see the agent logs in {job.run_dir}.")
        targets = self.policy.decide(statuses)
        for job, status in zip(active, statuses):
            self.timeline.record(job.name, status.workers)
            if job.name in self.done or targets[job.name] == status.workers or targets[job.name] == 0:
                continue
            reason = resize_reason(self.policy, status, targets[job.name], statuses, targets)
            print(f"lds-elastic: job {job.name!r}: {status.workers} -> {targets[job.name]} workers: {reason}",
                  flush=True)
            self.timeline.record(job.name, targets[job.name], reason)
            self.backend.scale(job, targets[job.name])
            self.started.add(job.name)
            self.last_resize[job.name] = time.time()
            self.in_flight[job.name] = (targets[job.name], self.last_resize[job.name])
        return targets

    def run(self, timeout_s: float | None = None) -> None:
        """Decide every ``interval_s`` until every job has finished; stops all jobs on a failure."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            while True:
                self.step()
                if len(self.done) == len(self.jobs):
                    return
                if deadline is not None and time.monotonic() > deadline:
                    raise JobFailed(f"jobs still running after timeout_s={timeout_s}.")
                time.sleep(self.interval_s)
        except BaseException:
            for job in self.jobs:
                self.backend.stop(job)
            raise
        finally:
            for run_dir in dict.fromkeys(job.run_dir for job in self.jobs):
                self.timeline.plot(run_dir / "workers.png")


def main(argv: list[str] | None = None) -> None:
    """Console entry point of ``lds-elastic`` (one job on this machine)."""
    parser = argparse.ArgumentParser(prog="lds-elastic", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", default="lds-elastic", help="job id (torchrun --rdzv-id)")
    parser.add_argument("--backend", choices=("local", "slurm"), default="local",
                        help="local: torchrun agents on this machine; slurm: one single-node SLURM job per node")
    parser.add_argument("--partition", default=None, help="SLURM partition (--backend slurm; default: the default)")
    parser.add_argument("--min-workers", type=int, required=True, help="fewest nodes")
    parser.add_argument("--max-workers", type=int, required=True, help="most nodes")
    parser.add_argument("--nproc-per-node", type=int, default=1)
    parser.add_argument("--pool-size", type=int, default=None, help="nodes available (default: max-workers)")
    parser.add_argument("--target-samples-per-s", type=float, default=None)
    parser.add_argument("--deadline-s", type=float, default=None)
    parser.add_argument("--run-dir", default="runs/elastic", help="agent logs; reports.jsonl is read from here")
    parser.add_argument("--report-file", default=None, help="default: <run-dir>/reports.jsonl")
    parser.add_argument("--rdzv-port", type=int, default=29400)
    parser.add_argument("--interval-s", type=float, default=5.0)
    parser.add_argument("--cooldown-s", type=float, default=30.0)
    parser.add_argument("--torchrun-defaults", action="store_true", help="keep torchrun's slow rendezvous timeouts")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- training script and its arguments")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        job = JobSpec(args.name, command, args.min_workers, args.max_workers, nproc_per_node=args.nproc_per_node,
                      run_dir=Path(args.run_dir), report_file=args.report_file,
                      target_samples_per_s=args.target_samples_per_s, deadline_s=args.deadline_s)
        tuning = RendezvousTuning.torchrun_defaults() if args.torchrun_defaults else RendezvousTuning()
        policy = ScalingPolicy(pool_size=args.pool_size or args.max_workers, cooldown_s=args.cooldown_s)
        if args.backend == "slurm":
            from lightning_deepseek.elastic.controller.slurm import SlurmBackend

            backend: Backend = SlurmBackend(args.partition, args.rdzv_port, tuning)
        else:
            backend = LocalBackend(args.rdzv_port, tuning)
        ElasticController(backend, policy, [job], args.interval_s).run()
    except (ValueError, JobFailed, BackendError) as exc:
        print(f"lds-elastic: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)

