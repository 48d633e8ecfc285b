"""``OptunaPruning``: stop an unpromising Optuna trial from inside Lightning, under DDP too.

A drop-in for optuna-integration's ``PyTorchLightningPruningCallback(trial, monitor)``: used the same way
(``study.optimize`` around an objective that builds the Trainer with the callback), a pruned trial ends PRUNED
with no extra call. At every validation (not only at epoch ends: ``val_check_interval`` may validate several
times per epoch) the callback reports the monitored metric to the trial with ``trainer.global_step`` as the
step, asks the study's pruner, and, if it says prune, sets ``trainer.should_stop`` so that Lightning ends
``fit`` the normal way (checkpoints, loggers, ``on_fit_end``); then, in its ``teardown`` hook, it raises
``optuna.TrialPruned`` out of ``trainer.fit`` in the process that owns the trial, which marks it PRUNED.
:meth:`OptunaPruning.check_pruned` (call it after ``fit``) raises it too, for code that catches exceptions
around ``fit`` and for ``strategy="ddp_spawn"``.

Under DDP (or any multi-process strategy) only global rank 0 talks to Optuna; the decision is broadcast with
``trainer.strategy.broadcast`` so every rank stops at the same step and no rank waits in a collective that
the others skipped; ranks > 0 never raise. Cost: one small broadcast per validation. Under ``ddp_spawn`` rank
0 is a spawned process, so it records the decision in the trial's storage (user attribute
``lds_pruned_at_step``) instead of raising, and ``check_pruned()`` in the main process reads it from there: as
with optuna-integration, that needs a storage both processes open (RDB or journal file), and an in-memory
study is refused with the fix.

Differences from ``PyTorchLightningPruningCallback`` (docs/hpo.md): the step is ``global_step``, not the epoch
(so a second validation in an epoch is not dropped); a monitor that was never logged is an error naming the
logged metrics, not a warning; DDP works with any storage, not only RDB; pruning on a diverged (nan) metric.
Not supported: multi-objective studies (Optuna cannot prune them; refused at ``setup``).
"""

from __future__ import annotations

import math
import os
from typing import Any

import lightning.pytorch as pl
import optuna
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

PRUNED_ATTR = "lds_pruned_at_step"


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
        elif self._spawned and _is_in_memory(self.trial):
            raise PruningConfigError(
                "OptunaPruning: rank 0 runs in a spawned process, so reports to an in-memory study would be "
                "lost. Use strategy='ddp' (rank 0 stays in the main process) or a persistent storage "
                "(optuna.create_study(storage='sqlite:///optuna.db') or a JournalStorage file).")
        if len(self.trial.study.directions) > 1:
            raise PruningConfigError(
                f"OptunaPruning: study {self.trial.study.study_name!r} has {len(self.trial.study.directions)} "
                "objectives, and Optuna cannot prune multi-objective studies. Drop the callback for this study "
                "(the lds_optuna sweeper attaches none to multi-objective sweeps).")

    @property
    def _spawned(self) -> bool:
        """Whether this copy runs in another process than the one that built it (``ddp_spawn``'s rank 0)."""
        return os.getpid() != self._creator_pid

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
            if trainer.is_global_zero and self._spawned:  # the main process reads it in check_pruned()
                self.trial.set_user_attr(PRUNED_ATTR, {"step": self.pruned_step, "value": self.last_value})

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.num_validations == 0:
            raise PruningConfigError(
                f"OptunaPruning: no validation ran in {trainer.global_step} steps, so {self.monitor!r} was never "
                "reported and the trial could not be pruned. Set trainer.val_check_interval below "
                "trainer.max_steps (or validate every epoch).")

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # The end of fit, after on_fit_end (checkpoints, loggers, reports): end the trial PRUNED the way Optuna
        # expects, in the process that owns the trial; a spawned rank 0 leaves that to check_pruned().
        if stage == "fit" and self.pruned and trainer.is_global_zero and not self._spawned:
            self.check_pruned()

    def check_pruned(self) -> None:
        """Raise ``optuna.TrialPruned`` if this run was pruned (call it after ``trainer.fit``; needed only under
        ``ddp_spawn``, where the decision is read back from the trial's storage)."""
        if not self.pruned and self.trial is not None and not self._spawned:
            recorded = _recorded_decision(self.trial)
            if recorded is not None:
                self.pruned, self.pruned_step, self.last_value = True, recorded["step"], recorded["value"]
        if self.pruned:
            raise optuna.TrialPruned(f"trial {self.trial_number} pruned at step {self.pruned_step} "
                                     f"({self.monitor}={self.last_value})")

    def summary(self) -> dict[str, Any]:
        """Run summary rows (:mod:`lightning_deepseek.reporting`): the trial and where it was pruned."""
        return {"hpo_trial": self.trial_number, "hpo_pruned_at_step": self.pruned_step}

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"trial_number": self.trial_number, "pruned": self.pruned, "pruned_step": self.pruned_step}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.pruned = state_dict["pruned"]
        self.pruned_step = state_dict["pruned_step"]


def _recorded_decision(trial: optuna.Trial) -> dict[str, Any] | None:
    """The pruning decision a spawned rank 0 stored in ``trial`` (read fresh: ``trial.user_attrs`` is a cache)."""
    if _is_in_memory(trial):
        return None
    frozen = next(t for t in trial.study.get_trials(deepcopy=False) if t.number == trial.number)
    return frozen.user_attrs.get(PRUNED_ATTR)


def _is_in_memory(trial: optuna.Trial) -> bool:
    # Private names: Optuna has no public way to ask which storage a study uses; _CachedStorage wraps the real one.
    storage = trial.study._storage
    storage = getattr(storage, "_backend", storage)
    return isinstance(storage, optuna.storages.InMemoryStorage)
