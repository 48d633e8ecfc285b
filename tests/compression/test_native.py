"""Native CPU kernels: built once into the cache, the eager fallback (with a warning) without a compiler, the switch.

Their results are checked against the eager path and a plain reference in ``test_quantize.py`` (every test there
runs on both paths).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_deepseek.compression import native
from lightning_deepseek.compression.quantize import dequantize, quantize

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on PATH")


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty kernel cache and a module that has not tried to load the kernels yet."""
    monkeypatch.setenv("LDS_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("LDS_NATIVE_KERNELS", raising=False)
    monkeypatch.setattr(native, "_library", None)
    monkeypatch.setattr(native, "_tried", False)
    return tmp_path / "cache"


@needs_compiler
def test_built_once_into_the_cache_and_reused(fresh: Path) -> None:
    first = native.build()
    assert first.parent == fresh and first.exists()
    stamp = first.stat().st_mtime_ns
    assert native.build() == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in fresh.iterdir()] == [first.name]  # no temporary left behind
    assert native.library() is not None


@needs_compiler
def test_ranks_building_together_share_one_file(fresh: Path) -> None:
    # native.py alone (it needs only torch): the package's __init__ would import Lightning in each process.
    code = (f"import importlib.util as u; spec = u.spec_from_file_location('native', {native.__file__!r}); "
            "module = u.module_from_spec(spec); spec.loader.exec_module(module); print(module.build())")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(3)]
    paths = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(paths) == 1 and [p.name for p in fresh.iterdir()] == [Path(paths.pop()).name]


def test_without_a_compiler_warns_once_and_falls_back(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "no-such-compiler-lds")
    x = torch.randn(256)
    with pytest.warns(RuntimeWarning, match="no-such-compiler-lds.*LDS_NATIVE_KERNELS=0"):
        codes, scales = quantize(x, 8, 64)
    assert native.library() is None
    assert (dequantize(codes, scales, 8, 64) - x).abs().max() <= x.abs().max() / 127
    assert not fresh.exists()


def test_a_failing_compiler_is_reported_with_its_message(fresh: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    broken = tmp_path / "broken-cc"
    broken.write_text("#!/bin/sh\n[ \"$1\" = --version ] && exit 0\necho 'fatal: out of licences' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    with pytest.raises(native.NativeKernelsUnavailable, match="out of licences"):
        native.build()
    assert not any(fresh.iterdir())  # the failed output was removed


def test_switched_off_by_environment(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LDS_NATIVE_KERNELS", "0")
    assert native.library() is None
    quantize(torch.randn(128), 8, 64)
    assert not fresh.exists()  # nothing was built


@needs_compiler
def test_non_contiguous_or_non_fp32_inputs_take_the_eager_path(fresh: Path) -> None:
    x = torch.randn(64, 4)[:, 0]  # strided
    assert not native.usable(x)
    codes, scales = quantize(x, 8, 16)
    ref_codes, ref_scales = quantize(x.contiguous(), 8, 16)
    assert torch.equal(codes, ref_codes) and torch.equal(scales.float(), ref_scales.float())
    half = quantize(x.contiguous().half(), 8, 16)
    assert torch.equal(half[1].float(), quantize(x.contiguous().half().float(), 8, 16)[1].float())


def test_prebuild_command_prints_the_library_or_fails_with_the_reason(fresh: Path) -> None:
    cmd = [sys.executable, "-m", "lightning_deepseek.compression"]
    env = {**os.environ, "CC": "no-such-compiler-lds"}
    failed = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert failed.returncode == 1 and "no-such-compiler-lds" in failed.stderr
    if shutil.which("cc") is None:
        return
    built = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    assert Path(built.stdout.strip()).parent == fresh and Path(built.stdout.strip()).exists()


@needs_compiler
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("nrows", [1, 2, 3])
def test_average_range_matches_a_slice_of_the_eager_average(bits: int, nrows: int,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    block_size = 32
    gen = torch.Generator().manual_seed(0)
    rows = [quantize(torch.randn(20 * block_size, generator=gen) * (r + 1), bits, block_size) for r in range(nrows)]
    monkeypatch.setenv("LDS_NATIVE_KERNELS", "0")  # the reference: eager dequantize, accumulate, div_ (tile path)
    full = dequantize(*rows[0], bits, block_size)
    for codes, scales in rows[1:]:
        dequantize(codes, scales, bits, block_size, out=full, accumulate=True)
    if nrows > 1:
        full.div_(nrows)
    monkeypatch.delenv("LDS_NATIVE_KERNELS")
    # Unaligned starts and ends, inside one block, across many, a whole block, the very end.
    for first, count in [(0, 640), (5, 3), (31, 2), (30, 100), (64, 32), (600, 40), (639, 1)]:
        out = torch.full((count,), float("nan"))
        native.average_range(rows, out, first, bits, block_size)
        assert torch.equal(out, full[first:first + count]), (first, count)
