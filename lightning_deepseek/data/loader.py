"""``ResumableDataLoader``: a ``DataLoader`` whose position in the epoch survives a checkpoint.

Lightning saves the ``state_dict`` of every training loader that has one (``fit_loop["combined_loader"]``) and
hands it back through ``load_state_dict`` before the first batch of a resumed run; a loader without it gets the
"dataloader is not resumable" warning and restarts its epoch, replaying batches. The state here is
``(epoch, seed, consumed)``:

- ``consumed`` counts the batches the training step has *used* this epoch. Lightning fetches one batch ahead
  of the step, so the loader's own count of yielded batches is one too many at a checkpoint; the owning data
  module counts instead in ``on_before_batch_transfer``, which runs once per used batch.
- ``seed``: the order of a single-process epoch (``RandomSampler``) comes from the seed that ``RandomSampler``
  would draw from torch's global generator when the epoch starts (found on a copy of it, and the global
  generator advanced as ``RandomSampler`` would: the order and the random state after are a plain
  ``DataLoader(shuffle=True)``'s), and is kept so that a resumed epoch repeats it.
- ``epoch``: ``DistributedSampler`` orders by ``seed + epoch``; Lightning sets the epoch only after it has
  opened the resumed epoch's iterator, so ``load_state_dict`` sets it first.

On resume the first ``consumed`` batches of the epoch are drawn and dropped (cheap for memory-mapped windows;
a loader with costly batches would want to skip indices instead). Iterable datasets are not supported.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, RandomSampler


@dataclass
class LoaderPosition:
    """Where the training loader stands in its epoch; shared by the loader and the data module that counts."""

    epoch: int = 0
    seed: int | None = None
    consumed: int = 0
    resuming: bool = False  # set by load_state_dict: the next iterator continues the saved epoch


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` with ``state_dict`` / ``load_state_dict`` (Lightning's resumable-loader interface).

    Args:
        *args: ``DataLoader``'s arguments.
        position: the shared position object (the data module counts used batches into it).
        **kwargs: ``DataLoader``'s keyword arguments.
    """

    def __init__(self, *args: Any, position: LoaderPosition | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.position = position if position is not None else LoaderPosition()
        self._draws_seed = isinstance(self.sampler, RandomSampler) and self.sampler.generator is None

    def state_dict(self) -> dict[str, Any]:
        state = asdict(self.position)
        del state["resuming"]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.position.epoch = int(state_dict["epoch"])
        self.position.seed = state_dict["seed"]
        self.position.consumed = int(state_dict["consumed"])
        self.position.resuming = True
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(self.position.epoch)

    def __iter__(self) -> Any:
        position = self.position
        skip = position.consumed if position.resuming else 0
        if not position.resuming:
            position.consumed = 0
            position.epoch = int(getattr(self.sampler, "epoch", position.epoch))
            position.seed = self._next_sampler_seed() if self._draws_seed else None
        position.resuming = False
        if self._draws_seed:
            self.sampler.generator = torch.Generator().manual_seed(position.seed)
        iterator = super().__iter__()  # draws the workers' base seed from the global generator
        if self._draws_seed:
            torch.empty((), dtype=torch.int64).random_()  # the draw RandomSampler would have made: same RNG state after
        if skip >= len(self):
            skip = 0  # the saved epoch had ended: this is the next one
        for _ in range(skip):
            next(iterator)
        return iterator

    def _next_sampler_seed(self) -> int:
        """The seed a generator-less ``RandomSampler`` draws, found on a copy of the global generator: the
        iterator first draws its base seed (from the global generator unless the loader has its own)."""
        probe = torch.Generator()
        probe.set_state(torch.get_rng_state())
        if self.generator is None:
            torch.empty((), dtype=torch.int64).random_(generator=probe)
        return int(torch.empty((), dtype=torch.int64).random_(generator=probe).item())
