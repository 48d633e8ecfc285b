"""``StagedPrecision``: a Lightning precision plugin that changes the compute precision during training.

Default schedule: FP32 while training is fragile (first 10% of steps), FP16 autocast with a dynamic loss scaler
(until 80%), BF16 autocast for the rest. One plugin instance serves the whole run: master weights and optimizer
state stay FP32, and a stage change only switches the autocast dtype and whether the loss scaler is active, so
nothing is recast. ``precision`` (the string Lightning reads) is derived from the current stage.

Supports: automatic and manual optimization, gradient accumulation, gradient clipping (on unscaled gradients),
any strategy whose gradients are plain tensors or DTensors (Lightning's ``DDPStrategy``, ``HybridParallelStrategy``),
CPU (autocast float16 and bfloat16) and CUDA. Stage boundaries in optimizer steps, epochs or a fraction of the run.

FP16 fallback: when FP16 keeps overflowing (``fallback_skipped_steps`` skipped steps within ``fallback_window``
steps, counted once the scaler has calibrated, or the scale reaches its floor) the rest of that stage runs in
BF16, or FP32 where the device has no BF16 autocast; the reason is logged and marked in ``events()``. Every rank
takes the decision at the same step because it is derived from the all-reduced overflow flag.

Skipped steps: ``last_step_skipped`` tells callbacks whether the last optimizer step was skipped, and by default
step-interval LR schedulers do not advance on a skipped step (Lightning steps them unconditionally after every
optimizer step; ``torch.amp`` users have long had to detect this by hand). The user's own scheduler objects stay
in place: see :mod:`lightning_deepseek.precision.lr_scheduler`.

Lightning's ``MixedPrecision`` contract: ``autocast_context_manager()``, ``forward_context()``, a ``scaler`` with
``get_scale()`` / ``state_dict()``, and the autocast weight cache disabled as Lightning 2.6 does: with the cache on,
older torch versions let a ``torch.no_grad()`` forward inside the autocast region cache weight casts without autograd
history, so a later forward in the same region lost its graph (torch 2.13 no longer does); the cache only saves
re-casting a weight used more than once per forward. ``device`` is the autocast device type.

State: the schedule, the fallbacks taken, the scaler and the log of stage changes (``events()``). The current stage
is not stored: it is the stage of the last logged change, and at each step the schedule decides from
``trainer.global_step`` and ``trainer.current_epoch`` whether a change is due.

Costs: in FP16 stages one fused unscale kernel, one all-reduce of one float and one host sync per optimizer step.
Does not support: LBFGS or other closure-reevaluating optimizers in FP16 stages, optimizers that unscale
internally (fused Adam with a scaler), true half-precision weights (``16-true``).

FP8: ``Stage("fp8")`` converts the model's ``nn.Linear`` layers to torchao's float8 training at the stage boundary
(and back after it); see :mod:`lightning_deepseek.precision.float8`.

Sharded parameters (FSDP2, ``HybridParallelStrategy(data_parallel_shard_size=N)``): at each stage change the FSDP
units' mixed-precision policy follows the stage (parameters all-gathered in FP16 or BF16, BF16 in FP8 stages,
gradients reduce-scattered in ``fsdp_reduce_dtype``; no policy in FP32 stages), see
:mod:`lightning_deepseek.precision.fsdp_policy`. With an FP8 stage the layers are converted at setup, before the
strategy shards them (``convert_module``), and compute as ``nn.Linear`` (bitwise) until the FP8 stage turns their FP8
GEMMs on; after it, and after ``fit``, they stay converted with FP8 off. Not supported there:
``data_parallel_shard_size="auto"`` (the size is decided after the conversion point) or a model the user shards in
``configure_model``: both are refused at setup.

Why our own plugin: Lightning's ``MixedPrecision`` fixes one dtype for the run and uses ``torch.amp.GradScaler``,
whose limits are listed in :mod:`lightning_deepseek.precision.loss_scaler`.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from collections.abc import Callable, Generator, Sequence
from typing import Any, NamedTuple

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed.fsdp import FSDPModule
from torch.nn import Module
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from lightning_deepseek.precision import float8, fsdp_policy
from lightning_deepseek.precision.float8 import DEFAULT_EXCLUDE, Float8Training
from lightning_deepseek.precision.loss_scaler import DynamicLossScaler
from lightning_deepseek.precision.lr_scheduler import SkippedStepSchedulerGuard
from lightning_deepseek.precision.schedule import AUTOCAST_DTYPES, PrecisionSchedule, default_schedule


class _Event(NamedTuple):
    """One line of the stage log: the optimizer step it takes effect at, its label, the stage it leaves us in."""

    step: int
    label: str
    stage: int


class StagedPrecisionError(ValueError):
    """Bad ``StagedPrecision`` input or a stage the device cannot run; the message names the setting and fix."""


def autocast_supported(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch.autocast(device_type, dtype)`` really computes in ``dtype`` on this machine."""
    if device_type == "cpu":
        return dtype in (torch.float16, torch.bfloat16)
    if device_type == "cuda":
        return dtype == torch.float16 or torch.cuda.is_bf16_supported(including_emulation=False)
    return torch.amp.is_autocast_available(device_type) and dtype == torch.float16


def _lightning_module(model: Module) -> pl.LightningModule:
    # The strategy hands `connect` its wrapped model (DDP, FSDP, compile); the LightningModule is inside.
    while not isinstance(model, pl.LightningModule):
        inner = getattr(model, "module", getattr(model, "_orig_mod", None))
        if not isinstance(inner, Module):
            raise TypeError(f"StagedPrecision needs a LightningModule inside the strategy's model, got {type(model)}.")
        model = inner
    return model


def _will_shard_parameters(strategy: Any) -> bool:
    # The sizes known after setup_environment; an "auto" data_parallel_shard_size counts as 1 until setup decides it.
    # (HybridParallelStrategy's dims, read by name: precision works without the parallel package.)
    dims = getattr(strategy, "parallel_dims", None)
    return bool(getattr(dims, "fsdp_enabled", False))


class StagedPrecision(Precision):
    """Precision schedule (FP32 -> FP16 -> BF16 by default) with a dynamic FP16 loss scaler and fallback.

    Args:
        schedule: stages as ``Stage`` objects, mappings ``{precision, until, unit}`` or tuples; ``None`` for the
            default (FP32 to 10% of steps, FP16 to 80%, then BF16).
        init_scale: initial FP16 loss scale.
        growth_interval: consecutive finite FP16 steps before the scale doubles.
        hysteresis: consecutive overflows before the scale backs off.
        min_scale: floor of the loss scale; reaching it triggers the fallback.
        fallback_skipped_steps: skipped steps within ``fallback_window`` that trigger the fallback (0 disables
            this trigger; the floor still applies).
        fallback_window: window, in optimizer steps, for ``fallback_skipped_steps``.
        skip_lr_scheduler_on_skipped_step: step-interval LR schedulers do not advance on a skipped step.
        device: autocast device type; ``None`` follows the strategy's device.
        fp8_recipe: torchao float8 recipe of ``Stage("fp8")``: ``"tensorwise"``, ``"rowwise"``,
            ``"rowwise_with_gw_hp"`` or a ``torchao.float8.Float8LinearConfig``.
        fp8_exclude: module names whose ``nn.Linear`` layers FP8 stages leave alone (default: head and routers).
        fp8_emulate: emulate FP8 GEMMs; ``None`` emulates on CPU only.
        fsdp_reduce_dtype: dtype of FSDP's gradient reduce-scatter in FP16/BF16 stages when the model is sharded
            (a ``torch.dtype`` or its name, ``"float32"``, ``"bf16"``...; ``None``: the stage's dtype).
    """

    def __init__(
        self,
        schedule: Sequence[Any] | None = None,
        init_scale: float = 2.0**16,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        min_scale: float = 1.0,
        fallback_skipped_steps: int = 10,
        fallback_window: int = 200,
        skip_lr_scheduler_on_skipped_step: bool = True,
        device: str | None = None,
        fp8_recipe: Any = "tensorwise",
        fp8_exclude: Sequence[str] = DEFAULT_EXCLUDE,
        fp8_emulate: bool | None = None,
        fsdp_reduce_dtype: torch.dtype | str | None = torch.float32,
    ) -> None:
        self.schedule = PrecisionSchedule(default_schedule() if schedule is None else schedule)
        uses_fp8 = any(stage.precision == "fp8-mixed" for stage in self.schedule.stages)
        self.float8 = Float8Training(fp8_recipe, fp8_exclude, fp8_emulate) if uses_fp8 else None
        if fallback_skipped_steps < 0 or fallback_window < 1:
            raise StagedPrecisionError(
                f"fallback_skipped_steps={fallback_skipped_steps}, fallback_window={fallback_window}: use "
                "fallback_skipped_steps >= 0 (0 disables it) and fallback_window >= 1.")
        if device is not None and device not in ("cpu", "cuda", "mps", "xpu"):
            raise StagedPrecisionError(f"device={device!r} is not an autocast device type. Use 'cpu' or 'cuda', or "
                                       "leave it unset to follow the strategy.")
        self.scaler = DynamicLossScaler(init_scale=init_scale, growth_interval=growth_interval,
                                        hysteresis=hysteresis, min_scale=min_scale)
        self.fallback_skipped_steps = fallback_skipped_steps
        self.fallback_window = fallback_window
        self.skip_lr_scheduler_on_skipped_step = skip_lr_scheduler_on_skipped_step
        self._device = device  # as given; `device` derives the autocast device type from the strategy when None
        self.fallbacks: dict[int, str] = {}  # stage index -> precision that replaced its FP16
        self.num_skipped_steps = 0
        self.last_step_skipped = False
        self._recent_skips: deque[int] = deque()
        self._events: list[_Event] = []
        self._trainer: pl.Trainer | None = None
        self.float8_layers: list[str] = []  # paths of the layers the last FP8 stage converted
        self._float8_active = False  # whether the model computes FP8 GEMMs now
        self._float8_toggled = False  # whether its layers were converted at setup (sharded parameters)
        self.fsdp_reduce_dtype = fsdp_policy.reduce_dtype_of(fsdp_reduce_dtype)
        self._fsdp_units: list[FSDPModule] = []  # the model's FSDP units, found at connect
        self._fsdp_precision: str | None = None  # the precision whose policy they hold

    def __repr__(self) -> str:
        return f"StagedPrecision(schedule={self.schedule!r})"

    @property
    def device(self) -> str:
        """The autocast device type: ``device=`` if given, else the strategy's device (``"cpu"`` before setup)."""
        if self._device is not None:
            return self._device
        return self._trainer.strategy.root_device.type if self._trainer is not None else "cpu"

    @property
    def stage_index(self) -> int:
        """Index of the current stage: the stage entered last (0 before the first change)."""
        return min(self._events[-1].stage, len(self.schedule) - 1) if self._events else 0

    @property  # type: ignore[override]
    def precision(self) -> str:
        """Lightning's precision string of the current stage (after any fallback)."""
        return self.fallbacks.get(self.stage_index, self.schedule.stages[self.stage_index].precision)

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    @property
    def scaling(self) -> bool:
        """Whether the current stage scales the loss (FP16)."""
        return self.precision == "16-mixed"

    # ---------------------------------------------------------------- setup

    @override
    def convert_module(self, module: Module) -> Module:
        """With an FP8 stage and a strategy that will shard the parameters, convert the FP8 stage's layers now
        (before sharding) with their FP8 GEMMs off; otherwise ``module`` as it is."""
        if self.float8 is None:
            return module
        lightning_module = _lightning_module(module)
        if not _will_shard_parameters(lightning_module.trainer.strategy):
            return module
        if not float8.toggled_layers(lightning_module):  # else an earlier fit of this model converted them
            device = self.check_device(lightning_module.trainer.strategy.root_device.type)
            self.float8_layers = self.float8.convert(lightning_module, device, toggled=True)
            self._check_float8_layers(lightning_module)
        self._float8_toggled = True
        return module

    @override
    def connect(
        self, model: Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[Module, list[Optimizer], list[Any]]:
        module = _lightning_module(model)
        trainer = module.trainer
        self.check_device(trainer.strategy.root_device.type)
        self._trainer = trainer
        if trainer.state.fn == TrainerFn.FITTING:
            self._resolve_schedule(trainer)
            if self.skip_lr_scheduler_on_skipped_step:
                SkippedStepSchedulerGuard.install(module, self, lr_schedulers)
        self._fsdp_units = fsdp_policy.fsdp_units(module)
        if self._fsdp_units and self.float8 is not None and not self._float8_toggled:
            raise StagedPrecisionError(
                "Stage('fp8') with sharded parameters needs its float8 layers before sharding, but "
                f"{type(module).__name__} was sharded before StagedPrecision saw it (data_parallel_shard_size='auto', "
                "or fully_shard in configure_model). Set data_parallel_shard_size to a size and let the strategy "
                "shard, or use 'bf16-mixed' for this stage.")
        self._sync_model(module)
        return model, optimizers, lr_schedulers

    @override
    def teardown(self) -> None:
        module = self._trainer.lightning_module if self._trainer is not None else None
        if module is not None:
            SkippedStepSchedulerGuard.remove(module)
            if self._float8_toggled:  # sharded: the layers FSDP holds stay, computing as nn.Linear
                float8.set_float8_enabled(module, False)
            elif self._float8_active:  # the model leaves the run with the nn.Linear layers it came with
                float8.revert(module)
            self._float8_active = self._float8_toggled = False
            if self._fsdp_precision not in (None, "32-true"):  # and with FSDP's FP32 all-gathers
                fsdp_policy.set_mixed_precision(self._fsdp_units, fsdp_policy.stage_policy("32-true"))
        self._fsdp_units, self._fsdp_precision = [], None
        super().teardown()

    def check_device(self, strategy_device: str) -> str:
        """Raise unless every stage can run on ``strategy_device``; return the autocast device type.

        Args:
            strategy_device: the strategy's root device type (``"cpu"``, ``"cuda"``).
        """
        if self._device is not None and self._device != strategy_device:
            raise StagedPrecisionError(f"StagedPrecision(device={self._device!r}) but the strategy runs on "
                                       f"{strategy_device!r}. Drop `device` or set it to {strategy_device!r}.")
        for i, stage in enumerate(self.schedule.stages):
            dtype = AUTOCAST_DTYPES[stage.precision]
            if dtype is not None and not autocast_supported(strategy_device, dtype):
                raise StagedPrecisionError(
                    f"schedule[{i}] asks for {stage.precision!r} but {strategy_device!r} has no {dtype} autocast "
                    "(BF16 needs an Ampere or newer GPU). Use '16-mixed' or '32-true' for this stage.")
        if self.float8 is not None:
            self.float8.check_device(strategy_device)
        return strategy_device

    def _resolve_schedule(self, trainer: pl.Trainer) -> None:
        if trainer.train_dataloader is None:
            trainer.fit_loop.setup_data()  # what `estimated_stepping_batches` does; needed for steps per epoch
        total = trainer.estimated_stepping_batches
        if not math.isfinite(total):
            raise StagedPrecisionError("StagedPrecision needs a run of known length: set trainer.max_steps, or "
                                       "max_epochs with a sized train dataloader.")
        num_batches = trainer.num_training_batches
        steps_per_epoch = math.ceil(num_batches / trainer.accumulate_grad_batches) if math.isfinite(
            num_batches) else int(total)
        self.schedule.resolve(int(total), max(1, steps_per_epoch), trainer.max_epochs)

    # ---------------------------------------------------------------- forward / backward

    @override
    @contextlib.contextmanager
    def train_step_context(self) -> Generator[None, None, None]:
        self._enter_stage_of_current_step()
        with self.forward_context():
            yield

    def autocast_context_manager(self) -> torch.autocast:
        """``torch.autocast`` for the current stage (disabled in FP32 stages), without the weight cache.

        As Lightning's ``MixedPrecision.autocast_context_manager``; see the module docstring for the cache.
        """
        dtype = AUTOCAST_DTYPES[self.precision]
        return torch.autocast(self.device, dtype=dtype or torch.bfloat16, enabled=dtype is not None,
                              cache_enabled=False)

    @override
    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if AUTOCAST_DTYPES[self.precision] is None:
            # FP32: no autocast region at all, so an FP32 stage is bitwise identical to training without a plugin.
            yield
            return
        with self.autocast_context_manager():
            yield

    @override
    def pre_backward(self, tensor: torch.Tensor, module: pl.LightningModule) -> torch.Tensor:  # type: ignore[override]
        if self.scaling:
            tensor = self.scaler.scale_loss(tensor)
        return super().pre_backward(tensor, module)

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizer, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        # In automatic optimization the closure (forward and backward) runs inside this call, so the stage of
        # this step must be entered before choosing between the scaled and the plain path.
        self._enter_stage_of_current_step()
        if not self.scaling:
            self.last_step_skipped = False
            output = super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
            self._log(model)
            return output
        if isinstance(optimizer, LBFGS):
            raise StagedPrecisionError("An FP16 stage cannot drive LBFGS (it re-evaluates the closure). "
                                       "Use '32-true' or 'bf16-mixed' stages with LBFGS.")
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            # training_step returned None: Lightning skipped backward, so there is nothing to unscale or step.
            self._after_closure(model, optimizer)
            self.last_step_skipped = False
            return closure_result
        found_inf = self.scaler.unscale_(optimizer)
        self._after_closure(model, optimizer)
        if not found_inf:
            optimizer.step(**kwargs)
        self._after_scaled_step(model.trainer.global_step, found_inf)
        self._log(model)
        return closure_result

    # ---------------------------------------------------------------- stage and fallback logic

    def _enter_stage_of_current_step(self) -> None:
        trainer = self._trainer
        if trainer is None:
            return
        index = self.schedule.stage_at(trainer.global_step, trainer.current_epoch)
        if index != self.stage_index:
            after = self.fallbacks.get(index, self.schedule.stages[index].precision)
            self._events.append(_Event(trainer.global_step, f"{self.precision} -> {after}", index))
        self._sync_model(trainer.lightning_module)

    def _sync_model(self, module: pl.LightningModule) -> None:
        """Bring the model in line with the current stage: FSDP's policy, the FP8 layers."""
        if self._fsdp_units and self._fsdp_precision != self.precision:  # FSDP's policy follows the stage
            policy = fsdp_policy.stage_policy(self.precision, self.fsdp_reduce_dtype)
            fsdp_policy.set_mixed_precision(self._fsdp_units, policy)
            self._fsdp_precision = self.precision
        # Converts at the boundary into an FP8 stage (also the first step after a resume mid-FP8), reverts after it.
        in_fp8 = self.precision == "fp8-mixed"
        if in_fp8 == self._float8_active:
            return
        if self._float8_toggled:  # converted at setup: a toggle, the modules FSDP holds stay
            float8.set_float8_enabled(module, in_fp8)
        elif in_fp8:
            assert self.float8 is not None
            self.float8_layers = self.float8.convert(module, self.device)
            self._check_float8_layers(module)
        else:
            float8.revert(module)
        self._float8_active = in_fp8

    def _check_float8_layers(self, module: Module) -> None:
        if not self.float8_layers:
            assert self.float8 is not None
            raise StagedPrecisionError(
                f"Stage('fp8') found no nn.Linear layer to convert in {type(module).__name__} (excluded by "
                f"fp8_exclude={list(self.float8.exclude)}, or dims not multiples of 16). "
                "Use 'bf16-mixed' for this stage or narrow fp8_exclude.")

    def _after_scaled_step(self, step: int, found_inf: bool) -> None:
        counts_for_fallback = found_inf and self.scaler.calibrated
        self.scaler.update(found_inf)
        self.last_step_skipped = found_inf
        if not found_inf:
            return
        self.num_skipped_steps += 1
        if counts_for_fallback:
            self._recent_skips.append(step)
        while self._recent_skips and self._recent_skips[0] <= step - self.fallback_window:
            self._recent_skips.popleft()
        if self.scaler.at_floor:
            self._fall_back(step, f"the loss scale reached its floor min_scale={self.scaler.min_scale:g}")
        elif self.fallback_skipped_steps and len(self._recent_skips) >= self.fallback_skipped_steps:
            self._fall_back(step, f"{len(self._recent_skips)} skipped steps within {self.fallback_window} steps")

    def _fall_back(self, step: int, reason: str) -> None:
        target = "bf16-mixed" if autocast_supported(self.device, torch.bfloat16) else "32-true"
        self.fallbacks[self.stage_index] = target
        self._recent_skips.clear()
        self._events.append(_Event(step + 1, f"16-mixed -> {target} (fallback)", self.stage_index))
        rank_zero_warn(f"StagedPrecision: FP16 fallback at optimizer step {step}: {reason}; the rest of stage "
                       f"{self.stage_index} ({self.schedule.stages[self.stage_index].label()}) runs in {target}.")

    def _log(self, model: pl.LightningModule) -> None:
        # Private: Lightning's own monitors read it; there is no public "the loggers write this step" predicate.
        if not model.trainer._logger_connector.should_update_logs:
            return
        metrics = {
            "precision/stage": float(self.stage_index),
            "precision/loss_scale": self.scaler.scale,
            "precision/skipped_steps": float(self.num_skipped_steps),
        }
        model.log_dict(metrics, on_step=True, on_epoch=False, prog_bar=False, logger=bool(model.trainer.loggers))

    # ---------------------------------------------------------------- reporting and checkpoints

    def summary(self) -> dict[str, object]:
        """Rows of a run summary (:mod:`lightning_deepseek.reporting`)."""
        return {
            "precision_schedule": self.schedule.describe(),
            "precision_final": self.precision,
            "loss_scale_final": self.scaler.scale,
            "skipped_steps": self.num_skipped_steps,
            "precision_fallbacks": ", ".join(f"stage {i} -> {p}" for i, p in self.fallbacks.items()) or "none",
            **({"fp8_layers": len(self.float8_layers)} if self.float8 is not None else {}),
        }

    def events(self) -> list[tuple[int, str]]:
        """``(optimizer step, label)`` of every stage change and fallback, in order."""
        return [(event.step, event.label) for event in self._events]

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "fallbacks": dict(self.fallbacks),
            "num_skipped_steps": self.num_skipped_steps,
            "recent_skips": list(self._recent_skips),
            "events": [list(event) for event in self._events],
            "scaler": self.scaler.state_dict(),
            "schedule": [(s.precision, s.until, s.unit) for s in self.schedule.stages],
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = [tuple(s) for s in state_dict["schedule"]]
        current = [(s.precision, s.until, s.unit) for s in self.schedule.stages]
        if saved != current:
            rank_zero_warn(f"StagedPrecision: resuming with schedule {current} from a checkpoint written with "
                           f"{saved}; the stage is re-derived from the new schedule at the next step.")
        self.fallbacks = {int(k): str(v) for k, v in state_dict["fallbacks"].items()}
        self.num_skipped_steps = int(state_dict["num_skipped_steps"])
        self._recent_skips = deque(int(s) for s in state_dict["recent_skips"])
        # Checkpoints written before the stage was derived hold `stage_index` and (step, label) events: the stage
        # entered last is that index (earlier events only feed `events()`, which does not read their stage).
        stage = int(state_dict.get("stage_index", 0))
        self._events = [_Event(int(e[0]), str(e[1]), int(e[2]) if len(e) > 2 else stage) for e in state_dict["events"]]
        self.scaler.load_state_dict(state_dict["scaler"])
