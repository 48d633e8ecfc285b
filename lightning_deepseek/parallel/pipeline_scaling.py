"""FP16 loss scaling under a pipeline: the scale each micro-batch's loss is multiplied by, and one overflow verdict
for every rank.

A pipeline runs each micro-batch's backward inside its schedule, where the precision plugin never sees the loss
(Lightning's ``pre_backward`` would scale it): the strategy multiplies each micro-batch's loss by the plugin's current
scale instead (:func:`loss_scale`, through the runner's ``grad_scale``). The plugin's own ``optimizer_step`` then
unscales after the closure (after the ``dp`` exchange, before clipping) and skips the step on an overflow, as
without a pipeline. The ranks of a pipeline hold different stages, so an overflow in one stage's gradients must
skip the step on every rank: the verdict is all-reduced over the world.

Supports: ``StagedPrecision``'s FP16 stages (its scaler all-reduces the verdict over the world already) and
Lightning's ``MixedPrecision("16-mixed")``, whose ``torch.amp.GradScaler`` decides per rank:
:func:`prepare_loss_scaling` replaces it with torch's ``ShardedGradScaler`` (the same scale, growth and backoff, the
same state-dict format; it all-reduces ``found_inf`` over the world in ``unscale_``). Costs: one host read of the
scale per training batch ('16-mixed'), the scalers' own all-reduce of one value per optimizer step. Does not support:
other plugins with a ``scaler`` (refused at setup, naming the plugin).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from lightning_deepseek.precision import StagedPrecision

__all__ = ["loss_scale", "prepare_loss_scaling"]


def prepare_loss_scaling(plugin: Precision, pp_size: int) -> None:
    """Make ``plugin``'s loss scaler decide for all ranks at once (``'16-mixed'``: a world ``ShardedGradScaler``).

    Raises:
        ValueError: a plugin with a scaler this module does not know how to drive under a pipeline.
    """
    scaler = getattr(plugin, "scaler", None)
    if scaler is None or isinstance(plugin, StagedPrecision) or isinstance(scaler, ShardedGradScaler):
        return
    if not isinstance(scaler, torch.amp.GradScaler):
        raise ValueError(
            f"{type(plugin).__name__} has a loss scaler ({type(scaler).__name__}) and pipeline_parallel_size={pp_size} "
            "runs the backward inside the schedule: only StagedPrecision and Lightning's precision='16-mixed' are "
            "scaled there. Use one of those, precision='bf16-mixed' or '32-true', or pipeline_parallel_size=1.")
    if scaler.is_enabled():
        plugin.scaler = ShardedGradScaler(
            device=scaler._device,  # GradScaler keeps its device type only under this name
            init_scale=scaler.get_scale(), growth_factor=scaler.get_growth_factor(),
            backoff_factor=scaler.get_backoff_factor(), growth_interval=scaler.get_growth_interval(),
            process_group=dist.group.WORLD)


def loss_scale(plugin: Precision, device: torch.device) -> float:
    """The factor of each micro-batch's loss this training batch: the plugin's FP16 scale, 1 without scaling."""
    scaler = getattr(plugin, "scaler", None)
    if scaler is None:
        return 1.0
    if isinstance(plugin, StagedPrecision):
        return plugin.loss_scale if plugin.scaling else 1.0
    if not scaler.is_enabled():
        return 1.0
    # scale() makes GradScaler's scale tensor on first use (unscale_ needs it); its value is the factor
    return float(scaler.scale(torch.ones((), device=device)))
