"""Fused quantizer kernels for GPUs: the quantizer's formulation compiled by ``torch.compile`` (inductor, Triton).

Why: on a GPU the eager path of ``quantize.py`` launches about ten kernels per pass over the bucket, each a full
trip through device memory. Inductor fuses each direction into one kernel (a per-block reduction and the pointwise
work after it). The block size is a compile-time constant and the codes are written straight into the message (the
residual is staged only when it overwrites its input). Its speed against a memory copy is measured by
``benchmarks/compression/kernels.py`` on a GPU (benchmarks/compression/REPORT.md).
Why not a hand-written Triton kernel: inductor writes the kernel from the ten lines of torch below, for every bit
width and residual mode, and keeps up with torch and Triton versions; torch's CUDA wheels ship Triton.
On CPU the native kernels (``native.py``) run instead: inductor's C++ per-block reduction is slower there.

What runs here: round-to-nearest :func:`quantize` (codes, bfloat16 scales, the error-feedback residual written or
accumulated in the same pass) and :func:`dequantize` (overwrite or accumulate), the contract of ``native.py``.
Stochastic rounding stays on the eager path (its noise comes from a ``torch.Generator``). The formulation is the
eager path's, op for op; evaluated eagerly, and compiled on CPU, it gives bitwise the eager path's results
(``tests/compression/test_fused.py``); compiled on a GPU, ``tests/compression/test_cuda.py`` compares it with the CPU.

Compiled on first use in each process (seconds per kernel: one per bit width, block size, residual mode and
accumulate flag; sizes are dynamic from the first call, so bucket sizes do not recompile) with inductor's
``emulate_precision_casts``: by default inductor keeps float32 through the scales' bfloat16 round trip inside a
fused kernel, so codes and residual would follow the unrounded scale, not the one sent (the error feedback would
then carry the wrong error). ``LDS_FUSED_KERNELS=0`` turns it off; without Triton, or if compiling fails, the eager
path runs and a warning says why, once per process.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

SCALE_DTYPE = torch.bfloat16
_FLOAT_MAX = torch.finfo(torch.float32).max
_lock = threading.Lock()
_compiled: dict[tuple[Any, ...], Callable[..., Any]] = {}
_failed: str | None = None
_FAILED = object()


def enabled() -> bool:
    """Whether ``LDS_FUSED_KERNELS`` allows the fused kernels (anything but ``0``/``false``/``no``/``off``)."""
    return os.environ.get("LDS_FUSED_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def available(device: torch.device) -> bool:
    """Whether round-to-nearest on ``device`` runs in the fused kernels (so far in this process)."""
    return device.type == "cuda" and usable()


def usable(*tensors: torch.Tensor | None) -> bool:
    """Whether the fused kernels serve these tensors: all on a CUDA device (``None`` is skipped), allowed by
    ``LDS_FUSED_KERNELS``, Triton importable, and no earlier compile failure in this process."""
    if _failed is not None or not enabled():
        return False
    if not all(t is None or t.device.type == "cuda" for t in tensors):
        return False
    from torch.utils._triton import has_triton

    return has_triton()


def quantize_blocks(x: torch.Tensor, codes: torch.Tensor, residual: torch.Tensor | None, bits: int,
                    block_size: int, residual_alpha: float | None) -> torch.Tensor:
    """Round-to-nearest quantize of float32 ``x`` into ``codes`` (uint8); returns the bfloat16 scales. ``residual``
    (may be ``x``) receives ``x - dequantized`` or, with ``residual_alpha``, accumulates ``residual_alpha`` times it.
    The formulation both the compiled kernels and the tests evaluate (see ``quantize.quantize`` for the why). The
    scales are returned, not written: compiled code cannot write into an input that is a view of another dtype, and
    the hook's scales are bfloat16 views of a byte buffer (the codes are converted to bytes for the same reason)."""
    limit = 127 if bits == 8 else 7  # qmax; no shift: torch 2.11 cannot trace one of a symbolic int
    # Equal sizes, stated: with them the compiler indexes every tensor alike (no staging copy, no modulo).
    torch._check(codes.numel() * 8 == x.numel() * bits)
    torch._check(residual is None or residual.numel() == x.numel())
    blocks = x.view(-1, block_size)
    absmax = torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg())  # max(|x|), NaN included
    scales = (absmax / limit).to(SCALE_DTYPE)
    step = scales.float()
    inverse = torch.where(step > 0, step.reciprocal(), torch.zeros_like(step)).clamp(max=_FLOAT_MAX)
    y = (blocks * inverse.unsqueeze(1)).round().clamp(-limit, limit)
    if bits == 8:
        codes.copy_(y.to(torch.int8).to(torch.uint8).view(-1))  # two's complement bytes
    else:  # two codes per byte, the first in the low nibble, both offset by 8
        pairs = y.view(-1, block_size // 2, 2).to(torch.int32) + 8
        codes.copy_((pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8).view(-1))
    if residual is not None:
        error = blocks - y * step.unsqueeze(1)  # y * step is exact in float32: one rounding, as in the eager path
        # Written as flat tensors, not through views: inductor then stores straight into them (no staging copy).
        if residual_alpha is None:
            residual.copy_(error.view(-1))
        else:
            residual.add_(error.view(-1), alpha=residual_alpha)
    return scales


def dequantize_blocks(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, bits: int, block_size: int,
                      accumulate: bool) -> None:
    """``out`` (contiguous float32) = (or, with ``accumulate``, += ) the values of ``codes``/``scales``; leading
    dimensions of ``codes`` and ``scales`` (one row per rank) are flattened in order."""
    steps = scales.reshape(-1, 1).float()
    if bits == 8:
        q = codes.view(torch.int8).reshape(-1, block_size).float()
    else:
        b = codes.reshape(-1, block_size // 2).to(torch.int32)
        q = torch.stack(((b & 0xF) - 8, (b >> 4) - 8), dim=-1).reshape(-1, block_size).float()
    values = out.view(-1, block_size)
    if accumulate:
        values.add_(q * steps)  # q * step is exact: one rounding, as the eager path's addcmul_
    else:
        values.copy_(q * steps)


def _quantizer(bits: int, block_size: int, residual_alpha: float | None) -> Callable[..., torch.Tensor]:
    def quantize_kernel(x: torch.Tensor, codes: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return quantize_blocks(x, codes, residual, bits, block_size, residual_alpha)
    return quantize_kernel


def _dequantizer(bits: int, block_size: int, accumulate: bool) -> Callable[..., None]:
    def dequantize_kernel(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
        dequantize_blocks(codes, scales, out, bits, block_size, accumulate)
    return dequantize_kernel


def _run(make: Callable[..., Callable[..., Any]], settings: tuple[Any, ...], *tensors: torch.Tensor | None) -> Any:
    """``make(*settings)`` compiled, on ``tensors``; ``_FAILED`` if compiling failed (warned; the caller runs the
    eager path). The settings are constants of the kernel (one compiled kernel each: a block size known to the
    compiler gives a fixed-size per-block reduction); the tensors' sizes are dynamic (no recompile per bucket)."""
    global _failed
    key = (make.__name__, *settings)
    with _lock:
        if key not in _compiled:
            options = {"emulate_precision_casts": True}  # see the module docstring
            _compiled[key] = torch.compile(make(*settings), fullgraph=True, options=options)
        compiled = _compiled[key]
    for t in tensors:  # sizes vary by bucket: dynamic from the first call (a constant block size stays constant)
        for dim in range(t.dim() if t is not None else 0):
            torch._dynamo.maybe_mark_dynamic(t, dim)
    try:
        return compiled(*tensors)
    except Exception as exc:
        from torch._dynamo.exc import TorchDynamoException

        if not (isinstance(exc, TorchDynamoException) or type(exc).__module__.startswith("torch._inductor")):
            raise  # the kernel ran and failed (out of memory, a bad input): not a compiler's failure
        _failed = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
        warnings.warn(f"lightning_deepseek: the fused quantizer kernels failed to compile ({_failed}); the "
                      "gradient compression runs the eager torch ops instead (slower on GPUs, same results). "
                      "Set LDS_FUSED_KERNELS=0 to skip the attempt.", stacklevel=3)
        return _FAILED


def quantize(x: torch.Tensor, residual: torch.Tensor | None, codes: torch.Tensor, scales: torch.Tensor,
             bits: int, block_size: int, residual_alpha: float | None = None) -> bool:
    """Compiled :func:`quantize_blocks` into ``codes`` and ``scales``; ``False`` (nothing written) if compiling
    failed: then run the eager path."""
    computed = _run(_quantizer, (bits, block_size, residual_alpha), x, codes, residual)
    if computed is _FAILED:
        return False
    scales.copy_(computed)
    return True


def dequantize(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, bits: int, block_size: int,
               accumulate: bool = False) -> bool:
    """Compiled :func:`dequantize_blocks`; ``False`` (nothing written) if compiling failed: run the eager path."""
    return _run(_dequantizer, (bits, block_size, accumulate), codes, scales, out) is not _FAILED
