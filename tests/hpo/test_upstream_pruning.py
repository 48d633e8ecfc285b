"""optuna-integration's tests of ``PyTorchLightningPruningCallback``, adapted to ``OptunaPruning`` (a drop-in swap).

From optuna-integration's ``tests/pytorch_lightning/test_pytorch_lightning.py``; each test names its upstream
test. Changes: the callback's name; Trainers write into ``tmp_path``; where our behaviour deliberately differs
(docs/hpo.md, "Differences from PyTorchLightningPruningCallback") the test asserts ours and says so. The
``ddp_spawn`` runs are real: two new processes on gloo, each with its own copy of the callback. They are started
by ``ddp_spawn``'s own launcher with the ``forkserver`` start method (Lightning's ``start_method`` option), from
``run_distributed``'s server, which has imported torch and Lightning already: a spawned rank spent ~10 s importing
them, six times in this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import optuna
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from optuna.testing.pruners import DeterministicPruner
from torch import nn
from torch.multiprocessing.spawn import ProcessRaisedException

from lightning_deepseek.hpo import OptunaPruning, PruningConfigError
from tests.helpers import start_forkserver


class Model(pl.LightningModule):
    """upstream's Model: a linear layer on three zero samples, ``accuracy`` logged at each validation's end."""

    def __init__(self) -> None:
        super().__init__()
        self._model = nn.Sequential(nn.Linear(4, 8))
        self.validation_step_outputs: list[torch.Tensor] = []

    def forward(self, data: torch.Tensor) -> torch.Tensor:
        return self._model(data)

    def training_step(self, batch: Sequence[torch.Tensor], batch_nb: int) -> dict[str, torch.Tensor]:
        data, target = batch
        return {"loss": F.nll_loss(self.forward(data), target)}

    def validation_step(self, batch: Sequence[torch.Tensor], batch_nb: int) -> torch.Tensor:
        data, target = batch
        pred = self.forward(data).argmax(dim=1, keepdim=True)
        accuracy = pred.eq(target.view_as(pred)).double().mean()
        self.validation_step_outputs.append(accuracy)
        return accuracy

    def on_validation_epoch_end(self) -> None:
        if self.validation_step_outputs:
            self.log("accuracy", sum(self.validation_step_outputs) / len(self.validation_step_outputs))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self._model.parameters(), lr=1e-2)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return self._dataset()

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return self._dataset()

    def _dataset(self) -> torch.utils.data.DataLoader:
        data = torch.zeros(3, 4, dtype=torch.float32)
        target = torch.zeros(3, dtype=torch.int64)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data, target), batch_size=1)


class ModelDDP(Model):
    """upstream's ModelDDP: rank 0 logs 0.3 and rank 1 logs 0.6, synced to their mean 0.45."""

    def validation_step(self, batch: Sequence[torch.Tensor], batch_nb: int) -> torch.Tensor:
        accuracy = torch.tensor(0.3 if self.global_rank == 0 else 0.6)
        self.log("accuracy", accuracy, sync_dist=True)
        return accuracy

    def on_validation_epoch_end(self) -> None:
        return


def _trainer(root: Path, callback: OptunaPruning, **kwargs: object) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", enable_checkpointing=False, callbacks=[callback], default_root_dir=root,
                      enable_progress_bar=False, enable_model_summary=False, logger=False, **kwargs)


def test_pytorch_lightning_pruning_callback(tmp_path: Path) -> None:
    # upstream: test_pytorch_lightning_pruning_callback (no check_pruned() call: the drop-in way)
    def objective(trial: optuna.trial.Trial) -> float:
        callback = OptunaPruning(trial, monitor="accuracy")
        _trainer(tmp_path, callback, max_epochs=2).fit(Model())
        return 1.0

    study = optuna.create_study(pruner=DeterministicPruner(True))
    study.optimize(objective, n_trials=1)
    assert study.trials[0].state == optuna.trial.TrialState.PRUNED

    study = optuna.create_study(pruner=DeterministicPruner(False))
    study.optimize(objective, n_trials=1)
    assert study.trials[0].state == optuna.trial.TrialState.COMPLETE
    assert study.trials[0].value == 1.0


def test_pytorch_lightning_pruning_callback_monitor_is_invalid(tmp_path: Path) -> None:
    # upstream: test_pytorch_lightning_pruning_callback_monitor_is_invalid. Difference: upstream warns and keeps
    # training without pruning; ours stops with an error that names the metrics that were logged.
    study = optuna.create_study(pruner=DeterministicPruner(True))
    callback = OptunaPruning(study.ask(), "InvalidMonitor")
    trainer = _trainer(tmp_path, callback, max_epochs=1)
    with pytest.raises(PruningConfigError, match=r"monitor='InvalidMonitor' was never logged \(logged: nothing\)"):
        callback.on_validation_end(trainer, Model())


def _ddp_spawn() -> DDPStrategy:
    """``strategy="ddp_spawn"`` (gloo on CPU), its ranks forked from the preloaded forkserver."""
    start_forkserver()
    return DDPStrategy(start_method="forkserver", process_group_backend="gloo")


def _ddp_objective(root: Path):
    def objective(trial: optuna.trial.Trial) -> float:
        callback = OptunaPruning(trial, monitor="accuracy")
        _trainer(root, callback, max_epochs=2, devices=2, strategy=_ddp_spawn()).fit(ModelDDP())
        callback.check_pruned()  # as upstream: under ddp_spawn the decision is read back in this process
        return 1.0
    return objective


def test_pytorch_lightning_pruning_callback_ddp_monitor(tmp_path: Path) -> None:
    # upstream: test_pytorch_lightning_pruning_callback_ddp_monitor, for its "cached_sqlite" storage (what
    # optuna.create_study(storage="sqlite:///...") builds). Difference: the step is the global step, not the epoch
    # (3 samples, batch 1, 2 ranks: 2 steps per epoch), so upstream's steps [0] and [0, 1] are [2] and [2, 4].
    # (upstream's StorageSupplier needs fakeredis; a URL gives the same cached SQLite storage.)
    storage = optuna.storages.get_storage(f"sqlite:///{tmp_path / 'optuna.db'}")
    study = optuna.create_study(storage=storage, pruner=DeterministicPruner(True))
    study.optimize(_ddp_objective(tmp_path), n_trials=1)
    assert study.trials[0].state == optuna.trial.TrialState.PRUNED
    assert list(study.trials[0].intermediate_values.keys()) == [2]
    np.testing.assert_almost_equal(study.trials[0].intermediate_values[2], 0.45)

    study = optuna.create_study(storage=storage, pruner=DeterministicPruner(False))
    study.optimize(_ddp_objective(tmp_path), n_trials=1)
    assert study.trials[0].state == optuna.trial.TrialState.COMPLETE
    assert study.trials[0].value == 1.0
    assert list(study.trials[0].intermediate_values.keys()) == [2, 4]
    np.testing.assert_almost_equal(study.trials[0].intermediate_values[2], 0.45)
    np.testing.assert_almost_equal(study.trials[0].intermediate_values[4], 0.45)


def test_pytorch_lightning_pruning_callback_ddp_unsupported_storage(tmp_path: Path) -> None:
    # upstream: test_pytorch_lightning_pruning_callback_ddp_unsupported_storage (ours says why and how to fix it)
    study = optuna.create_study(storage=optuna.storages.InMemoryStorage(), pruner=DeterministicPruner(True))
    with pytest.raises(ProcessRaisedException, match="reports to an in-memory study would be lost"):
        study.optimize(_ddp_objective(tmp_path), n_trials=1)
