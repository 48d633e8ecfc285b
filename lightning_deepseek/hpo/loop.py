"""The trial loop shared by the ``lds_optuna`` sweeper and :func:`~lightning_deepseek.hpo.search`.

The loop keeps ``n_jobs`` trials in flight and asks for a new one as soon as any finishes (no batch barrier).
Budget: it stops launching once the study holds ``n_trials`` COMPLETE, PRUNED, RUNNING or WAITING trials plus
the trials that failed in this run, so a re-run on the same storage (resume), or a second process on the same
shared storage, only runs what is left, and a re-run gives failed slots another chance.

Failures, as hydra-optuna-sweeper's ``max_failure_rate``: once more than that fraction of the trials this run
finished are FAIL, no new trial starts and the outcome is ``aborted`` (``1.0`` never aborts). Upstream checks
per batch of ``n_jobs``; there are no batches here, so the fraction is over every trial this run finished
(the same as upstream with ``n_jobs=1``). A trial that raises :class:`FatalTrialError` stops the loop at once
(the trials in flight still finish). A trial left RUNNING by a dead process on this host (killed sweep) is
marked FAIL when the loop starts; such lost trials do not count as failures of the search.

The loop returns a :class:`SweepOutcome`; :func:`sweep_failure` turns a failed one into the one error that the
sweeper and ``search()`` both raise. Costs: one ask/tell round trip to the storage per trial, and the sampler
runs in the loop's thread while the other trials train.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.trial import TrialState

from lightning_deepseek.hpo.report import count_states
from lightning_deepseek.hpo.space import suggest

OWNER_ATTR = "lds_owner"
LOST_ATTR = "lds_lost"  # FAIL because its sweeper died or was interrupted, not because the job failed
ORPHAN_AFTER_S = 60
RunTrial = Callable[[optuna.Trial, dict[str, Any]], Any]
ExtendSpace = Callable[[optuna.Trial], None]


class SweepFailedError(RuntimeError):
    """Too many trials failed (more than ``max_failure_rate`` of them), or one failed with a fatal error."""


class FatalTrialError(RuntimeError):
    """Raised by an objective for a failure that every trial would repeat (a configuration error that does not
    depend on the sampled parameters): the trial is FAIL, no new trial starts, and the search fails."""


@dataclass(frozen=True)
class SweepOutcome:
    """How :func:`run_trials` ended.

    Args:
        counts: trials per state name in the whole study at the end (``COMPLETE``, ``PRUNED``, ``FAIL``, ...).
        num_finished: trials this run saw to an end (any state).
        num_failed: of those, the ones that are FAIL.
        aborted: more than ``max_failure_rate`` of this run's trials failed, so no new trial was started.
        fatal_trial: number of the trial that raised :class:`FatalTrialError`, if one did.
    """

    counts: Mapping[str, int]
    num_finished: int
    num_failed: int
    aborted: bool
    fatal_trial: int | None

    @property
    def failed(self) -> bool:
        return self.aborted or self.fatal_trial is not None


def sweep_failure(outcome: SweepOutcome, study: optuna.Study, *, max_failure_rate: float, setting_prefix: str,
                  resume_hint: str, fatal_why: str = "") -> SweepFailedError | None:
    """The error a failed sweep ends with (``None`` if it did not fail); used by the sweeper and ``search()``.

    Args:
        outcome: what :func:`run_trials` returned.
        study: the study (for the fatal trial's ``fail_reason``).
        max_failure_rate: the setting, quoted in the message.
        setting_prefix: how the caller names its settings (``"hydra.sweeper."`` or ``""``).
        resume_hint: how to resume after fixing the cause (``"re-run the same command"``).
        fatal_why: why the fatal trial's error stops everything (the sweeper: it names no searched setting).
    """
    if outcome.fatal_trial is not None:
        number = outcome.fatal_trial
        reason = study.trials[number].user_attrs.get("fail_reason", "")
        why = f" {fatal_why}" if fatal_why else ""
        return SweepFailedError(f"stopped the sweep after trial {number}: {reason}.{why} No further trial was "
                                f"started; fix the cause, then {resume_hint} to resume.")
    if outcome.aborted:
        return SweepFailedError(
            f"{outcome.num_failed} of {outcome.num_finished} finished trials failed, more than {setting_prefix}"
            f"max_failure_rate={max_failure_rate}; see each trial's fail_reason (trials.csv), fix the cause, then "
            f"{resume_hint} to resume.")
    return None


def _log(message: str, prefix: str) -> None:
    print(f"[{prefix}] {message}", file=sys.stderr, flush=True)


def _fail_lost(study: optuna.Study, trial: optuna.trial.FrozenTrial | optuna.Trial, reason: str) -> None:
    # Private names: Optuna has no public way to set attributes of a trial this process did not ask for.
    trial_id = trial._trial_id
    study._storage.set_trial_user_attr(trial_id, "fail_reason", reason)
    study._storage.set_trial_user_attr(trial_id, LOST_ATTR, True)
    study.tell(trial.number, state=TrialState.FAIL)


def fail_stale_trials(study: optuna.Study) -> list[int]:
    """Mark FAIL the RUNNING trials whose owning process on this host is gone; return their numbers."""
    host = socket.gethostname()
    now = datetime.datetime.now()
    stale = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        owner = trial.user_attrs.get(OWNER_ATTR)
        # A live sweeper records itself milliseconds after ask(); no owner a minute later means it died in between.
        orphan = owner is None and (now - trial.datetime_start).total_seconds() > ORPHAN_AFTER_S
        dead = (owner is not None and owner.get("host") == host and owner.get("pid") != os.getpid()
                and not _pid_alive(owner.get("pid", 0)))
        if orphan or dead:
            _fail_lost(study, trial, "its sweeper process died")
            stale.append(trial.number)
    return stale


def _tell(study: optuna.Study, trial: optuna.Trial, values: Sequence[float] | None = None,
          state: TrialState | None = None) -> None:
    try:
        study.tell(trial, values, state=state)
    except RuntimeError as exc:
        # GridSampler.after_trial calls study.stop() once the grid is exhausted, which Optuna only allows inside
        # study.optimize; the trial is already stored by then, and the loop checks is_exhausted() itself.
        if "Study.stop" not in str(exc):
            raise


def objective_values(value: Any, num_objectives: int = 1) -> list[float]:
    """The job's return as ``num_objectives`` finite floats, or ``TypeError``/``ValueError`` saying what to return."""
    values = list(value) if num_objectives > 1 and isinstance(value, (list, tuple)) else [value]
    if len(values) != num_objectives:
        raise TypeError(f"the job returned {value!r}; this study has {num_objectives} objectives (one per "
                        "direction), so it must return a list of that many numbers.")
    numbers = []
    for item in values:
        if isinstance(item, bool) or not isinstance(item, (int, float)) and not hasattr(item, "__float__"):
            raise TypeError(f"the job returned {value!r}; it must return the objective as a number (lds-train "
                            "returns the final val_loss: make sure validation runs, trainer.val_check_interval "
                            "<= trainer.max_steps).")
        number = float(item)
        if number != number or number in (float("inf"), float("-inf")):
            raise ValueError(f"the job returned a non-finite objective ({number}); the run diverged.")
        numbers.append(number)
    return numbers


def _finish(study: optuna.Study, trial: optuna.Trial, future: Future) -> tuple[TrialState, str]:
    """Tell the study how ``trial`` ended; return its state and a one-line log message."""
    params = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in trial.params.items())
    try:
        values = objective_values(future.result(), len(study.directions))
    except optuna.TrialPruned as exc:
        _tell(study, trial, state=TrialState.PRUNED)
        return TrialState.PRUNED, f"trial {trial.number} PRUNED ({exc}) [{params}]"
    except Exception as exc:  # noqa: BLE001 - any crash of a job is a FAIL, the sweep goes on
        reason = " ".join(str(exc).split())[:500] or type(exc).__name__
        trial.set_user_attr("fail_reason", reason)
        _tell(study, trial, state=TrialState.FAIL)
        if os.environ.get("LDS_DEBUG"):
            traceback.print_exception(exc)
        return TrialState.FAIL, f"trial {trial.number} FAIL: {type(exc).__name__}: {reason} [{params}]"
    _tell(study, trial, values)
    shown = f"{values[0]:.5g}" if len(values) == 1 else "[" + ", ".join(f"{v:.5g}" for v in values) + "]"
    return TrialState.COMPLETE, f"trial {trial.number} COMPLETE value={shown} [{params}]"


def _budget_reached(study: optuna.Study, n_trials: int, num_failed: int) -> bool:
    counts = count_states(study)
    in_budget = sum(counts[s] for s in ("COMPLETE", "PRUNED", "RUNNING", "WAITING")) + num_failed
    if in_budget >= n_trials:
        return True
    return isinstance(study.sampler, optuna.samplers.GridSampler) and study.sampler.is_exhausted(study)


def run_trials(study: optuna.Study, space: Mapping[str, BaseDistribution], run_trial: RunTrial, n_trials: int,
               n_jobs: int = 1, max_failure_rate: float = 0.5, extend_space: ExtendSpace | None = None,
               log_prefix: str = "hpo") -> SweepOutcome:
    """Run trials until the study holds ``n_trials`` (see the module docstring).

    Args:
        study: the study (its sampler proposes the parameters).
        space: name -> distribution.
        run_trial: ``run_trial(trial, params)`` returns the objective (a list of values for a multi-objective
            study), raises ``optuna.TrialPruned`` when pruned, anything else when it crashed.
        n_trials: study-wide number of trials to reach.
        n_jobs: trials in flight at once (``run_trial`` is called from that many threads).
        max_failure_rate: stop launching once more than this fraction of this run's finished trials failed.
        extend_space: called with each new trial after ``space`` was suggested, to suggest more parameters
            (hydra-optuna-sweeper's ``custom_search_space``); ``params`` then holds all of ``trial.params``.
        log_prefix: the tag of the trial lines on stderr (``[hpo] trial 3 COMPLETE ...``; the calibration's ``tune``).
    """
    if n_trials < 1 or n_jobs < 1:
        raise ValueError(f"n_trials={n_trials} and n_jobs={n_jobs} must both be >= 1.")
    if not 0 <= max_failure_rate <= 1:
        raise ValueError(f"max_failure_rate={max_failure_rate} must be between 0 and 1.")
    stale = fail_stale_trials(study)
    if stale:
        _log(f"marked FAIL trials {stale}: left RUNNING by a sweeper process that no longer exists", log_prefix)
    owner = {"host": socket.gethostname(), "pid": os.getpid()}
    running: dict[Future, optuna.Trial] = {}
    num_finished = num_failed = 0
    aborted = False
    fatal_trial: int | None = None
    with ThreadPoolExecutor(max_workers=n_jobs, thread_name_prefix="lds-trial") as pool:
        try:
            while True:
                while (len(running) < n_jobs and not aborted and fatal_trial is None
                       and not _budget_reached(study, n_trials, num_failed)):
                    trial = study.ask()
                    trial.set_user_attr(OWNER_ATTR, owner)
                    suggest(trial, space)
                    if extend_space is not None:
                        extend_space(trial)
                    running[pool.submit(run_trial, trial, dict(trial.params))] = trial
                if not running:
                    break
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    trial = running.pop(future)
                    state, message = _finish(study, trial, future)
                    _log(message, log_prefix)
                    num_finished += 1
                    num_failed += state == TrialState.FAIL
                    if fatal_trial is None and isinstance(future.exception(), FatalTrialError):
                        fatal_trial = trial.number
                aborted = aborted or num_failed > max_failure_rate * num_finished
        finally:
            for future, trial in running.items():  # interrupted (Ctrl-C): in-flight trials cannot finish
                future.cancel()
                _fail_lost(study, trial, "the sweep was interrupted")
    return SweepOutcome(count_states(study), num_finished, num_failed, aborted, fatal_trial)


def _pid_alive(pid: int) -> bool:
    """Whether a process with this id exists on this host (one of another user counts)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
