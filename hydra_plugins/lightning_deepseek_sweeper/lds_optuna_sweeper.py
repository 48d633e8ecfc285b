"""``LdsOptunaSweeper``, the Hydra sweeper ``lds_optuna`` (config: ``config.py``, body: ``_impl.py``).

Hydra imports every plugin module at the start of every app, sweeping or not; this one stays light (no torch,
Lightning or Optuna import) and loads the sweeper's body only when an app selects ``hydra/sweeper=lds_optuna``
(``_impl`` starts with an underscore, so Hydra's plugin scan skips it), as hydra-optuna-sweeper does.
"""

from __future__ import annotations

from typing import Any

from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig


class LdsOptunaSweeper(Sweeper):
    """Optuna (>= 4) search with pruning, asynchronous trials and resumable studies; arguments: the fields of
    ``LdsOptunaSweeperConf``."""

    def __init__(self, **fields: Any) -> None:
        from hydra_plugins.lightning_deepseek_sweeper._impl import LdsOptunaSweeperImpl

        self.sweeper = LdsOptunaSweeperImpl(**fields)

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.sweeper.setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> Any:
        return self.sweeper.sweep(arguments)
