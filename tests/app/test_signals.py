"""Signals and lost ranks on real ``lds-train`` processes: nothing is lost beyond one checkpoint interval.

One chain of runs in one folder covers the battery at the cost of five launches: SIGTERM to rank 0 (exit
143), ``resume=auto``; SIGKILL of rank 1 (rank 0 names it and exits 1), ``resume=auto``; SIGINT to the whole
process group, as Ctrl-C sends it (exit 130), ``resume=auto`` to the end, with a SIGTERM during the final save
(exit 143, the final checkpoint complete). The losses of every step then equal those of one uninterrupted run
(which gets a SIGINT after its teardown: exit 130): each resume continued the data order and the optimizer
exactly. One more launch gets a Ctrl-C while its ranks start (exit 130, nothing left behind).

The uninterrupted reference run starts with the module (``reference``) and trains while the chain runs: a launch
spends most of its time importing, one rank after the other, on one core of two.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[2]
MAX_STEPS = 16
ARGS = ["model=tiny", "strategy=ddp", "compression=none", "data.batch_size=4", "trainer.devices=2",
        f"trainer.max_steps={MAX_STEPS}", "trainer.val_check_interval=4", "trainer.limit_val_batches=1",
        "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false", "+trainer.enable_model_summary=false",
        "plot=false", "checkpoint.every_n_steps=2"]


_STARTED: list[subprocess.Popen] = []


class SendSignal(Callback):
    """Sends the signal ``name`` to its own process (rank 0) at ``hook``: after the last step, as a scheduler's
    stop can.

    Args:
        name: ``SIGTERM`` or ``SIGINT``.
        hook: ``on_train_end`` (before the final save) or ``on_fit_end`` (after the trainer's teardown).
    """

    def __init__(self, name: str, hook: str) -> None:
        self.signum = getattr(signal, name)
        self.hook = hook

    def _send(self, trainer: pl.Trainer, hook: str) -> None:
        if hook == self.hook and trainer.global_rank == 0:
            os.kill(os.getpid(), self.signum)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._send(trainer, "on_train_end")

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._send(trainer, "on_fit_end")


def send_signal_at(name: str, hook: str) -> list[str]:
    return [f"+callbacks.late._target_={__name__}.SendSignal", f"+callbacks.late.name={name}",
            f"+callbacks.late.hook={hook}"]


def start(run_dir: Path | None, *extra: str, cwd: Path | None = None, stdout: Any = subprocess.PIPE,
          stderr: Any = subprocess.PIPE) -> subprocess.Popen:
    run_dir_arg = [f"hydra.run.dir={run_dir}"] if run_dir else []
    proc = subprocess.Popen([str(BIN / "lds-train"), *ARGS, *run_dir_arg, *extra], cwd=cwd,
                            stdout=stdout, stderr=stderr, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})  # tests.test_signals.SendSignal
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


@pytest.fixture(scope="module", autouse=True)
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Callable[[], tuple[int, str, str]]]]:
    """The uninterrupted run, started before the chain (it gets a SIGINT after the trainer's teardown), and how to
    wait for its exit code, stdout and stderr. Its output goes to files: nobody reads a pipe while it runs."""
    folder = tmp_path_factory.mktemp("signals")
    with open(folder / "out.txt", "w+") as out, open(folder / "err.txt", "w+") as err:
        proc = start(folder / "reference", *send_signal_at("SIGINT", "on_fit_end"), stdout=out, stderr=err)

        def finished() -> tuple[int, str, str]:
            proc.wait(timeout=240)
            return proc.returncode, (folder / "out.txt").read_text(), (folder / "err.txt").read_text()

        yield folder / "reference", finished


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


def test_resumed_run_equals_an_uninterrupted_one(run_dir: Path, reference: tuple[Path, Callable]) -> None:
    # The last part gets a SIGTERM during its final save: the save completes, then the run exits 143, not 0.
    code, out, err = finish(start(run_dir, "resume=auto", *send_signal_at("SIGTERM", "on_train_end")), timeout=240)
    assert code == 143, err[-3000:]
    assert "not resumable" not in err and "Traceback" not in err  # the data module's loader is resumable
    assert f"stopped by SIGTERM after the last step ({MAX_STEPS}); the final checkpoint" in out
    assert saved_step(run_dir) == MAX_STEPS
    final = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert final["global_step"] == MAX_STEPS
    # The reference gets a SIGINT after the trainer's teardown: exit 130 all the same, its summary written.
    reference_dir, reference_finished = reference
    code, out, err = reference_finished()
    assert code == 130, err[-3000:]
    assert "stopped by SIGINT after the last step" in out and "Traceback" not in err
    resumed, uninterrupted = train_curve(run_dir), train_curve(reference_dir)
    assert [s for s, _ in resumed] == [s for s, _ in uninterrupted] == list(range(1, MAX_STEPS + 1))
    assert resumed == uninterrupted  # bitwise: same data order, same optimizer and scheduler state


def test_ctrl_c_while_the_ranks_start_exits_130_and_leaves_nothing(tmp_path: Path) -> None:
    # Rank 0 then waits in init_process_group (C++, where no Python signal handler runs) or imports torch.
    proc = start(None, cwd=tmp_path)  # Hydra names the folder: it must go
    deadline = time.monotonic() + 240
    # Once rank 1 runs lds-train's code (its signal watcher is its second thread): a Ctrl-C in the first tens of
    # milliseconds of a Python process, before any of its code runs, gets Python's own KeyboardInterrupt.
    while not (ranks := children(proc.pid)) or len(list(Path(f"/proc/{ranks[0]}/task").glob("*"))) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    code, out, err = finish(proc, timeout=60)
    assert code == 130, err[-3000:]
    assert "lds-train: stopped by SIGINT before training started; nothing was saved." in err
    assert "Traceback" not in err
    assert not list(tmp_path.glob("outputs/*/*"))  # no empty run folder
    assert not [pid for pid in ranks if Path(f"/proc/{pid}").exists()]  # no orphan rank
