"""Block-wise symmetric absmax quantization of flat fp32 tensors to int8 or packed int4.

Supports: ``bits`` 8 (values in [-127, 127], one byte each) and 4 (values in [-7, 7], two per byte), blocks of
``block_size`` consecutive values sharing one scale ``absmax / qmax`` stored as bfloat16, round-to-nearest or
stochastic rounding. Every operation is a whole-tensor torch op (no Python loop over blocks), so it runs on CPU
and CUDA alike.

Costs: the payload is ``numel * bits / 8`` bytes plus 2 bytes per block. Compute is eager PyTorch written for
few passes and no temporaries: absmax as ``max(amax, -amin)`` (two read-only passes, no ``|x|`` copy), one scaling
``mul`` into a caller-provided fp32 scratch (``work``), in-place ``round_``/``clamp_``/``nan_to_num_``, one narrowing
copy to int8; dequantize is one int8 -> fp32 copy into ``out`` plus one in-place ``mul_``. int4 packs and unpacks
with one shift and one or on an int16 view of the byte pairs instead of strided nibble arithmetic. Fresh large
tensors cost as much as the arithmetic on CPU (glibc serves >32 MiB from ``mmap``, so every call page-faults them
in), hence ``work``/``out``. On one core of the development CPU an int8 round trip runs at ~0.3x of a memory copy
(int4 ~0.2x), against ~0.04x for the original ten-pass formulation (``benchmarks/compression/kernels.py``).
``torch.compile`` (inductor C++) was measured and not adopted: ~22 s of compile per process and no faster than
this path on CPU (its row-wise absmax and bf16 cast are not vectorised better than ATen's). The results are
bitwise equal to the plain formulation (``test_fast_path_is_bitwise_equal_to_the_reference``).

Why bfloat16 scales and not float16: gradients span from ~1e-10 (unscaled, late in training) to ~1e7 (multiplied
by a loss scaler); a float16 scale underflows to 0 or overflows to inf at both ends. bfloat16 keeps the fp32 range;
its 8-bit mantissa only changes the step size slightly (values are quantized with the rounded scale, so the
round-trip error stays within half a step).

Non-finite inputs propagate: a block holding inf or NaN gets a non-finite scale and dequantizes to non-finite
values, so a loss scaler downstream still sees the overflow. Not supported: other bit widths, asymmetric
(zero-point) schemes, per-channel scales.
"""

from __future__ import annotations

import torch

SUPPORTED_BITS = (4, 8)
MIN_BLOCK_SIZE = 16
MAX_BLOCK_SIZE = 4096
SCALE_DTYPE = torch.bfloat16
SCALE_BYTES = 2


class QuantizationConfigError(ValueError):
    """A bad ``bits`` or ``block_size``; the message names the argument, the value and the fix."""


def validate(bits: int, block_size: int) -> None:
    """Raise :class:`QuantizationConfigError` unless ``bits`` and ``block_size`` are supported."""
    if isinstance(bits, bool) or bits not in SUPPORTED_BITS:
        raise QuantizationConfigError(f"compression bits={bits!r} is not supported: use bits=8 or bits=4.")
    if (isinstance(block_size, bool) or not isinstance(block_size, int)
            or not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE or block_size % 2):
        raise QuantizationConfigError(
            f"compression block_size={block_size!r} is invalid: use an even integer in "
            f"[{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}] (64-256 is the usual range; smaller blocks are more precise "
            "and cost 2 bytes of scale per block)."
        )


def qmax(bits: int) -> int:
    """Largest quantized magnitude: 127 for int8, 7 for int4 (symmetric, so -qmax..qmax)."""
    return (1 << (bits - 1)) - 1


def payload_bytes(numel: int, bits: int, block_size: int) -> int:
    """Bytes of a quantized tensor of ``numel`` values (a multiple of ``block_size``): codes plus scales."""
    return numel * bits // 8 + (numel // block_size) * SCALE_BYTES


def quantize(x: torch.Tensor, bits: int, block_size: int, generator: torch.Generator | None = None,
             work: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a flat float tensor whose length is a multiple of ``block_size``.

    Args:
        x: 1-D float tensor, ``x.numel() % block_size == 0``; not modified.
        bits: 8 or 4.
        block_size: values per scale (even).
        generator: if given, stochastic rounding with this generator (unbiased: ``E[dequantize] == x``);
            otherwise round to nearest.
        work: optional float32 scratch of ``x.numel()`` values (e.g. the buffer that :func:`dequantize` fills
            next); saves allocating and page-faulting a fresh one per call.

    Returns:
        ``(codes, scales)``: ``codes`` is uint8 of ``numel`` bytes (int8 bit patterns) or ``numel / 2`` bytes
        (two int4 codes per byte, offset by 8); ``scales`` is bfloat16 of ``numel / block_size``.
    """
    limit = qmax(bits)
    blocks = x.float().view(-1, block_size)
    # max(max, -min) == max(|x|) (NaN included) without materialising |x|: two read-only passes.
    absmax = blocks.amax(dim=1)
    torch.maximum(absmax, blocks.amin(dim=1).neg_(), out=absmax)
    scales = absmax.div_(limit).to(SCALE_DTYPE)
    step = scales.float()
    # A zero block has scale 0; a non-finite block has scale inf/NaN and 1/scale of 0/NaN: its codes are
    # meaningless but its dequantized values are non-finite either way (0 * inf, q * NaN).
    inverse = torch.where(step > 0, step.reciprocal(), torch.zeros_like(step))
    y = torch.mul(blocks, inverse.unsqueeze(1), out=None if work is None else work.view(-1, block_size))
    if generator is None:
        y.round_()
    else:
        y.add_(torch.rand(y.shape, generator=generator, device=y.device, dtype=y.dtype)).floor_()
    y.clamp_(-limit, limit).nan_to_num_(0.0)
    if bits == 8:
        return torch.empty(y.shape, dtype=torch.int8, device=y.device).copy_(y).view(torch.uint8).view(-1), scales
    # Offset codes 1..15, one byte each; read as little-endian int16 pairs ``lo | hi << 8``, ``w | w >> 4`` holds
    # ``lo | hi << 4`` in its low byte, which the int16 -> uint8 cast keeps: one shift, one or, one narrowing copy.
    wide = torch.empty(y.shape, dtype=torch.uint8, device=y.device).copy_(y.add_(8.0)).view(torch.int16)
    return wide.bitwise_or(wide >> 4).to(torch.uint8).view(-1), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of :func:`quantize`: float32 tensor of ``scales.numel() * block_size`` values.

    Leading dimensions are kept: ``codes`` of shape ``(k, m)`` and ``scales`` of shape ``(k, n)`` give
    ``(k, n * block_size)``, which dequantizes ``k`` payloads (one per rank) in one call.

    Args:
        out: optional contiguous float32 tensor of the result's shape to write into.
    """
    lead = codes.shape[:-1]
    if bits == 8:
        values = codes.view(torch.int8)
    else:
        # Inverse of the packing in quantize: ``(p | p << 4) & 0x0F0F`` as int16 holds lo, hi in its two bytes.
        wide = codes.to(torch.int16)
        values = wide.bitwise_or_(wide << 4).bitwise_and_(0x0F0F).view(torch.int8).sub_(8)
    if out is None:
        out = torch.empty(*lead, values.shape[-1], dtype=torch.float32, device=codes.device)
    # Copy (int8 -> fp32 is a cheap conversion) then an fp32 in-place multiply: a mixed-dtype ``mul`` takes a
    # slow casting path on CPU, and ``.float()`` would allocate and page-fault a temporary.
    out.copy_(values)
    out.view(*lead, -1, block_size).mul_(scales.float().unsqueeze(-1))
    return out.view(*lead, -1)
