"""The trial loop of the sweeper, and :func:`search`, the same search from Python (no Hydra).

The loop keeps ``n_jobs`` trials in flight and asks for a new one as soon as any finishes (no batch barrier).
``n_trials`` counts the study's COMPLETE, PRUNED, RUNNING and WAITING trials, so re-running a sweep on the
same storage (resume), or a second process on the same shared storage, only runs what is left. FAIL trials do
not count towards ``n_trials``; the loop stops launching once the study holds more than
``max_failure_rate * n_trials`` of them and :class:`SweepFailedError` is raised after the report is written.
A trial that raises :class:`FatalTrialError` stops the loop at once (the trials in flight still finish).
A trial left RUNNING by a dead process on this host (killed sweep) is marked FAIL when the loop starts.

Costs: one ask/tell round trip to the storage per trial, and the sampler runs in the loop's thread while
the other trials train. Not supported: multi-objective studies.
"""

from __future__ import annotations

import datetime
import math
import os
import socket
import sys
import traceback
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.trial import TrialState

from lightning_deepseek.hpo.space import SearchSpaceError, build_space, suggest
from lightning_deepseek.hpo.study import (
    PRUNERS,
    SAMPLERS,
    build_component,
    count_states,
    create_study,
    objective_value,
    open_storage,
    write_report,
)

OWNER_ATTR = "lds_owner"
ORPHAN_AFTER_S = 60
RunTrial = Callable[[optuna.Trial, dict[str, Any]], Any]


class SweepFailedError(RuntimeError):
    """Too many trials failed (more than ``max_failure_rate * n_trials``), or one failed with a fatal error."""


class FatalTrialError(RuntimeError):
    """Raised by an objective for a failure that every trial would repeat (a configuration error that does not
    depend on the sampled parameters): the trial is FAIL, no new trial starts, and the search fails."""


def _log(message: str) -> None:
    print(f"[hpo] {message}", file=sys.stderr, flush=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
            study._storage.set_trial_user_attr(trial._trial_id, "fail_reason", "its sweeper process died")
            study.tell(trial.number, state=TrialState.FAIL)
            stale.append(trial.number)
    return stale


def _tell(study: optuna.Study, trial: optuna.Trial, value: float | None = None,
          state: TrialState | None = None) -> None:
    try:
        study.tell(trial, value, state=state)
    except RuntimeError as exc:
        # GridSampler.after_trial calls study.stop() once the grid is exhausted, which Optuna only allows inside
        # study.optimize; the trial is already stored by then, and the loop checks is_exhausted() itself.
        if "Study.stop" not in str(exc):
            raise


def _finish(study: optuna.Study, trial: optuna.Trial, future: Future) -> str:
    """Tell the study how ``trial`` ended; return a one-line log message."""
    params = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in trial.params.items())
    try:
        value = objective_value(future.result())
    except optuna.TrialPruned as exc:
        _tell(study, trial, state=TrialState.PRUNED)
        return f"trial {trial.number} PRUNED ({exc}) [{params}]"
    except Exception as exc:  # noqa: BLE001 - any crash of a job is a FAIL, the sweep goes on
        reason = " ".join(str(exc).split())[:500] or type(exc).__name__
        trial.set_user_attr("fail_reason", reason)
        _tell(study, trial, state=TrialState.FAIL)
        if os.environ.get("LDS_DEBUG"):
            traceback.print_exception(exc)
        return f"trial {trial.number} FAIL: {type(exc).__name__}: {reason} [{params}]"
    _tell(study, trial, value)
    return f"trial {trial.number} COMPLETE value={value:.5g} [{params}]"


def run_trials(study: optuna.Study, space: Mapping[str, BaseDistribution], run_trial: RunTrial, n_trials: int,
               n_jobs: int = 1, max_failure_rate: float = 0.5) -> dict[str, int]:
    """Run trials until the study holds ``n_trials`` (see the module docstring); return trials per state.

    Args:
        study: the study (its sampler proposes the parameters).
        space: name -> distribution.
        run_trial: ``run_trial(trial, params)`` returns the objective, raises ``optuna.TrialPruned`` when
            pruned, anything else when it crashed.
        n_trials: study-wide number of trials to reach.
        n_jobs: trials in flight at once (``run_trial`` is called from that many threads).
        max_failure_rate: stop launching once FAIL trials exceed this fraction of ``n_trials``.

    Returns:
        Trials per state name, plus ``aborted: 1`` when the failure rate was exceeded and ``fatal_trial: N``
        when trial ``N`` raised :class:`FatalTrialError`.
    """
    if n_trials < 1 or n_jobs < 1:
        raise ValueError(f"n_trials={n_trials} and n_jobs={n_jobs} must both be >= 1.")
    if not 0 <= max_failure_rate <= 1:
        raise ValueError(f"max_failure_rate={max_failure_rate} must be between 0 and 1.")
    stale = fail_stale_trials(study)
    if stale:
        _log(f"marked FAIL trials {stale}: left RUNNING by a sweeper process that no longer exists")
    max_failures = math.floor(max_failure_rate * n_trials)
    owner = {"host": socket.gethostname(), "pid": os.getpid()}
    running: dict[Future, optuna.Trial] = {}
    too_many_failures = False
    fatal_trial: int | None = None
    with ThreadPoolExecutor(max_workers=n_jobs, thread_name_prefix="lds-trial") as pool:
        try:
            while True:
                while len(running) < n_jobs and not too_many_failures and fatal_trial is None:
                    counts = count_states(study)
                    if counts["FAIL"] > max_failures:
                        too_many_failures = True
                        break
                    if sum(counts[s] for s in ("COMPLETE", "PRUNED", "RUNNING", "WAITING")) >= n_trials:
                        break
                    if isinstance(study.sampler, optuna.samplers.GridSampler) and study.sampler.is_exhausted(study):
                        break
                    trial = study.ask()
                    trial.set_user_attr(OWNER_ATTR, owner)
                    params = suggest(trial, space)
                    running[pool.submit(run_trial, trial, params)] = trial
                if not running:
                    break
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    trial = running.pop(future)
                    _log(_finish(study, trial, future))
                    if fatal_trial is None and isinstance(future.exception(), FatalTrialError):
                        fatal_trial = trial.number
        finally:
            for future, trial in running.items():  # interrupted (Ctrl-C): in-flight trials cannot finish
                future.cancel()
                trial.set_user_attr("fail_reason", "the sweep was interrupted")
                study.tell(trial, state=TrialState.FAIL)
    counts = count_states(study)
    if too_many_failures:
        counts["aborted"] = 1
    if fatal_trial is not None:
        counts["fatal_trial"] = fatal_trial
    return counts


def _search_space(space: Mapping[str, str | BaseDistribution]) -> dict[str, BaseDistribution]:
    """``search``'s space as distributions; every entry that is not a search space is an error naming it."""
    for name, value in space.items():
        if not isinstance(value, (str, BaseDistribution)):
            raise SearchSpaceError(
                f"search(space=...): {name!r}: {value!r} is a {type(value).__name__}, not a search space; write a "
                f"sweep string ({name!r}: 'tag(log, interval(1e-4, 1e-2))', 'choice(16, 32)', 'range(0, 100, 10)') "
                "or an Optuna distribution (optuna.distributions.FloatDistribution(1e-4, 1e-2, log=True)). Pass "
                "fixed values to your objective yourself.")
    distributions, fixed = build_space({k: v for k, v in space.items() if isinstance(v, str)},
                                       field="search(space=...)")
    if fixed:
        raise SearchSpaceError(f"search(space=...): {fixed} are fixed values, not search spaces; write them as "
                               "choice(...), range(...), interval(...) or tag(log, interval(...)), or pass them to "
                               "your objective yourself.")
    distributions.update({k: v for k, v in space.items() if isinstance(v, BaseDistribution)})
    return distributions


def search(
    objective: RunTrial,
    space: Mapping[str, str | BaseDistribution],
    n_trials: int,
    *,
    study_name: str = "lds",
    storage: str | None = None,
    sampler: Any = None,
    pruner: Any = None,
    direction: str = "minimize",
    n_jobs: int = 1,
    max_failure_rate: float = 0.5,
    output_dir: str | Path | None = None,
) -> optuna.Study:
    """Bayesian search without Hydra: the sweeper's loop around a Python objective.

    Args:
        objective: ``objective(trial, params) -> float``; build the Trainer with ``OptunaPruning(trial)`` and call
            its ``check_pruned()`` after ``fit`` so that pruned runs raise ``optuna.TrialPruned``. Raise
            :class:`FatalTrialError` for an error that every trial would repeat, to stop the search at once.
        space: name -> sweep string (``"tag(log, interval(1e-4, 1e-2))"``, ``"choice(16, 32)"``) or an Optuna
            distribution.
        n_trials: study-wide number of trials (a re-run on the same storage resumes).
        study_name: study name in the storage.
        storage: ``*.journal`` path or SQLAlchemy URL; default ``<output_dir>/optuna.journal``, or in memory
            when ``output_dir`` is ``None``.
        sampler: an Optuna sampler or a ``_target_`` dict (default TPE).
        pruner: an Optuna pruner or a ``_target_`` dict (default median).
        direction: ``"minimize"`` or ``"maximize"``.
        n_jobs: trials in flight at once (threads: only for objectives that are thread-safe, e.g. launch a process).
        max_failure_rate: stop once FAIL trials exceed this fraction of ``n_trials``.
        output_dir: where to write ``best_params.yaml``, ``trials.csv`` and plots (nothing written if ``None``).
    """
    distributions = _search_space(space)
    sampler = sampler if sampler is not None else {"_target_": "optuna.samplers.TPESampler", "multivariate": True}
    pruner = pruner if pruner is not None else {"_target_": "optuna.pruners.MedianPruner"}
    if storage is None and output_dir is not None:
        storage = str(Path(output_dir) / "optuna.journal")
    if isinstance(sampler, Mapping) and isinstance(pruner, Mapping) and storage is not None:
        study = create_study(study_name, storage, sampler, pruner, direction, distributions)
    else:
        study = optuna.create_study(
            study_name=study_name, storage=open_storage(storage) if storage else None, direction=direction,
            sampler=build_component(sampler, optuna.samplers.BaseSampler, "sampler", SAMPLERS, distributions),
            pruner=build_component(pruner, optuna.pruners.BasePruner, "pruner", PRUNERS), load_if_exists=True)
    counts = run_trials(study, distributions, objective, n_trials, n_jobs, max_failure_rate)
    if output_dir is not None:
        write_report(study, output_dir)
    if "fatal_trial" in counts:
        reason = study.trials[counts["fatal_trial"]].user_attrs.get("fail_reason", "")
        raise SweepFailedError(f"trial {counts['fatal_trial']} raised FatalTrialError ({reason}); no further trial "
                               "was started. Fix the cause, then call search() again on the same storage to resume.")
    if counts.get("aborted"):
        raise SweepFailedError(f"{counts['FAIL']} trials failed, more than max_failure_rate={max_failure_rate} "
                               f"of n_trials={n_trials}; see each trial's fail_reason (trials.csv).")
    return study
