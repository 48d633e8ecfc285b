"""``OptunaPruning``: reports per validation with the global step, stops cleanly, agrees across DDP ranks.

(optuna-integration's own tests of the callback it replaces are in test_upstream_pruning.py.)"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import optuna
import pytest
import torch
from optuna.trial import TrialState

from lightning_deepseek.data import TextDataModule
from lightning_deepseek.hpo import OptunaPruning, PruningConfigError, open_storage
from lightning_deepseek.models import PRESETS, GPTConfig, LightningGPT
from tests.helpers import run_distributed


def _fit(pruning: OptunaPruning, cache_dir: Path, max_steps: int = 12, devices: int = 1,
         strategy: str = "auto", trainers: list[pl.Trainer] | None = None) -> pl.Trainer:
    pl.seed_everything(0, verbose=False)
    model = LightningGPT(GPTConfig(vocab_size=256, **{**PRESETS["tiny"], "block_size": 16}), warmup_steps=2)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=max_steps,
                         val_check_interval=3, limit_val_batches=1, num_sanity_val_steps=0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[pruning])
    if trainers is not None:
        trainers.append(trainer)
    trainer.fit(model, datamodule=TextDataModule(block_size=16, batch_size=4, cache_dir=cache_dir))
    return trainer


def test_reports_every_validation_with_global_step_and_completes(tmp_path: Path) -> None:
    study = optuna.create_study(pruner=optuna.pruners.NopPruner())
    trial = study.ask()
    pruning = OptunaPruning(trial)
    trainer = _fit(pruning, tmp_path)
    # Four validations inside the first epoch: each one is a separate step, none dropped.
    assert sorted(study.trials[0].intermediate_values) == [3, 6, 9, 12]
    assert trainer.global_step == 12 and not pruning.pruned
    pruning.check_pruned()  # not pruned: no exception


def test_pruned_run_stops_at_that_validation_and_raises_trial_pruned(tmp_path: Path) -> None:
    study = optuna.create_study(pruner=optuna.pruners.ThresholdPruner(upper=0.0))  # prunes at the first report
    trial = study.ask()
    pruning = OptunaPruning(trial)
    # fit ends cleanly at that validation (on_fit_end ran), then raises TrialPruned like optuna-integration's.
    with pytest.raises(optuna.TrialPruned, match="pruned at step 3"):
        _fit(pruning, tmp_path)
    assert pruning.pruned and pruning.pruned_step == 3 and pruning.num_validations == 1
    with pytest.raises(optuna.TrialPruned, match="pruned at step 3"):
        pruning.check_pruned()  # still available after fit


def test_metric_never_logged_names_the_monitor(tmp_path: Path) -> None:
    study = optuna.create_study()
    with pytest.raises(PruningConfigError, match=r"monitor='val_acc' was never logged .*val_loss"):
        _fit(OptunaPruning(study.ask(), monitor="val_acc"), tmp_path)


def test_constructor_needs_a_trial_or_its_coordinates() -> None:
    with pytest.raises(PruningConfigError, match="trial_number"):
        OptunaPruning(storage="x.journal", study_name="s")


def _ddp_pruned_trial(rank: int, world_size: int, storage: str, trial_number: int, cache_dir: str) -> dict:
    torch.set_num_threads(1)
    pruning = OptunaPruning(storage=storage, study_name="ddp", trial_number=trial_number)
    trainers: list[pl.Trainer] = []
    try:
        _fit(pruning, Path(cache_dir) / str(rank), max_steps=30, devices=2, strategy="ddp", trainers=trainers)
        raised = False
    except optuna.TrialPruned:
        raised = True  # only where the trial lives (rank 0): other ranks end normally
    try:
        pruning.check_pruned()
        outcome = "complete"
    except optuna.TrialPruned:
        outcome = "pruned"
    return {"step": trainers[0].global_step, "outcome": outcome, "raised": raised,
            "loaded_trial": pruning.trial is not None}


def test_ddp_pruned_trial_stops_on_both_ranks(tmp_path: Path) -> None:
    storage = str(tmp_path / "optuna.journal")
    study = optuna.create_study(study_name="ddp", storage=open_storage(storage))
    study.set_user_attr("lds_pruner", {"_target_": "optuna.pruners.ThresholdPruner", "upper": 0.0})
    trial = study.ask()
    results = run_distributed(_ddp_pruned_trial, 2, storage, trial.number, str(tmp_path), timeout=150)
    assert [r["step"] for r in results] == [3, 3]  # both ranks stopped at the first validation
    assert [r["outcome"] for r in results] == ["pruned", "pruned"]
    assert [r["raised"] for r in results] == [True, False]
    assert [r["loaded_trial"] for r in results] == [True, False]  # only rank 0 opened the study
    study.tell(trial.number, state=TrialState.PRUNED)
    frozen = optuna.load_study(study_name="ddp", storage=open_storage(storage)).trials[0]
    assert frozen.state == TrialState.PRUNED and frozen.intermediate_values.keys() == {3}
