"""The controller killed: a real ``lds-elastic`` is SIGKILLed mid-training and its job must still finish.

``lds-elastic`` starts one torchrun agent of ``examples/elastic_train.py`` through ``LocalBackend`` (the agent
in a session of its own, hosting its own rendezvous). Once the job has trained a few steps and written a
complete checkpoint, the controller process (only it) gets SIGKILL. The same worker process must keep
training (no restart, no resume) to ``max_steps``, report ``done``, write its final checkpoint, and its agent
must exit 0; the audit files must show every step trained exactly once.

The agent is the controller's child, not ours: the test makes itself a child subreaper (Linux
``PR_SET_CHILD_SUBREAPER``) so that the orphaned agent is re-parented to it and its exit status can be read.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from lightning_deepseek.elastic import Reports, find_latest
from lightning_deepseek.elastic.controller.backend import descendant_pids
from tests.elastic.audit import CORPUS_BYTES, REPO, script_args, steps_trained
from tests.helpers import free_port

# Enough steps after the kill (at step 6) that a poller lagging on a loaded runner still sees training go on.
GLOBAL_BATCH, MICRO_BATCH, MAX_STEPS, CHECKPOINT_EVERY = 8, 2, 40, 4
PR_SET_CHILD_SUBREAPER = 36


def _set_child_subreaper(on: bool) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def _wait_for(what: str, predicate: Callable[[], object], timeout: float, context: Callable[[], str]) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{context()}")


def _wait_pid(pid: int, timeout: float) -> int | None:
    """Exit status of our (adopted) child ``pid``, or None if it is still running after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.1)
    return None


def _kill_and_reap(pids: set[int], timeout: float = 30.0) -> None:
    """SIGKILL ``pids`` and their descendants, then reap those re-parented to us.

    Only live descendants of this process are signalled: a pid that already exited may belong to someone else now,
    and a job process still running is ours (its parents' deaths re-parented it to this subreaper).
    """
    ours = set(descendant_pids(os.getpid()))
    targets = {p for pid in pids for p in (pid, *descendant_pids(pid)) if p in ours}
    for pid in targets:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while targets and time.monotonic() < deadline:
        for pid in list(targets):
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    targets.discard(pid)
            except ChildProcessError:  # reaped by its own parent, or not re-parented to us yet
                if not Path(f"/proc/{pid}").exists():
                    targets.discard(pid)
        time.sleep(0.05)


@pytest.mark.timeout(240)
def test_job_finishes_without_losing_steps_after_the_controller_is_killed(tmp_path: Path) -> None:
    run_dir = tmp_path / "elastic"
    (run_dir / "audit").mkdir(parents=True)
    train = script_args(run_dir, max_steps=MAX_STEPS, global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH,
                        checkpoint_every=CHECKPOINT_EVERY, corpus_bytes=CORPUS_BYTES, step_sleep=0.05,
                        audit_dir=run_dir / "audit")
    command = [sys.executable, "-m", "lightning_deepseek.elastic.controller", "--name", "test-killed",
               "--min-workers", "1", "--max-workers", "1", "--run-dir", str(run_dir), "--rdzv-port", str(free_port()),
               "--interval-s", "0.5", "--", *train]
    controller_log = tmp_path / "controller.log"
    reports = Reports(run_dir / "reports.jsonl")
    seen: list[dict] = []
    job: set[int] = set()  # every pid of the job seen so far, for the cleanup

    def read_reports() -> list[dict]:
        new = reports.read_new()
        seen.extend(new)
        job.update(r["pid"] for r in new)
        job.update(agent_pids())
        job.update(child for pid in list(job) for child in descendant_pids(pid))
        return seen

    def context() -> str:
        logs = [controller_log, *sorted(run_dir.glob("agent-*.log"))]
        tails = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in logs if p.exists())
        return f"last reports: {json.dumps(seen[-5:], indent=1)}\n{tails}"

    def agent_pids() -> list[int]:
        try:
            return json.loads((run_dir / "agents.json").read_text())["agent_pids"]
        except (FileNotFoundError, json.JSONDecodeError):  # not written yet, or being written
            return []

    _set_child_subreaper(True)
    try:
        with open(controller_log, "w") as log_file:
            controller = subprocess.Popen(command, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT,
                                          env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
        job.add(controller.pid)
        _wait_for("lds-elastic to start an agent", lambda: agent_pids() or controller.poll() is not None, 60, context)
        assert controller.poll() is None, context()
        (agent,) = agent_pids()
        before = _wait_for(
            f"step {CHECKPOINT_EVERY + 2} and a complete checkpoint",
            lambda: next((r for r in reversed(read_reports()) if r["event"] == "progress"
                          and r["step"] >= CHECKPOINT_EVERY + 2 and find_latest(run_dir / "checkpoints")), None),
            150, context)
        assert controller.poll() is None, context()
        controller.send_signal(signal.SIGKILL)
        assert controller.wait(timeout=30) == -signal.SIGKILL
        killed_at = time.time()

        agent_exit: list[int] = []  # the agent was adopted by this process when its controller died

        def job_done() -> dict | None:
            if not agent_exit and (exited := os.waitpid(agent, os.WNOHANG))[0]:
                agent_exit.append(os.waitstatus_to_exitcode(exited[1]))
            done = next((r for r in read_reports() if r["event"] == "done"), None)  # read after the exit check
            assert done or not agent_exit, f"the agent exited with {agent_exit[0]} before 'done'\n{context()}"
            return done

        done = _wait_for("the 'done' report", job_done, 120, context)
        if not agent_exit:
            agent_exit.append(_wait_pid(agent, 60))
        assert agent_exit == [0], context()
    finally:
        _kill_and_reap(job)
        _set_child_subreaper(False)

    # The job carried on in the same worker process: no restart, no resume, nothing lost or redone.
    after = [r for r in seen if r["event"] == "progress" and r["time"] > killed_at]
    assert len(after) >= 2 and {r["pid"] for r in after} == {before["pid"]}, "no training after the kill"
    assert done["step"] == MAX_STEPS and done["pid"] == before["pid"], done
    assert [r for r in seen if r["event"] in ("resumed", "stopping", "fatal")] == [], context()
    assert find_latest(run_dir / "checkpoints").step == MAX_STEPS
    steps = steps_trained(run_dir / "audit")
    assert sorted(steps) == list(range(1, MAX_STEPS + 1))
    assert {s["attempts"] for s in steps.values()} == {1}
    assert {len(s["indices"]) for s in steps.values()} == {GLOBAL_BATCH}
    assert {tuple(s["world_size"]) for s in steps.values()} == {(1,)}
