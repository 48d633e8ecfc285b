"""``RunCheckpoint``: lds-train's periodic, atomic ``last`` checkpoints, and the signals that end a run with one.

Why not Lightning's ``ModelCheckpoint(save_last=True)``: it overwrites ``last.ckpt`` in place, and a
``HybridParallelStrategy`` checkpoint is a folder (DCP shards plus ``meta.pt``) that a kill can leave half
written. Here every save goes to ``checkpoints/.step-NNNNNNN.ckpt.partial`` (a file, or a DCP folder), is
renamed to ``step-NNNNNNN.ckpt`` once every rank has written (a rename to a new name is atomic, for folders
too), then ``last.ckpt``, a symbolic link, is swapped to it (also a rename) and older steps are removed.
``last.ckpt`` therefore always names a complete checkpoint; a kill during a save leaves only a ``.partial``
that nothing reads and the next save removes.

Signals. Lightning's own SIGTERM handler runs a ``broadcast`` inside the signal handler, which can meet a
collective in flight on another rank and hang; it also exits 0 or 1. ``RunCheckpoint`` replaces it once
training starts: SIGTERM, SIGINT (and, under SLURM with auto-requeue, its requeue signal) only set a flag.
After each optimizer step (and at the end of each validation) the ranks agree on the flags with one
``all_reduce`` (``max``), so a signal sent to one rank or to all stops every rank at the same step boundary:
the checkpoint is written, then ``RunInterrupted`` ends ``fit``; ``lds-train`` exits 143 (SIGTERM) or 130
(SIGINT). A second Ctrl-C quits at once without a checkpoint. The SLURM requeue signal runs Lightning's own
requeue handler (``hpc_ckpt_N.ckpt`` then ``scontrol requeue``) at that boundary instead of inside the handler.
A signal after the last step's boundary (during the final save) stops nothing: the save completes, and
``lds-train`` exits 143 or 130 afterwards (``pending_signal``); ``signals.py`` handles signals outside the loop.
Cost: one ``all_reduce`` of one integer per optimizer step.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_deepseek.app.checkpoint_files import LAST, META, checkpoints_in, is_complete
from lightning_deepseek.app.signals import EXIT_CODES, OUTSIDE_TRAINING, exit_code

__all__ = ["EXIT_CODES", "RunCheckpoint", "RunInterrupted", "checkpoint_model_config", "checkpoints_in",
           "is_complete"]


class RunInterrupted(BaseException):  # noqa: N818 - like KeyboardInterrupt, not an error of the program
    """Raised on every rank at the same step boundary after a signal; the checkpoint is already written."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None) -> None:
        super().__init__(f"{signal.Signals(signum).name} at step {step}")
        self.signum = signum
        self.step = step
        self.checkpoint = checkpoint

    @property
    def exit_code(self) -> int:
        return exit_code(self.signum)


class RunCheckpoint(Callback):
    """Saves ``last`` atomically every ``every_n_steps`` optimizer steps (default: after each validation) and at
    the end of training; on SIGTERM/SIGINT saves and stops every rank at one step boundary.

    Args:
        dirpath: the checkpoints folder (``<run folder>/checkpoints``).
        every_n_steps: save every this many optimizer steps; ``None`` saves after each validation.
        keep: complete checkpoints kept besides the newest being written.
    """

    def __init__(self, dirpath: str | Path, every_n_steps: int | None = None, keep: int = 1) -> None:
        if every_n_steps is not None and (not isinstance(every_n_steps, int) or every_n_steps < 1):
            raise ValueError(f"checkpoint.every_n_steps={every_n_steps!r} must be a positive number of optimizer "
                             "steps, or null to save after each validation.")
        self.dirpath = Path(dirpath)
        self.every_n_steps = every_n_steps
        self.keep = keep
        self.last_path: Path | None = None
        self._last_saved_step = -1
        self._step_seen = -1
        self._deferred = False  # the step's save and signal check wait for its validation
        self._pending = 0  # signal number received by this process, 0 for none
        self._requeue_signal = -1  # SLURM's requeue signal when SLURM auto-requeue is on
        self._previous_handlers: dict[int, Any] = {}
        self._save_seconds: list[float] = []

    # -- saving --------------------------------------------------------------------------------------------
    def save(self, trainer: pl.Trainer) -> Path:
        """Write a checkpoint of the current step on every rank, then publish it as ``last.ckpt``."""
        started = time.perf_counter()
        step = trainer.global_step
        final = self.dirpath / f"step-{step:07d}.ckpt"
        partial = self.dirpath / f".{final.name}.partial"
        if trainer.is_global_zero:
            self.dirpath.mkdir(parents=True, exist_ok=True)
            for stale in self.dirpath.glob(".*.partial"):
                _remove(stale)
        trainer.strategy.barrier("RunCheckpoint.save")
        trainer.save_checkpoint(partial, weights_only=False)  # every rank, whole state; returns after its barrier
        if trainer.is_global_zero:
            _remove(final)  # the same step saved before (a resumed run re-saving its first step)
            os.replace(partial, final)
            link = self.dirpath / f".{LAST}.link"
            _remove(link)
            os.symlink(final.name, link)
            last = self.dirpath / LAST
            if last.exists() and not last.is_symlink():
                _remove(last)  # a real file or folder from an older version
            os.replace(link, last)
            _fsync_dir(self.dirpath)
            for old in sorted(self.dirpath.glob("step-*.ckpt"))[: -(self.keep + 1)]:
                _remove(old)
        self._last_saved_step = step
        self.last_path = final
        self._save_seconds.append(time.perf_counter() - started)
        return final

    @property
    def pending_signal(self) -> int:
        """A signal this process received that did not stop the loop (it came after the last step); 0 if none."""
        return self._pending

    def summary(self) -> dict[str, Any]:
        """Rows of the run summary: how many saves and what one cost (every rank waits for it)."""
        if not self._save_seconds:
            return {}
        return {"checkpoint_saves": len(self._save_seconds),
                "checkpoint_s_per_save": round(sum(self._save_seconds) / len(self._save_seconds), 3)}

    # -- Lightning hooks -----------------------------------------------------------------------------------
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._step_seen = trainer.global_step
        self._last_saved_step = trainer.global_step if trainer.ckpt_path else -1
        OUTSIDE_TRAINING.training_started()  # a signal after the loop (when teardown restores it) is only noted
        if threading.current_thread() is not threading.main_thread():
            return
        signals = [signal.SIGTERM, signal.SIGINT]
        environment = getattr(trainer.strategy, "cluster_environment", None)  # parallel strategies have one
        if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
            self._requeue_signal = int(environment.requeue_signal or signal.SIGUSR1)
            signals.append(self._requeue_signal)
        for signum in signals:  # replaces Lightning's handlers, which its teardown restores to the originals
            self._previous_handlers[signum] = signal.getsignal(signum)
            signal.signal(signum, self._on_signal)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == self._step_seen:
            return  # accumulating gradients: not a step boundary
        self._step_seen = trainer.global_step
        if _validation_follows(trainer):
            # A checkpoint taken before this step's validation would skip it on resume (Lightning fast-forwards
            # the validation of the step it restarts at): save and act at the end of the validation instead.
            self._deferred = True
            return
        if self.every_n_steps and trainer.global_step % self.every_n_steps == 0:
            self.save(trainer)
        self._act_on_signals(trainer)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        due = self.every_n_steps is None or self._deferred and trainer.global_step % self.every_n_steps == 0
        self._deferred = False
        if due and trainer.global_step != self._last_saved_step:
            self.save(trainer)
        self._act_on_signals(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step != self._last_saved_step:
            self.save(trainer)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers.clear()

    # -- signals -------------------------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: Any) -> None:
        # Only sets a flag: no collective, no I/O beyond one os.write (print could re-enter a busy stream).
        if self._pending == signum == signal.SIGINT:
            os.write(2, b"\nlds-train: second Ctrl-C: quitting without a checkpoint.\n")
            os._exit(130)
        if not self._pending:
            os.write(2, f"\nlds-train: received {signal.Signals(signum).name}: saving a checkpoint at the end of "
                        "this step, then stopping (a second Ctrl-C quits at once).\n".encode())
        if self._priority(signum) > self._priority(self._pending):
            self._pending = signum

    def _priority(self, signum: int) -> int:
        return {0: 0, signal.SIGINT: 1, self._requeue_signal: 2, signal.SIGTERM: 3}.get(signum, 0)

    def _agreed_signal(self, trainer: pl.Trainer) -> int:
        """The strongest signal any rank has received (one ``all_reduce`` of its priority); 0 for none."""
        code = self._priority(self._pending)
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            flag = torch.tensor([code], dtype=torch.int32, device=trainer.strategy.root_device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            code = int(flag.item())
        return [0, signal.SIGINT, self._requeue_signal, signal.SIGTERM][code]

    def _act_on_signals(self, trainer: pl.Trainer) -> None:
        signum = self._agreed_signal(trainer)
        if not signum:
            return
        if signum == self._requeue_signal:  # SLURM: Lightning's requeue (hpc checkpoint, scontrol requeue)
            self._pending = 0
            # Private: Lightning's SLURM requeue (HPC checkpoint, scontrol requeue) has no public entry point.
            trainer._signal_connector._slurm_sigusr_handler_fn(signum, None)
            return
        if trainer.global_step != self._last_saved_step:
            self.save(trainer)
        raise RunInterrupted(signum, trainer.global_step, self.last_path)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"every_n_steps": self.every_n_steps}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass  # the schedule comes from this run's configuration


def _validation_follows(trainer: pl.Trainer) -> bool:
    """Whether Lightning validates right after this training batch (its own decision, Lightning 2.x)."""
    epoch_loop = trainer.fit_loop.epoch_loop
    try:  # private: Lightning decides this in its epoch loop and exposes no public predicate
        return bool(epoch_loop._should_check_val_fx(trainer.fit_loop._data_fetcher)) and not epoch_loop._skip_next_val
    except AttributeError:  # another Lightning version: save at the batch end (a resume may skip one validation)
        return False


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_model_config(path: Path) -> dict[str, Any] | None:
    """The ``GPTConfig`` fields a checkpoint was trained with (``None`` if it records none); raises ``ValueError``
    when ``path`` is not a checkpoint at all."""
    source = path / META if path.is_dir() else path
    if path.is_dir() and not source.is_file():
        raise ValueError(f"{path} is a folder but not a checkpoint (no {META} in it)")
    try:
        checkpoint = torch.load(source, map_location="cpu", weights_only=False, mmap=not path.is_dir())
    except Exception as exc:  # noqa: BLE001 - pickle, zip and format errors all mean the same to the user
        raise ValueError(f"{path} is not a checkpoint torch can read ({type(exc).__name__}: "
                         f"{' '.join(str(exc).split())[:120]})") from None
    if not isinstance(checkpoint, dict):
        raise ValueError(f"{path} holds a {type(checkpoint).__name__}, not a Lightning checkpoint")
    config = checkpoint.get("hyper_parameters", {}).get("config")
    if config is None:
        return None
    if hasattr(config, "__dataclass_fields__"):
        return {f.name: getattr(config, f.name) for f in fields(config)}
    return dict(config)
