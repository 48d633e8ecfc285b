"""Block-wise symmetric absmax quantization of flat fp32 tensors to int8 or packed int4.

Supports: ``bits`` 8 (values in [-127, 127], one byte each) and 4 (values in [-7, 7], two per byte), blocks of
``block_size`` consecutive values sharing one scale ``absmax / qmax`` stored as bfloat16, round-to-nearest or
stochastic rounding. The reference path is vectorised torch ops (no Python loop over blocks) and runs on CPU and
CUDA alike; on CPU, native kernels take over where they can (below).

Costs: the payload is ``numel * bits / 8`` bytes plus 2 bytes per block. Compute: on CPU, round-to-nearest on
contiguous float32 tensors runs in the native kernels of ``native.py`` (one pass over memory per call; an int8 round
trip with the error-feedback residual at ~0.5x of a memory copy on one core of the development CPU, int4 ~0.4x). On
CUDA, round-to-nearest on float32 runs in the fused kernels that ``torch.compile`` makes of the same formulation
(``fused.py``: one kernel per direction; on an H200 the eager ops ran the int8 round trip with the residual at 0.09x
of a memory copy, the fused kernels' first version at 0.14x). Everything else (stochastic rounding, other dtypes,
strided views on CPU, other accelerators, no C compiler, or ``LDS_NATIVE_KERNELS=0`` / ``LDS_FUSED_KERNELS=0``) runs
the eager PyTorch formulation below, which gives bitwise the native kernels' codes, scales and residuals (signed
zeros of all-zero blocks aside; ``tests/compression/test_quantize.py`` runs every test on both).
The eager path is arranged so that each value crosses DRAM about once: on CPU the tensor is processed in tiles of
``TILE_VALUES`` values (a Python loop over tiles of thousands of blocks, never over blocks); per tile, absmax as
``max(amax, -amin)`` (no ``|x|`` temporary), one scaling ``mul`` into a tile-sized scratch, in-place
``round_``/``clamp_`` and one narrowing copy into the codes all run out of cache (~0.28x of a memory copy for the
int8 round trip). Dequantize is one int8 -> fp32 copy plus one in-place ``mul_`` per tile, into ``out`` when given
(fresh >32 MiB tensors are ``mmap``-ed and page-faulted on every call on CPU). ``torch.compile`` (inductor C++) of
the plain formulation runs at ~0.12x and compiles for seconds per process. See
``benchmarks/compression/kernels.py``.

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

from lightning_deepseek.compression import fused, native

SUPPORTED_BITS = (4, 8)
MIN_BLOCK_SIZE = 16
MAX_BLOCK_SIZE = 4096
SCALE_DTYPE = torch.bfloat16
SCALE_BYTES = 2
_FLOAT_MAX = torch.finfo(torch.float32).max
TILE_VALUES = 1 << 19  # 2 MiB of fp32 per tile: fits this CPU's L2 + L3 share, amortises per-op overhead


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


def _tile_rows(x: torch.Tensor, num_blocks: int, block_size: int) -> int:
    # On CPU, work through TILE_VALUES values at a time so that every pass after the first read of a tile runs out of
    # cache instead of DRAM; accelerators get one tile (launch count, not cache, is what matters there).
    return max(1, num_blocks if x.device.type != "cpu" else min(num_blocks, TILE_VALUES // block_size))


def quantize(x: torch.Tensor, bits: int, block_size: int, generator: torch.Generator | None = None,
             residual: torch.Tensor | None = None, codes: torch.Tensor | None = None,
             scales: torch.Tensor | None = None, residual_alpha: float | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a flat float tensor whose length is a multiple of ``block_size``.

    Args:
        x: 1-D float tensor, ``x.numel() % block_size == 0``; not modified.
        bits: 8 or 4.
        block_size: values per scale (even).
        generator: if given, stochastic rounding with this generator (unbiased: ``E[dequantize] == x``);
            otherwise round to nearest.
        residual: if given, a float32 tensor of ``x``'s size (``x`` itself is allowed) that receives
            ``x - dequantize(codes, scales)``, bitwise, computed while each tile is still in cache (error feedback).
        codes: optional contiguous uint8 output of ``numel * bits / 8`` bytes (a slice of a send buffer).
        scales: optional contiguous bfloat16 output of ``numel / block_size`` values.
        residual_alpha: if given, ``residual`` (then not ``x``) is accumulated into instead:
            ``residual.add_(x - dequantize(codes, scales), alpha=residual_alpha)`` in the same pass.

    Returns:
        ``(codes, scales)``: ``codes`` is uint8 of ``numel`` bytes (int8 bit patterns) or ``numel / 2`` bytes
        (two int4 codes per byte, offset by 8); ``scales`` is bfloat16 of ``numel / block_size``.
    """
    if generator is None and x.dtype == torch.float32:  # round-to-nearest: native (CPU) or fused (CUDA) kernels
        on_cpu = native.usable(x, residual, codes, scales) and native.library() is not None
        on_gpu = (not on_cpu and fused.usable(x, residual, codes, scales)
                  and all(t is None or t.is_contiguous() for t in (x, residual, codes, scales)))
        if on_cpu or on_gpu:
            codes = torch.empty(x.numel() * bits // 8, dtype=torch.uint8, device=x.device) if codes is None else codes
            scales = (torch.empty(x.numel() // block_size, dtype=SCALE_DTYPE, device=x.device) if scales is None
                      else scales)
            if on_cpu:
                native.quantize(x, residual, codes, scales, bits, block_size, residual_alpha)
                return codes.view(-1), scales
            if fused.quantize(x, residual, codes, scales, bits, block_size, residual_alpha):
                return codes.view(-1), scales
    limit = qmax(bits)
    blocks = x.float().view(-1, block_size)
    num_blocks, device = blocks.shape[0], blocks.device
    rows = _tile_rows(x, num_blocks, block_size)
    if scales is None:
        scales = torch.empty(num_blocks, dtype=SCALE_DTYPE, device=device)
    codes = (torch.empty(num_blocks, block_size * bits // 8, dtype=torch.uint8, device=device) if codes is None
             else codes.view(num_blocks, -1))
    work = torch.empty(rows, block_size, device=device)
    absmax, negmin = torch.empty(rows, device=device), torch.empty(rows, device=device)
    if bits == 4:  # a tile's codes, one per byte, before packing
        unpacked = torch.empty(rows, block_size, dtype=torch.int8, device=device)
    for first in range(0, num_blocks, rows):
        tile = blocks[first:first + rows]
        n = tile.shape[0]
        y, top, bottom, tile_scales = work[:n], absmax[:n], negmin[:n], scales[first:first + n]
        # max(max, -min) == max(|x|) (NaN included) without materialising |x|.
        torch.maximum(torch.amax(tile, dim=1, out=top), torch.amin(tile, dim=1, out=bottom).neg_(), out=top)
        step = tile_scales.copy_(top.div_(limit)).float()
        # A zero block has scale 0; a non-finite block has scale inf/NaN and 1/scale of 0/NaN: its codes are
        # unspecified (NaN narrowed to int8; no ``nan_to_num_`` pass spent on them) but its dequantized values
        # are non-finite either way (q * NaN, q * inf with q = 0 included).
        # A subnormal scale (absmax below ~1.5e-36) has no finite reciprocal: capping it keeps its block's codes
        # finite (0 * inf would be NaN and poison the error-feedback residual); they come out a little small.
        inverse = torch.where(step > 0, step.reciprocal(), torch.zeros_like(step)).clamp_(max=_FLOAT_MAX)
        torch.mul(tile, inverse.unsqueeze(1), out=y)
        if generator is None:
            y.round_()
        else:
            y.add_(torch.rand(y.shape, generator=generator, device=device, dtype=y.dtype)).floor_()
        y.clamp_(-limit, limit)
        if bits == 8:
            codes[first:first + n].view(torch.int8).copy_(y)
        else:
            # Pack without strided ops (fp32 -> int8 is a fast conversion, fp32 -> uint8 and stride-2 reads are
            # not): the tile's int8 codes read as little-endian int16 pairs, masked to both nibbles, the high one
            # folded down (| >> 4), the low byte kept by the narrowing copy; XOR 0x88 adds the offset 8 to both.
            pairs = unpacked[:n].copy_(y).view(torch.int16).bitwise_and_(0x0F0F)
            codes[first:first + n].copy_(pairs.bitwise_or_(pairs >> 4)).bitwise_xor_(0x88)
        if residual is not None:
            # x - y * step in one pass; y * step (7-bit integer times 8-bit bfloat16 mantissa) is exact in fp32, so
            # a fused multiply-add gives bitwise what dequantize's y * step followed by a subtraction gives.
            target = residual.view(-1, block_size)[first:first + n]
            if residual_alpha is None:
                torch.addcmul(tile, y, step.unsqueeze(1), value=-1, out=target)
            else:
                target.add_(torch.addcmul(tile, y, step.unsqueeze(1), value=-1, out=y), alpha=residual_alpha)
    return codes.view(-1), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int,
               out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
    """Inverse of :func:`quantize`: float32 tensor of ``scales.numel() * block_size`` values.

    Leading dimensions are kept: ``codes`` of shape ``(k, m)`` and ``scales`` of shape ``(k, n)`` give
    ``(k, n * block_size)``, which dequantizes ``k`` payloads (one per rank) in one call.

    Args:
        codes: as returned by :func:`quantize`, optionally with leading dimensions (rows may be strided).
        scales: bfloat16 scales with the same leading dimensions.
        bits: 8 or 4.
        block_size: values per scale.
        out: optional contiguous float32 tensor of the result's shape to write into.
        accumulate: add the dequantized values to ``out`` (required then) instead of overwriting it; summing
            several ranks' payloads this way keeps each tile in cache.
    """
    lead = codes.shape[:-1]
    code_blocks = codes.reshape(-1, block_size * bits // 8)
    steps = scales.reshape(-1).float().unsqueeze(1)
    num_blocks = steps.shape[0]
    if out is None:
        if accumulate:
            raise ValueError("dequantize(accumulate=True) needs `out`, the tensor to add to.")
        out = torch.empty(*lead, scales.shape[-1] * block_size, device=codes.device)
    if native.usable(codes, scales, out) and native.library() is not None:
        native.dequantize(codes, scales, out, bits, block_size, accumulate)
        return out
    if out.is_contiguous() and fused.usable(codes, scales, out) and fused.dequantize(codes, scales, out, bits,
                                                                                     block_size, accumulate):
        return out
    values = out.view(num_blocks, block_size)
    rows = _tile_rows(codes, num_blocks, block_size)
    scratch = torch.empty(min(rows, num_blocks), block_size, device=codes.device) if accumulate else None
    for first in range(0, num_blocks, rows):
        tile, chunk = code_blocks[first:first + rows], values[first:first + rows]
        if scratch is not None:
            target, chunk = chunk, scratch[:tile.shape[0]]
        if bits == 8:
            chunk.copy_(tile.view(torch.int8))
        else:
            # Unpack: ``(p | p << 4) & 0x0F0F`` as an int16 holds lo, hi in its two bytes (little-endian, as on
            # every CPU and GPU torch runs on); viewed as int8 and offset back, one copy converts both to fp32.
            wide = tile.to(torch.int16)
            chunk.copy_(wide.bitwise_or_(wide << 4).bitwise_and_(0x0F0F).view(torch.int8).sub_(8))
        # Copy then an fp32 in-place multiply: a mixed int8 * fp32 ``mul`` takes a slow casting path on CPU.
        if scratch is None:
            chunk.mul_(steps[first:first + rows])
        else:
            target.addcmul_(chunk, steps[first:first + rows])
    return out
