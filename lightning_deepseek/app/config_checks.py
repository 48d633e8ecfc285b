"""The checks ``lds-train`` runs on its composed configuration in the launching process, before importing torch.

Everything that can be known without torch is checked here, once, in well under a second: a type or range
mistake, a setting Lightning would ignore or overwrite, a misspelt ``trainer.*`` key. Each failure is a
``ConfigError`` naming the setting, the value and the fix, which ``lds-train`` prints as one paragraph with exit
code 2 (see ``errors.py``). ``run.py`` adds the model shape, the corpus and the ``resume`` path, also without
torch. This module must not import torch or Lightning (``tests/app/test_config_errors.py`` fails if the checks do):
importing them takes ~9 s, the checks ~1 s. The exceptions, checked after torch is imported and still before any
process starts, are in ``run.check_with_torch``: a GPU count, the model shape inside a ``resume`` checkpoint, and
whatever instantiating a ``_target_`` node reveals. What only a running job can tell (a tensor-parallel plan that
does not fit, a precision schedule past the run's end) is checked by the component at setup.

A config group joins by adding its check, ``check_<group>(cfg: DictConfig) -> None`` (light: no torch at import or
call), to ``GROUP_CHECKS``.
"""

from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_deepseek.app.errors import ConfigError

_FROM_GROUPS = {"strategy": "strategy=hybrid or strategy=ddp", "precision": "precision=fp32|fp16|bf16|staged",
                "plugins": "the precision group", "logger": "lds-train's CSV and TensorBoard loggers",
                "callbacks": "the callbacks mapping (callbacks.NAME={_target_: ...})",
                "default_root_dir": "hydra.run.dir", "enable_checkpointing": "the checkpoint settings"}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check(setting: str, value: Any, ok: bool, expected: str, example: str) -> None:
    if not ok:
        shown = repr(value) if isinstance(value, str) else value
        raise ConfigError(f"{setting}={shown} is not valid: it must be {expected}. Set it like {example}.")


def positive_int(setting: str, value: Any, example: str) -> None:
    _check(setting, value, _is_int(value) and value >= 1, "a positive whole number", example)


def check_trainer(cfg: DictConfig) -> None:
    """Keys and values of the ``trainer`` group."""
    trainer_cfg = cfg.trainer
    kwargs = OmegaConf.to_container(trainer_cfg, resolve=True)
    for key in kwargs:
        if key in _FROM_GROUPS:
            raise ConfigError(f"trainer.{key}={kwargs[key]} would be overwritten: lds-train sets the Trainer's {key} "
                              f"from {_FROM_GROUPS[key]}. Drop trainer.{key} and use that instead.")
    check_trainer_keys(kwargs)
    max_steps, max_epochs = kwargs.get("max_steps", -1), kwargs.get("max_epochs")
    if max_steps != -1 or max_epochs is None:
        positive_int("trainer.max_steps", max_steps, "trainer.max_steps=500 (or -1 with trainer.max_epochs=N)")
    if max_epochs is not None:
        _check("trainer.max_epochs", max_epochs, _is_int(max_epochs) and max_epochs >= 1 or max_epochs == -1,
               "a positive whole number or -1", "trainer.max_epochs=3")
    for key, example in (("log_every_n_steps", "10"), ("accumulate_grad_batches", "1"), ("num_nodes", "1")):
        if key in kwargs:
            positive_int(f"trainer.{key}", kwargs[key], f"trainer.{key}={example}")
    interval = kwargs.get("val_check_interval")
    if interval is not None:
        _check("trainer.val_check_interval", interval,
               _is_int(interval) and interval >= 1 or isinstance(interval, float) and 0 < interval <= 1,
               "a number of training batches (>= 1) or a fraction of an epoch in (0, 1]",
               "trainer.val_check_interval=100")
    for key in ("limit_val_batches", "limit_train_batches"):
        if kwargs.get(key) is not None:
            value = kwargs[key]
            ok = _is_int(value) and value >= 0 or isinstance(value, float) and 0 <= value <= 1
            _check(f"trainer.{key}", value, ok, "a number of batches (>= 0) or a fraction in [0, 1]",
                   f"trainer.{key}=20")
    clip = kwargs.get("gradient_clip_val")
    if clip is not None:
        _check("trainer.gradient_clip_val", clip, _is_number(clip) and clip >= 0,
               "a number >= 0 (or null: no clipping)", "trainer.gradient_clip_val=1.0")
    sanity = kwargs.get("num_sanity_val_steps", 0)
    _check("trainer.num_sanity_val_steps", sanity, _is_int(sanity) and sanity >= -1, "a whole number >= -1",
           "trainer.num_sanity_val_steps=0")
    for key in ("enable_progress_bar", "enable_model_summary", "deterministic", "benchmark"):
        if kwargs.get(key) is not None:
            _check(f"trainer.{key}", kwargs[key], isinstance(kwargs[key], bool), "true or false",
                   f"trainer.{key}=false")
    check_devices(trainer_cfg, cfg.allow_oversubscribe)


@functools.cache
def trainer_arguments() -> frozenset[str]:
    """The argument names of ``lightning.pytorch.Trainer``, read from its source without importing Lightning
    (importing it takes ~6 s); ``inspect.signature`` on the class if the source cannot be read."""
    spec = importlib.util.find_spec("lightning")
    source = Path(spec.origin).parent / "pytorch" / "trainer" / "trainer.py" if spec and spec.origin else None
    try:
        tree = ast.parse(source.read_bytes())  # type: ignore[union-attr]
        init = next(node for cls in tree.body if isinstance(cls, ast.ClassDef) and cls.name == "Trainer"
                    for node in cls.body if isinstance(node, ast.FunctionDef) and node.name == "__init__")
    except (AttributeError, OSError, SyntaxError, StopIteration):
        import inspect

        import lightning.pytorch as pl

        return frozenset(inspect.signature(pl.Trainer.__init__).parameters) - {"self"}
    args = init.args
    return frozenset(a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)) - {"self"}


def check_trainer_keys(trainer_kwargs: dict[str, Any]) -> None:
    """Name a misspelt ``trainer.*`` key (added with ``+``, as Hydra suggests) before ``Trainer`` rejects it."""
    known = set(trainer_arguments()) - set(_FROM_GROUPS)
    for key in trainer_kwargs:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"did you mean trainer.{close[0]}?" if close else "see lightning.pytorch.Trainer's arguments."
            raise ConfigError(f"trainer.{key} is not an argument of Lightning's Trainer: {hint} (strategy, "
                              "precision, callbacks and loggers come from their own groups.)")


def check_devices(trainer_cfg: DictConfig, allow_oversubscribe: bool) -> None:
    """Fail early when ``trainer.devices`` is malformed or asks for more CPU devices than this machine has (GPUs
    are counted by ``check_gpus``, which needs torch)."""
    devices, accelerator = trainer_cfg.get("devices", 1), str(trainer_cfg.get("accelerator", "cpu"))
    if isinstance(devices, str) and devices != "auto":
        if not re.fullmatch(r"\s*-?\d+\s*|(\s*\d+\s*,)+(\s*\d+\s*)?", devices):
            raise ConfigError(f"trainer.devices={devices!r} is not a device count or a list of device ids. Use a "
                              "number (trainer.devices=2), 'auto', or ids (trainer.devices=[0,1]).")
        devices = int(devices) if re.fullmatch(r"\s*-?\d+\s*", devices) else devices
        if isinstance(devices, str):
            return  # "0,1": Lightning parses ids
    if isinstance(devices, bool) or isinstance(devices, float):
        raise ConfigError(f"trainer.devices={devices} is not a device count. Use a whole number "
                          "(trainer.devices=2), 'auto', or ids (trainer.devices=[0,1]).")
    if not isinstance(devices, int):
        return  # lists of ids: Lightning validates those
    if devices == 0 or devices < -1:
        raise ConfigError(f"trainer.devices={devices} asks for no device: use a positive count "
                          "(trainer.devices=2), -1 or 'auto' for all of them.")
    available = os.cpu_count() or 1
    if accelerator == "cpu" and not allow_oversubscribe and devices > available:
        raise ConfigError(f"trainer.devices={devices} but this machine has {available} CPU core(s); each CPU device "
                          f"is one process. Set trainer.devices to at most {available} or pass "
                          "allow_oversubscribe=true.")


def check_gpus(trainer_cfg: DictConfig) -> None:
    """``trainer.accelerator=gpu``: torch sees a GPU, and as many as ``trainer.devices`` asks for. Imports torch:
    ``run.check_with_torch`` calls it after the light checks."""
    devices, accelerator = trainer_cfg.get("devices", 1), str(trainer_cfg.get("accelerator", "cpu"))
    if accelerator not in ("gpu", "cuda"):
        return
    import torch

    available = torch.cuda.device_count()
    if available == 0:
        raise ConfigError(f"trainer.accelerator={accelerator} but this machine has no GPU that torch can use "
                          f"(torch {torch.__version__}, CUDA {torch.version.cuda or 'not built in'}). Train on "
                          "CPU with trainer=cpu, or install a CUDA build of torch.")
    if isinstance(devices, str) and re.fullmatch(r"\s*\d+\s*", devices):
        devices = int(devices)
    if isinstance(devices, int) and not isinstance(devices, bool) and devices > available:
        raise ConfigError(f"trainer.devices={devices} but this machine has {available} GPU(s). "
                          f"Set trainer.devices to at most {available}.")


def check_data(cfg: DictConfig) -> None:
    """Types and ranges of the ``data`` group (``run.check_config`` reads the corpus itself)."""
    data = OmegaConf.to_container(cfg.data, resolve=True)
    positive_int("data.batch_size", data.get("batch_size"), "data.batch_size=16")
    if data.get("block_size") is not None:
        positive_int("data.block_size", data["block_size"], "data.block_size=64 (or null: the model's)")
    fraction = data.get("val_fraction")
    _check("data.val_fraction", fraction, _is_number(fraction) and 0 < fraction < 1, "a fraction strictly between "
           "0 and 1", "data.val_fraction=0.1")
    workers = data.get("num_workers", 0)
    _check("data.num_workers", workers, _is_int(workers) and workers >= 0, "a whole number >= 0", "data.num_workers=0")
    path = data.get("path")
    _check("data.path", path, path is None or isinstance(path, str), "a file or folder path (or null: the built-in "
           "corpus)", "data.path=$HOME/books")


def check_optim(cfg: DictConfig) -> None:
    """Types and ranges of the ``optim`` settings."""
    optim = OmegaConf.to_container(cfg.optim, resolve=True)
    checks: dict[str, tuple[Callable[[Any], bool], str, str]] = {
        "learning_rate": (lambda v: _is_number(v) and v > 0, "a positive number", "1.0e-3"),
        "weight_decay": (lambda v: _is_number(v) and v >= 0, "a number >= 0", "0.1"),
        "warmup_steps": (lambda v: _is_int(v) and v >= 0, "a whole number >= 0", "20"),
        "min_lr_ratio": (lambda v: _is_number(v) and 0 <= v <= 1, "a number in [0, 1]", "0.1"),
        "moment_dtype": (lambda v: v in ("fp32", "bf16"), "fp32 or bf16", "bf16"),
    }
    for key, value in optim.items():
        if key not in checks:
            close = difflib.get_close_matches(key, sorted(checks), n=1)
            hint = f"did you mean optim.{close[0]}?" if close else f"the settings are {sorted(checks)}."
            raise ConfigError(f"optim.{key} is not an optimizer setting: {hint}")
        ok, expected, example = checks[key]
        _check(f"optim.{key}", value, ok(value), expected, f"optim.{key}={example}")


def check_model_fields(model_cfg: DictConfig) -> None:
    """Types of the fields set in the ``model`` group (``GPTConfig`` checks the ranges)."""
    for key, value in OmegaConf.to_container(model_cfg, resolve=True).items():
        if key in ("preset",) or value is None:
            continue
        if key == "dropout":
            _check("model.dropout", value, _is_number(value), "a number in [0, 1)", "model.dropout=0.1")
        elif key == "bias":
            _check("model.bias", value, isinstance(value, bool), "true or false", "model.bias=false")
        else:
            positive_int(f"model.{key}", value, f"model.{key}=4")


def check_top_level(cfg: DictConfig) -> None:
    """The app's own top-level settings."""
    _check("seed", cfg.seed, _is_int(cfg.seed), "a whole number", "seed=1234")
    for key in ("plot", "allow_oversubscribe"):
        _check(key, cfg[key], isinstance(cfg[key], bool), "true or false", f"{key}=false")
    every = cfg.get("checkpoint", {}).get("every_n_steps")
    if every is not None:
        positive_int("checkpoint.every_n_steps", every, "checkpoint.every_n_steps=100 (or null: after each "
                     "validation)")
    resume = cfg.get("resume")
    _check("resume", resume, resume is None or isinstance(resume, str), "auto, a run folder or a checkpoint path",
           "resume=auto")


# The checks of each part of the configuration, in order; each takes the whole composed config.
GROUP_CHECKS: tuple[Callable[[DictConfig], None], ...] = (
    check_top_level,
    check_trainer,
    check_optim,
    check_data,
)


def check_groups(cfg: DictConfig) -> None:
    """Run every check of ``GROUP_CHECKS``; raises the ``ConfigError`` of the first bad setting."""
    for check in GROUP_CHECKS:
        check(cfg)


def describe_model_difference(saved: dict[str, Any], wanted: dict[str, Any]) -> str:
    """``n_layer 2 (this run: 4), n_embd 64 (this run: 128)``; empty when the shapes agree."""
    keys = [k for k in wanted if k in saved and k != "dropout" and saved[k] != wanted[k]]
    return ", ".join(f"{k} {saved[k]} (this run: {wanted[k]})" for k in keys)


def expand_home_in_overrides(argv: list[str]) -> list[str]:
    """``key=~/books`` -> ``key=/home/me/books``: Hydra's override grammar reads ``~`` as a deletion, so the
    shell's usual spelling of a home folder would fail with a lexer error."""
    home = str(Path.home())
    return [re.sub(r"^([\w.+-]+)=~(?=/|$)", lambda m: f"{m.group(1)}={home}", arg) for arg in argv]


def check_run_dir_override(argv: list[str]) -> None:
    """``hydra.run.dir=X`` on the command line names a folder that can be created (Hydra would fail with a
    traceback)."""
    for arg in argv:
        if arg.startswith("hydra.run.dir=") and "${" not in arg:
            value = arg.split("=", 1)[1].strip("'\"")
            try:
                Path(value).expanduser().mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ConfigError(f"hydra.run.dir={value!r} cannot be created ({exc.strerror}). Pick a folder you "
                                  "can write to, e.g. hydra.run.dir=outputs/my-run, or drop it for "
                                  "outputs/<date>/<time>.") from None
