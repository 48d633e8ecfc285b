"""Hyper-parameter search: the ``OptunaPruning`` callback, search spaces, study helpers and :func:`search`."""

from lightning_deepseek.hpo.pruning import OptunaPruning, PruningConfigError
from lightning_deepseek.hpo.search import FatalTrialError, SweepFailedError, run_trials, search
from lightning_deepseek.hpo.space import SearchSpaceError, build_space, suggest, to_overrides
from lightning_deepseek.hpo.study import StudyConfigError, create_study, load_trial, open_storage, write_report

__all__ = [
    "FatalTrialError",
    "OptunaPruning",
    "PruningConfigError",
    "SearchSpaceError",
    "StudyConfigError",
    "SweepFailedError",
    "build_space",
    "create_study",
    "load_trial",
    "open_storage",
    "run_trials",
    "search",
    "suggest",
    "to_overrides",
    "write_report",
]
