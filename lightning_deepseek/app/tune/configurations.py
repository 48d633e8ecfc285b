"""The configurations ``lds-train tune=...`` measures: which ones, and how one is applied to the run's config.

A :class:`Configuration` is one system configuration (strategy, tensor- and expert-parallel sizes, gradient
compression, DDP bucket size), spelt as the ``lds-train`` overrides that select it, so that the chosen one can be
replayed as a direct run (``lds-train <its overrides> tune=none``) with the same losses. :func:`configurations`
enumerates them from the ``tune`` group's lists; a setting the user forced (on the command line, or listed in
``tune.keep``) is taken from the run's own config instead of being enumerated. Plain DDP without compression
(the baseline every table compares with) is always measured first, as a reference when the forced settings rule
it out. A pipeline (``strategy.pipeline_parallel_size`` > 1) is never chosen nor dropped by the calibration: it
leaves one configuration (:func:`pipeline_configuration`), so ``tune=auto`` trains with it uncalibrated.

This module imports neither torch nor Lightning: the launching process checks ``tune`` with it before anything
heavy is loaded.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
DIMENSIONS = ("strategy", "tensor_parallel_size", "expert_parallel_size", "compression", "bucket_cap_mb")
HYBRID_TARGET = "lightning_deepseek.HybridParallelStrategy"


@dataclass(frozen=True)
class Configuration:
    """One system configuration.

    Args:
        strategy: ``ddp`` (Lightning's DDP) or ``hybrid`` (``HybridParallelStrategy``).
        tensor_parallel_size: the ``tp`` size of ``hybrid`` (``None`` for ``ddp``).
        expert_parallel_size: the ``ep`` size of ``hybrid`` on MoE models (``None``: the config's).
        compression: ``none``, ``int8`` or ``int4`` (an option of the ``compression`` group).
        bucket_cap_mb: DDP's bucket size in MB (``None``: torch's default, 25).
        micro_batch_tokens: ``hybrid``'s tokens per rank and micro-batch, from which it places ``tp`` inside or
            across nodes (not part of the name: the run's own batch, so that a calibrated hybrid is placed as its
            training will be, not by the strategy's 2048-token default).
    """

    strategy: str = "ddp"
    tensor_parallel_size: int | str | None = None
    expert_parallel_size: int | str | None = None
    compression: str = "none"
    bucket_cap_mb: int | None = None
    micro_batch_tokens: int | None = None

    @property
    def name(self) -> str:
        parts = [self.strategy]
        if self.tensor_parallel_size is not None:
            parts.append(f"tp{self.tensor_parallel_size}")
        if self.expert_parallel_size is not None:
            parts.append(f"ep{self.expert_parallel_size}")
        parts.append(self.compression)
        if self.bucket_cap_mb is not None:
            parts.append(f"bucket{self.bucket_cap_mb}")
        return "/".join(parts)

    @property
    def is_plain_ddp(self) -> bool:
        return self == PLAIN_DDP

    def overrides(self) -> list[str]:
        """The ``lds-train`` overrides that select this configuration (add ``tune=none`` to replay it)."""
        out = [f"strategy={self.strategy}"]
        if self.tensor_parallel_size is not None:
            out.append(f"strategy.tensor_parallel_size={self.tensor_parallel_size}")
        if self.expert_parallel_size is not None:
            out.append(f"strategy.expert_parallel_size={self.expert_parallel_size}")
        out.append(f"compression={self.compression}")
        if self.bucket_cap_mb is not None:
            out.append(f"+strategy.bucket_cap_mb={self.bucket_cap_mb}")
        if self.micro_batch_tokens is not None:
            out.append(f"strategy.micro_batch_tokens={self.micro_batch_tokens}")
        return out

    def apply(self, cfg: DictConfig) -> DictConfig:
        """A copy of ``cfg`` with this configuration's ``strategy`` and ``compression`` groups (the user's other
        settings of a group kept when the group stays the same)."""
        out = copy.deepcopy(cfg)
        OmegaConf.set_struct(out, False)
        if strategy_of(cfg) != self.strategy:
            out.strategy = OmegaConf.load(CONF_DIR / "strategy" / f"{self.strategy}.yaml")
        if self.tensor_parallel_size is not None:
            out.strategy.tensor_parallel_size = self.tensor_parallel_size
        if self.expert_parallel_size is not None:
            out.strategy.expert_parallel_size = self.expert_parallel_size
        if self.bucket_cap_mb is not None:
            out.strategy.bucket_cap_mb = self.bucket_cap_mb
        if self.micro_batch_tokens is not None:
            out.strategy.micro_batch_tokens = self.micro_batch_tokens
        if compression_of(cfg) != self.compression:
            out.compression = OmegaConf.load(CONF_DIR / "compression" / f"{self.compression}.yaml")
        return out


PLAIN_DDP = Configuration()


def strategy_of(cfg: DictConfig) -> str:
    """``ddp`` or ``hybrid``: the strategy a composed config selects."""
    return "hybrid" if cfg.strategy.get("_target_") == HYBRID_TARGET else "ddp"


def compression_of(cfg: DictConfig) -> str:
    """``none``, ``int8`` or ``int4``: the compression a composed config selects."""
    callback = cfg.compression.get("callback")
    return "none" if callback is None else f"int{callback.get('bits')}"


def current(cfg: DictConfig) -> Configuration:
    """The configuration ``cfg`` itself selects (the values of the forced settings come from here)."""
    hybrid = strategy_of(cfg) == "hybrid"
    return Configuration(strategy_of(cfg),
                     cfg.strategy.get("tensor_parallel_size") if hybrid else None,
                     cfg.strategy.get("expert_parallel_size") if hybrid else None,
                     compression_of(cfg), cfg.strategy.get("bucket_cap_mb"))


def forced_settings(cfg: DictConfig, task_overrides: list[str]) -> list[str]:
    """The dimensions the user fixed: named in ``tune.keep`` or set by a command-line override."""
    forced = set(cfg.tune.get("keep") or [])
    for override in task_overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key == "strategy":
            forced.add("strategy")
        elif key.startswith("strategy.") and key.split(".", 1)[1] in DIMENSIONS:
            forced.add(key.split(".", 1)[1])
        elif key == "compression" or key.startswith("compression."):
            forced.add("compression")
    return [d for d in DIMENSIONS if d in forced]


def processes(cfg: DictConfig) -> tuple[int, int]:
    """(processes per node, nodes) of the ``trainer`` group; a device list counts its entries."""
    devices = cfg.trainer.get("devices", 1)
    if isinstance(devices, str):
        devices = len(devices.strip(",").split(",")) if "," in devices else (1 if devices == "auto" else int(devices))
    elif not isinstance(devices, int):
        devices = len(devices)
    return max(int(devices), 1), int(cfg.trainer.get("num_nodes", 1) or 1)


def pipeline_size(cfg: DictConfig) -> int:
    """``strategy.pipeline_parallel_size`` of a hybrid run (1: no pipeline; DDP has none)."""
    size = cfg.strategy.get("pipeline_parallel_size", 1) if strategy_of(cfg) == "hybrid" else 1
    return size if isinstance(size, int) and not isinstance(size, bool) else 1  # the strategy names a bad value


def pipeline_configuration(cfg: DictConfig) -> Configuration:
    """The one configuration of a pipeline run: the hybrid strategy as composed (its pipeline, and the tensor- and
    expert-parallel sizes a stage takes: 1 or auto), uncompressed (compression replaces DDP's all-reduce, and a
    pipeline averages its stages' gradients without DDP), with the run's own bucket size (no DDP bucket under a
    pipeline: nothing to time)."""
    return Configuration("hybrid", compression="none", bucket_cap_mb=current(cfg).bucket_cap_mb)


def micro_batch_tokens(cfg: DictConfig) -> int:
    """Tokens per rank and micro-batch of the run: ``data.batch_size`` sequences of ``data.block_size`` (else the
    model's) tokens, or the strategy's own ``micro_batch_tokens`` where the run sets it."""
    from lightning_deepseek.models.config import PRESETS

    own = cfg.strategy.get("micro_batch_tokens")
    if own is not None:
        return int(own)
    block = cfg.data.get("block_size") or cfg.model.get("block_size") or PRESETS[cfg.model.preset]["block_size"]
    return int(cfg.data.batch_size) * int(block)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def configurations(cfg: DictConfig, forced: list[str], experts: int = 0) -> list[Configuration]:
    """The configurations to choose from, plain DDP first when it is one.

    Enumerated from ``tune.strategies``, ``tune.compressions`` and ``tune.bucket_cap_mb``: hybrid takes each
    ``tp`` that divides the processes per node (> 1; MoE models also 1), and for MoE models each ``ep`` that
    divides the world size and ``experts`` (routed experts per MoE layer; 0: a dense model), except tp=1 with
    ep=1 (DDP's layout). Compression pairs with hybrid at any ``tp``:
    its data-parallel part (everything not sharded) spans every rank. A combination a strategy refuses at set-up
    is a ``failed`` row of the calibration, not an error. A pipeline run has one: :func:`pipeline_configuration`.
    """
    if pipeline_size(cfg) > 1:
        return [pipeline_configuration(cfg)]
    per_node, nodes = processes(cfg)
    own = current(cfg)
    strategies = [own.strategy] if "strategy" in forced else list(cfg.tune.strategies)
    compressions = [own.compression] if "compression" in forced else list(cfg.tune.compressions)
    buckets = [own.bucket_cap_mb] if "bucket_cap_mb" in forced else list(cfg.tune.get("bucket_cap_mb") or [None])
    tokens = micro_batch_tokens(cfg) if "hybrid" in strategies else None
    found: list[Configuration] = []
    for strategy in strategies:
        if strategy == "hybrid":
            # tp=1 only for MoE models, where it still shards the experts (ep > 1); tp=1 with ep=1 is DDP's layout.
            tps = [own.tensor_parallel_size] if "tensor_parallel_size" in forced else \
                [d for d in _divisors(per_node) if d > 1 or experts]
            eps = [own.expert_parallel_size] if "expert_parallel_size" in forced or not experts else \
                [d for d in _divisors(per_node * nodes) if experts % d == 0]
            shapes = [(tp, ep if experts else None) for tp in tps for ep in eps if experts == 0 or (tp, ep) != (1, 1)]
        else:
            shapes = [(None, None)]
        for (tp, ep), compression, bucket in itertools.product(shapes, compressions, buckets):
            candidate = Configuration(strategy, tp, ep, compression, bucket, tokens if strategy == "hybrid" else None)
            if candidate not in found:
                found.append(candidate)
    found.sort(key=lambda c: not c.is_plain_ddp)  # the baseline first
    return found


def describe_forced(cfg: DictConfig, forced: list[str]) -> str:
    """``compression=int8 (forced)``-style note for the table; empty when nothing is forced."""
    own = current(cfg)
    values = {"strategy": own.strategy, "tensor_parallel_size": own.tensor_parallel_size,
              "expert_parallel_size": own.expert_parallel_size, "compression": own.compression,
              "bucket_cap_mb": own.bucket_cap_mb}
    return ", ".join(f"{d}={values[d]}" for d in forced)
