"""Config of the ``lds_optuna`` sweeper and its sampler/pruner presets, registered in Hydra's ConfigStore.

Select with ``hydra/sweeper=lds_optuna``; presets with ``hydra/sweeper/sampler=tpe|gp|cmaes|random|grid|nsgaii|
qmc|motpe`` and ``hydra/sweeper/pruner=median|hyperband|sha|none``. Any other sampler or pruner: set its
``_target_``. The field names are hydra-optuna-sweeper's, so its configs run with ``hydra/sweeper=lds_optuna``.
"""

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore


@dataclass
class LdsOptunaSweeperConf:
    """Fields of ``hydra.sweeper`` (each is also a command-line override ``hydra.sweeper.<field>=...``)."""

    _target_: str = "hydra_plugins.lightning_deepseek_sweeper.lds_optuna_sweeper.LdsOptunaSweeper"
    _recursive_: bool = False  # the sweeper builds sampler/pruner itself and stores the pruner config for jobs
    defaults: list[Any] = field(default_factory=lambda: ["_self_", {"sampler": "tpe"}, {"pruner": "median"}])
    sampler: Any = None
    """``_target_`` node of an Optuna sampler."""
    pruner: Any = None
    """``_target_`` node of an Optuna pruner, or null for no pruning."""
    direction: Any = "minimize"
    """``minimize`` or ``maximize`` the value that the Hydra app returns, or a list of them (one per value of
    the list the app returns) for a multi-objective study: the report then holds the Pareto front, no pruning."""
    study_name: str = "lds"
    """Study name inside the storage; several sweepers with the same name and storage share one study."""
    storage: str | None = None
    """SQLAlchemy URL or ``*.journal`` path; null: ``<hydra.sweep.dir>/optuna.journal``."""
    n_trials: int = 20
    """Study-wide number of trials; a re-run on the same storage only runs the ones still missing."""
    n_jobs: int = 1
    """Trials in flight at once. The basic launcher runs jobs in this process, so it forces 1."""
    max_failure_rate: float = 0.5
    """Stop launching once more than this fraction of the trials this run finished failed; 1.0: never."""
    params: dict[str, Any] = field(default_factory=dict)
    """Search space: ``key: choice(...) | range(...) | interval(...) | tag(log, ...)`` or a fixed value."""
    custom_search_space: str | None = None
    """Dotted path of ``fn(cfg, trial)`` that suggests more parameters from those already sampled (a leading
    ``.`` looks in the app's own script, as hydra-optuna-sweeper's examples write it)."""
    search_space: dict[str, Any] | None = None
    """hydra-optuna-sweeper's deprecated form of ``params`` (``{type, low, high, step, log, choices}``)."""
    experiment_sequence: str | None = None
    """Accepted for hydra-optuna-sweeper configs and ignored (with a warning): this sweeper runs its own loop."""
    pruning_group: str | None = "hpo"
    """Config group whose ``optuna`` option attaches ``OptunaPruning`` in each job (``hpo=optuna`` of lds-train),
    used only when the app has that group; null: never."""


_SAMPLERS = {
    # constant_liar: trials still running count as bad guesses, so concurrent jobs do not all sample one spot.
    "tpe": {"_target_": "optuna.samplers.TPESampler", "multivariate": True, "constant_liar": True, "seed": None,
            "n_startup_trials": 5},
    "gp": {"_target_": "optuna.samplers.GPSampler", "seed": None, "n_startup_trials": 5},
    "cmaes": {"_target_": "optuna.samplers.CmaEsSampler", "seed": None, "n_startup_trials": 1},
    "random": {"_target_": "optuna.samplers.RandomSampler", "seed": None},
    "grid": {"_target_": "optuna.samplers.GridSampler", "search_space": None, "seed": None},
    "nsgaii": {"_target_": "optuna.samplers.NSGAIISampler", "seed": None, "population_size": 50},
    "qmc": {"_target_": "optuna.samplers.QMCSampler", "seed": None},
    # Optuna 4 removed MOTPESampler: its TPESampler handles several objectives (hydra-optuna-sweeper's motpe).
    "motpe": {"_target_": "optuna.samplers.TPESampler", "seed": None, "n_startup_trials": 10},
}
_PRUNERS = {
    "median": {"_target_": "optuna.pruners.MedianPruner", "n_startup_trials": 2, "n_warmup_steps": 0,
               "interval_steps": 1, "n_min_trials": 1},
    "hyperband": {"_target_": "optuna.pruners.HyperbandPruner", "min_resource": 1, "max_resource": "auto",
                  "reduction_factor": 3},
    "sha": {"_target_": "optuna.pruners.SuccessiveHalvingPruner", "min_resource": "auto", "reduction_factor": 4,
            "min_early_stopping_rate": 0},
    "none": {"_target_": "optuna.pruners.NopPruner"},
}

_store = ConfigStore.instance()
_store.store(group="hydra/sweeper", name="lds_optuna", node=LdsOptunaSweeperConf, provider="lightning_deepseek")
for _name, _node in _SAMPLERS.items():
    _store.store(group="hydra/sweeper/sampler", name=_name, node=_node, provider="lightning_deepseek")
for _name, _node in _PRUNERS.items():
    _store.store(group="hydra/sweeper/pruner", name=_name, node=_node, provider="lightning_deepseek")
