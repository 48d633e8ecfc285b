"""Launcher backends: how the controller adds and removes workers of a job. Ships ``LocalBackend``.

A backend owns the torchrun *agents* of a job (one agent = one node = ``nproc_per_node`` workers); the
controller only calls ``scale(job, num_workers)``, ``size(job)``, ``alive(job)`` and ``stop(job)``.

``LocalBackend`` runs agents on this machine: ``python -m torch.distributed.run --nnodes=MIN:MAX
--rdzv-backend=c10d`` in their own session, stopped with SIGTERM (then SIGKILL after ``stop_timeout_s``).
Agent 0 hosts the c10d rendezvous store (``is_host=true``) and is never the one removed on a shrink, since
the job's rendezvous would die with it. ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` is set because a grow after
a shrink deadlocks when workers share the agent's store. ``RendezvousTuning`` shortens torchrun's defaults
(30 s last call, 3 x 5 s keep-alive before a stopped agent counts as gone), which dominate the outage of a
resize; it costs more rendezvous rounds when agents join one by one.

``SlurmBackend`` (``slurm.py``) runs the same agents as single-node SLURM jobs. Other schedulers plug in by
implementing ``Backend`` (see docs/elastic.md), e.g. Kubernetes (``scale`` patches the Kubeflow ``PyTorchJob``'s
``Worker.replicas`` within its ``elasticPolicy.minReplicas/maxReplicas``; the operator starts or deletes pods,
and pod deletion sends SIGTERM).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RendezvousTuning:
    """torchrun settings that decide how long a resize takes.

    Args:
        last_call_timeout_s: once ``min`` nodes are there, how long the rendezvous waits for more.
        keep_alive_interval_s: heartbeat period of an agent.
        keep_alive_max_attempt: missed heartbeats after which an agent that left counts as gone.
        monitor_interval_s: how often an agent polls its workers and the rendezvous for waiting nodes.
        join_timeout_s: how long an agent waits for a rendezvous round to complete.
        close_timeout_s: how long a closing rendezvous waits for the other agents.
    """

    last_call_timeout_s: int = 1
    keep_alive_interval_s: int = 1
    keep_alive_max_attempt: int = 5
    monitor_interval_s: float = 0.1
    join_timeout_s: int = 600
    close_timeout_s: int = 10

    @classmethod
    def torchrun_defaults(cls) -> RendezvousTuning:
        """torchrun's own defaults (the reference the benchmark compares against)."""
        return cls(last_call_timeout_s=30, keep_alive_interval_s=5, keep_alive_max_attempt=3, monitor_interval_s=0.1,
                   join_timeout_s=600, close_timeout_s=30)

    def rdzv_conf(self) -> str:
        return (f"join_timeout={self.join_timeout_s},last_call_timeout={self.last_call_timeout_s},"
                f"close_timeout={self.close_timeout_s},keep_alive_interval={self.keep_alive_interval_s},"
                f"keep_alive_max_attempt={self.keep_alive_max_attempt}")


@dataclass
class JobSpec:
    """One elastic job.

    Args:
        name: job id (the torchrun ``--rdzv-id``).
        command: the training script and its arguments (what torchrun runs on every worker).
        min_workers: fewest nodes the job runs with.
        max_workers: most nodes the job may use.
        nproc_per_node: workers (processes) per node.
        run_dir: where agent logs and the report file live.
        report_file: the JSON-lines report file the job writes (``ElasticTraining(report_path=...)``).
        target_samples_per_s: throughput below which the job counts as lagging; ``None``: no target.
        deadline_s: seconds after the start by which the job should finish; ``None``: no deadline.
    """

    name: str
    command: list[str]
    min_workers: int
    max_workers: int
    nproc_per_node: int = 1
    run_dir: Path = Path("runs/elastic")
    report_file: Path | None = None
    target_samples_per_s: float | None = None
    deadline_s: float | None = None
    started_at: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        if self.min_workers < 1:
            raise ValueError(f"min_workers={self.min_workers} must be at least 1.")
        if self.min_workers > self.max_workers:
            raise ValueError(f"min_workers={self.min_workers} > max_workers={self.max_workers} for job "
                             f"{self.name!r}: set min_workers <= max_workers.")
        if not self.command:
            raise ValueError(f"job {self.name!r} has an empty command: pass the training script and its arguments.")
        self.run_dir = Path(self.run_dir)
        self.report_file = Path(self.report_file) if self.report_file else self.run_dir / "reports.jsonl"


class BackendError(RuntimeError):
    """A backend cannot start, stop or query a job's nodes (its message names the command or setting at fault)."""


class Backend(ABC):
    """Adds and removes the nodes (torchrun agents) of elastic jobs."""

    @abstractmethod
    def size(self, job: JobSpec) -> int:
        """Nodes of ``job`` currently running."""

    @abstractmethod
    def scale(self, job: JobSpec, num_workers: int) -> None:
        """Start or stop nodes until ``job`` has ``num_workers`` of them."""

    @abstractmethod
    def alive(self, job: JobSpec) -> bool:
        """Whether the job still runs (False once it finished or failed)."""

    @abstractmethod
    def stop(self, job: JobSpec) -> None:
        """Stop every node of ``job``."""


class LocalBackend(Backend):
    """torchrun agents on this machine.

    Args:
        rdzv_port: TCP port of the rendezvous store that agent 0 hosts on 127.0.0.1.
        tuning: rendezvous settings (``RendezvousTuning()`` is fast, ``.torchrun_defaults()`` is torchrun's).
        max_restarts: worker-group restarts an agent allows; each shrink costs the survivors one.
        stop_timeout_s: seconds between SIGTERM and SIGKILL when stopping an agent.
        python: interpreter that runs torchrun.
    """

    def __init__(self, rdzv_port: int = 29400, tuning: RendezvousTuning | None = None, max_restarts: int = 100,
                 stop_timeout_s: float = 60.0, python: str = sys.executable) -> None:
        self.rdzv_port = rdzv_port
        self.tuning = tuning or RendezvousTuning()
        self.max_restarts = max_restarts
        self.stop_timeout_s = stop_timeout_s
        self.python = python
        self.agents: dict[str, list[subprocess.Popen]] = {}
        self._started = 0

    def agent_command(self, job: JobSpec, is_host: bool) -> list[str]:
        """The torchrun command line of one agent of ``job``."""
        t = self.tuning
        return [
            self.python, "-m", "torch.distributed.run", f"--nnodes={job.min_workers}:{job.max_workers}",
            f"--nproc-per-node={job.nproc_per_node}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{self.rdzv_port}", f"--rdzv-id={job.name}",
            f"--max-restarts={self.max_restarts}", f"--monitor-interval={t.monitor_interval_s}",
            f"--rdzv-conf={t.rdzv_conf()},is_host={str(is_host).lower()}", *job.command,
        ]

    def start_agent(self, job: JobSpec) -> subprocess.Popen:
        """Start one more agent (node) of ``job``."""
        agents = self.agents.setdefault(job.name, [])
        agents[:] = [a for a in agents if a.poll() is None]
        job.run_dir.mkdir(parents=True, exist_ok=True)
        self._started += 1
        env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
        log_file = open(job.run_dir / f"agent-{self._started}.log", "w")  # noqa: SIM115 - the child owns it
        proc = subprocess.Popen(self.agent_command(job, is_host=not agents), stdout=log_file,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log_file.close()
        agents.append(proc)
        self._write_state(job)
        return proc

    def stop_agent(self, job: JobSpec, proc: subprocess.Popen, timeout_s: float | None = None) -> int | None:
        """SIGTERM one agent (its workers checkpoint and exit), SIGKILL its session after the timeout."""
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=self.stop_timeout_s if timeout_s is None else timeout_s)
            except subprocess.TimeoutExpired:
                log.warning(f"agent {proc.pid} of {job.name} ignored SIGTERM; killing its process group.")
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        agents = self.agents.get(job.name, [])
        if proc in agents:
            agents.remove(proc)
        self._write_state(job)
        return proc.returncode

    def size(self, job: JobSpec) -> int:
        return sum(1 for a in self.agents.get(job.name, []) if a.poll() is None)

    def scale(self, job: JobSpec, num_workers: int) -> None:
        if not job.min_workers <= num_workers <= job.max_workers:
            raise ValueError(f"scale({job.name!r}, {num_workers}) is outside [min_workers={job.min_workers}, "
                             f"max_workers={job.max_workers}].")
        while self.size(job) < num_workers:
            self.start_agent(job)
        while self.size(job) > num_workers:
            live = [a for a in self.agents[job.name] if a.poll() is None]
            self.stop_agent(job, live[-1])  # newest first: agent 0 hosts the rendezvous

    def alive(self, job: JobSpec) -> bool:
        agents = self.agents.get(job.name, [])
        return bool(agents) and agents[0].poll() is None

    def stop(self, job: JobSpec) -> None:
        for proc in reversed(list(self.agents.get(job.name, []))):
            self.stop_agent(job, proc)

    def kill(self, job: JobSpec) -> None:
        """SIGKILL every agent of ``job`` and its workers (in sessions of their own): the cleanup of last resort."""
        for proc in self.agents.get(job.name, []):
            for pid in [*descendant_pids(proc.pid), proc.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()
        self.agents[job.name] = []
        self._write_state(job)

    def _write_state(self, job: JobSpec) -> None:
        """Record agent pids so that an operator (or a restarted controller) can find the job's processes."""
        pids = [a.pid for a in self.agents.get(job.name, []) if a.poll() is None]
        (job.run_dir / "agents.json").write_text(json.dumps({"job": job.name, "agent_pids": pids}))


def descendant_pids(pid: int) -> list[int]:
    """Child processes of ``pid``, recursively (Linux ``/proc``)."""
    found = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            for child in map(int, children.read_text().split()):
                found += [child, *descendant_pids(child)]
        except OSError:
            continue
    return found
