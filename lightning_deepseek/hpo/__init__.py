"""Hyper-parameter search: the ``OptunaPruning`` callback, search spaces, study helpers and :func:`search`."""

from lightning_deepseek.hpo.loop import FatalTrialError, SweepFailedError, SweepOutcome, run_trials, sweep_failure
from lightning_deepseek.hpo.pruning import OptunaPruning, PruningConfigError
from lightning_deepseek.hpo.report import dashboard_command, pareto_front, write_report
from lightning_deepseek.hpo.search import search
from lightning_deepseek.hpo.space import SearchSpaceError, build_space, suggest, to_overrides
from lightning_deepseek.hpo.study import StudyConfigError, create_study, load_trial, open_storage

__all__ = [
    "FatalTrialError",
    "OptunaPruning",
    "PruningConfigError",
    "SearchSpaceError",
    "StudyConfigError",
    "SweepFailedError",
    "SweepOutcome",
    "build_space",
    "create_study",
    "dashboard_command",
    "load_trial",
    "open_storage",
    "pareto_front",
    "run_trials",
    "search",
    "suggest",
    "sweep_failure",
    "to_overrides",
    "write_report",
]
