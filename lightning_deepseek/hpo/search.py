""":func:`search`: the sweeper's trial loop (``loop.py``) and report (``report.py``) around a Python objective.

For LightningCLI users and plain scripts that do not use Hydra. Multi-objective searches pass a list of
directions; their objective returns one value per direction and cannot be pruned (Optuna's rule).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import optuna
from optuna.distributions import BaseDistribution

from lightning_deepseek.hpo.loop import RunTrial, run_trials, sweep_failure
from lightning_deepseek.hpo.report import write_report
from lightning_deepseek.hpo.space import SearchSpaceError, build_space
from lightning_deepseek.hpo.study import (
    PRUNERS,
    SAMPLERS,
    build_component,
    create_study,
    normalize_directions,
    open_storage,
)


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
    direction: str | Sequence[str] = "minimize",
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
        direction: ``"minimize"`` or ``"maximize"``, or a list of them for a multi-objective search (the
            report then holds the Pareto front; no pruning).
        n_jobs: trials in flight at once (threads: only for objectives that are thread-safe, e.g. launch a process).
        max_failure_rate: stop once more than this fraction of the finished trials failed (1.0: never).
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
        directions = normalize_directions(direction)
        study = optuna.create_study(
            study_name=study_name, storage=open_storage(storage) if storage else None, directions=directions,
            sampler=build_component(sampler, optuna.samplers.BaseSampler, "sampler", SAMPLERS, distributions),
            pruner=build_component(pruner, optuna.pruners.BasePruner, "pruner", PRUNERS), load_if_exists=True)
    outcome = run_trials(study, distributions, objective, n_trials, n_jobs, max_failure_rate)
    if output_dir is not None:
        write_report(study, output_dir)
    error = sweep_failure(outcome, study, max_failure_rate=max_failure_rate, setting_prefix="",
                          resume_hint="call search() again on the same storage")
    if error is not None:
        raise error
    return study
