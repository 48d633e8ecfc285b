"""``ResumableDataLoader``: a resumed epoch continues at the next unused batch, in the same order."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_deepseek.data.loader import LoaderPosition, ResumableDataLoader

DATA = list(range(40))


def _batches(loader: DataLoader, count: int | None = None) -> list[list[int]]:
    out = []
    for batch in loader:
        out.append(batch.tolist())
        if count is not None and len(out) == count:
            break
    return out


def test_order_and_random_state_are_a_plain_shuffled_loaders() -> None:
    torch.manual_seed(7)
    plain, after_plain = _batches(DataLoader(DATA, batch_size=4, shuffle=True)), torch.rand(3)
    torch.manual_seed(7)
    assert _batches(ResumableDataLoader(DATA, batch_size=4, shuffle=True)) == plain
    assert torch.equal(torch.rand(3), after_plain)  # the global generator is where a plain loader leaves it


def test_resume_continues_the_epoch_without_replay_or_skip() -> None:
    torch.manual_seed(3)
    position = LoaderPosition()
    loader = ResumableDataLoader(DATA, batch_size=4, shuffle=True, position=position)
    epoch = _batches(loader)
    position.consumed = 3  # what the data module counted: three batches used by training steps
    state = loader.state_dict()

    torch.manual_seed(12345)  # a new process: another global generator state
    resumed = ResumableDataLoader(DATA, batch_size=4, shuffle=True)
    resumed.load_state_dict(state)
    assert _batches(resumed) == epoch[3:]
    assert resumed.state_dict()["consumed"] == 3  # the data module goes on counting from there
    assert len(_batches(resumed)) == len(epoch)  # the next epoch is whole again


def test_distributed_sampler_epoch_is_restored_before_the_first_batch() -> None:
    sampler = DistributedSampler(DATA, num_replicas=2, rank=1, shuffle=True, seed=0)
    sampler.set_epoch(2)
    epoch2 = _batches(ResumableDataLoader(DATA, batch_size=2, sampler=sampler))
    fresh = ResumableDataLoader(DATA, batch_size=2, sampler=DistributedSampler(DATA, num_replicas=2, rank=1, seed=0))
    fresh.load_state_dict({"epoch": 2, "seed": None, "consumed": 4})
    assert _batches(fresh) == epoch2[4:]
