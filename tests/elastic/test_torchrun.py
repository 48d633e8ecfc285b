"""End to end on real torchrun agents (gloo): shrink 2 -> 1, grow 1 -> 2, a SIGKILLed worker, then audit.

One job of ``examples/elastic_train.py`` runs under two ``torchrun --nnodes=1:2`` agents started by
``LocalBackend``. The second agent is stopped with SIGTERM (the survivor must resume at world size 1 from the
checkpoint written at the stop), then a new agent is started (the job must grow back to 2), then one worker
is SIGKILLed (the job must resume from its newest complete checkpoint at world size 2). The audit files
must show every optimizer step trained once with the same global batch, every sample of every epoch exactly
once, and the final weights must match an uninterrupted single-process run with the same global batch.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from lightning_deepseek.elastic import Reports, find_latest
from lightning_deepseek.elastic.controller.backend import JobSpec, LocalBackend, RendezvousTuning, descendant_pids
from tests.elastic.audit import (
    GLOBAL_BATCH,
    JOB_OPTIONS,
    MAX_STEPS,
    ReferenceRun,
    final_loss,
    script_args,
    steps_trained,
)
from tests.helpers import free_port

TRAIN_WINDOWS = 64


class ReportWaiter:
    """Walks the job's report records in order, waiting for more when it runs out."""

    def __init__(self, path: Path) -> None:
        self.reports = Reports(path)
        self.seen: list[dict] = []
        self._next = 0

    def until(self, predicate, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            while self._next < len(self.seen):
                record = self.seen[self._next]
                self._next += 1
                if predicate(record):
                    return record
            self.seen += self.reports.read_new()
            time.sleep(0.1)
        raise AssertionError(f"timed out after {timeout}s; last records: {json.dumps(self.seen[-5:], indent=1)}")


@pytest.mark.timeout(900)  # about 60 s here; its own waits add up to far more, and name what they waited for
def test_shrink_and_grow_keep_global_batch_and_see_every_sample_once(tmp_path: Path,
                                                                     reference_run: ReferenceRun) -> None:
    run_dir = tmp_path / "elastic"
    (run_dir / "audit").mkdir(parents=True)
    # 0.15 s per micro-batch: every resize and the crash land mid-training (the crash some 30 steps before the end).
    job = JobSpec("test-elastic", script_args(run_dir, step_sleep=0.15, audit_dir=run_dir / "audit", **JOB_OPTIONS),
                  min_workers=1, max_workers=2, run_dir=run_dir)
    # Heartbeats may be late on a loaded 2-core runner (an agent counted as gone would add a rendezvous round), and
    # the shrink waits this many seconds for the departed agent's keep-alive to expire.
    backend = LocalBackend(rdzv_port=free_port(), stop_timeout_s=60, tuning=RendezvousTuning(keep_alive_max_attempt=8))
    waiter = ReportWaiter(job.report_file)
    try:
        backend.scale(job, 2)
        waiter.until(lambda r: r["event"] == "progress" and r["world_size"] == 2 and r["step"] >= 6, 120)
        backend.scale(job, 1)  # SIGTERM to the newest agent
        waiter.until(lambda r: r["event"] == "resumed" and r["world_size"] == 1, 90)
        waiter.until(lambda r: r["event"] == "progress" and r["world_size"] == 1, 60)
        backend.scale(job, 2)
        grown = waiter.until(lambda r: r["event"] == "resumed" and r["world_size"] == 2, 90)
        # Crash: SIGKILL one worker mid-training. Both agents restart their workers from the newest complete
        # (possibly asynchronously written) checkpoint; only the steps after it are redone.
        waiter.until(lambda r: r["event"] == "progress" and r["step"] >= grown["step"] + 6, 60)
        newest_complete = find_latest(run_dir / "checkpoints").step
        os.kill(descendant_pids(backend.agents[job.name][-1].pid)[0], signal.SIGKILL)
        crash_resume = waiter.until(lambda r: r["event"] == "resumed", 90)
        waiter.until(lambda r: r["event"] == "done", 120)
        assert backend.agents[job.name][0].wait(timeout=60) == 0
        seen = waiter.seen + waiter.reports.read_new()
    finally:
        backend.kill(job)

    events = [(r["event"], r["world_size"]) for r in seen if r["event"] in ("stopping", "resumed", "resized")]
    assert events == [("stopping", 2), ("resumed", 1), ("resized", 1), ("stopping", 1), ("resumed", 2),
                      ("resized", 2), ("resumed", 2)], events
    resumes = [r for r in seen if r["event"] == "resumed"]
    stops = [r for r in seen if r["event"] == "stopping"]
    assert [r["from_step"] for r in resumes[:2]] == [r["checkpoint_step"] for r in stops]  # no step lost
    # No more lost than since the checkpoint, and nothing resumed from beyond what was trained before the crash.
    before_crash = seen[:seen.index(crash_resume)]
    last_trained = max(r["step"] for r in before_crash if r["event"] == "progress")
    assert newest_complete <= crash_resume["from_step"] <= last_trained

    steps = steps_trained(run_dir / "audit")
    assert sorted(steps) == list(range(1, MAX_STEPS + 1))
    redone = {step for step, s in steps.items() if s["attempts"] > 1}
    assert redone and redone <= set(range(crash_resume["from_step"] + 1, MAX_STEPS + 1))  # resizes redo nothing
    assert {len(s["indices"]) for s in steps.values()} == {GLOBAL_BATCH}
    assert {tuple(s["world_size"]) for s in steps.values()} == {(1,), (2,)}
    steps_per_epoch = TRAIN_WINDOWS // GLOBAL_BATCH
    for epoch in range(MAX_STEPS // steps_per_epoch):
        seen_indices = [i for step in range(epoch * steps_per_epoch + 1, (epoch + 1) * steps_per_epoch + 1)
                        for i in steps[step]["indices"]]
        assert sorted(seen_indices) == list(range(TRAIN_WINDOWS)), f"epoch {epoch}"

    # Same samples in the same global batches: only the summation order differs from the reference.
    assert final_loss(run_dir) == pytest.approx(reference_run.final_loss(), rel=1e-3)
