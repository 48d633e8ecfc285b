"""Signals and lost ranks on real ``lds-train`` processes: nothing is lost beyond one checkpoint interval.

One chain of runs in one folder covers the battery at the cost of five launches: SIGTERM to rank 0 (exit
143), ``resume=auto``; SIGKILL of rank 1 (rank 0 names it and exits 1), ``resume=auto``; SIGINT to the whole
process group, as Ctrl-C sends it (exit 130), ``resume=auto`` to the end. The losses of every step then equal
those of one uninterrupted run: each resume continued the data order and the optimizer exactly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
MAX_STEPS = 16
ARGS = ["model=tiny", "strategy=ddp", "compression=none", "data.batch_size=4", "trainer.devices=2",
        f"trainer.max_steps={MAX_STEPS}", "trainer.val_check_interval=4", "trainer.limit_val_batches=1",
        "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false", "+trainer.enable_model_summary=false",
        "plot=false", "checkpoint.every_n_steps=2"]


_STARTED: list[subprocess.Popen] = []


def start(run_dir: Path, *extra: str) -> subprocess.Popen:
    proc = subprocess.Popen([str(BIN / "lds-train"), *ARGS, f"hydra.run.dir={run_dir}", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    _STARTED.append(proc)
    return proc


@pytest.fixture(scope="module", autouse=True)
def _no_process_left() -> Iterator[None]:
    yield
    for proc in _STARTED:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def saved_step(run_dir: Path) -> int:
    """The step of the newest published checkpoint (``last.ckpt`` -> ``step-NNNNNNN.ckpt``), 0 for none."""
    try:
        return int(os.readlink(run_dir / "checkpoints" / "last.ckpt")[5:12])
    except FileNotFoundError:
        return 0


def wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, timeout: float = 240) -> None:
    """Until a checkpoint of at least ``step`` is published: the run is then that far."""
    deadline = time.monotonic() + timeout
    while saved_step(run_dir) < step:
        assert proc.poll() is None, f"run ended early ({proc.returncode}): {proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, "no checkpoint in time"
        time.sleep(0.05)


def children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def train_curve(run_dir: Path) -> list[tuple[int, float]]:
    return [tuple(p) for p in json.loads((run_dir / "summary.json").read_text())["train_curve"]]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One run folder that the tests below stop and resume in turn (they run in this order)."""
    return tmp_path_factory.mktemp("signals") / "run"


def test_sigterm_to_rank_0_checkpoints_and_exits_143(run_dir: Path) -> None:
    # A scheduler's stop reaches rank 0 only: both ranks agree at a step boundary, save, exit 143.
    proc = start(run_dir)
    wait_for_step(proc, run_dir, 2)
    proc.send_signal(signal.SIGTERM)
    code, out, err = finish(proc)
    assert code == 143, err[-3000:]
    assert "Traceback" not in err and "stopped by SIGTERM at step" in out
    stopped_at = int(out.split("stopped by SIGTERM at step ")[1].split(";")[0])
    assert saved_step(run_dir) == stopped_at >= 2
    assert json.loads((run_dir / "summary.json").read_text())["stopped_by"] == f"SIGTERM at step {stopped_at}"


def test_sigkill_of_rank_1_names_it_and_fails(run_dir: Path) -> None:
    before = saved_step(run_dir)
    proc = start(run_dir, "resume=auto")
    wait_for_step(proc, run_dir, before + 2)
    (rank1,) = children(proc.pid)
    os.kill(rank1, signal.SIGKILL)
    code, out, err = finish(proc, timeout=60)  # never a hang
    assert code == 1, err[-3000:]
    assert f"lds-train: error: rank 1 (pid {rank1}) was killed by SIGKILL" in err
    assert f"continue with the same settings plus resume={run_dir}" in err


def test_sigint_to_process_group_checkpoints_and_exits_130(run_dir: Path) -> None:
    before = saved_step(run_dir)
    proc = start(run_dir, "resume=auto")
    wait_for_step(proc, run_dir, before + 2)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    code, out, err = finish(proc)
    assert code == 130, err[-3000:]
    assert f"resume=auto: continuing from {run_dir}/checkpoints/step-{before:07d}.ckpt" in out
    assert "stopped by SIGINT" in out and "Traceback" not in err
    assert saved_step(run_dir) < MAX_STEPS


def test_resumed_run_equals_an_uninterrupted_one(run_dir: Path, tmp_path: Path) -> None:
    code, out, err = finish(start(run_dir, "resume=auto"), timeout=240)
    assert code == 0, err[-3000:]
    assert "not resumable" not in err  # the data module's loader is resumable
    code, _, err = finish(start(tmp_path / "reference"), timeout=240)
    assert code == 0, err[-3000:]
    resumed, reference = train_curve(run_dir), train_curve(tmp_path / "reference")
    assert [s for s, _ in resumed] == [s for s, _ in reference] == list(range(1, MAX_STEPS + 1))
    assert resumed == reference  # bitwise: same data order, same optimizer and scheduler state
