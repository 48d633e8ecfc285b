"""``DynamicLossScaler``: FP16 loss scaling with hysteresis, a floor and one decision shared by all ranks.

Supports: gradients on any device (CPU or CUDA), plain tensors and ``DTensor`` (the local shard is unscaled),
any number of optimizer parameter groups, gradient accumulation (the scale only changes at optimizer steps).

Costs: one fused unscale-and-check kernel per (device, dtype) group of gradients, as in ``torch.amp``, plus one
all-reduce of a single float and one host sync per optimizer step (``torch.amp.GradScaler.step`` also syncs).

Does not support: optimizers that unscale inside ``step`` (fused Adam with a scaler), sparse gradients.

GradScaler-like surface: ``unscale_(optimizer)``, ``get_scale()``, ``get_growth_factor()``,
``get_backoff_factor()``, ``get_growth_interval()``, ``is_enabled()``, ``state_dict()`` / ``load_state_dict()``.
Differences: the loss is scaled by ``scale_loss(loss)`` (the attribute ``scale`` holds the value, where GradScaler
has a method), ``unscale_`` returns the (all-ranks) overflow verdict, and ``update(found_inf)`` takes it instead of
reading per-optimizer state, because the plugin decides once per step for all ranks; there is no ``step()`` (the
plugin calls ``optimizer.step()`` itself when no rank overflowed). ``state_dict()`` has its own keys (the scale,
calibration and the consecutive counters), not GradScaler's, so one scaler's checkpoint does not load into the
other.

Why not ``torch.amp.GradScaler``: it backs off on every overflow (no hysteresis), has no lower bound on the
scale (a model that overflows in the forward pass drives it to zero instead of saying so), and decides per rank:
its ``unscale_`` does not all-reduce ``found_inf``, so a rank whose gradients alone overflow (after the DDP
reduction, for example in a tensor-parallel shard or a hook) skips while the others step. Here the overflow flag
is all-reduced over the default process group, so every rank skips, backs off and grows at the same steps and
the scaler state stays identical everywhere.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer


class LossScalerConfigError(ValueError):
    """A loss-scaler argument is out of range; the message names it and the fix."""


def _local(grad: torch.Tensor) -> torch.Tensor:
    # A DTensor gradient is unscaled through its local shard; the found-inf all-reduce covers the other shards.
    return grad.to_local() if hasattr(grad, "to_local") else grad


class DynamicLossScaler:
    """Dynamic loss scale for FP16 autocast.

    On an overflow the step is skipped; the scale is multiplied by ``backoff_factor`` once ``hysteresis``
    consecutive overflows have been seen (and on every further consecutive one), never below ``min_scale``.
    Until the first finite step the scale is still being calibrated, so every overflow backs off at once.
    After ``growth_interval`` consecutive finite steps the scale is multiplied by ``growth_factor`` (at most
    ``max_scale``).

    Args:
        init_scale: starting scale.
        growth_factor: multiplier after ``growth_interval`` finite steps (> 1).
        backoff_factor: multiplier on a back-off (in (0, 1)).
        growth_interval: consecutive finite steps before growing.
        hysteresis: consecutive overflows before the first back-off (1 behaves like ``torch.amp.GradScaler``).
        min_scale: floor of the scale; reaching it is the signal that FP16 cannot train this model.
        max_scale: ceiling of the scale.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
    ) -> None:
        checks = [
            ("growth_factor", growth_factor, growth_factor > 1, "a value > 1, e.g. 2.0"),
            ("backoff_factor", backoff_factor, 0 < backoff_factor < 1, "a value in (0, 1), e.g. 0.5"),
            ("growth_interval", growth_interval, growth_interval >= 1, "a positive integer, e.g. 1000"),
            ("hysteresis", hysteresis, hysteresis >= 1, "a positive integer (1 = back off on every overflow)"),
            ("min_scale", min_scale, 0 < min_scale <= init_scale, f"a positive value <= init_scale={init_scale}"),
            ("max_scale", max_scale, max_scale >= init_scale, f"a value >= init_scale={init_scale}"),
        ]
        for name, value, ok, fix in checks:
            if not ok:
                raise LossScalerConfigError(f"Loss scaler `{name}={value}` is out of range. Use {fix}.")
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.min_scale = min_scale
        self.max_scale = max_scale
        self.scale = float(init_scale)
        self.calibrated = False
        self.num_consecutive_overflows = 0
        self.num_consecutive_finite = 0

    @property
    def at_floor(self) -> bool:
        """Whether the scale has been driven down to ``min_scale``."""
        return self.scale <= self.min_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale``, for the backward pass."""
        return loss * self.scale

    def get_scale(self) -> float:
        """The current scale (as ``torch.amp.GradScaler.get_scale``)."""
        return self.scale

    def get_growth_factor(self) -> float:
        return self.growth_factor

    def get_backoff_factor(self) -> float:
        return self.backoff_factor

    def get_growth_interval(self) -> int:
        return self.growth_interval

    def is_enabled(self) -> bool:
        """Always True: the plugin decides per stage whether the scaler is used (``StagedPrecision.scaling``)."""
        return True

    def unscale_(self, optimizer: Optimizer) -> bool:
        """Divide every gradient of ``optimizer`` by the scale in place; return whether any rank overflowed.

        Collective: every rank of the default process group must call it at the same step.
        """
        grads: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    grad = _local(param.grad)
                    grads[(grad.device, grad.dtype)].append(grad)
        device = next(iter(grads))[0] if grads else torch.device("cpu")
        found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        # Same reciprocal as torch.amp.GradScaler (computed in float64, rounded to float32), so an FP16-only
        # run matches GradScaler bit for bit when hysteresis=1.
        inv_scale = torch.full((1,), 1.0 / self.scale, dtype=torch.float64, device=device).float()
        for (grad_device, _), tensors in grads.items():
            found = found_inf if grad_device == device else torch.zeros_like(found_inf, device=grad_device)
            # GradScaler's own fused check-and-unscale kernel; torch exposes no public equivalent
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, inv_scale.to(grad_device))
            if found is not found_inf:
                found_inf += found.to(device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        return bool(found_inf.item() > 0)

    def update(self, found_inf: bool) -> None:
        """Advance the scale after a step (skipped when ``found_inf``)."""
        if found_inf:
            self.num_consecutive_finite = 0
            self.num_consecutive_overflows += 1
            if not self.calibrated or self.num_consecutive_overflows >= self.hysteresis:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self.calibrated = True
        self.num_consecutive_overflows = 0
        self.num_consecutive_finite += 1
        if self.num_consecutive_finite >= self.growth_interval:
            self.num_consecutive_finite = 0
            self.scale = min(self.scale * self.growth_factor, self.max_scale)

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "calibrated": self.calibrated,
            "num_consecutive_overflows": self.num_consecutive_overflows,
            "num_consecutive_finite": self.num_consecutive_finite,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        scale = float(state_dict["scale"])
        if not (math.isfinite(scale) and scale > 0):
            raise LossScalerConfigError(f"Checkpointed loss scale {scale} is not a positive finite number; "
                                        "the checkpoint is corrupt. Resume from an earlier checkpoint.")
        self.scale = scale
        self.calibrated = bool(state_dict["calibrated"])
        self.num_consecutive_overflows = int(state_dict["num_consecutive_overflows"])
        self.num_consecutive_finite = int(state_dict["num_consecutive_finite"])
