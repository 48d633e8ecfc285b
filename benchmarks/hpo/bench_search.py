"""Budget-matched search benchmark: TPE + median pruning vs TPE vs random search, over several seeds.

Each search trains the example GPT (``tiny`` preset, block 32, batch 8, one CPU process, in-process trials
through ``lightning_deepseek.hpo.search`` and ``OptunaPruning``) over the learning rate (log, 1e-5..1) and
the warm-up length, with the same total budget of optimizer steps. Reported per method (median over seeds):
optimizer steps spent until any validation reaches the target loss, and the best completed trial at the
budget. Then the seed document's observation: the learning rate found against the default 1e-3, trained for
the same number of steps from the same initialisation.

    .venv/bin/python benchmarks/hpo/bench_search.py --seeds 5
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import optuna
import torch

from lightning_deepseek.data import TextDataModule
from lightning_deepseek.hpo import OptunaPruning, search
from lightning_deepseek.models import PRESETS, GPTConfig, LightningGPT

SPACE = {"learning_rate": "tag(log, interval(1e-5, 1.0))", "warmup_steps": "range(0, 25, 4)"}
METHODS = ("tpe+pruning", "tpe", "random")


class Budget:
    """Steps spent by one search, and when a validation first reached the target."""

    def __init__(self, total: int, target: float) -> None:
        self.total, self.target = total, target
        self.spent = 0
        self.steps_to_target: int | None = None

    def record(self, curve: list[tuple[int, float]], steps: int) -> None:
        for step, value in curve:
            if self.steps_to_target is None and value <= self.target:
                self.steps_to_target = self.spent + step
        self.spent += steps


class _Curve(pl.Callback):
    def __init__(self) -> None:
        self.points: list[tuple[int, float]] = []

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.points.append((trainer.global_step, float(trainer.callback_metrics["val_loss"])))


def train(params: dict[str, Any], max_steps: int, init_seed: int, data: TextDataModule, val_every: int,
          trial: optuna.Trial | None = None) -> tuple[float, list[tuple[int, float]], int, OptunaPruning | None]:
    pl.seed_everything(init_seed, verbose=False)
    config = GPTConfig(vocab_size=256, **{**PRESETS["tiny"], "block_size": 32})
    model = LightningGPT(config, learning_rate=params["learning_rate"], warmup_steps=params["warmup_steps"])
    curve = _Curve()
    pruning = OptunaPruning(trial, monitor="val_loss") if trial is not None else None
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, val_check_interval=val_every, limit_val_batches=4,
        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[curve] + ([pruning] if pruning else []),
    )
    try:
        trainer.fit(model, datamodule=data)
    except optuna.TrialPruned:
        pass  # the objective counts the pruned run's steps first, then pruning.check_pruned() re-raises
    value = curve.points[-1][1] if curve.points else math.inf
    return value, curve.points, trainer.global_step, pruning


def run_search(method: str, seed: int, args: argparse.Namespace, data: TextDataModule, workdir: Path) -> dict:
    budget = Budget(args.trials * args.steps, args.target)
    sampler: optuna.samplers.BaseSampler = (
        optuna.samplers.RandomSampler(seed=seed) if method == "random"
        else optuna.samplers.TPESampler(multivariate=True, seed=seed, n_startup_trials=args.startup))
    pruner: optuna.pruners.BasePruner = (
        optuna.pruners.MedianPruner(n_startup_trials=args.startup, n_warmup_steps=args.warmup_report)
        if method == "tpe+pruning" else optuna.pruners.NopPruner())

    def objective(trial: optuna.Trial, params: dict[str, Any]) -> float:
        max_steps = min(args.steps, budget.total - budget.spent)
        value, curve, steps, pruning = train(params, max_steps, args.init_seed, data, args.val_every, trial)
        budget.record(curve, steps)
        pruning.check_pruned()
        return value

    storage = str(workdir / f"{method}-{seed}.journal")
    n_trials = 0
    study = None
    while budget.spent < budget.total:
        n_trials += 1  # one more trial on the same storage: search() resumes the study
        study = search(objective, SPACE, n_trials, study_name=f"{method}-{seed}", storage=storage,
                       sampler=sampler, pruner=pruner)
    complete = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    best = min(complete, key=lambda t: t.value)
    return {"method": method, "seed": seed, "steps_to_target": budget.steps_to_target, "trials": n_trials,
            "pruned": n_trials - len(complete), "best_value": best.value, "best_params": best.params}


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--trials", type=int, default=12, help="budget = trials x steps optimizer steps")
    parser.add_argument("--steps", type=int, default=60, help="steps of a full trial")
    parser.add_argument("--val-every", type=int, default=5)
    parser.add_argument("--startup", type=int, default=4, help="random trials before TPE / before pruning")
    parser.add_argument("--warmup-report", type=int, default=10, help="no pruning before this step")
    parser.add_argument("--target", type=float, default=3.15, help="target validation loss (nats/byte)")
    parser.add_argument("--init-seed", type=int, default=1234, help="model initialisation, same for all trials")
    parser.add_argument("--long-steps", type=int, default=300, help="steps of the default-vs-found comparison")
    args = parser.parse_args()
    torch.set_num_threads(1)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    start = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="lds-hpo-bench-"))
    data = TextDataModule(block_size=32, batch_size=8, cache_dir=workdir)
    results = []
    for seed in range(args.seeds):
        for method in METHODS:  # interleaved, so machine noise hits every method alike (steps are counted anyway)
            result = run_search(method, seed, args, data, workdir)
            results.append(result)
            print(f"seed {seed} {method:12s} steps_to_target={result['steps_to_target']} trials={result['trials']}"
                  f" pruned={result['pruned']} best={result['best_value']:.4f} {result['best_params']}",
                  file=sys.stderr, flush=True)
    budget = args.trials * args.steps
    print(f"\nbudget {budget} optimizer steps per search ({args.trials} full trials x {args.steps} steps), "
          f"target val_loss <= {args.target}, {args.seeds} seeds\n")
    print("| method | searches reaching target | median steps to target | vs random | median best val_loss "
          "at budget | median trials (pruned) |")
    print("|---|---|---|---|---|---|")
    steps_to_target, reached = {}, {}
    for method in METHODS:
        mine = [r for r in results if r["method"] == method]
        # A search that never reached the target counts as twice the budget (a lower bound on its cost).
        steps_to_target[method] = _median([r["steps_to_target"] or 2 * budget for r in mine])
        reached[method] = f"{sum(r['steps_to_target'] is not None for r in mine)}/{len(mine)}"
    for method in METHODS:
        mine = [r for r in results if r["method"] == method]
        ratio = steps_to_target[method] / steps_to_target["random"]
        print(f"| {method} | {reached[method]} | {steps_to_target[method]:.0f} | {ratio:.2f} "
              f"| {_median([r['best_value'] for r in mine]):.4f} | {_median([r['trials'] for r in mine]):.0f} "
              f"({_median([r['pruned'] for r in mine]):.0f}) |")
    rows = steps_to_target
    print(f"\nratio TPE+pruning / random steps to target: {rows['tpe+pruning'] / rows['random']:.2f} "
          "(target <= 0.33)")
    found = [r for r in results if r["method"] == "tpe+pruning"]
    best = min(found, key=lambda r: r["best_value"])["best_params"]
    default = {"learning_rate": 1e-3, "warmup_steps": 20}
    print(f"\nseed document's observation: default {default} vs found {best}, same init, same steps")
    print("| steps | val_loss default | val_loss found | difference |")
    print("|---|---|---|---|")
    for steps in (args.steps, args.long_steps):
        base, _, _, _ = train(default, steps, args.init_seed, data, steps)
        tuned, _, _, _ = train(best, steps, args.init_seed, data, steps)
        print(f"| {steps} | {base:.4f} | {tuned:.4f} | {100 * (tuned - base) / base:+.1f}% |")
    print(f"\nwall time {time.perf_counter() - start:.0f} s; command: .venv/bin/python benchmarks/hpo/bench_search.py "
          + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
