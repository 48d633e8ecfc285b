"""``lds-train`` and ``lds-sample``: the Hydra applications that train and sample the example GPT.

``lds-train`` composes ``conf/train.yaml`` and its groups (model, data, trainer, strategy, precision,
compression, hpo), then builds the model, data, strategy, plugins and callbacks from ``_target_`` nodes,
so a component joins the app by adding a config file, not by editing this module. The configs live in
``lightning_deepseek/conf`` (installed with the package; ``./conf`` links there). The whole configuration is
checked in the launching process first (``run.py``, ``config_checks.py``): bad input ends in one paragraph on
stderr and exit code 2 before any training process starts; ``LDS_DEBUG=1`` shows the full traceback instead.
Checkpoints, SIGTERM/SIGINT and resuming are ``checkpointing.py``'s; a lost rank is named by ``watchdog.py``.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

import hydra
import lightning.pytorch as pl
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from lightning_deepseek.autotune import check_tune_option
from lightning_deepseek.checkpointing import (
    RunCheckpoint,
    RunInterrupted,
    checkpoint_model_config,
    checkpoints_in,
    is_complete,
)
from lightning_deepseek.config_checks import check_run_dir_override, expand_home_in_overrides
from lightning_deepseek.data import TextDataModule
from lightning_deepseek.errors import USER_ERROR_EXIT, USER_ERRORS, ConfigError, exit_on_user_error, user_errors_exit
from lightning_deepseek.models import LightningGPT
from lightning_deepseek.run import CONFIG_DIR, RunFolder, RunPlan, validate_config
from lightning_deepseek.summary import RunSummary
from lightning_deepseek.watchdog import LostRankWatchdog, wait_for_watchdog


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
        callbacks=[*callbacks, *monitors, RunSummary(run_dir, plot=cfg.plot), checkpoint, watchdog],
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


def prepare_training(cfg: DictConfig, folder: RunFolder) -> tuple[RunPlan, TextDataModule, LightningGPT, pl.Trainer]:
    """Everything before ``fit``, in the launching process: the checked plan, the data, the model, the trainer
    (strategy, precision plugin and callbacks instantiated). Raises the user error of the first bad setting."""
    plan = validate_config(cfg, folder)
    folder.claim()
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    data = TextDataModule(**plan.data_kwargs, cache_dir=folder.path)
    model = LightningGPT(plan.model_config, **cfg.optim)
    return plan, data, model, build_trainer(cfg, folder.path, build_callbacks(cfg))


def run_training(cfg: DictConfig) -> dict[str, Any]:
    """Train with a composed config; returns the run summary (empty on ranks other than 0).

    The whole configuration is checked first (``validate_config``), in the launching process, so that a mistake
    ends in one paragraph and exit code 2 before any other process starts. A SIGTERM or SIGINT during training
    writes a checkpoint and exits 143 or 130.
    """
    folder = RunFolder.from_config(cfg)
    try:
        if cfg.get("tune") is not None and cfg.tune.get("mode") != "none":  # measure, then train with the fastest
            from lightning_deepseek.autotune import calibrated_config  # Optuna: imported only when tuning

            cfg = calibrated_config(cfg, validate_config(cfg, folder), folder)
        plan, data, model, trainer = prepare_training(cfg, folder)
    except USER_ERRORS as exc:
        folder.fail(exc)
        exit_on_user_error(exc)
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
    except USER_ERRORS as exc:  # a setting only a running job can check (e.g. a tensor-parallel plan)
        if not folder.is_launcher:
            sys.exit(USER_ERROR_EXIT)  # every rank finds it; the launching process prints it, once
        folder.fail(exc)
        exit_on_user_error(exc)
    except Exception:
        _exit_if_rank_lost(trainer)
        raise
    folder.release()
    summary = next(cb for cb in trainer.callbacks if isinstance(cb, RunSummary))
    if trainer.global_rank == 0:
        print(f"run folder: {folder.path}", flush=True)
        if hint := tensorboard_hint(folder.path):
            print(hint, flush=True)
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


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")
def _train_app(cfg: DictConfig) -> float | None:
    report = run_training(cfg)
    if cfg.hpo.get("objectives"):  # a multi-objective sweep (hpo=pareto): one value per direction
        return [report.get(key) for key in cfg.hpo.objectives]
    return report.get("val_loss_final")  # the objective that a Hydra sweeper minimises


def load_model(path: Path) -> LightningGPT:
    """``LightningGPT`` from a checkpoint file, or from a sharded DCP folder (``strategy=hybrid``)."""
    if not path.is_dir():
        return LightningGPT.load_from_checkpoint(path, map_location="cpu")
    from lightning.fabric.utilities.load import _load_distributed_checkpoint

    checkpoint = _load_distributed_checkpoint(path)  # gathers the shards into full tensors on CPU
    model = LightningGPT(**checkpoint["hyper_parameters"])
    model.load_state_dict(checkpoint["state_dict"])
    return model


SAMPLE_ERROR_PREFIX = "lds-sample: error: "


def resolve_sample_checkpoint(ckpt: str | None) -> Path:
    """The checkpoint ``ckpt`` names: a file, a DCP folder, or the newest complete one of a run or checkpoints
    folder."""
    if not ckpt:
        raise ConfigError("ckpt is not set. Pass ckpt=PATH: a run folder of lds-train (outputs/<date>/<time>) or a "
                          "checkpoint in it (outputs/<date>/<time>/checkpoints/last.ckpt).")
    path = Path(ckpt).expanduser()
    if not path.exists():
        raise ConfigError(f"ckpt={ckpt!r} does not exist. Pass a run folder of lds-train or a checkpoint in it "
                          "(a .ckpt file, or the folder that strategy=hybrid writes).")
    if path.is_dir() and not is_complete(path):
        found = checkpoints_in(path)
        if not found:
            raise ConfigError(f"ckpt={ckpt!r} is a folder with no complete checkpoint in it (no step-*.ckpt, "
                              "last.ckpt or DCP meta.pt). Pass a run folder of lds-train or a checkpoint in it.")
        path = found[-1]
    try:
        checkpoint_model_config(path)
    except ValueError as exc:
        raise ConfigError(f"ckpt={ckpt!r}: {exc}. Pass a checkpoint written by lds-train, or its run folder.") \
            from None
    return path


@user_errors_exit(SAMPLE_ERROR_PREFIX)
def run_sampling(cfg: DictConfig) -> str:
    """Generate text from ``cfg.ckpt`` after ``cfg.prompt``; returns and prints it."""
    path = resolve_sample_checkpoint(cfg.ckpt)
    for key in ("max_new_tokens", "top_k"):
        if cfg[key] is not None and (not isinstance(cfg[key], int) or isinstance(cfg[key], bool) or cfg[key] < 1):
            raise ConfigError(f"{key}={cfg[key]!r} must be a positive whole number, e.g. {key}=100.")
    if not isinstance(cfg.temperature, (int, float)) or isinstance(cfg.temperature, bool) or cfg.temperature <= 0:
        raise ConfigError(f"temperature={cfg.temperature!r} must be a positive number, e.g. temperature=0.8.")
    torch.manual_seed(cfg.seed)
    model = load_model(path).eval()
    prompt = str(cfg.prompt).encode("utf-8") or b"\n"
    idx = torch.tensor([list(prompt)], dtype=torch.long)
    out = model.model.generate(idx, cfg.max_new_tokens, temperature=cfg.temperature, top_k=cfg.top_k)
    text = bytes(out[0].tolist()).decode("utf-8", errors="replace")
    print(text, flush=True)
    return text


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="sample")
def _sample_app(cfg: DictConfig) -> None:
    run_sampling(cfg)


def train() -> None:
    """Console entry point of ``lds-train``."""
    sys.argv[1:] = expand_home_in_overrides(sys.argv[1:])
    try:
        check_run_dir_override(sys.argv[1:])
        check_tune_option(sys.argv[1:])
    except ConfigError as exc:
        exit_on_user_error(exc)
    _train_app()


def sample() -> None:
    """Console entry point of ``lds-sample``."""
    _sample_app()


if __name__ == "__main__":
    train()
