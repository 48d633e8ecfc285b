"""``OptunaPruning``: stop an unpromising Optuna trial from inside Lightning, under DDP too.

At every validation (not only at epoch ends: ``val_check_interval`` may validate several times per epoch) the
callback reports the monitored metric to the trial with ``trainer.global_step`` as the step, asks the
study's pruner, and, if it says prune, sets ``trainer.should_stop`` so that Lightning ends ``fit`` the normal
way (checkpoints, loggers, teardown). Whoever owns the trial then calls :meth:`OptunaPruning.check_pruned`,
which raises ``optuna.TrialPruned``, and marks the trial PRUNED (the sweeper and :func:`search` do this).

Under DDP (or any multi-process strategy) only global rank 0 talks to Optuna; the decision is broadcast with
``trainer.strategy.broadcast`` so every rank stops at the same step and no rank waits in a collective that
the others skipped. Cost: one small broadcast per validation.

Why not ``optuna_integration.PyTorchLightningPruningCallback``: it reports ``current_epoch`` as the step (a
second validation in the same epoch is dropped with a warning), and under DDP it refuses anything but an
RDB storage because it syncs the decision through database attributes that every rank polls, instead of a
collective. Ours works with any storage, including in-memory when rank 0 is the main process (``ddp``).

Not supported: multi-objective studies (Optuna cannot prune them).
"""

from __future__ import annotations

import math
import os
from typing import Any

import lightning.pytorch as pl
import optuna
from lightning.pytorch.callbacks import Callback
from typing_extensions import override


class PruningConfigError(ValueError):
    """Bad pruning setting (metric never logged, storage that ranks cannot share); names the fix."""


class OptunaPruning(Callback):
    """Report ``monitor`` to an Optuna trial at every validation and stop the run when the pruner says so.

    Args:
        trial: the running trial. ``None`` together with ``storage``/``study_name``/``trial_number`` makes the
            callback load the trial lazily on rank 0 (how sweeper jobs use it).
        monitor: metric in ``trainer.callback_metrics`` to report, for example ``"val_loss"``.
        storage: storage URL or path of the study (only when ``trial`` is ``None``).
        study_name: study name (only when ``trial`` is ``None``).
        trial_number: trial number inside the study (only when ``trial`` is ``None``).
    """

    def __init__(
        self,
        trial: optuna.Trial | None = None,
        monitor: str = "val_loss",
        storage: str | None = None,
        study_name: str | None = None,
        trial_number: int | None = None,
    ) -> None:
        if trial is None and None in (storage, study_name, trial_number):
            raise PruningConfigError(
                "OptunaPruning needs either `trial=` or all of `storage=`, `study_name=` and `trial_number=` "
                f"(got storage={storage!r}, study_name={study_name!r}, trial_number={trial_number!r}). "
                "Under the lds_optuna sweeper these come from the `hpo` group; set them or pass a trial.")
        self.trial = trial
        self.monitor = monitor
        self._study_ref = (storage, study_name, trial_number)
        self._creator_pid = os.getpid()
        self.pruned = False
        self.pruned_step: int | None = None
        self.num_validations = 0
        self.last_value: float | None = None

    @property
    def trial_number(self) -> int | None:
        return self.trial.number if self.trial is not None else self._study_ref[2]

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not trainer.is_global_zero:
            return
        if self.trial is None:
            from lightning_deepseek.hpo.study import load_trial

            storage, study_name, number = self._study_ref
            self.trial = load_trial(storage, study_name, int(number))
        elif os.getpid() != self._creator_pid and _is_in_memory(self.trial):
            raise PruningConfigError(
                "OptunaPruning: rank 0 runs in a spawned process, so reports to an in-memory study would be "
                "lost. Use strategy='ddp' (rank 0 stays in the main process) or a persistent storage "
                "(optuna.create_study(storage='sqlite:///optuna.db') or a JournalStorage file).")

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            logged = sorted(trainer.callback_metrics) or ["nothing"]
            raise PruningConfigError(
                f"OptunaPruning: monitor={self.monitor!r} was never logged (logged: {', '.join(logged)}). "
                "Log it with self.log() in validation_step or set the monitor (hpo.monitor=...) to a logged name.")
        self.num_validations += 1
        should_prune = False
        if trainer.is_global_zero:
            self.last_value = float(value)
            if math.isfinite(self.last_value):
                self.trial.report(self.last_value, step=trainer.global_step)
            # A diverged run (nan/inf) cannot be reported; it is pruned rather than trained to the end.
            should_prune = bool(self.trial.should_prune()) or not math.isfinite(self.last_value)
        # Every rank must reach this broadcast: the decision is made once and shared, never re-derived.
        should_prune = trainer.strategy.broadcast(should_prune, src=0)
        if should_prune:
            self.pruned = True
            self.pruned_step = trainer.global_step
            trainer.should_stop = True

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.num_validations == 0:
            raise PruningConfigError(
                f"OptunaPruning: no validation ran in {trainer.global_step} steps, so {self.monitor!r} was never "
                "reported and the trial could not be pruned. Set trainer.val_check_interval below "
                "trainer.max_steps (or validate every epoch).")

    def check_pruned(self) -> None:
        """Raise ``optuna.TrialPruned`` if this run was pruned (call it after ``trainer.fit``)."""
        if self.pruned:
            raise optuna.TrialPruned(f"trial {self.trial_number} pruned at step {self.pruned_step} "
                                     f"({self.monitor}={self.last_value})")

    def summary(self) -> dict[str, Any]:
        """Rows for ``RunSummary``: trial number and whether (and where) it was pruned."""
        return {"hpo_trial": self.trial_number, "hpo_pruned_at_step": self.pruned_step}

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"trial_number": self.trial_number, "pruned": self.pruned, "pruned_step": self.pruned_step}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.pruned = state_dict["pruned"]
        self.pruned_step = state_dict["pruned_step"]


def _is_in_memory(trial: optuna.Trial) -> bool:
    storage = trial.study._storage
    storage = getattr(storage, "_backend", storage)  # _CachedStorage wraps the real one
    return isinstance(storage, optuna.storages.InMemoryStorage)
