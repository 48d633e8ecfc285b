"""SlurmBackend against a real SLURM: slurmctld and three slurmd (node names lds-n1..3 on this machine, started by
``.ci/slurm.sh``), torchrun agents as SLURM jobs, gloo on CPU; ``lds-elastic --backend slurm``'s bad input.

The job is ``examples/elastic_train.py``. Under ``ElasticController`` and the real ``ScalingPolicy`` it starts on
one node, grows to two when the pool grows (another job leaving), and shrinks back when its target says one node
is enough; then SLURM's ``scontrol requeue`` preempts it, and it must resume from its newest complete checkpoint.
Every run must train every step once with the same global batch and end with the loss of an uninterrupted
single-process run. If SLURM cannot be started here, these tests skip with the reason ``.ci/slurm.sh`` gave.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_deepseek.elastic import find_latest
from lightning_deepseek.elastic.controller import ElasticController, JobSpec, RendezvousTuning, ScalingPolicy
from lightning_deepseek.elastic.controller.slurm import SlurmBackend, SlurmError, run_slurm
from tests.elastic.audit import (
    GLOBAL_BATCH,
    JOB_OPTIONS,
    MAX_STEPS,
    ReferenceRun,
    final_loss,
    script_args,
    steps_trained,
)
from tests.elastic.test_torchrun import ReportWaiter
from tests.helpers import free_port

REPO = Path(__file__).resolve().parents[3]
SLURM_DIR = Path(os.environ.get("LDS_SLURM_DIR", "/tmp/lds-slurm"))


@pytest.fixture(scope="module")
def slurm() -> str:
    """Start (or find) the test cluster; yields its partition, with SLURM_CONF pointing at its configuration."""
    env = {**os.environ, "LDS_SLURM_INSTALL": "0", "LDS_SLURM_DIR": str(SLURM_DIR)}
    started = subprocess.run(["bash", str(REPO / ".ci" / "slurm.sh")], capture_output=True, text=True, env=env,
                             timeout=300)
    print(started.stdout + started.stderr)
    if "started" not in started.stdout and "already running" not in started.stdout:
        pytest.skip(f"no SLURM cluster: {started.stdout.strip()} {started.stderr.strip()}")
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(SLURM_DIR / "slurm.conf")
    yield "lds"
    if previous is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = previous


def slurm_job(tmp_path: Path, name: str) -> JobSpec:
    run_dir = tmp_path / name
    (run_dir / "audit").mkdir(parents=True)
    return JobSpec(name, script_args(run_dir, step_sleep=0.1, audit_dir=run_dir / "audit", **JOB_OPTIONS),
                   min_workers=1, max_workers=2, run_dir=run_dir)


def backend_for(partition: str) -> SlurmBackend:
    # Heartbeats may be late on a loaded 2-core runner (an agent counted as gone adds a rendezvous round), and
    # every shrink waits this many seconds for the departed agent's keep-alive to expire.
    return SlurmBackend(partition, rdzv_port=free_port(), tuning=RendezvousTuning(keep_alive_max_attempt=8),
                        stop_timeout_s=90)


def assert_every_step_once(job: JobSpec, reference: ReferenceRun) -> None:
    steps = steps_trained(job.run_dir / "audit")
    assert sorted(steps) == list(range(1, MAX_STEPS + 1))
    assert {len(s["indices"]) for s in steps.values()} == {GLOBAL_BATCH}
    assert final_loss(job.run_dir) == pytest.approx(reference.final_loss(), rel=1e-3)


@pytest.mark.timeout(600)
def test_job_grows_to_two_slurm_nodes_shrinks_back_and_survives_requeue_without_losing_a_step(
        slurm: str, reference_run: ReferenceRun, tmp_path: Path,
        capsys: pytest.CaptureFixture) -> None:
    # One job for the three events: each SLURM job start costs seconds of imports on this 2-core runner.
    job = slurm_job(tmp_path, "slurm-resize")
    backend = backend_for(slurm)
    policy = ScalingPolicy(pool_size=1, cooldown_s=0.0)
    controller = ElasticController(backend, policy, [job])
    waiter = ReportWaiter(job.report_file)
    try:
        assert controller.step() == {job.name: 1}
        waiter.until(lambda r: r["event"] == "progress" and r["step"] >= 4, 180)
        policy.pool_size = 2  # another job left: the idle node goes to this flexible job
        assert controller.step() == {job.name: 2}
        assert backend.size(job) == 2
        grown = waiter.until(lambda r: r["event"] == "resumed" and r["world_size"] == 2, 180)
        waiter.until(lambda r: r["event"] == "progress" and r["world_size"] == 2 and r["step"] >= grown["step"] + 4, 90)
        job.target_samples_per_s = 1e-3  # one node is now enough: the job is ahead and gives one back
        assert controller.step() == {job.name: 1}
        shrunk = waiter.until(lambda r: r["event"] == "resumed" and r["world_size"] == 1, 180)
        waiter.until(lambda r: r["event"] == "progress" and r["step"] >= shrunk["step"] + 2, 60)
        newest = find_latest(job.run_dir / "checkpoints").step
        run_slurm(["scontrol", "requeue", backend.job_ids[job.name][0]])  # what a preempting job does
        requeued = waiter.until(lambda r: r["event"] == "resumed" and r["step"] > shrunk["step"], 180)
        assert backend.alive(job) and backend.size(job) == 1
        waiter.until(lambda r: r["event"] == "done", 180)
        seen = waiter.seen + waiter.reports.read_new()
        controller.timeline.plot(job.run_dir / "workers.png")
    finally:
        backend.cancel(job)

    printed = capsys.readouterr().out
    assert "1 -> 2 workers: flexible: idle workers in the pool (2)" in printed, printed
    assert "2 -> 1 workers: ahead: would still meet its target 0.001 samples/s with one worker fewer" in printed
    assert (job.run_dir / "workers.png").stat().st_size > 0
    events = [(r["event"], r["world_size"]) for r in seen if r["event"] in ("stopping", "resumed", "resized")]
    assert events[:6] == [("stopping", 1), ("resumed", 2), ("resized", 2), ("stopping", 2), ("resumed", 1),
                          ("resized", 1)], events
    resumes = [r for r in seen if r["event"] == "resumed"]
    stops = [r for r in seen if r["event"] == "stopping"]
    assert [r["from_step"] for r in resumes[:2]] == [r["checkpoint_step"] for r in stops[:2]]  # no step lost
    assert requeued["from_step"] >= newest  # the requeued job resumed from its newest complete checkpoint
    assert_every_step_once(job, reference_run)


def test_lds_elastic_names_the_slurm_command_that_failed(tmp_path: Path) -> None:
    if shutil.which("sinfo") is None:
        pytest.skip("SLURM's client commands are not installed (.ci/slurm.sh installs them)")
    # A controller address where nothing listens (port 9, discard), as after slurmctld died.
    (tmp_path / "slurm.conf").write_text("ClusterName=nowhere\nSlurmctldHost=localhost(127.0.0.1)\nSlurmctldPort=9\n"
                                         "MessageTimeout=2\n")
    done = subprocess.run(
        [sys.executable, "-m", "lightning_deepseek.elastic.controller", "--backend", "slurm", "--min-workers", "1",
         "--max-workers", "2", "--run-dir", str(tmp_path / "run"), "--", "train.py"],
        capture_output=True, text=True, env={**os.environ, "SLURM_CONF": str(tmp_path / "slurm.conf")}, timeout=120)
    assert done.returncode == 2
    assert ("lds-elastic: error: `sinfo -h -o %P %D` failed with exit code 1: slurm_load_partitions: Unable to "
            "contact slurm controller") in done.stderr, done.stderr
    assert not (tmp_path / "run").exists()


def test_lds_elastic_refuses_a_partition_smaller_than_min_workers(slurm: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "lightning_deepseek.elastic.controller", "--backend", "slurm", "--partition", slurm,
         "--min-workers", "4", "--max-workers", "4", "--name", "too-big", "--run-dir", str(tmp_path), "--",
         "train.py"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "min_workers=4 for job 'too-big' exceeds the 3 nodes of SLURM partition 'lds'" in done.stderr, done.stderr
    assert "too-big" not in run_slurm(["squeue", "-h", "-t", "all", "-o", "%j"])  # nothing was submitted


@pytest.mark.timeout(600)
def test_lost_rendezvous_host_fails_the_job_and_keeps_its_checkpoints(slurm: str, tmp_path: Path) -> None:
    job = slurm_job(tmp_path, "slurm-host-lost")
    backend = backend_for(slurm)
    backend.stop_timeout_s = 20
    controller = ElasticController(backend, ScalingPolicy(pool_size=2, cooldown_s=0.0), [job], interval_s=0.5)
    waiter = ReportWaiter(job.report_file)
    try:
        controller.step()
        waiter.until(lambda r: r["event"] == "progress" and r["world_size"] == 2 and r["step"] >= 6, 240)
        before = sorted(p.name for p in (job.run_dir / "checkpoints").glob("step-*") if (p / "COMPLETE").exists())
        run_slurm(["scancel", "--signal=KILL", backend.job_ids[job.name][0]])  # the host's node dies
        with pytest.raises(SlurmError, match=r"the rendezvous host of job 'slurm-host-lost' \(SLURM job \d+\) has "
                                             r"ended .*Checkpoints .* are untouched"):
            controller.run(timeout_s=120)
    finally:
        backend.cancel(job)
    after = sorted(p.name for p in (job.run_dir / "checkpoints").glob("step-*") if (p / "COMPLETE").exists())
    assert before and before[-1] in after, (before, after)  # the newest complete one is still there and complete
    assert find_latest(job.run_dir / "checkpoints").step >= int(before[-1].split("-")[1])
