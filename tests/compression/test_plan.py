"""A bucket's plan is a value of sizes, world size and settings: built and checked here without a process group."""

from __future__ import annotations

import pytest
import torch

from lightning_deepseek.compression import CompressionConfig
from lightning_deepseek.compression.plan import BucketLayout, make_plan
from lightning_deepseek.compression.quantize import payload_bytes
from lightning_deepseek.compression.state import compressed_bytes

CPU = torch.device("cpu")


def test_layout_pads_to_whole_blocks_per_rank_and_finds_segments() -> None:
    layout = BucketLayout([100, 30, 200], world_size=4, block_size=16)
    assert layout.offsets == [0, 100, 130, 330] and layout.numel == 330
    assert layout.chunk == 96  # ceil(330 / 64) blocks of 16 per rank
    assert layout.segments(90, 140) == [(0, 90, 0, 10), (1, 0, 10, 30), (2, 0, 40, 10)]
    grads = [torch.arange(n, dtype=torch.float32) + 1000 * i for i, n in enumerate(layout.sizes)]
    dst = torch.full((64,), -1.0)
    layout.gather(grads, 320, 384, dst, add=False)  # reads the last 10 values, then the zero padding
    assert torch.equal(dst[:10], grads[2][190:]) and not dst[10:].any()


@pytest.mark.parametrize("world_size, single", [(2, True), (4, False)])
def test_plan_buffers_and_bytes_match_the_byte_formula(world_size: int, single: bool) -> None:
    config = CompressionConfig(bits=4, block_size=32)
    plan = make_plan(["a", "b"], [1000, 3001], world_size, config, CPU, {})
    row = payload_bytes(plan.layout.chunk, 4, 32)
    assert plan.single == single and plan.send.shape == (world_size, row)
    assert plan.received is (plan.recv if single else plan.gathered)
    assert len(plan.rows(0)) == (world_size if single else 1)
    assert plan.bytes_sent == compressed_bytes(4001, world_size, 4, 32)
    forced = make_plan(["a"], [1000], 2, CompressionConfig(single_exchange_max_world=0), CPU, {})
    assert not forced.single and forced.gathered.shape[0] == 2


def test_plan_starts_residuals_from_saved_ones_by_name() -> None:
    saved = {"b": torch.arange(30, dtype=torch.float32).view(3, 10)}
    plan = make_plan(["a", "b"], [20, 30], 2, CompressionConfig(block_size=16), CPU, saved)
    views = plan.residual_views()
    assert not views["a"].any() and torch.equal(views["b"], saved["b"].view(-1))
    assert views["b"].data_ptr() == plan.residual[20:].data_ptr()  # views into the plan's one buffer
    assert make_plan(["a"], [20], 2, CompressionConfig(error_feedback=False), CPU, saved).residual_views() == {}
    with pytest.raises(ValueError, match="residual of 'b' has 30 values, the parameter has 31"):
        make_plan(["a", "b"], [20, 31], 2, CompressionConfig(), CPU, saved)


def test_config_is_frozen_and_validated_once() -> None:
    config = CompressionConfig()
    with pytest.raises(AttributeError):
        config.bits = 4  # type: ignore[misc]
    with pytest.raises(ValueError, match="single_exchange_max_world=-1"):
        CompressionConfig(single_exchange_max_world=-1)
