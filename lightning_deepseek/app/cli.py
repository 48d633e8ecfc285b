"""``lds-train`` and ``lds-sample``: the Hydra applications that train and sample the example GPT.

``lds-train`` composes ``conf/train.yaml`` and its groups (model, data, trainer, strategy, precision,
compression, hpo), then builds the model, data, strategy, plugins and callbacks from ``_target_`` nodes,
so a component joins the app by adding a config file, not by editing this module. The configs live in
``lightning_deepseek/app/conf`` (installed with the package; ``./conf`` links there).

This module imports no torch and no Lightning (~9 s together): the whole configuration is checked first, in the
launching process, with Hydra, OmegaConf and the light modules only (``run.check_config``), so that a mistake ends
in one paragraph on stderr and exit code 2 in about a second; ``LDS_DEBUG=1`` shows the full traceback instead.
Only a good configuration imports ``training.py`` (or ``sampling.py``), whose checks that need torch
(``run.check_with_torch``) still run before any other process starts. Checkpoints, SIGTERM/SIGINT and resuming
are ``checkpointing.py``'s and ``signals.py``'s; a lost rank is named by ``watchdog.py``.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import hydra
from omegaconf import DictConfig

from lightning_deepseek.app.checkpoint_files import checkpoints_in, is_complete, not_a_checkpoint
from lightning_deepseek.app.config_checks import check_run_dir_override, expand_home_in_overrides
from lightning_deepseek.app.errors import ConfigError, exit_on_user_error, user_errors, user_errors_exit
from lightning_deepseek.app.run import CONFIG_DIR, RunFolder, RunPlan, check_config
from lightning_deepseek.app.signals import OUTSIDE_TRAINING
from lightning_deepseek.app.tune import check_tune_option

__all__ = ["CONFIG_DIR", "check_training_config", "resolve_sample_checkpoint", "run_sampling", "sample", "train"]

@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")
def _train_app(cfg: DictConfig) -> float | None:
    folder = RunFolder.from_config(cfg)
    OUTSIDE_TRAINING.begin_launch(folder.fail)  # a signal before training: nothing to keep
    plan = check_training_config(cfg, folder)
    from lightning_deepseek.app.training import run_training  # torch and Lightning: only for a good configuration

    report = run_training(cfg, folder, plan)
    if cfg.hpo.get("objectives"):  # a multi-objective sweep (hpo=pareto): one value per direction
        return [report.get(key) for key in cfg.hpo.objectives]
    return report.get("val_loss_final")  # the objective that a Hydra sweeper minimises


def check_training_config(cfg: DictConfig, folder: RunFolder) -> RunPlan:
    """``run.check_config``, without torch; a bad setting ends in one paragraph and exit code 2, its run folder
    removed (Hydra named it) or marked ``FAILED``."""
    try:
        return check_config(cfg, folder)
    except user_errors() as exc:
        folder.fail(exc)
        exit_on_user_error(exc)


SAMPLE_ERROR_PREFIX = "lds-sample: error: "


def resolve_sample_checkpoint(ckpt: str | None) -> Path:
    """The checkpoint ``ckpt`` names: a file, a DCP folder, or the newest complete one of a run or checkpoints
    folder (checked without torch to be a file that ``torch.save`` writes)."""
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
    if (reason := not_a_checkpoint(path)) is not None:
        raise ConfigError(f"ckpt={ckpt!r}: {reason}. Pass a checkpoint written by lds-train, or its run folder.")
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
    from lightning_deepseek.app.checkpointing import checkpoint_model_config  # torch: only for good settings
    from lightning_deepseek.app.sampling import generate

    try:
        checkpoint_model_config(path)
    except ValueError as exc:
        raise ConfigError(f"ckpt={cfg.ckpt!r}: {exc}. Pass a checkpoint written by lds-train, or its run folder.") \
            from None
    text = generate(path, str(cfg.prompt), cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.seed)
    print(text, flush=True)
    return text


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="sample")
def _sample_app(cfg: DictConfig) -> None:
    run_sampling(cfg)


def train() -> None:
    """Console entry point of ``lds-train``."""
    OUTSIDE_TRAINING.install(sys.argv[1:])  # first: a Ctrl-C while torch loads ends the launch cleanly (signals.py)
    # Lightning 2.6's batch flattening builds torch's LeafSpec, which torch 2.13 deprecates: once per rank and fit,
    # nothing a user of lds-train can act on (their own Trainer scripts still see it).
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning, module=r"lightning\.pytorch\.utilities\._pytree")
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
