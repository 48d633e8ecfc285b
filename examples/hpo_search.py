"""Bayesian search with pruning in a plain Lightning script (no Hydra): ``search`` + ``OptunaPruning``.

    .venv/bin/python examples/hpo_search.py --trials 8 --out runs/hpo-example

Each trial trains the example GPT for a few dozen steps with a sampled learning rate and warm-up; the
callback reports the validation loss at every validation and stops trials that the median pruner rejects.
Re-running the same command resumes the study in ``--out`` (only the missing trials run). Any LightningModule
works the same way: build the Trainer with ``OptunaPruning(trial)``; a pruned trial's ``fit`` raises
``optuna.TrialPruned`` once it has ended cleanly, and the search marks the trial PRUNED. Open the study with
``optuna-dashboard <out>/optuna.journal``.
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning.pytorch as pl
import optuna
import torch

from lightning_deepseek import OptunaPruning, search
from lightning_deepseek.data import TextDataModule
from lightning_deepseek.models import PRESETS, GPTConfig, LightningGPT


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default="runs/hpo-example")
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = TextDataModule(block_size=32, batch_size=8, cache_dir=args.out)

    def objective(trial: optuna.Trial, params: dict[str, Any]) -> float:
        pl.seed_everything(0, verbose=False)
        model = LightningGPT(GPTConfig(vocab_size=256, **{**PRESETS["tiny"], "block_size": 32}), **params)
        pruning = OptunaPruning(trial, monitor="val_loss")
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=args.steps, val_check_interval=5,
                             limit_val_batches=4, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, callbacks=[pruning])
        trainer.fit(model, datamodule=data)  # raises optuna.TrialPruned when pruned: search() marks it PRUNED
        return float(trainer.callback_metrics["val_loss"])

    study = search(
        objective,
        {"learning_rate": "tag(log, interval(1e-4, 1e-1))", "warmup_steps": "range(0, 20, 5)"},
        n_trials=args.trials,
        sampler={"_target_": "optuna.samplers.TPESampler", "multivariate": True, "seed": 0, "n_startup_trials": 4},
        pruner={"_target_": "optuna.pruners.MedianPruner", "n_startup_trials": 3, "n_warmup_steps": 10},
        output_dir=args.out,
    )
    print(f"best trial {study.best_trial.number}: val_loss={study.best_value:.4f} params={study.best_params}")
    print(f"report in {args.out}: best_params.yaml, trials.csv, optimization_history.png, param_importances.png")


if __name__ == "__main__":
    main()
