"""``lds-train`` and ``lds-sample``: the Hydra applications that train and sample the example GPT.

``lds-train`` composes ``conf/train.yaml`` and its groups (model, data, trainer, strategy, precision,
compression, hpo), then builds the model, data, strategy, plugins and callbacks from ``_target_`` nodes,
so a component joins the app by adding a config file, not by editing this module. The configs live in
``lightning_deepseek/conf`` (installed with the package; ``./conf`` links there). Bad input ends in one
paragraph on stderr and exit code 2; ``LDS_DEBUG=1`` shows the full traceback instead.
"""

from __future__ import annotations

import difflib
import inspect
import os
import re
from pathlib import Path
from typing import Any

import hydra
import lightning.pytorch as pl
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from lightning_deepseek.data import TextDataModule
from lightning_deepseek.data.text import VOCAB_SIZE
from lightning_deepseek.errors import ConfigError, user_errors_exit
from lightning_deepseek.hpo import OptunaPruning
from lightning_deepseek.models import PRESETS, GPTConfig, LightningGPT
from lightning_deepseek.summary import RunSummary

CONFIG_DIR = str(Path(__file__).resolve().parent / "conf")  # packaged with the module; ./conf links here


def build_model_config(cfg: DictConfig, vocab_size: int) -> GPTConfig:
    """``GPTConfig`` from ``model.preset`` plus any field set explicitly in the ``model`` group."""
    preset = cfg.model.preset
    if preset not in PRESETS:
        raise ConfigError(f"model.preset={preset!r} is not a known preset. Choose one of {sorted(PRESETS)} "
                          "(for example `model=tiny`).")
    fields = {k: v for k, v in OmegaConf.to_container(cfg.model).items() if k != "preset" and v is not None}
    return GPTConfig(vocab_size=vocab_size, **{**PRESETS[preset], **fields})


def check_devices(trainer_cfg: DictConfig, allow_oversubscribe: bool) -> None:
    """Fail early when ``trainer.devices`` is malformed or asks for more devices than this machine has."""
    devices, accelerator = trainer_cfg.get("devices", 1), str(trainer_cfg.get("accelerator", "cpu"))
    if isinstance(devices, str) and devices != "auto":
        if not re.fullmatch(r"\s*-?\d+\s*|(\s*\d+\s*,)+(\s*\d+\s*)?", devices):
            raise ConfigError(f"trainer.devices={devices!r} is not a device count or a list of device ids. Use a "
                              "number (trainer.devices=2), 'auto', or ids (trainer.devices=[0,1]).")
        return  # "0,1" and "-1": Lightning parses those
    if not isinstance(devices, int):
        return  # lists of ids: Lightning validates those
    if accelerator in ("gpu", "cuda"):
        available, unit = torch.cuda.device_count(), "GPU(s)"
        if available == 0:
            raise ConfigError(f"trainer.accelerator={accelerator} but this machine has no GPU that torch can use "
                              f"(torch {torch.__version__}, CUDA {torch.version.cuda or 'not built in'}). Train on "
                              "CPU with trainer=cpu, or install a CUDA build of torch.")
    elif accelerator == "cpu":
        available, unit = (os.cpu_count() or 1), "CPU core(s); each CPU device is one process"
        if allow_oversubscribe:
            return
    else:
        return
    if devices > available:
        hint = " or pass allow_oversubscribe=true" if accelerator == "cpu" else ""
        raise ConfigError(f"trainer.devices={devices} but this machine has {available} {unit}. "
                          f"Set trainer.devices to at most {available}{hint}.")


def check_trainer_keys(trainer_kwargs: dict[str, Any]) -> None:
    """Name a misspelt ``trainer.*`` key (added with ``+``, as Hydra suggests) before ``Trainer`` rejects it."""
    known = set(inspect.signature(pl.Trainer.__init__).parameters) - {"self", "strategy", "plugins", "logger",
                                                                        "callbacks", "default_root_dir"}
    for key in trainer_kwargs:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"did you mean trainer.{close[0]}?" if close else "see lightning.pytorch.Trainer's arguments."
            raise ConfigError(f"trainer.{key} is not an argument of Lightning's Trainer: {hint} (strategy, "
                              "precision, callbacks and loggers come from their own groups.)")


def build_callbacks(cfg: DictConfig) -> list[pl.Callback]:
    """Callbacks of the component groups (compression, hpo) and of the ``callbacks`` mapping."""
    nodes = [cfg.compression.get("callback"), cfg.hpo.get("callback"), *cfg.get("callbacks", {}).values()]
    return [instantiate(node) for node in nodes if node is not None]


def build_trainer(cfg: DictConfig, run_dir: Path, callbacks: list[pl.Callback]) -> pl.Trainer:
    """``Trainer`` from the ``trainer`` group with the strategy, precision, logger and checkpoints wired in."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    trainer_kwargs = OmegaConf.to_container(cfg.trainer, resolve=True)
    check_trainer_keys(trainer_kwargs)
    plugins = []
    if cfg.precision.get("plugin") is not None:
        plugins.append(instantiate(cfg.precision.plugin))
    else:
        trainer_kwargs["precision"] = cfg.precision.name
    strategy = cfg.strategy
    strategy = instantiate(strategy) if "_target_" in strategy else strategy.name
    checkpoint = ModelCheckpoint(dirpath=run_dir / "checkpoints", save_last=True, save_top_k=0)
    return pl.Trainer(
        **trainer_kwargs, strategy=strategy, plugins=plugins or None, logger=_loggers(run_dir),
        callbacks=[*callbacks, checkpoint, RunSummary(run_dir, plot=cfg.plot)], default_root_dir=run_dir,
    )


def _loggers(run_dir: Path) -> list[Any]:
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    loggers: list[Any] = [CSVLogger(run_dir, name="logs", version="")]
    try:
        import tensorboard  # noqa: F401

        loggers.append(TensorBoardLogger(run_dir, name="tb", version=""))
    except ImportError:
        pass
    return loggers


@user_errors_exit()
def run_training(cfg: DictConfig) -> dict[str, Any]:
    """Train with a composed config; returns the run summary (empty on ranks other than 0)."""
    run_dir = Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else Path(cfg.run_dir)
    check_devices(cfg.trainer, cfg.allow_oversubscribe)
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    model_config = build_model_config(cfg, VOCAB_SIZE)
    data_kwargs = OmegaConf.to_container(cfg.data, resolve=True)
    data_kwargs["block_size"] = data_kwargs.get("block_size") or model_config.block_size
    if data_kwargs["block_size"] > model_config.block_size:
        raise ConfigError(f"data.block_size={data_kwargs['block_size']} exceeds model.block_size="
                          f"{model_config.block_size}: lower data.block_size or pick a larger model preset.")
    data = TextDataModule(**data_kwargs, cache_dir=run_dir)
    data.validate()
    model = LightningGPT(model_config, **cfg.optim)
    resume = cfg.get("resume")
    if resume not in (None, "last", "hpc") and not Path(resume).exists():  # Lightning resolves "last" and "hpc"
        raise ConfigError(f"resume={resume!r} does not exist. Pass a checkpoint written by lds-train (for example "
                          "resume=outputs/<date>/<time>/checkpoints/last.ckpt), or drop resume to start fresh.")
    trainer = build_trainer(cfg, run_dir, build_callbacks(cfg))
    trainer.fit(model, datamodule=data, ckpt_path=resume)
    summary = next(cb for cb in trainer.callbacks if isinstance(cb, RunSummary))
    if trainer.global_rank == 0:
        print(f"run folder: {run_dir}", flush=True)
        for callback in trainer.callbacks:
            if isinstance(callback, OptunaPruning):
                callback.check_pruned()  # raises optuna.TrialPruned; the sweeper marks the trial PRUNED
    return summary.report


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")
def _train_app(cfg: DictConfig) -> float | None:
    report = run_training(cfg)
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


@user_errors_exit()
def run_sampling(cfg: DictConfig) -> str:
    """Generate text from ``cfg.ckpt`` after ``cfg.prompt``; returns and prints it."""
    if not cfg.ckpt:
        raise ConfigError("ckpt is not set. Pass ckpt=PATH to a checkpoint written by lds-train "
                          "(for example outputs/<date>/<time>/checkpoints/last.ckpt).")
    path = Path(cfg.ckpt)
    if not path.exists():
        raise ConfigError(f"ckpt={cfg.ckpt!r} does not exist. Pass a checkpoint written by lds-train "
                          "(a .ckpt file, or the folder that strategy=hybrid writes).")
    torch.manual_seed(cfg.seed)
    model = load_model(path).eval()
    prompt = cfg.prompt.encode("utf-8") or b"\n"
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
    _train_app()


def sample() -> None:
    """Console entry point of ``lds-sample``."""
    _sample_app()


if __name__ == "__main__":
    train()
