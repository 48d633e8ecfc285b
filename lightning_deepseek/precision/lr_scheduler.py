"""``SkippedStepSchedulerGuard``: step-interval LR schedulers do not advance after a skipped optimizer step.

Lightning steps every step-interval scheduler after every optimizer step, also when the loss scaler skipped it,
so each overflow silently shortens warm-up and moves the whole decay one step ahead of the weights (with
``torch.amp`` the usual workaround is to compare the scale before and after ``update()`` in user code).

Lightning advances a scheduler only through the LightningModule's ``lr_scheduler_step(scheduler, metric)`` hook.
For the length of a fit the guard stands in that hook's place on the module instance and calls the module's own
hook (the user's override or Lightning's default) with the user's own scheduler object, except for step-interval
schedulers right after a skipped step. So ``self.lr_schedulers()``, ``trainer.lr_scheduler_configs`` and the hook
see the configured schedulers (``isinstance(s, StepLR)`` holds), and checkpoints hold their usual state.
Epoch-interval and ``ReduceLROnPlateau`` schedulers are never held back: they are not tied to one optimizer step.

Why on the module instance: Lightning's loop offers no other point between the optimizer step and the scheduler
step; wrapping the scheduler object instead (this module's former design) hid the user's scheduler from their own
hook. ``remove`` restores the module at the end of the fit (``StagedPrecision.teardown``).
"""

from __future__ import annotations

from typing import Any, Protocol

import lightning.pytorch as pl

_HOOK = "lr_scheduler_step"


class _SkipSource(Protocol):
    last_step_skipped: bool


class SkippedStepSchedulerGuard:
    """Calls ``hook(scheduler, metric)`` unless ``scheduler`` is a guarded one and the last step was skipped.

    Args:
        hook: the module's own ``lr_scheduler_step``.
        source: anything with a ``last_step_skipped`` attribute (the precision plugin).
        schedulers: the step-interval schedulers to hold back after a skipped step.
    """

    def __init__(self, hook: Any, source: _SkipSource, schedulers: list[Any]) -> None:
        self.hook = hook
        self.source = source
        self.scheduler_ids = {id(s) for s in schedulers}
        self.num_held_back = 0
        self.instance_hook: Any | None = None

    def __call__(self, scheduler: Any, metric: Any | None = None) -> None:
        if self.source.last_step_skipped and id(scheduler) in self.scheduler_ids:
            self.num_held_back += 1
            return None
        return self.hook(scheduler, metric)

    @staticmethod
    def install(module: pl.LightningModule, source: _SkipSource, lr_scheduler_configs: list[Any]) -> None:
        """Put a guard on ``module`` for the step-interval, non-plateau schedulers among ``lr_scheduler_configs``."""
        SkippedStepSchedulerGuard.remove(module)
        schedulers = [c.scheduler for c in lr_scheduler_configs if c.interval == "step" and not c.reduce_on_plateau]
        if schedulers:
            guard = SkippedStepSchedulerGuard(getattr(module, _HOOK), source, schedulers)
            guard.instance_hook = module.__dict__.get(_HOOK)  # a hook the user set on the instance, put back later
            # Set on the instance (object.__setattr__: not a parameter or submodule), so the class's hook is untouched.
            object.__setattr__(module, _HOOK, guard)

    @staticmethod
    def remove(module: pl.LightningModule) -> None:
        """Take the guard off ``module`` again (a no-op without one)."""
        guard = module.__dict__.get(_HOOK)
        if isinstance(guard, SkippedStepSchedulerGuard):
            object.__delattr__(module, _HOOK)
            if guard.instance_hook is not None:
                object.__setattr__(module, _HOOK, guard.instance_hook)
