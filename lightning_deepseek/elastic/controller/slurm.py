"""``SlurmBackend``: the nodes of an elastic job as single-node SLURM jobs, submitted and signalled through SLURM.

Each elastic node is one SLURM batch job (one node, one task) that runs the same ``torchrun --nnodes=MIN:MAX``
command as ``LocalBackend``'s agents; the first job of an elastic job hosts the c10d rendezvous (``is_host=true``,
on ``rdzv_port``) and the others point at its node's address (``NodeAddr`` from ``scontrol show node``), so a grow
waits until the first job runs. A grow submits one more job; a shrink sends SIGTERM to the newest job's processes
with ``scancel --signal=TERM`` (never to the first job: the rendezvous dies with it), which is the same checkpoint-
and-leave path as on a local SIGTERM, and waits for it to end (a plain ``scancel`` after ``stop_timeout_s``).
``size`` counts the jobs that are pending or running and ``alive`` asks whether the first one still is, both from
``squeue`` (``sacct`` needs a SLURM database, which small clusters do not run). Jobs are submitted with
``--requeue``: a preempted job (``scontrol requeue``, or a preempting partition) comes back, reruns the same
torchrun command, and ``ElasticTraining`` resumes from the newest complete checkpoint.

Submission goes through **submitit** (``submitit.SlurmExecutor``): it writes the sbatch script, runs the agent
under ``srun`` inside it, keeps each job's log in ``<run_dir>/slurm/<job id>_0_log.out`` and pickles the agent
(``TorchrunAgent``) so the same Python runs it on the node. submitit has no grow or shrink of a running job and
its cancel sends no chosen signal (its ``_interrupt`` is a test helper sending SIGTERM then USR2, which submitit
turns into its own checkpoint-and-requeue), and its job states come from ``sacct``; so the signals and states
here are ``scancel``, ``scontrol`` and ``squeue`` command lines, each failure raised as ``SlurmError`` naming the
command and its output. submitit's USR2 requeue is not used: a job is requeued by SLURM itself.

Not supported: several nodes per SLURM job (a heterogeneous or multi-node allocation that grows in place), GPUs
other than what ``slurm_parameters`` requests (e.g. ``{"gpus_per_node": 8}``), a controller restarted while its
jobs run (it does not find the jobs it submitted before), two elastic jobs whose first SLURM jobs share a node (one
``rdzv_port`` for all), and a first job that is lost: the job then fails with a ``SlurmError`` naming it, as the
rendezvous store goes with it (a requeued first job while others run is not tested).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from lightning_deepseek.elastic.controller.backend import Backend, BackendError, JobSpec, RendezvousTuning

log = logging.getLogger(__name__)

LIVE_STATES = frozenset({"PENDING", "CONFIGURING", "RUNNING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "RESIZING",
                         "SUSPENDED", "SIGNALING", "STAGE_OUT"})


class SlurmError(BackendError):
    """A SLURM command failed, or SLURM cannot run the job as asked."""


def run_slurm(command: list[str], timeout_s: float = 60.0) -> str:
    """Run one SLURM command; return its stdout, or raise ``SlurmError`` naming the command and its output.

    Args:
        command: the command line (``sinfo``, ``squeue``, ``scancel``, ...).
        timeout_s: seconds before the command counts as failed.
    """
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except FileNotFoundError as exc:
        raise SlurmError(f"`{' '.join(command)}` failed: {exc}. Install SLURM's client commands (Debian: "
                         "slurm-client) or run lds-elastic on a SLURM login node.") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"`{' '.join(command)}` did not answer within {timeout_s:.0f} s: is slurmctld reachable "
                         f"(SLURM_CONF={os.environ.get('SLURM_CONF', '<default>')})?") from None
    if done.returncode != 0:
        output = (done.stderr + done.stdout).strip()
        raise SlurmError(f"`{' '.join(command)}` failed with exit code {done.returncode}: {output or '<no output>'}"
                         f" (SLURM_CONF={os.environ.get('SLURM_CONF', '<default>')}).")
    return done.stdout


@dataclass(frozen=True)
class TorchrunAgent:
    """What one SLURM job runs (pickled by submitit): a torchrun agent, its output into the job's log.

    Args:
        command: the torchrun command line.
    """

    command: list[str]

    def __call__(self) -> int:
        # Lightning prefers its SLURMEnvironment (world size from SLURM_NTASKS, here 1) over torchrun's whenever
        # SLURM_NTASKS is set; the workers' world is torchrun's, so the step's task count is hidden from them.
        env = {key: value for key, value in os.environ.items() if key not in ("SLURM_NTASKS", "SLURM_NPROCS")}
        env.update(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
        return subprocess.run(self.command, env=env).returncode


class SlurmBackend(Backend):
    """Elastic nodes as single-node SLURM jobs.

    Args:
        partition: SLURM partition; ``None``: the cluster's default partition.
        rdzv_port: TCP port of the rendezvous store on the first job's node.
        tuning: torchrun rendezvous settings (as for ``LocalBackend``).
        max_restarts: worker-group restarts an agent allows; each resize costs the survivors one.
        stop_timeout_s: seconds between ``scancel --signal=TERM`` and a plain ``scancel``.
        start_timeout_s: how long a grow waits for the first job to start running (its address is needed).
        slurm_parameters: extra ``submitit.SlurmExecutor`` parameters (``time``, ``gpus_per_node``, ``account``...).
        python: interpreter that runs torchrun on the nodes.
    """

    def __init__(self, partition: str | None = None, rdzv_port: int = 29400, tuning: RendezvousTuning | None = None,
                 max_restarts: int = 100, stop_timeout_s: float = 120.0, start_timeout_s: float = 600.0,
                 slurm_parameters: dict[str, Any] | None = None, python: str = sys.executable) -> None:
        self.rdzv_port = rdzv_port
        self.tuning = tuning or RendezvousTuning()
        self.max_restarts = max_restarts
        self.stop_timeout_s = stop_timeout_s
        self.start_timeout_s = start_timeout_s
        self.slurm_parameters = dict(slurm_parameters or {})
        self.python = python
        try:
            import submitit  # noqa: F401 - only the SLURM backend needs it; fail before anything is submitted
        except ImportError:
            raise SlurmError("SlurmBackend needs submitit: pip install 'lightning-deepseek[slurm]'.") from None
        self.partition, self.partition_nodes = self._partition(partition)
        self.job_ids: dict[str, list[str]] = {}

    @staticmethod
    def _partition(partition: str | None) -> tuple[str, int]:
        """The partition's name and node count; the default partition when ``partition`` is ``None``."""
        rows = [line.split() for line in run_slurm(["sinfo", "-h", "-o", "%P %D"]).splitlines() if line.strip()]
        nodes: dict[str, int] = {}
        default = None
        for name, count in rows:
            default = name.rstrip("*") if name.endswith("*") else default
            nodes[name.rstrip("*")] = nodes.get(name.rstrip("*"), 0) + int(count)
        chosen = partition or default
        if chosen not in nodes:
            raise SlurmError(f"partition={chosen!r} is not a SLURM partition (sinfo lists {sorted(nodes)}): pass one "
                             "of those (lds-elastic --partition).")
        return chosen, nodes[chosen]

    def agent_command(self, job: JobSpec, endpoint: str, is_host: bool) -> list[str]:
        """The torchrun command line of one node of ``job``."""
        t = self.tuning
        return [
            self.python, "-m", "torch.distributed.run", f"--nnodes={job.min_workers}:{job.max_workers}",
            f"--nproc-per-node={job.nproc_per_node}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={job.name}", f"--max-restarts={self.max_restarts}",
            f"--monitor-interval={t.monitor_interval_s}",
            f"--rdzv-conf={t.rdzv_conf()},is_host={str(is_host).lower()}", *job.command,
        ]

    def states(self, job: JobSpec) -> dict[str, tuple[str, str]]:
        """``{slurm job id: (state, node)}`` of the jobs submitted for ``job``; ended ones SLURM forgot are absent."""
        ids = self.job_ids.get(job.name, [])
        if not ids:
            return {}
        out = run_slurm(["squeue", "-h", "-t", "all", "-j", ",".join(ids), "-o", "%i|%T|%N"])
        rows = [line.split("|") for line in out.splitlines() if line.count("|") == 2]
        return {job_id: (state, node) for job_id, state, node in rows}

    def live_ids(self, job: JobSpec) -> list[str]:
        """Submitted jobs of ``job`` that are pending or running, oldest first."""
        states = self.states(job)
        return [i for i in self.job_ids.get(job.name, []) if states.get(i, ("", ""))[0] in LIVE_STATES]

    def size(self, job: JobSpec) -> int:
        return len(self.live_ids(job))

    def alive(self, job: JobSpec) -> bool:
        """Whether the first SLURM job (the rendezvous host) still runs; raises ``SlurmError`` if it ended while
        other nodes of the job still run (they cannot go on without its store)."""
        ids = self.job_ids.get(job.name, [])
        live = self.live_ids(job)
        if ids and ids[0] not in live and live:
            raise self.host_lost(job)
        return bool(ids) and ids[0] in live

    def scale(self, job: JobSpec, num_workers: int) -> None:
        if not job.min_workers <= num_workers <= job.max_workers:
            raise ValueError(f"scale({job.name!r}, {num_workers}) is outside [min_workers={job.min_workers}, "
                             f"max_workers={job.max_workers}].")
        if job.min_workers > self.partition_nodes:
            raise ValueError(f"min_workers={job.min_workers} for job {job.name!r} exceeds the {self.partition_nodes} "
                             f"nodes of SLURM partition {self.partition!r}: lower --min-workers or choose a larger "
                             "partition (--partition).")
        if self.job_ids.get(job.name) and not self.alive(job):
            raise self.host_lost(job)
        live = self.live_ids(job)
        for _ in range(num_workers - len(live)):
            self.submit(job)
        for job_id in reversed(live[num_workers:]):  # newest first; num_workers >= 1 keeps the host
            self.signal_stop(job, job_id)

    def submit(self, job: JobSpec) -> str:
        """Submit one more node of ``job``; returns its SLURM job id."""
        import submitit  # only the SLURM backend needs it

        ids = self.job_ids.setdefault(job.name, [])
        if ids:
            endpoint, is_host = f"{self.host_address(job)}:{self.rdzv_port}", False
        else:
            endpoint, is_host = f"127.0.0.1:{self.rdzv_port}", True  # the store listens on every interface
        executor = submitit.SlurmExecutor(folder=job.run_dir / "slurm", python=self.python)
        parameters = {"time": 0, "signal_delay_s": 30, **self.slurm_parameters}
        extra = {"requeue": True, **parameters.pop("additional_parameters", {})}
        executor.update_parameters(job_name=job.name, partition=self.partition, nodes=1, ntasks_per_node=1,
                                   stderr_to_stdout=True, additional_parameters=extra, **parameters)
        try:
            submitted = executor.submit(TorchrunAgent(self.agent_command(job, endpoint, is_host)))
        except Exception as exc:  # submitit raises its own and subprocess errors for a failed sbatch
            raise SlurmError(f"sbatch (through submitit) failed for job {job.name!r}: {exc}") from None
        ids.append(str(submitted.job_id))
        log.info(f"SlurmBackend: job {job.name!r}: submitted SLURM job {submitted.job_id} "
                 f"({'rendezvous host' if is_host else f'joins {endpoint}'}).")
        return str(submitted.job_id)

    def host_address(self, job: JobSpec) -> str:
        """Address of the node that runs ``job``'s first SLURM job (waits until it runs)."""
        host_id = self.job_ids[job.name][0]
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            state, node = self.states(job).get(host_id, ("GONE", ""))
            if state == "RUNNING" and node:
                break
            if state not in LIVE_STATES:
                raise self.host_lost(job)
            if time.monotonic() > deadline:
                raise SlurmError(f"the rendezvous host of job {job.name!r} (SLURM job {host_id}) is still {state} "
                                 f"after start_timeout_s={self.start_timeout_s:.0f}: the partition {self.partition!r}"
                                 " is busy; raise start_timeout_s or free nodes.")
            time.sleep(1.0)
        fields = dict(item.split("=", 1) for item in run_slurm(["scontrol", "-o", "show", "node", node]).split()
                      if "=" in item)
        return fields.get("NodeAddr", node)

    def host_lost(self, job: JobSpec) -> SlurmError:
        """The error for a job whose rendezvous host (first SLURM job) has ended."""
        host_id = self.job_ids[job.name][0]
        state = self.states(job).get(host_id, ("no longer known to squeue", ""))[0]
        return SlurmError(f"the rendezvous host of job {job.name!r} (SLURM job {host_id}) has ended ({state}); the "
                          f"other nodes cannot continue without its store. Checkpoints in the job's checkpoint "
                          "directory are untouched: start the job again to resume from the newest complete one.")

    def signal_stop(self, job: JobSpec, job_id: str) -> None:
        """SIGTERM one node's processes (they checkpoint and leave); a plain ``scancel`` after the timeout."""
        state = self.states(job).get(job_id, ("GONE", ""))[0]
        if state == "PENDING":
            run_slurm(["scancel", job_id])
        elif state in LIVE_STATES:
            run_slurm(["scancel", "--signal=TERM", job_id])
        deadline = time.monotonic() + self.stop_timeout_s
        while self.states(job).get(job_id, ("GONE", ""))[0] in LIVE_STATES:
            if time.monotonic() > deadline:
                log.warning(f"SLURM job {job_id} of {job.name!r} ignored SIGTERM for {self.stop_timeout_s:.0f} s; "
                            "cancelling it.")
                run_slurm(["scancel", job_id])
                deadline = float("inf")
            time.sleep(0.5)

    def stop(self, job: JobSpec) -> None:
        for job_id in reversed(self.live_ids(job)):
            self.signal_stop(job, job_id)

    def cancel(self, job: JobSpec) -> None:
        """Cancel every SLURM job of ``job`` at once (no checkpoint): the cleanup of last resort."""
        ids = self.job_ids.get(job.name, [])
        if ids:
            run_slurm(["scancel", *ids])
