"""Training with a checked configuration: ``lds-train``'s work after ``run.check_config`` (``cli.py``).

Builds the model, data, strategy, plugins and callbacks from the composed configuration's ``_target_`` nodes, runs
the checks that need torch (``run.check_with_torch``), then ``Trainer.fit``. Importing this module imports torch
and Lightning (~9 s); ``cli.py`` does it only once the configuration is known good.
"""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from lightning_deepseek.app.checkpointing import RunCheckpoint, RunInterrupted
from lightning_deepseek.app.errors import USER_ERROR_EXIT, exit_on_user_error, user_errors
from lightning_deepseek.app.progress_bar import progress_bar
from lightning_deepseek.app.run import RunFolder, RunPlan, check_config, check_with_torch
from lightning_deepseek.app.signals import OUTSIDE_TRAINING, exit_code
from lightning_deepseek.app.summary import RunSummary
from lightning_deepseek.app.watchdog import LostRankWatchdog, wait_for_watchdog
from lightning_deepseek.data import TextDataModule
from lightning_deepseek.models import LightningGPT

# Lightning prints its messages through its own handler only when it is imported before logging is configured; here
# Hydra has configured the root logger first, so each message would print twice (Lightning's "INFO: ..." handler and
# Hydra's). Keep Lightning's plain one-line messages, as when Lightning is imported first.
for _name in ("lightning.pytorch", "lightning.fabric"):
    _log = logging.getLogger(_name)
    if not _log.handlers:
        _log.addHandler(logging.StreamHandler())
    _log.propagate = False


def build_callbacks(cfg: DictConfig) -> list[pl.Callback]:
    """Callbacks of the component groups (compression, hpo) and of the ``callbacks`` mapping."""
    nodes = [cfg.compression.get("callback"), cfg.hpo.get("callback"), *cfg.get("callbacks", {}).values()]
    return [instantiate(node) for node in nodes if node is not None]


def build_trainer(cfg: DictConfig, run_dir: Path, callbacks: list[pl.Callback]) -> pl.Trainer:
    """``Trainer`` from the ``trainer`` group with the strategy, precision, logger and checkpoints wired in."""
    trainer_kwargs = OmegaConf.to_container(cfg.trainer, resolve=True)
    plugins = []
    if cfg.precision.get("plugin") is not None:
        plugins.append(instantiate(cfg.precision.plugin))
    else:
        trainer_kwargs["precision"] = cfg.precision.name
    strategy = cfg.strategy
    strategy = instantiate(strategy) if "_target_" in strategy else strategy.name
    from lightning.pytorch.callbacks import LearningRateMonitor, ThroughputMonitor

    # lr-AdamW/pg1.. (one per parameter group) and train/items_per_sec (tokens/s) in metrics.csv and TensorBoard;
    # the throughput is a rolling mean over as many batches as lie between two logged steps (Lightning's default
    # window, 100, would leave short runs without any).
    window = max(2, int(cfg.trainer.get("log_every_n_steps", 10)))
    monitors = [LearningRateMonitor(logging_interval="step"),
                ThroughputMonitor(batch_size_fn=_batch_size, length_fn=_batch_tokens, window_size=window)]
    checkpoint = RunCheckpoint(run_dir / "checkpoints", every_n_steps=cfg.get("checkpoint", {}).get("every_n_steps"))
    watchdog = LostRankWatchdog(describe=lambda lost: _lost_rank_paragraph(lost, checkpoint, run_dir))
    # RunSummary before RunCheckpoint: a checkpoint then holds the curves up to its own step.
    return pl.Trainer(
        **trainer_kwargs, strategy=strategy, plugins=plugins or None, logger=_loggers(run_dir),
        callbacks=[*callbacks, *monitors, RunSummary(run_dir, plot=cfg.plot), checkpoint, watchdog,
                   *progress_bar(trainer_kwargs.get("enable_progress_bar", True), callbacks)],
        default_root_dir=run_dir, enable_checkpointing=False,  # RunCheckpoint writes the checkpoints
    )


def _batch_size(batch: Any) -> int:
    return batch[0].size(0)


def _batch_tokens(batch: Any) -> int:
    return batch[0].numel()


def tensorboard_hint(run_dir: Path) -> str | None:
    """How to open this run's TensorBoard logs, when they are written."""
    if not (run_dir / "tb").exists():
        return None
    return f"TensorBoard: tensorboard --logdir {run_dir / 'tb'}  (then open http://localhost:6006)"


def _lost_rank_paragraph(lost: str, checkpoint: RunCheckpoint, run_dir: Path) -> str:
    saved = f"the last complete checkpoint is {checkpoint.last_path}" if checkpoint.last_path else \
        "no checkpoint was written in this run yet"
    return (f"{lost}; the other ranks cannot continue without it, so the job stops. {saved[0].upper()}{saved[1:]}; "
            f"continue with the same settings plus resume={run_dir}.")


def _loggers(run_dir: Path) -> list[Any]:
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    loggers: list[Any] = [CSVLogger(run_dir, name="logs", version="")]
    try:
        import tensorboard  # noqa: F401

        loggers.append(TensorBoardLogger(run_dir, name="tb", version=""))
    except ImportError:
        pass
    return loggers


def prepare_training(cfg: DictConfig, folder: RunFolder, plan: RunPlan | None = None,
                     ) -> tuple[RunPlan, TextDataModule, LightningGPT, pl.Trainer]:
    """Everything before ``fit``, in the launching process: the checked plan (``check_config``, unless given,
    then ``check_with_torch``), the data, the model, the trainer (strategy, precision plugin and callbacks
    instantiated). Raises the user error of the first bad setting."""
    plan = plan or check_config(cfg, folder)
    check_with_torch(cfg, plan)
    folder.claim()
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    data = TextDataModule(**plan.data_kwargs, cache_dir=folder.path)
    model = LightningGPT(plan.model_config, **cfg.optim)
    return plan, data, model, build_trainer(cfg, folder.path, build_callbacks(cfg))


def run_training(cfg: DictConfig, folder: RunFolder | None = None, plan: RunPlan | None = None) -> dict[str, Any]:
    """Train with a composed config; returns the run summary (empty on ranks other than 0).

    ``plan`` is ``check_config``'s (``cli.py`` checks before importing this module); without it the checks run
    here. A mistake ends in one paragraph and exit code 2 before any other process starts. A SIGTERM or SIGINT
    during training writes a checkpoint and exits 143 or 130; one after the last step exits 143 or 130 once the
    final checkpoint is written; one before training starts ends the launch (``signals.py``).
    """
    folder = folder or RunFolder.from_config(cfg)
    try:
        if cfg.get("tune") is not None and cfg.tune.get("mode") != "none":  # measure, then train with the fastest
            from lightning_deepseek.app.tune import calibrated_config  # Optuna: imported only when tuning

            plan = plan or check_config(cfg, folder)
            check_with_torch(cfg, plan)  # e.g. a resume checkpoint of another model: before any measurement
            cfg = calibrated_config(cfg, plan, folder)
        plan, data, model, trainer = prepare_training(cfg, folder, plan)
    except user_errors() as exc:
        folder.fail(exc)
        exit_on_user_error(exc)
    return _fit(folder, plan, data, model, trainer)


def _fit(folder: RunFolder, plan: RunPlan, data: TextDataModule, model: LightningGPT,
         trainer: pl.Trainer) -> dict[str, Any]:
    if plan.note and folder.is_launcher:
        print(plan.note, flush=True)
    if folder.is_launcher and any(type(lg).__name__ == "TensorBoardLogger" for lg in trainer.loggers):
        print(f"TensorBoard: tensorboard --logdir {folder.path / 'tb'}  (then open http://localhost:6006)", flush=True)
    try:
        trainer.fit(model, datamodule=data, ckpt_path=plan.resume)
    except RunInterrupted as stop:
        folder.release()
        if trainer.global_rank == 0:
            print(f"lds-train: stopped by {signal.Signals(stop.signum).name} at step {stop.step}; checkpoint "
                  f"{stop.checkpoint}. Continue with the same settings plus resume={folder.path}", flush=True)
        # Lightning's launcher takes a child's exit code != 0 for a crash and kills the job: only rank 0 reports.
        sys.exit(stop.exit_code if folder.is_launcher else 0)
    except user_errors() as exc:  # a setting only a running job can check (e.g. a tensor-parallel plan)
        if not folder.is_launcher:
            sys.exit(USER_ERROR_EXIT)  # every rank finds it; the launching process prints it, once
        folder.fail(exc)
        exit_on_user_error(exc)
    except Exception:
        _exit_if_rank_lost(trainer)
        raise
    folder.release()
    summary = next(cb for cb in trainer.callbacks if isinstance(cb, RunSummary))
    checkpoint = next(cb for cb in trainer.callbacks if isinstance(cb, RunCheckpoint))
    late_signal = checkpoint.pending_signal or OUTSIDE_TRAINING.received
    if trainer.global_rank == 0:
        print(f"run folder: {folder.path}", flush=True)
        if hint := tensorboard_hint(folder.path):
            print(hint, flush=True)
    if late_signal:  # after the last step: the final checkpoint is complete; say the run was stopped all the same
        if trainer.global_rank == 0:
            name = signal.Signals(late_signal).name
            print(f"lds-train: stopped by {name} after the last step ({trainer.global_step}); the final checkpoint "
                  f"{checkpoint.last_path} is complete.", flush=True)
        sys.exit(exit_code(late_signal) if folder.is_launcher else 0)
    if trainer.global_rank == 0:
        from lightning_deepseek.hpo import OptunaPruning  # imported here: Optuna costs seconds at start-up

        for callback in trainer.callbacks:
            if isinstance(callback, OptunaPruning):
                callback.check_pruned()  # raises optuna.TrialPruned; the sweeper marks the trial PRUNED
    return summary.report


def _exit_if_rank_lost(trainer: pl.Trainer) -> None:
    """After a failed collective: if a peer rank died, say which in one paragraph and exit 1."""
    watchdog = next((cb for cb in trainer.callbacks if isinstance(cb, LostRankWatchdog)), None)
    if watchdog is None or trainer.world_size < 2:
        return
    wait_for_watchdog(watchdog, seconds=3.0)
    paragraph = watchdog.report()
    if paragraph is not None:
        print(f"lds-train: error: {paragraph}", file=sys.stderr, flush=True)
        sys.exit(1)
