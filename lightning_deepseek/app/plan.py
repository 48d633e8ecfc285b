"""``lds-plan``: the planning library (:mod:`lightning_deepseek.planning`) as a Hydra application.

Resolves ``model=`` (a preset of ``conf/plan/presets/model``, ``lds-<preset>`` for this package's GPT presets, or
a local transformers ``config.json``) and ``cluster=`` (a preset of ``conf/plan/presets/cluster`` or a user's YAML
file), plans the layout the ``strategy.*`` settings give (``layout=manual``) or searches every supported one
(``layout=auto``), with ``compression=`` (``none``, ``int8``, ``int4``: ``GradientCompression`` as lds-train's
presets set it) on DDP's buckets or a pipeline's replicated stages, and prints a table or JSON (``output=json``). An
unknown preset, a cluster file lacking a field, a layout the world size cannot hold, or a model that fits no layout
end in one paragraph on stderr and exit code 2.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import hydra
import yaml
from omegaconf import DictConfig, OmegaConf

from lightning_deepseek.app.errors import ConfigError, user_errors_exit

# Its own config folder: the train app's conf/ has a ``model`` group, which would capture ``model=...`` here.
CONFIG_DIR = Path(__file__).resolve().parent / "conf" / "plan"
PRESETS_DIR = CONFIG_DIR / "presets"
PLAN_ERROR_PREFIX = "lds-plan: error: "
LDS_PREFIX = "lds-"
COMPRESSION_BITS = {"none": None, "int8": 8, "int4": 4}  # lds-train's compression= presets: their bits


def _presets(folder: str) -> list[str]:
    return sorted(path.stem for path in (PRESETS_DIR / folder).glob("*.yaml"))


def model_presets() -> list[str]:
    """Every name ``model=`` accepts besides a path."""
    from lightning_deepseek.models.config import PRESETS

    return _presets("model") + [f"{LDS_PREFIX}{name}" for name in PRESETS]


def resolve_model(name: str) -> Any:
    """The ``ModelSpec`` of ``model=``."""
    from lightning_deepseek.models.config import PRESETS
    from lightning_deepseek.planning import ModelSpec

    if name.startswith(LDS_PREFIX) and name[len(LDS_PREFIX):] in PRESETS:
        return ModelSpec(name, "lds", dict(PRESETS[name[len(LDS_PREFIX):]]))
    preset = PRESETS_DIR / "model" / f"{name}.yaml"
    if preset.is_file():
        spec = yaml.safe_load(preset.read_text())
        return ModelSpec(name, spec["source"], spec["config"])
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".json":
        return ModelSpec.from_config_json(path)
    raise ConfigError(f"model={name!r} is neither a preset nor a transformers config.json file. Presets: "
                      f"{', '.join(model_presets())}; or pass the path of a config.json.")


def resolve_cluster(name: str) -> Any:
    """The ``ClusterSpec`` of ``cluster=``."""
    from lightning_deepseek.planning import ClusterSpec

    preset = PRESETS_DIR / "cluster" / f"{name}.yaml"
    path = preset if preset.is_file() else Path(name).expanduser()
    if not path.is_file():
        raise ConfigError(f"cluster={name!r} is neither a preset nor a YAML file. Presets: "
                          f"{', '.join(_presets('cluster'))}; or pass the path of a file with their fields "
                          f"(see {PRESETS_DIR / 'cluster' / 'h100.yaml'}).")
    spec = yaml.safe_load(path.read_text())
    if not isinstance(spec, dict):
        raise ConfigError(f"cluster file {path} holds no mapping: copy {PRESETS_DIR / 'cluster' / 'h100.yaml'}.")
    return ClusterSpec.from_mapping(spec, str(path))


def run_plan(cfg: DictConfig) -> int:
    """Plan or search as ``cfg`` says, print the result; the exit code."""
    from lightning_deepseek.planning import PlanLayout, StepShape, plan
    from lightning_deepseek.planning.search import search

    if cfg.layout not in ("manual", "auto") or cfg.output not in ("table", "json"):
        raise ConfigError(f"layout={cfg.layout!r} must be manual or auto, output={cfg.output!r} table or json.")
    if cfg.compression not in COMPRESSION_BITS:
        raise ConfigError(f"compression={cfg.compression!r} must be one of {', '.join(map(str, COMPRESSION_BITS))} "
                          "(lds-train's compression presets; layout=auto plans each).")
    if not isinstance(cfg.world_size, int) or cfg.world_size < 1:
        raise ConfigError(f"world_size={cfg.world_size!r} must be a positive integer.")
    workers = _workers(cfg.workers)
    time_limit = _time_limit(cfg.time_limit)
    model, cluster = resolve_model(str(cfg.model)), resolve_cluster(str(cfg.cluster))
    s = cfg.strategy
    step = StepShape(**OmegaConf.to_container(cfg.step), min_shard_params=s.min_shard_params,
                     bucket_cap_mb=s.bucket_cap_mb)
    if cfg.layout == "manual":
        layout = PlanLayout(s.tensor_parallel_size, s.expert_parallel_size, s.shard_optimizer_states, s.placement,
                            s.data_parallel_shard_size, s.reshard_after_forward, s.activation_checkpointing,
                            s.pipeline_parallel_size, s.pipeline_schedule, s.pipeline_microbatches,
                            COMPRESSION_BITS[cfg.compression], s.sequence_parallel, s.loss_parallel)
        report = plan(model, cfg.world_size, layout, cluster, step, cfg.depth)
        print(json.dumps(report.to_dict(), indent=1) if cfg.output == "json" else report.table())
        return 0
    result = search(model, cfg.world_size, cluster, step, depth=cfg.depth, top=cfg.top, workers=workers,
                    progress=_progress(cfg.world_size), time_limit=time_limit)
    if cfg.output == "json":
        print(json.dumps({"fitting": [r.to_dict() for r in result.fitting],
                          "not_fitting": [r.to_dict() for r in result.not_fitting],
                          "rejected": [{"layout": vars(layout), "reason": why} for layout, why in result.rejected],
                          "pruned": [{"layout": vars(layout), "reason": why} for layout, why in result.pruned],
                          "unplanned": [vars(layout) for layout in result.unplanned]},
                         indent=1))
    else:
        print(_search_table(result, cfg.top))
    if not result.fitting:
        raise ConfigError(_fits_nothing(result, model.name, cfg.world_size, cluster, time_limit))
    return 0


def _time_limit(value: Any) -> float | None:
    """``time_limit=``: null or a positive number of seconds."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(f"time_limit={value!r} must be a positive number of seconds after which layout=auto plans "
                          "no further layout, or null to plan every layout.")
    return float(value)


def _workers(value: Any) -> int:
    """``workers=``: ``auto`` (one per CPU core this process may use) or a positive integer."""
    if value == "auto":
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"workers={value!r} must be auto (one process per CPU core) or a positive integer "
                          "(processes planning layouts side by side; 1: in this process).")
    return value


def _progress(world_size: int) -> Any:
    """A line on stderr per plan of a search: a long search's progress (stdout holds the result only)."""
    started, count = time.perf_counter(), [0]

    def report(plan: Any) -> None:
        count[0] += 1
        print(f"lds-plan: {count[0]} planned, {time.perf_counter() - started:.0f} s: "
              f"{plan.layout.describe(world_size)} {'fits' if plan.fits else 'does not fit'}", file=sys.stderr,
              flush=True)

    return report


def _search_table(result: Any, top: int) -> str:
    lines = ["| rank | layout | step s | tokens/s/GPU | MFU | peak GiB | why |", "|---|---|---|---|---|---|---|"]
    for i, report in enumerate(result.fitting[:top], 1):
        lines.append(f"| {i} | {report.layout.describe(report.world_size)} | {report.step_seconds:.3f} | "
                     f"{report.tokens_per_second_per_gpu:,.0f} | {report.mfu:.1%} | "
                     f"{report.memory.steady_peak / 2**30:.1f} | "
                     f"{result.why(report)} |")
    counts = (f"{len(result.fitting)} layouts fit, {len(result.not_fitting)} do not, {len(result.rejected)} refused "
              f"by the strategy, {len(result.pruned)} not planned (their model states alone exceed the device, the "
              f"same layout recomputing more did not fit, or their compute and tp / ep collectives alone, per token, "
              f"exceed the time of the {top} fastest)")
    refused = [f"- {layout.describe(0).split(' ', 1)[1]}: {why}" for layout, why in result.rejected[:5]]
    left = [f"time_limit ended the search: {len(result.unplanned)} layouts neither planned nor ruled out by a bound; "
            "the ranking covers the planned layouts only (a larger time_limit, or null, plans them)"
            ] if result.unplanned else []
    return "\n".join([*lines, "", counts, *left, *refused])


def _fits_nothing(result: Any, model: str, world_size: int, cluster: Any, time_limit: float | None) -> str:
    if result.unplanned and not result.not_fitting:
        return (f"time_limit={time_limit:g} s ended the search before a layout of {world_size} ranks fit {model}: "
                f"{len(result.unplanned)} layouts were not planned. Raise time_limit, or set it to null.")
    if not result.not_fitting:
        return f"no layout of {world_size} ranks could be planned for {model}: every candidate was refused."
    closest = result.not_fitting[0]
    over = (closest.memory.steady_peak - closest.memory_capacity) / 2**30
    return (f"{model} fits no supported layout on {world_size} x {cluster.name}: the closest, "
            f"{closest.layout.describe(world_size)}, needs {closest.memory.steady_peak / 2**30:.1f} GiB per rank, "
            f"{over:.1f} GiB more than the {closest.memory_capacity / 2**30:.1f} GiB of a device. Closer: more ranks "
            f"(world_size), a shorter step (step.micro_batch_size, step.seq_len), or a larger device (cluster)."
            + (f" time_limit={time_limit:g} s left {len(result.unplanned)} layouts unplanned." if result.unplanned
               else ""))


@hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="plan")
@user_errors_exit(PLAN_ERROR_PREFIX)
def _plan_app(cfg: DictConfig) -> None:
    code = run_plan(cfg)
    if code:
        sys.exit(code)


def main() -> None:
    """``lds-plan``."""
    _plan_app()
