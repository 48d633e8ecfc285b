"""Block-wise quantizer: round-trip error bounds, int4 packing, stochastic rounding, non-finite values, bad input.

Every test runs twice: on the native CPU kernels (``native.py``) and on the eager PyTorch path.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from lightning_deepseek.compression import native
from lightning_deepseek.compression import quantize as quantize_module
from lightning_deepseek.compression.quantize import (
    QuantizationConfigError,
    dequantize,
    payload_bytes,
    qmax,
    quantize,
    validate,
)


@pytest.fixture(autouse=True, params=["native", "torch"])
def kernel_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "torch":
        monkeypatch.setenv("LDS_NATIVE_KERNELS", "0")
    else:
        if shutil.which("cc") is None:
            pytest.skip("no C compiler on PATH: the native kernels cannot be built here")
        monkeypatch.delenv("LDS_NATIVE_KERNELS", raising=False)
        assert native.library() is not None
    return request.param


def _blocks_absmax(x: torch.Tensor, block_size: int) -> torch.Tensor:
    return x.view(-1, block_size).abs().amax(dim=1, keepdim=True)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block_size", [64, 128])
def test_round_to_nearest_error_within_half_step(bits: int, block_size: int) -> None:
    gen = torch.Generator().manual_seed(0)
    # Blocks of very different magnitudes: per-block scales must follow each block, not the tensor.
    x = torch.randn(64 * block_size, generator=gen) * torch.logspace(-8, 4, 64).repeat_interleave(block_size)
    codes, scales = quantize(x, bits, block_size)
    assert codes.dtype == torch.uint8 and codes.numel() == x.numel() * bits // 8
    assert scales.dtype == torch.bfloat16 and scales.numel() == x.numel() // block_size
    assert codes.numel() + 2 * scales.numel() == payload_bytes(x.numel(), bits, block_size)
    err = (dequantize(codes, scales, bits, block_size) - x).view(-1, block_size).abs()
    step = _blocks_absmax(x, block_size) / qmax(bits)
    assert (err <= 0.5 * step * (1 + 2**-7)).all()
    # Round-to-nearest is exact on the grid: quantizing the dequantized values changes nothing.
    again = quantize(dequantize(codes, scales, bits, block_size), bits, block_size)
    assert torch.equal(again[0], codes) and torch.equal(again[1], scales)


def test_int4_packs_two_codes_per_byte_exactly() -> None:
    block = torch.arange(-7, 9, dtype=torch.float32).clamp(max=7)  # every int4 level, absmax 7 -> scale 1
    x = block.repeat(4)
    codes, scales = quantize(x, 4, 16)
    assert torch.equal(scales.float(), torch.ones(4))
    assert torch.equal(dequantize(codes, scales, 4, 16), x)
    assert codes[0].item() == (-7 + 8) | ((-6 + 8) << 4)


def test_ties_round_half_to_even_in_codes_and_scales() -> None:
    # Scale 1: the halves must go to the even neighbour (torch.round's rule), not away from zero.
    x = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.0] * 2)
    codes, scales = quantize(x, 8, 16)
    assert torch.equal(codes.view(torch.int8)[:8], torch.tensor([127, 0, 2, 2, 0, -2, -2, 3], dtype=torch.int8))
    # absmax / 127 == 1.00390625, exactly halfway between two bfloat16 values: round to the even one, as torch does.
    tie = torch.zeros(16)
    tie[0] = 127.49609375
    scale = quantize(tie, 8, 16)[1]
    assert scale.view(torch.int16).item() == torch.tensor(1.00390625).to(torch.bfloat16).view(torch.int16).item()
    assert scale.item() == 1.0


def test_zero_block_and_batched_dequantize() -> None:
    x = torch.cat([torch.zeros(64), torch.randn(64)])
    codes, scales = quantize(x, 8, 64)
    out = dequantize(codes.view(2, -1), scales.view(2, -1), 8, 64)
    assert out.shape == (2, 64)
    assert torch.equal(out[0], torch.zeros(64))


@pytest.mark.parametrize("bits", [8, 4])
def test_stochastic_rounding_is_unbiased(bits: int) -> None:
    x = torch.full((64,), 0.3)
    x[0] = 1.0  # absmax 1: 0.3 sits between two levels for both widths
    gen = torch.Generator().manual_seed(1)
    mean = torch.stack([dequantize(*quantize(x, bits, 64, gen), bits, 64) for _ in range(2000)]).mean(0)
    rtn = dequantize(*quantize(x, bits, 64), bits, 64)
    step = 1.0 / qmax(bits)
    assert (rtn[1:] - 0.3).abs().max() > 0.1 * step  # round-to-nearest is biased here ...
    assert (mean[1:] - 0.3).abs().max() < 0.05 * step  # ... stochastic rounding is not


@pytest.mark.parametrize("bits", [8, 4])
def test_non_finite_values_propagate_to_their_block(bits: int) -> None:
    x = torch.randn(4 * 32)
    x[5], x[40] = float("inf"), float("nan")
    out = dequantize(*quantize(x, bits, 32), bits, 32)
    assert not torch.isfinite(out[:32]).any() and not torch.isfinite(out[32:64]).any()
    assert torch.isfinite(out[64:]).all()


@pytest.mark.parametrize("bits, block_size", [(3, 128), (16, 128), (True, 128), (8, 0), (8, 127), (8, 8192),
                                              (8, 64.0)])
def test_bad_settings_raise_with_the_setting_name(bits: object, block_size: object) -> None:
    with pytest.raises(QuantizationConfigError, match="bits" if block_size == 128 else "block_size"):
        validate(bits, block_size)  # type: ignore[arg-type]


def _reference_quantize(x: torch.Tensor, bits: int, block_size: int, generator: torch.Generator | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain formulation (|x| temporary, fresh tensors, stack-based int4 packing) the fast path must match."""
    limit = qmax(bits)
    blocks = x.float().view(-1, block_size)
    scales = (blocks.abs().amax(dim=1) / limit).to(torch.bfloat16)
    step = scales.float()
    inverse = torch.where(step > 0, step.reciprocal(), torch.zeros_like(step)).clamp(max=torch.finfo(torch.float32).max)
    y = blocks * inverse.unsqueeze(1)
    if generator is None:
        y = y.round()
    else:
        y = (y + torch.rand(y.shape, generator=generator)).floor()
    y = y.clamp(-limit, limit).nan_to_num(0.0)
    if bits == 8:
        return y.to(torch.int8).view(torch.uint8).view(-1), scales
    codes = (y.view(-1, 2) + 8).to(torch.uint8)
    return codes[:, 0] | (codes[:, 1] << 4), scales


def _reference_dequantize(codes: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int) -> torch.Tensor:
    lead = codes.shape[:-1]
    if bits == 8:
        values = codes.view(torch.int8).float()
    else:
        values = torch.stack((codes & 0x0F, codes >> 4), dim=-1).float() - 8.0
    return (values.view(*lead, -1, block_size) * scales.float().unsqueeze(-1)).view(*lead, -1)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal where finite, and non-finite at the same places (a non-finite block's codes are unspecified,
    so its values may come out as inf or NaN)."""
    a, b = a.float(), b.float()
    finite = a.isfinite()
    return torch.equal(finite, b.isfinite()) and torch.equal(a[finite], b[finite])


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("case", ["wide_range", "non_finite", "bfloat16_input", "stochastic", "subnormal"])
@pytest.mark.parametrize("tile_blocks", [None, 5])
def test_fast_path_is_bitwise_equal_to_the_reference(bits: int, case: str, tile_blocks: int | None,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    block_size, blocks = 64, 97
    if tile_blocks is not None:  # many tiles and a ragged last one (97 = 19 * 5 + 2), as for large buckets
        monkeypatch.setattr(quantize_module, "TILE_VALUES", tile_blocks * block_size)
    gen = torch.Generator().manual_seed(3)
    # 1e-30 .. 1e30 per block: tiny scales (bf16 subnormal territory) and huge ones, where clamping matters.
    x = torch.randn(blocks * block_size, generator=gen) * torch.logspace(-30, 30, blocks).repeat_interleave(block_size)
    if case == "non_finite":
        x[3], x[5 * block_size], x[7 * block_size + 1] = float("inf"), float("nan"), float("-inf")
        x[9 * block_size:10 * block_size] = 0.0
    if case == "bfloat16_input":
        x = x.bfloat16()
    if case == "subnormal":  # scales below 2^-126: no finite reciprocal; zeros inside the blocks (0 * inf = NaN)
        x = torch.randn(blocks * block_size, generator=gen) * torch.logspace(-44, -34, blocks).repeat_interleave(
            block_size)
        x[::3] = 0.0
    stochastic = case == "stochastic"
    ref = _reference_quantize(x, bits, block_size, torch.Generator().manual_seed(5) if stochastic else None)
    fast = quantize(x, bits, block_size, torch.Generator().manual_seed(5) if stochastic else None)
    assert _same(ref[1], fast[1])
    # Codes of a non-finite block are unspecified (its scale alone makes it dequantize to non-finite values).
    finite = torch.isfinite(ref[1].float()).repeat_interleave(block_size * bits // 8)
    assert torch.equal(ref[0][finite], fast[0][finite])
    # The fused error-feedback residual, also written over the input itself as the hook does.
    residual = x.float().clone()
    again = quantize(residual, bits, block_size, torch.Generator().manual_seed(5) if stochastic else None,
                     residual=residual)
    assert torch.equal(again[0][finite], fast[0][finite])
    assert _same(residual, x.float() - _reference_dequantize(*ref, bits, block_size))
    if case == "subnormal":
        assert torch.isfinite(residual).all() and (residual.abs() <= x.float().abs().amax()).all()
    # Accumulating into another tensor (the hook's phase 2: residual += W * (x - Q(x))), W not a power of two.
    if not stochastic:
        start = torch.randn(x.numel(), generator=gen)
        accumulated = start.clone()
        quantize(x, bits, block_size, residual=accumulated, residual_alpha=3.0)
        expected = start.add(x.float() - _reference_dequantize(*ref, bits, block_size), alpha=3.0)
        assert _same(accumulated, expected)
    out = torch.full((x.numel(),), 123.0)
    assert _same(_reference_dequantize(*ref, bits, block_size), dequantize(*fast, bits, block_size, out=out))
    assert _same(out, _reference_dequantize(*ref, bits, block_size))
    # Batched rows from a strided (non-contiguous) view, as phase 2 reads them out of the receive buffer.
    wire = torch.cat((fast[0].view(blocks, -1), torch.zeros(blocks, 3, dtype=torch.uint8)), dim=1)
    codes_rows = wire[:, :-3]
    assert _same(_reference_dequantize(codes_rows, fast[1].view(blocks, -1), bits, block_size),
                 dequantize(codes_rows, fast[1].view(blocks, -1), bits, block_size))
