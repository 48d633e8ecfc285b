"""The fused quantizer's formulation (``fused.py``): bitwise the eager path's results, evaluated eagerly and compiled
on CPU; when it is used; the fallback when compiling fails. Its CUDA speed and results: ``test_cuda.py`` and
``benchmarks/compression/kernels.py`` on a GPU."""

from __future__ import annotations

import pytest
import torch

from lightning_deepseek.compression import fused
from lightning_deepseek.compression.quantize import dequantize, quantize

CASES = [(8, 128), (4, 64)]


@pytest.fixture(autouse=True)
def eager_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LDS_NATIVE_KERNELS", "0")  # the reference: the eager torch path
    monkeypatch.setattr(fused, "_failed", None)


def _gradient_like(numel: int, block_size: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    blocks = numel // block_size
    x = torch.randn(numel, generator=gen) * torch.logspace(-9, 5, blocks).repeat_interleave(block_size)
    x[:block_size] = 0.0  # an all-zero block: scale 0
    x[block_size:2 * block_size] = 1e-38  # subnormal scale: the capped reciprocal
    return x


def _fused_quantize(quantize_fn, x, bits, block_size, residual=None, residual_alpha=None):  # noqa: ANN001, ANN202
    codes = torch.empty(x.numel() * bits // 8, dtype=torch.uint8)
    scales = quantize_fn(x, codes, residual, bits, block_size, residual_alpha)
    return codes, scales


@pytest.mark.parametrize(("bits", "block_size"), CASES)
def test_formulation_equals_the_eager_path_bitwise(bits: int, block_size: int) -> None:
    x = _gradient_like(64 * block_size, block_size)
    ref_codes, ref_scales = quantize(x, bits, block_size)
    codes, scales = _fused_quantize(fused.quantize_blocks, x, bits, block_size)
    assert torch.equal(codes, ref_codes) and torch.equal(scales, ref_scales)
    # The residual written in place of x (phase 1 of the hook) and accumulated with a weight (phase 2).
    ref_x, x_in_place = x.clone(), x.clone()
    quantize(ref_x, bits, block_size, residual=ref_x)
    _fused_quantize(fused.quantize_blocks, x_in_place, bits, block_size, residual=x_in_place)
    assert torch.equal(x_in_place, ref_x)
    ref_acc, acc = torch.ones_like(x), torch.ones_like(x)
    quantize(x, bits, block_size, residual=ref_acc, residual_alpha=3.0)
    _fused_quantize(fused.quantize_blocks, x, bits, block_size, residual=acc, residual_alpha=3.0)
    assert torch.equal(acc, ref_acc)
    # Dequantize, overwriting and accumulating, with one row per rank.
    rows_codes, rows_scales = torch.stack([codes, codes.flip(0)]), torch.stack([scales, scales.flip(0)])
    reference = dequantize(rows_codes, rows_scales, bits, block_size)
    out = torch.full_like(reference, float("nan"))
    fused.dequantize_blocks(rows_codes, rows_scales, out, bits, block_size, accumulate=False)
    assert torch.equal(out, reference)
    fused.dequantize_blocks(codes, scales, out[0], bits, block_size, accumulate=True)
    assert torch.equal(out[0], dequantize(codes, scales, bits, block_size, out=reference[0].clone(),
                                          accumulate=True))


def test_non_finite_blocks_dequantize_non_finite() -> None:
    x = torch.randn(4 * 128)
    x[3], x[200] = float("inf"), float("nan")
    codes, scales = _fused_quantize(fused.quantize_blocks, x, 8, 128)
    out = torch.empty_like(x)
    fused.dequantize_blocks(codes, scales, out, 8, 128, accumulate=False)
    finite = out.view(4, 128).isfinite().all(dim=1)
    assert finite.tolist() == [False, False, True, True]


def test_compiled_on_cpu_equals_the_eager_path_bitwise() -> None:
    """The compiled kernels (inductor's C++ backend here; Triton on CUDA), through the public entry points."""
    for bits, block_size in CASES:
        x = _gradient_like(32 * block_size, block_size, seed=1)
        ref_x = x.clone()
        ref_codes, ref_scales = quantize(ref_x, bits, block_size, residual=ref_x)
        codes = torch.empty_like(ref_codes)
        scales = torch.empty_like(ref_scales)
        assert fused.quantize(x, x, codes, scales, bits, block_size)
        assert torch.equal(codes, ref_codes) and torch.equal(scales, ref_scales) and torch.equal(x, ref_x)
        # A different length reuses the compiled kernel (dynamic shapes) and stays exact.
        out = torch.empty(16 * block_size)
        assert fused.dequantize(codes[:16 * block_size * bits // 8], scales[:16], out, bits, block_size)
        assert torch.equal(out, dequantize(ref_codes[:16 * block_size * bits // 8], ref_scales[:16], bits, block_size))
        # One row per rank, accumulated into what is there (phase 2 of the hook sums the ranks' rows this way).
        rows_codes, rows_scales = torch.stack([codes, codes.flip(0)]), torch.stack([scales, scales.flip(0)])
        total = torch.ones(2, x.numel())
        assert fused.dequantize(rows_codes, rows_scales, total, bits, block_size, accumulate=True)
        reference = dequantize(rows_codes, rows_scales, bits, block_size, out=torch.ones(2, x.numel()), accumulate=True)
        assert torch.equal(total, reference)
    assert fused._failed is None


def test_used_on_cuda_tensors_only_and_when_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not fused.usable(torch.zeros(4))
    monkeypatch.setenv("LDS_FUSED_KERNELS", "0")
    assert not fused.enabled()
    monkeypatch.setenv("LDS_FUSED_KERNELS", "1")
    assert fused.enabled()


def test_a_compile_failure_warns_once_and_leaves_the_eager_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._dynamo.exc import TorchDynamoException

    class CompilerFailed(TorchDynamoException):
        pass

    def failing_compile(fn, **kwargs):  # noqa: ANN001, ANN003, ANN202
        def run(*args):  # noqa: ANN002, ANN202
            raise CompilerFailed("no working C++ compiler")
        return run

    monkeypatch.setattr(fused, "_compiled", {})
    monkeypatch.setattr(torch, "compile", failing_compile)
    x = torch.randn(256)
    codes, scales = torch.empty(256, dtype=torch.uint8), torch.empty(2, dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="failed to compile.*LDS_FUSED_KERNELS=0"):
        assert not fused.quantize(x, None, codes, scales, 8, 128)
    assert fused._failed is not None and "no working C++ compiler" in fused._failed
    assert not fused.usable(x.new_zeros(0))  # off for the rest of the process


def test_a_kernel_error_is_raised_not_swallowed(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_compile(fn, **kwargs):  # noqa: ANN001, ANN003, ANN202
        def run(*args):  # noqa: ANN002, ANN202
            raise torch.OutOfMemoryError("CUDA out of memory")
        return run

    monkeypatch.setattr(fused, "_compiled", {})
    monkeypatch.setattr(torch, "compile", broken_compile)
    with pytest.raises(torch.OutOfMemoryError):
        fused.dequantize(torch.zeros(128, dtype=torch.uint8), torch.ones(1, dtype=torch.bfloat16), torch.empty(128),
                         8, 128)
    assert fused._failed is None
