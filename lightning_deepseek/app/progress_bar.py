"""The console's progress bar: Lightning's own choice, with rich's epoch label right for step-limited runs.

Lightning 2.6.6 picks :class:`~lightning.pytorch.callbacks.RichProgressBar` when ``rich`` is installed and labels
its bar ``Epoch {n}/{max_epochs - 1}``. ``lds-train`` stops on ``trainer.max_steps`` with ``max_epochs=-1`` (no
epoch limit), so its bar read "Epoch 4/-2". Lightning fixed this upstream (issue #21925, PR #21924: no total when
the epochs are unlimited) after 2.6.6; until a release has it, :func:`progress_bar` gives the same bar with that
fix. Everything else is Lightning's: ``TQDMProgressBar`` without ``rich``, nothing when the bar is off.
"""

from __future__ import annotations

import importlib.util

from lightning.pytorch.callbacks import Callback, ProgressBar, RichProgressBar, TQDMProgressBar


class StepLimitedRichProgressBar(RichProgressBar):
    """:class:`RichProgressBar` that shows ``Epoch 4``, not ``Epoch 4/-2``, when ``max_epochs`` is -1."""

    def _get_train_description(self, current_epoch: int) -> str:
        if self.trainer.max_epochs is not None and self.trainer.max_epochs >= 0:
            return super()._get_train_description(current_epoch)
        description = f"Epoch {current_epoch}"
        # Padded like Lightning's: the bar's label does not flicker between "Epoch N" and "Validation".
        return f"{description:{len(self.validation_description)}}"


def progress_bar(enabled: bool, callbacks: list[Callback]) -> list[ProgressBar]:
    """The bar to add to ``Trainer(callbacks=...)``: none when ``enable_progress_bar`` is off (Lightning refuses a bar
    callback then) or ``callbacks`` has one of the user's, otherwise the one Lightning would pick."""
    if not enabled or any(isinstance(callback, ProgressBar) for callback in callbacks):
        return []
    return [StepLimitedRichProgressBar() if _RICH_AVAILABLE else TQDMProgressBar()]


_RICH_AVAILABLE = importlib.util.find_spec("rich") is not None  # Lightning's own flag is private and 2.6+ only
