"""A bucket's plan: where its gradients lie in the quantized layout, its residual and its message buffers.

Decided once per bucket (on first use, again only when DDP rebuilds its buckets or a state is loaded) and read by
every step of the exchange (``hook.py``), which never re-derives a size or an offset. A plan can be built without
a process group: it is a value of the bucket's parameter sizes, the world size and the ``CompressionConfig``.

Buffers are reused every step: on CPU a fresh >32 MiB tensor is ``mmap``-ed and page-faulted on every allocation.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from lightning_deepseek.compression.config import CompressionConfig
from lightning_deepseek.compression.quantize import payload_bytes


class BucketLayout:
    """Where each gradient of one bucket lies in the bucket's canonical (parameter-order) flat layout.

    The exchange works on a padded flat vector of ``world_size * chunk`` values that never exists in full outside
    the residual buffer: each tile is gathered from the gradients right before it is quantized and scattered back
    right after it is dequantized, while it is in cache.
    """

    def __init__(self, sizes: Sequence[int], world_size: int, block_size: int) -> None:
        self.sizes = list(sizes)
        self.offsets = [0]
        for size in self.sizes:
            self.offsets.append(self.offsets[-1] + size)
        self.numel = self.offsets[-1]
        self.chunk = math.ceil(self.numel / (world_size * block_size)) * block_size

    def segments(self, lo: int, hi: int) -> list[tuple[int, int, int, int]]:
        """``(tensor index, start in the tensor, start in [lo, hi), length)`` of every piece overlapping."""
        out = []
        for i in range(bisect.bisect_right(self.offsets, lo) - 1, len(self.sizes)):
            start = self.offsets[i]
            if start >= hi:
                break
            a, b = max(lo, start), min(hi, self.offsets[i + 1])
            if b > a:
                out.append((i, a - start, a - lo, b - a))
        return out

    def gather(self, flats: Sequence[torch.Tensor], lo: int, hi: int, dst: torch.Tensor, add: bool) -> None:
        """``dst (+)= values [lo, hi)`` of the canonical vector; the padding past ``numel`` reads as zero."""
        if not add and hi > self.numel:
            dst[max(0, self.numel - lo):].zero_()
        for i, src, pos, n in self.segments(lo, hi):
            piece = dst[pos:pos + n]
            if add:
                piece.add_(flats[i][src:src + n])
            else:
                piece.copy_(flats[i][src:src + n])

    def scatter(self, src: torch.Tensor, lo: int, hi: int, flats: Sequence[torch.Tensor]) -> None:
        """Write ``src`` (values ``[lo, hi)`` of the canonical vector) back into the gradients."""
        for i, dst, pos, n in self.segments(lo, hi):
            flats[i][dst:dst + n].copy_(src[pos:pos + n])


@dataclass
class BucketPlan:
    """One bucket's persistent buffers: its layout, residual (the error-feedback memory) and message buffers."""

    names: tuple[str, ...]  # one per gradient, in layout order: the keys of their residuals
    layout: BucketLayout
    residual: torch.Tensor | None  # padded fp32, canonical order; None without error feedback
    send: torch.Tensor  # (W, row bytes): per destination chunk, its codes then its scales
    recv: torch.Tensor
    send2: torch.Tensor  # (row bytes,): the re-quantized own chunk
    gathered: torch.Tensor  # (W, row bytes)
    bits: int
    block_size: int
    single: bool  # one all-gather of whole quantized buckets (W <= 2): `recv` is (W, W, row bytes), no phase 2

    def codes(self, buffer: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """The codes of values ``[lo, hi)`` of a chunk, in a message row (or rows)."""
        return buffer[..., lo * self.bits // 8:hi * self.bits // 8]

    def scales(self, buffer: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """The bfloat16 scales of values ``[lo, hi)`` of a chunk; they follow the chunk's codes in a row."""
        code_bytes = self.layout.chunk * self.bits // 8
        return buffer[..., code_bytes:].view(torch.bfloat16)[..., lo // self.block_size:hi // self.block_size]

    @property
    def world_size(self) -> int:
        return self.send.shape[0]

    @property
    def received(self) -> torch.Tensor:
        """The buffer the last collective fills: every rank's bucket (one all-gather), or the owners' averages."""
        return self.recv if self.single else self.gathered

    def rows(self, chunk_index: int) -> list[torch.Tensor]:
        """The received message rows whose average is chunk ``chunk_index`` of the bucket."""
        return list(self.recv[:, chunk_index]) if self.single else [self.gathered[chunk_index]]

    @property
    def bytes_sent(self) -> int:
        """Bytes one rank sends per exchange: its whole bucket to each other rank (one all-gather), or a row to
        each in the all-to-all and the re-quantized own chunk to each in the all-gather."""
        if self.single:
            return (self.world_size - 1) * self.send.numel()
        return (self.world_size - 1) * (self.send.shape[1] + self.send2.numel())

    def residual_views(self) -> dict[str, torch.Tensor]:
        """Each parameter's residual, by name: views into ``residual`` (empty without error feedback)."""
        if self.residual is None:
            return {}
        offsets = self.layout.offsets
        return {name: self.residual[offsets[i]:offsets[i + 1]] for i, name in enumerate(self.names)}


def make_plan(names: Sequence[str], sizes: Sequence[int], world_size: int, config: CompressionConfig,
              device: torch.device, saved_residuals: Mapping[str, torch.Tensor]) -> BucketPlan:
    """The plan of a bucket holding parameters ``names`` of ``sizes`` values, its residual starting from
    ``saved_residuals`` (by parameter name; missing ones start at zero).

    Raises:
        ValueError: a saved residual's size differs from its parameter's (a checkpoint of another model).
    """
    layout = BucketLayout(sizes, world_size, config.block_size)
    residual = None
    if config.error_feedback:
        residual = torch.zeros(world_size * layout.chunk, device=device)
        for name, lo, size in zip(names, layout.offsets, sizes):
            old = saved_residuals.get(name)
            if old is not None:
                if old.numel() != size:
                    raise ValueError(f"GradientCompression: the saved error-feedback residual of {name!r} has "
                                     f"{old.numel()} values, the parameter has {size}: the checkpoint is from a "
                                     "different model. Resume from a checkpoint of this model.")
                residual[lo:lo + size].copy_(old.reshape(-1))
    row = payload_bytes(layout.chunk, config.bits, config.block_size)
    single = world_size <= config.single_exchange_max_world

    def buffer(*shape: int) -> torch.Tensor:
        return torch.empty(*shape, dtype=torch.uint8, device=device)

    return BucketPlan(tuple(names), layout, residual, buffer(world_size, row),
                      buffer(world_size, world_size, row) if single else buffer(world_size, row),
                      buffer(0 if single else row), buffer(0 if single else world_size, row), config.bits,
                      config.block_size, single)
