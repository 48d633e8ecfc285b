"""Block-wise symmetric absmax quantization of flat fp32 tensors to int8 or packed int4.

Supports: ``bits`` 8 (values in [-127, 127], one byte each) and 4 (values in [-7, 7], two per byte), blocks of
``block_size`` consecutive values sharing one scale ``absmax / qmax`` stored as bfloat16, round-to-nearest or
stochastic rounding. Every operation is a whole-tensor torch op (no Python loop over blocks), so it runs on CPU
and CUDA alike.

Costs: about ten elementwise passes over the input per quantize + dequantize round trip; the payload is
``numel * bits / 8`` bytes plus 2 bytes per block.

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
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a flat float tensor whose length is a multiple of ``block_size``.

    Args:
        x: 1-D float tensor, ``x.numel() % block_size == 0``.
        bits: 8 or 4.
        block_size: values per scale (even).
        generator: if given, stochastic rounding with this generator (unbiased: ``E[dequantize] == x``);
            otherwise round to nearest.

    Returns:
        ``(codes, scales)``: ``codes`` is uint8 of ``numel`` bytes (int8 bit patterns) or ``numel / 2`` bytes
        (two int4 codes per byte, offset by 8); ``scales`` is bfloat16 of ``numel / block_size``.
    """
    limit = qmax(bits)
    blocks = x.float().view(-1, block_size)
    scales = (blocks.abs().amax(dim=1) / limit).to(SCALE_DTYPE)
    step = scales.float()
    # A zero block has scale 0; a non-finite block has scale inf/NaN and 1/scale of 0/NaN: its codes are
    # meaningless but its dequantized values are non-finite either way (0 * inf, q * NaN).
    inverse = torch.where(step > 0, step.reciprocal(), torch.zeros_like(step))
    y = blocks * inverse.unsqueeze(1)
    if generator is None:
        y.round_()
    else:
        y.add_(torch.rand(y.shape, generator=generator, device=y.device, dtype=y.dtype)).floor_()
    y.clamp_(-limit, limit).nan_to_num_(0.0)
    if bits == 8:
        return y.to(torch.int8).view(torch.uint8).view(-1), scales
    codes = (y.view(-1, 2) + 8).to(torch.uint8)
    return codes[:, 0] | (codes[:, 1] << 4), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int) -> torch.Tensor:
    """Inverse of :func:`quantize`: float32 tensor of ``scales.numel() * block_size`` values.

    Leading dimensions are kept: ``codes`` of shape ``(k, m)`` and ``scales`` of shape ``(k, n)`` give
    ``(k, n * block_size)``, which dequantizes ``k`` payloads (one per rank) in one call.
    """
    lead = codes.shape[:-1]
    if bits == 8:
        values = codes.view(torch.int8).float()
    else:
        values = torch.stack((codes & 0x0F, codes >> 4), dim=-1).float().sub_(8.0)
    values = values.view(*lead, -1, block_size).mul_(scales.float().unsqueeze(-1))
    return values.view(*lead, -1)
