"""``RunCheckpoint`` and the run folder on real processes: a kill during a save, SLURM's requeue, concurrent runs.

The two runs started together begin with the module (``together``) and finish while the other tests run: each
``lds-train`` spends ~10 s importing on one core, and the tests in between leave the other core idle.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_deepseek.app.checkpoint_files import not_a_checkpoint
from lightning_deepseek.app.checkpointing import RunCheckpoint, checkpoints_in
from lightning_deepseek.app.run import RunFolder, resolve_resume
from lightning_deepseek.data import TextDataModule
from lightning_deepseek.models import PRESETS, GPTConfig, LightningGPT
from tests.helpers import Background, context

BIN = Path(sys.executable).parent
QUICK = ["model=tiny", "strategy=ddp", "compression=none", "trainer.devices=1", "data.batch_size=2",
         "trainer.limit_val_batches=1", "trainer.enable_progress_bar=false", "+trainer.enable_model_summary=false",
         "plot=false"]


def _train_and_die_while_saving(folder: str) -> None:
    """Train one step per save; the second save is cut short by SIGKILL after writing half a file."""
    pl.seed_everything(0)
    data = TextDataModule(block_size=32, batch_size=2, cache_dir=folder)
    model = LightningGPT(GPTConfig(**PRESETS["tiny"]))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         callbacks=[RunCheckpoint(Path(folder) / "checkpoints", every_n_steps=1)])
    io, save = trainer.strategy.checkpoint_io, trainer.strategy.checkpoint_io.save_checkpoint

    def save_then_die(checkpoint: dict, path: str, storage_options: object = None) -> None:
        if "0000002" not in str(path):
            return save(checkpoint, path)
        Path(path).write_bytes(b"PK\x03\x04 half a checkpoint")
        os.kill(os.getpid(), signal.SIGKILL)

    io.save_checkpoint = save_then_die
    trainer.fit(model, datamodule=data)


@pytest.fixture(scope="module", autouse=True)
def together(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, list[Background]]]:
    """Two ``lds-train`` runs started at the same moment in one folder, for
    ``test_two_runs_started_together_get_their_own_folders``."""
    cwd, logs = tmp_path_factory.mktemp("together"), tmp_path_factory.mktemp("together-logs")
    runs = [Background([str(BIN / "lds-train"), *QUICK, "trainer.max_steps=2", "trainer.val_check_interval=2"],
                       logs / str(i), cwd=cwd) for i in range(2)]
    yield cwd, runs
    for run in runs:
        run.kill()


def test_a_kill_while_saving_leaves_the_previous_checkpoint_whole(tmp_path: Path) -> None:
    # Forked from run_distributed's preloaded server: a fresh process (its own SIGKILL), without ~10 s of imports.
    proc = context().Process(target=_train_and_die_while_saving, args=(str(tmp_path),))
    proc.start()
    proc.join(timeout=240)
    assert proc.exitcode == -signal.SIGKILL
    folder = tmp_path / "checkpoints"
    assert (folder / ".step-0000002.ckpt.partial").exists()  # the cut save, under a name nothing reads
    assert os.readlink(folder / "last.ckpt") == "step-0000001.ckpt"
    assert checkpoints_in(tmp_path) == [folder / "step-0000001.ckpt"]
    path, _ = resolve_resume(str(tmp_path), RunFolder(tmp_path, named_by_hydra=False), GPTConfig(**PRESETS["tiny"]))
    assert path == str(folder / "step-0000001.ckpt")
    LightningGPT.load_from_checkpoint(folder / "last.ckpt", map_location="cpu")  # loads


def test_slurm_requeue_signal_saves_and_requeues(tmp_path: Path) -> None:
    # SLURM emulated: its variables for one task, and an `scontrol` that records how it was called.
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'scontrol.log'}\n")
    (fake_bin / "scontrol").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242", "SLURM_NTASKS": "1",
           "SLURM_NTASKS_PER_NODE": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
           "SLURM_NODELIST": "localhost", "SLURM_JOB_NAME": "lds-train"}
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([str(BIN / "lds-train"), *QUICK, "trainer.max_steps=100000", "checkpoint.every_n_steps=1",
                             "trainer.val_check_interval=1000", f"hydra.run.dir={run_dir}"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait(lambda: (run_dir / "checkpoints" / "last.ckpt").exists(), proc)
        proc.send_signal(signal.SIGUSR1)  # SLURM's warning before the time limit
        _wait(lambda: (tmp_path / "scontrol.log").exists(), proc)
        assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]
        assert (run_dir / "hpc_ckpt_1.ckpt").is_file()
        proc.send_signal(signal.SIGTERM)  # what SLURM sends the requeued job
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 143, err[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _wait(condition: object, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_two_runs_started_together_get_their_own_folders(together: tuple[Path, list[Background]]) -> None:
    cwd, runs = together
    results = [run.finish() for run in runs]
    assert [result.returncode for result in results] == [0, 0], [result.stderr[-2000:] for result in results]
    folders = sorted(cwd.glob("outputs/*/*"))
    assert len(folders) == 2
    assert all((folder / "summary.json").exists() and (folder / "checkpoints" / "last.ckpt").exists()
               for folder in folders)


def test_checkpoint_files_are_told_from_other_files_without_torch(tmp_path: Path) -> None:
    torch.save({"step": 1}, tmp_path / "zip.ckpt")
    torch.save({"step": 1}, tmp_path / "legacy.ckpt", _use_new_zipfile_serialization=False)
    (tmp_path / "dcp").mkdir()
    torch.save({"step": 1}, tmp_path / "dcp" / "meta.pt")
    (tmp_path / "notes.ckpt").write_text("not a checkpoint")
    for name in ("zip.ckpt", "legacy.ckpt", "dcp"):
        assert not_a_checkpoint(tmp_path / name) is None, name
    assert "is not a checkpoint (not a file that torch.save writes)" in not_a_checkpoint(tmp_path / "notes.ckpt")
