"""``one_chunk_per_rank`` (:mod:`lightning_deepseek.planning.fsdp_chunks`): the chunks are torch's, and plans made
with it equal plans made with FSDP2's own chunking, uneven shards (padding) included."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from lightning_deepseek.planning import ModelSpec, PlanLayout, plan, planner
from lightning_deepseek.planning import pipeline as pipeline_planner
from lightning_deepseek.planning.fsdp_chunks import LazyChunks, _lazy_chunk_with_empty
from tests.planning.test_against_real_runs import CLUSTER
from tests.planning.test_depth import DEEP, MIXED, STEP


@pytest.mark.parametrize(("size", "num_chunks"), [(5, 4), (5, 3), (8, 8), (7, 2048), (1, 2), (64, 6), (0, 3)])
def test_chunks_are_torch_chunks_padded_with_empty_ones(size: int, num_chunks: int) -> None:
    tensor = torch.arange(size * 3.0).reshape(size, 3)
    expected = list(torch.chunk(tensor, num_chunks, dim=0))
    expected += [expected[0].new_empty(0)] * (num_chunks - len(expected))
    chunks = _lazy_chunk_with_empty(tensor, num_chunks, dim=0)
    assert len(chunks) == num_chunks
    for index, chunk in enumerate(expected):
        got = chunks[index]
        assert (got.shape, got.stride(), got.storage_offset()) == (chunk.shape, chunk.stride(), chunk.storage_offset())
        assert torch.equal(got, chunk) and got.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr() \
            or got.numel() == 0
    if size:
        assert isinstance(chunks, LazyChunks) and chunks[-1].shape == expected[-1].shape
        with pytest.raises(IndexError):
            chunks[num_chunks]


@pytest.mark.parametrize(("spec", "layout"), [
    (MIXED, PlanLayout(ep=2, dp_shard=12, activation_checkpointing="selective")),  # 12 does not divide 64 or 256
    (DEEP, PlanLayout(pp=2, dp_shard=6)),
])
def test_plans_equal_those_of_fsdp2_own_chunks(spec: ModelSpec, layout: PlanLayout,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    world_size = 24 if layout.ep > 1 else 12
    lazy = dataclasses.replace(plan(spec, world_size, layout, CLUSTER, STEP), plan_seconds=0)
    monkeypatch.setattr(planner, "one_chunk_per_rank", contextlib.nullcontext)
    monkeypatch.setattr(pipeline_planner, "one_chunk_per_rank", contextlib.nullcontext)
    eager = dataclasses.replace(plan(spec, world_size, layout, CLUSTER, STEP), plan_seconds=0)
    assert lazy == eager
    assert lazy.memory.params > 0
