"""``one_chunk_per_rank``: FSDP2's set-up on the fake world makes only the chunks of a parameter it reads.

``fully_shard`` cuts each parameter into as many chunks as the shard group has ranks (``torch.chunk``, padded with
empty chunks) and keeps this rank's and the first's (its padded size). On fake tensors every chunk is a fake tensor
made through the dispatcher: 2,048 per parameter and twice per parameter for a 2,048-rank shard group, four fifths of
a DeepSeek-V3 plan's CPU time. Within this context the chunks are the same views (``narrow`` at the offsets
``torch.chunk`` uses), made when FSDP2 reads them; the set-up, its shards and what it gathers are unchanged
(``tests/planning/test_fsdp_chunks.py``: plans equal with and without it).

Replaces torch's private ``_chunk_with_empty`` in ``torch.distributed.fsdp._fully_shard._fsdp_param`` (torch 2.11 to
2.13, which index the list only) for the duration of the ``with`` block; real runs never enter it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch.distributed.fsdp._fully_shard import _fsdp_param  # private: no public hook into FSDP2's chunking


class LazyChunks(Sequence[torch.Tensor]):
    """``torch.chunk(tensor, num_chunks, dim)`` padded with empty chunks to ``num_chunks`` (FSDP2's
    ``_chunk_with_empty``), each made when indexed."""

    def __init__(self, tensor: torch.Tensor, num_chunks: int, dim: int) -> None:
        self.tensor, self.num_chunks, self.dim = tensor, num_chunks, dim
        self.size = tensor.size(dim)
        self.step = -(-self.size // num_chunks)  # torch.chunk's chunk size: ceil(size / num_chunks)
        self.filled = -(-self.size // self.step)  # chunks holding elements; those after them are empty

    def __len__(self) -> int:
        return self.num_chunks

    def __getitem__(self, index: int) -> torch.Tensor:  # type: ignore[override]  # FSDP2 indexes with ints only
        if not -self.num_chunks <= index < self.num_chunks:
            raise IndexError(index)
        index %= self.num_chunks
        if index < self.filled:
            start = index * self.step
            return self.tensor.narrow(self.dim, start, min(self.step, self.size - start))
        return self[0].new_empty(0)


def _lazy_chunk_with_empty(tensor: torch.Tensor, num_chunks: int, dim: int) -> Sequence[torch.Tensor]:
    if tensor.size(dim) == 0:  # torch.chunk's own rule for an empty dimension
        return list(torch.chunk(tensor, num_chunks, dim=dim))
    return LazyChunks(tensor, num_chunks, dim)


@contextmanager
def one_chunk_per_rank() -> Iterator[None]:
    """FSDP2's set-up within this block makes a parameter's chunks only when it reads them (module docstring)."""
    original = _fsdp_param._chunk_with_empty
    _fsdp_param._chunk_with_empty = _lazy_chunk_with_empty
    try:
        yield
    finally:
        _fsdp_param._chunk_with_empty = original
