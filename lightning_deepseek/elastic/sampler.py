"""``ElasticSampler``: a resumable data-parallel sampler whose position survives world-size changes.

Every epoch is one deterministic permutation of the dataset (seeded by ``seed + epoch``), cut into global
batches of ``global_batch_size`` samples. A global batch is consumed as micro-steps of ``world_size *
micro_batch_size`` consecutive samples, rank ``r`` taking the ``r``-th slice of each micro-step. The only
state is ``(epoch, consumed_samples)``, a count that every rank agrees on without communication, so a job
that resumes at another world size continues at the next unseen sample: across any sequence of shrinks and
grows, every sample of an epoch is trained exactly once (the tail that does not fill a global batch is
dropped, the same tail at every world size). With ``batch_policy="lr"`` the global batch itself changes at
a resize; the epoch then ends at the last whole new-size global batch.

It subclasses ``DistributedSampler`` only so that Lightning (``use_distributed_sampler=True``) leaves it in
place instead of wrapping it a second time. Unlike ``DistributedSampler`` it never pads or repeats samples.
Costs: one ``torch.randperm`` of the dataset per epoch. Not supported: iterable datasets.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized

import torch
from torch.utils.data import DistributedSampler


class ElasticSampler(DistributedSampler):
    """Deterministic per-epoch permutation, consumed in global batches, resumable at any world size.

    Args:
        dataset: a sized dataset.
        global_batch_size: samples per optimizer step summed over all ranks and accumulation steps.
        micro_batch_size: samples per rank per forward pass (the ``DataLoader``'s ``batch_size``).
        num_replicas: world size.
        rank: this process' rank.
        seed: base seed of the per-epoch permutation.
        shuffle: permute each epoch; ``False`` keeps dataset order (useful for audits).
    """

    def __init__(
        self,
        dataset: Sized,
        global_batch_size: int,
        micro_batch_size: int,
        num_replicas: int,
        rank: int,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if global_batch_size % (num_replicas * micro_batch_size):
            raise ValueError(
                f"global_batch_size={global_batch_size} is not a multiple of world_size * micro_batch_size = "
                f"{num_replicas} * {micro_batch_size}. Pick a global batch size divisible by every world size "
                "the job may run at times the micro-batch size."
            )
        if len(dataset) < global_batch_size:
            raise ValueError(f"The dataset has {len(dataset)} samples, fewer than global_batch_size="
                             f"{global_batch_size}. Use a smaller global batch or more data.")
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=True)
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.consumed_samples = 0
        self.steps_done = 0

    def set_position(self, epoch: int, consumed_samples: int, steps_done: int | None = None) -> None:
        """Resume ``epoch`` after ``consumed_samples`` (over all ranks) in ``steps_done`` optimizer steps.

        ``steps_done`` defaults to ``consumed_samples / global_batch_size``; it differs only when the global
        batch changed within the epoch (``batch_policy="lr"``).
        """
        if not 0 <= consumed_samples <= len(self.dataset):
            raise ValueError(f"consumed_samples={consumed_samples} lies outside an epoch of {len(self.dataset)}.")
        self.epoch = epoch
        self.consumed_samples = consumed_samples
        self.steps_done = consumed_samples // self.global_batch_size if steps_done is None else steps_done

    @property
    def _end(self) -> int:
        """Where this epoch stops: the last whole global batch after the resumed position."""
        remaining = len(self.dataset) - self.consumed_samples
        return self.consumed_samples + remaining // self.global_batch_size * self.global_batch_size

    def set_epoch(self, epoch: int) -> None:
        # Lightning calls this at every epoch start, including the resumed one: keep the resumed position.
        if epoch != self.epoch:
            self.epoch = epoch
            self.consumed_samples = self.steps_done = 0

    def permutation(self, epoch: int) -> list[int]:
        """The order in which ``epoch`` visits the dataset (identical on every rank)."""
        if not self.shuffle:
            return list(range(len(self.dataset)))
        generator = torch.Generator()
        generator.manual_seed(self.seed + epoch)
        return torch.randperm(len(self.dataset), generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        order = self.permutation(self.epoch)
        step = self.num_replicas * self.micro_batch_size
        offset = self.rank * self.micro_batch_size
        for start in range(self.consumed_samples, self._end, step):
            yield from order[start + offset : start + offset + self.micro_batch_size]

    def __len__(self) -> int:
        # The whole epoch, not the remainder: Lightning counts resumed batches from the restored progress.
        num_steps = self.steps_done + (self._end - self.consumed_samples) // self.global_batch_size
        return num_steps * self.global_batch_size // self.num_replicas
