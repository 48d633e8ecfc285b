"""ElasticSampler: every sample of an epoch exactly once across any sequence of world sizes."""

from __future__ import annotations

import pytest

from lightning_deepseek.elastic import ElasticSampler

N, GLOBAL, MICRO = 50, 8, 2  # 50 samples: 6 global batches of 8, a tail of 2 dropped at every world size


def _run_steps(epoch: int, consumed: int, world_size: int, num_steps: int) -> list[list[int]]:
    """What each of ``num_steps`` optimizer steps trains at ``world_size`` when resumed at ``consumed``."""
    accumulate = GLOBAL // (world_size * MICRO)
    streams = []
    for rank in range(world_size):
        sampler = ElasticSampler(range(N), GLOBAL, MICRO, world_size, rank, seed=7)
        sampler.set_position(epoch, consumed)
        streams.append(iter(list(sampler)))
    return [[next(stream) for stream in streams for _ in range(MICRO * accumulate)] for _ in range(num_steps)]


@pytest.mark.parametrize("world_sizes", [[1], [4], [2, 1, 4, 1, 2, 4], [4, 2, 4, 1, 4, 2]])
def test_every_sample_once_per_epoch_across_resizes(world_sizes: list[int]) -> None:
    steps_per_epoch = N // GLOBAL
    for epoch in range(2):
        batches, consumed = [], 0
        for phase, world_size in enumerate(world_sizes):
            num_steps = steps_per_epoch - consumed // GLOBAL if phase == len(world_sizes) - 1 else 1
            batches += _run_steps(epoch, consumed, world_size, num_steps)
            consumed += num_steps * GLOBAL
        seen = [i for batch in batches for i in batch]
        assert len(seen) == len(set(seen)) == steps_per_epoch * GLOBAL
        order = ElasticSampler(range(N), GLOBAL, MICRO, 1, 0, seed=7).permutation(epoch)
        # Each step trains the same global batch whatever the world size was.
        assert [sorted(b) for b in batches] == [sorted(order[k * GLOBAL : (k + 1) * GLOBAL]) for k in range(6)]


def test_length_counts_the_whole_epoch_in_micro_batches_of_this_world_size() -> None:
    sampler = ElasticSampler(range(N), GLOBAL, MICRO, num_replicas=2, rank=1)
    sampler.set_position(0, 3 * GLOBAL)
    assert len(sampler) == 6 * GLOBAL // 2  # Lightning resumes its batch counter, so len is the full epoch
    assert len(list(sampler)) == 3 * GLOBAL // 2  # but only the rest is yielded


def test_epochs_differ_and_set_epoch_keeps_a_resumed_position() -> None:
    sampler = ElasticSampler(range(N), GLOBAL, MICRO, 1, 0, seed=3)
    assert sampler.permutation(0) != sampler.permutation(1)
    sampler.set_position(1, 2 * GLOBAL)
    sampler.set_epoch(1)
    assert sampler.consumed_samples == 2 * GLOBAL
    sampler.set_epoch(2)
    assert sampler.consumed_samples == 0


def test_global_batch_not_divisible_by_world_size_is_refused() -> None:
    with pytest.raises(ValueError, match="global_batch_size=8 is not a multiple of world_size"):
        ElasticSampler(range(N), GLOBAL, MICRO, num_replicas=3, rank=0)
    with pytest.raises(ValueError, match="fewer than global_batch_size"):
        ElasticSampler(range(4), GLOBAL, MICRO, num_replicas=1, rank=0)
