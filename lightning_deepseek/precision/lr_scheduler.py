"""``SkipAwareLRScheduler``: an LR scheduler that does not advance when the optimizer step was skipped.

Lightning steps every step-interval scheduler after every optimizer step, also when the loss scaler skipped it,
so each overflow silently shortens warm-up and moves the whole decay one step ahead of the weights (with
``torch.amp`` the usual workaround is to compare the scale before and after ``update()`` in user code).
``StagedPrecision.connect`` wraps the run's step-interval schedulers in this class; everything but ``step`` is
forwarded to the wrapped scheduler, including ``state_dict``, so checkpoints are unchanged.
Epoch-interval and ``ReduceLROnPlateau`` schedulers are not wrapped: they are not tied to one optimizer step.
"""

from __future__ import annotations

from typing import Any, Protocol


class _SkipSource(Protocol):
    last_step_skipped: bool


class SkipAwareLRScheduler:
    """Forwards to ``scheduler`` except that ``step()`` is a no-op right after a skipped optimizer step.

    Args:
        scheduler: the wrapped LR scheduler.
        source: anything with a ``last_step_skipped`` attribute (the precision plugin).
    """

    def __init__(self, scheduler: Any, source: _SkipSource) -> None:
        self.scheduler = scheduler
        self.source = source
        self.num_skipped_calls = 0

    def step(self, *args: Any, **kwargs: Any) -> None:
        if self.source.last_step_skipped:
            self.num_skipped_calls += 1
            return
        self.scheduler.step(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        if name in ("scheduler", "source"):  # not set yet (copy/unpickle): avoid infinite recursion
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __repr__(self) -> str:
        return f"SkipAwareLRScheduler({self.scheduler!r})"
