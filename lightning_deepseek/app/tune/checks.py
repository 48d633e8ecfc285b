"""The checks of the ``tune`` group, run by ``lds-train`` in the launching process before any training process.

No torch import here: ``config_checks.py`` calls :func:`check_tune` before torch is loaded, and ``cli.py`` calls
:func:`check_tune_option` on the raw command line (Hydra itself would answer an unknown ``tune=`` option with a
traceback-style message and the wrong exit code).
"""

from __future__ import annotations

import math
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_deepseek.app.errors import ConfigError
from lightning_deepseek.app.tune.configurations import (
    CONF_DIR,
    DIMENSIONS,
    compression_of,
    configurations,
    describe_forced,
    forced_settings,
    pipeline_configuration,
    pipeline_size,
    processes,
)

MODES = ("none", "auto", "quick", "grid")
_STRATEGIES = ("ddp", "hybrid")
_COMPRESSIONS = ("none", "int8", "int4")


def tune_options() -> list[str]:
    """The options of the ``tune`` config group (``conf/tune/*.yaml``)."""
    return sorted(p.stem for p in (CONF_DIR / "tune").glob("*.yaml"))


def check_tune_option(argv: list[str]) -> None:
    """``tune=X`` on the command line names an option of the group."""
    options = tune_options()
    for arg in argv:
        if arg.startswith("tune="):
            value = arg.split("=", 1)[1].strip("'\"")
            if value not in options:
                raise ConfigError(f"tune={value!r} is not a calibration mode. Use one of {', '.join(options)} (tune="
                                  "quick: a few steps of each configuration, then train with the fastest; tune=none: "
                                  "train as configured).")


def task_overrides() -> list[str]:
    """The command-line overrides of this run (empty outside a Hydra app, e.g. the Python API)."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def _list_of(setting: str, value: Any, allowed: tuple[str, ...], example: str) -> None:
    if not isinstance(value, list) or not value or any(v not in allowed for v in value):
        raise ConfigError(f"{setting}={value} is not valid: it must be a non-empty list of {', '.join(allowed)}. Set "
                          f"it like {example}.")


def check_tune(cfg: DictConfig, experts: int = 0) -> None:
    """Values of the ``tune`` group, and (``quick``, ``grid``) whether a calibration can run: several processes
    and at least two configurations left once the forced settings are kept. ``auto`` trains as configured where
    a calibration has nothing to choose from. In every mode, a pipeline's kept settings (:func:`check_pipeline`)."""
    if "tune" not in cfg:
        return
    tune = OmegaConf.to_container(cfg.tune, resolve=True)
    mode = tune.get("mode")
    if mode not in MODES:
        raise ConfigError(f"tune.mode={mode!r} is not a calibration mode. Use tune=auto, tune=quick, tune=grid or "
                          "tune=none.")
    check_pipeline(cfg)
    if mode == "none":
        return
    _list_of("tune.strategies", tune.get("strategies"), _STRATEGIES, "tune.strategies=[ddp,hybrid]")
    _list_of("tune.compressions", tune.get("compressions"), _COMPRESSIONS, "tune.compressions=[none,int8]")
    buckets = tune.get("bucket_cap_mb")
    if not isinstance(buckets, list) or not buckets or any(
            b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1) for b in buckets):
        raise ConfigError(f"tune.bucket_cap_mb={buckets} is not valid: it must be a non-empty list of positive "
                          "whole numbers of MB or null (torch's 25). Set it like tune.bucket_cap_mb=[null,1,100].")
    for key, low in (("steps", 1), ("warmup_steps", 0), ("rounds", 1), ("first_warmup_steps", 0)):
        value = tune.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"tune.{key}={value} is not valid: it must be a whole number >= {low}. Set it like "
                              f"tune.{key}={3 if low else 1}.")
    gain = tune.get("min_gain")
    if isinstance(gain, bool) or not isinstance(gain, (int, float)) or not math.isfinite(gain) or gain < 0:
        raise ConfigError(f"tune.min_gain={gain} is not valid: it must be a number >= 0 (0.03: leave plain DDP "
                          "only for a configuration 3% faster). Set it like tune.min_gain=0.03.")
    for key, default in (("noise_margin", 1), ("paired_margin", 2)):
        margin = tune.get(key, default)
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin) or margin < 0:
            raise ConfigError(f"tune.{key}={margin} is not valid: it must be a number >= 0 (standard errors of the "
                              "measured difference a candidate must beat plain DDP by; 0: tune.min_gain alone). Set "
                              f"it like tune.{key}={default}.")
    budget = tune.get("budget", 0.0)
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 <= budget < 1:
        raise ConfigError(f"tune.budget={budget} is not valid: it must be a number >= 0 and < 1 (the share of the "
                          "planned training a long run's paired rounds may take; 0: none). Set it like "
                          "tune.budget=0.04.")
    planned = tune.get("planned_steps")
    if planned is not None and (isinstance(planned, bool) or not isinstance(planned, int) or planned < 1):
        raise ConfigError(f"tune.planned_steps={planned} is not valid: it must be a whole number >= 1 or null "
                          "(trainer.max_steps). Set it like tune.planned_steps=20000.")
    recheck = tune.get("recheck_best")
    if recheck is not None and (isinstance(recheck, bool) or not isinstance(recheck, int) or recheck < 0):
        raise ConfigError(f"tune.recheck_best={recheck} is not valid: it must be a whole number >= 0 or null (every "
                          "candidate). Set it like tune.recheck_best=2.")
    for key in ("prune", "staged"):
        if not isinstance(tune.get(key, False), bool):
            raise ConfigError(f"tune.{key}={tune.get(key)} is not valid: it must be true or false. Set it like "
                              f"tune.{key}=false.")
    keep = tune.get("keep") or []
    unknown = [k for k in keep if k not in DIMENSIONS]
    if unknown:
        raise ConfigError(f"tune.keep={keep} names {unknown}, which calibration does not choose. List some of "
                          f"{', '.join(DIMENSIONS)}, e.g. tune.keep=[compression].")
    reason = nothing_to_choose(cfg, experts)
    if reason is not None and mode != "auto":  # auto: train as configured (calibrated_config says why)
        raise ConfigError(reason)


def check_pipeline(cfg: DictConfig) -> None:
    """A pipeline run (``strategy.pipeline_parallel_size`` > 1), before any process starts: the size divides the
    processes, and so does a tensor- or expert-parallel size inside its stages (:func:`check_stage_model_parallel`).
    ``tune=none`` trains it with the compression set (the stages' data-parallel exchange compressed); a calibration
    has one configuration, uncompressed, so a compression forced on it is an error pointing to ``tune=none``. The
    strategy finds the first and the last only in the running ranks."""
    pp = pipeline_size(cfg)
    if pp == 1:
        return
    per_node, nodes = processes(cfg)
    if cfg.trainer.get("devices", 1) not in ("auto", -1, "-1") and (per_node * nodes) % pp:
        raise ConfigError(f"strategy.pipeline_parallel_size={pp} does not divide the run's {per_node * nodes} "
                          f"process(es) (trainer.devices={cfg.trainer.get('devices')}, trainer.num_nodes={nodes}). "
                          f"Train with a multiple of {pp} processes, or set strategy.pipeline_parallel_size=1.")
    check_stage_model_parallel(cfg, pp, per_node * nodes)
    compression = compression_of(cfg)
    if cfg.tune.mode != "none" and compression != "none" and "compression" in forced_settings(cfg, task_overrides()):
        raise ConfigError(f"compression={compression} (kept on the command line or in tune.keep) with "
                          f"strategy.pipeline_parallel_size={pp} and tune={cfg.tune.mode}: the calibration of a "
                          "pipeline has one configuration, uncompressed. Pass tune=none to train the pipeline with "
                          f"compression={compression}, or leave compression out.")


def check_stage_model_parallel(cfg: DictConfig, pp: int, num_processes: int) -> None:
    """Tensor or expert parallelism inside the stages of a pipeline: one of them (a number; ``auto`` is 1 under a
    pipeline), and with the pipeline dividing the processes."""
    sizes = {key: cfg.strategy.get(key, 1) for key in ("tensor_parallel_size", "expert_parallel_size")}
    used = {key: value for key, value in sizes.items() if value not in (1, "auto")}
    if len(used) == 2 or any(not isinstance(value, int) for value in used.values()):
        named = " and ".join(f"strategy.{key}={value}" for key, value in used.items())
        raise ConfigError(f"{named} with strategy.pipeline_parallel_size={pp} is not supported: a pipeline stage "
                          "composes with tensor or expert parallelism given as a number, not both (docs/pipeline.md). "
                          "Set one of them to 1, or strategy.pipeline_parallel_size=1.")
    for key, value in used.items():
        if cfg.trainer.get("devices", 1) not in ("auto", -1, "-1") and num_processes % (pp * value):
            raise ConfigError(f"strategy.pipeline_parallel_size={pp} x strategy.{key}={value} does not divide the "
                              f"run's {num_processes} process(es): each pipeline stage holds {value} or a multiple "
                              f"of ranks. Train with a multiple of {pp * value} processes, or lower strategy.{key}.")


def pipeline_reason(cfg: DictConfig) -> str | None:
    """Why a pipeline run leaves the calibration one configuration (:func:`pipeline_configuration`); ``None``
    without a pipeline."""
    pp = pipeline_size(cfg)
    if pp == 1:
        return None
    return (f"a pipeline (strategy.pipeline_parallel_size={pp}) is kept as set, on the hybrid strategy, uncompressed "
            "(tune=none trains it with the compression set), with the tensor- or expert-parallel size set")


def nothing_to_choose(cfg: DictConfig, experts: int = 0) -> str | None:
    """Why a calibration of ``cfg`` has nothing to choose from (one process; a pipeline; one configuration left
    once the forced settings are kept), as the paragraph of the error; ``None`` when it has."""
    mode = cfg.tune.mode
    per_node, nodes = processes(cfg)
    if per_node * nodes < 2:
        return (f"tune={mode} compares multi-process configurations, but this run has one process "
                f"(trainer.devices={cfg.trainer.get('devices')}, trainer.num_nodes={nodes}). Train with two or more "
                "processes (trainer.devices=2), or pass tune=none.")
    pipeline = pipeline_reason(cfg)
    if pipeline is not None:
        only = " ".join(pipeline_configuration(cfg).overrides())
        return (f"tune={mode} has nothing to choose from: {pipeline}, which leaves only {only}. Pass tune=auto "
                "(or tune=none compression=none) to train the pipeline, or strategy.pipeline_parallel_size=1 to "
                "calibrate.")
    forced = forced_settings(cfg, task_overrides())
    found = configurations(cfg, forced, experts)
    if len(found) >= 2:
        return None
    kept = describe_forced(cfg, forced) or "nothing"
    only = f"which leaves only {found[0].name}" if found else "which leaves no configuration"
    return (f"tune={mode} has nothing to choose from: the run keeps {kept} (set on the command line or in "
            f"tune.keep) and tries strategies {list(cfg.tune.strategies)} x compressions "
            f"{list(cfg.tune.compressions)}, {only}. Drop one of the kept settings, "
            "widen tune.strategies/tune.compressions, or pass tune=none to train as set.")
