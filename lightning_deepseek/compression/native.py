"""Native CPU kernels of the quantizer: ``kernels.c`` compiled on first use with the system C compiler.

Why our own: the gradient exchange spends its CPU time in quantize/dequantize, on the same cores as backward, so
their speed is step time. Eager PyTorch needs about ten ops per tile (0.35x of a memory copy for an int8 round trip
on one core of the development CPU), ``torch.compile`` (inductor C++) fuses them but its per-block reduction runs at
0.11x and compiles for seconds per process, and torch's C++-extension toolchain needs ninja, the torch headers and
about a minute of compile. ``kernels.c`` is three loops over blocks (quantize; dequantize; average received rows
into a slice of a gradient) in plain C with vector extensions, no headers beyond libc: it compiles in about 0.3 s,
vectorises without fast-math and runs the round trip at about 0.5x of a memory copy
(``benchmarks/compression/kernels.py``). Results equal the eager path bitwise
(``tests/compression/test_native.py``), so which one runs never changes what a model learns.

Build: ``$CC`` (default ``cc``) with ``-O3 -march=native`` (retried without ``-march=native`` if the compiler
rejects it) into ``$LDS_KERNEL_CACHE`` (default ``~/.cache/lightning_deepseek``), one file per source, flags,
compiler and CPU, written atomically so that ranks starting together share it. Loaded with ``ctypes``, which
releases the GIL during a call. ``LDS_NATIVE_KERNELS=0`` turns them off. Without a working compiler the eager path
runs and a warning says so once per process; nothing else changes. CPU only: accelerators run the eager ops.
``python -m lightning_deepseek.compression`` builds them ahead of time and prints the library's path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = ("-O3", "-fno-math-errno", "-ffp-contract=off", "-std=gnu11", "-shared", "-fPIC")
_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False


class NativeKernelsUnavailable(RuntimeError):
    """The C kernels could not be built or loaded; the message says why and how to fix it."""


def enabled() -> bool:
    """Whether ``LDS_NATIVE_KERNELS`` allows the native kernels (anything but ``0``/``false``/``no``/``off``)."""
    return os.environ.get("LDS_NATIVE_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    """Where built kernels are kept: ``$LDS_KERNEL_CACHE`` or ``~/.cache/lightning_deepseek``."""
    env = os.environ.get("LDS_KERNEL_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lightning_deepseek"


def _cpu_signature() -> str:
    # -march=native code must not run on a different CPU sharing the cache (a network home directory).
    try:
        text = Path("/proc/cpuinfo").read_text()
        flags = next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _compile(compiler: list[str], out: Path) -> None:
    errors = []
    for extra in (("-march=native",), ()):
        cmd = [*compiler, *FLAGS, *extra, str(SOURCE), "-o", str(out)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise NativeKernelsUnavailable(f"could not run the C compiler {shlex.join(compiler)!r}: {exc}") from exc
        if done.returncode == 0:
            return
        errors.append(f"$ {' '.join(cmd)}\n{done.stderr.strip()[-2000:]}")
    raise NativeKernelsUnavailable("the C compiler failed:\n" + "\n".join(errors))


def build() -> Path:
    """Compile ``kernels.c`` unless the cache already holds it; return the shared library's path."""
    compiler = shlex.split(os.environ.get("CC", "cc")) or ["cc"]  # CC may carry a launcher or flags: "ccache gcc"
    if shutil.which(compiler[0]) is None:
        raise NativeKernelsUnavailable(f"no C compiler: {compiler[0]!r} is not on PATH (install gcc or clang, or "
                                       "set CC to one)")
    try:
        version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NativeKernelsUnavailable(f"could not run the C compiler {shlex.join(compiler)!r}: {exc}") from exc
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *FLAGS, *compiler, version, _cpu_signature()]).encode())
    target = cache_dir() / f"kernels-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        _compile(compiler, Path(tmp))
        os.replace(tmp, target)  # atomic: another rank may be building the same file right now
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    lib.lds_quantize.argtypes = [ptr, ptr, ptr, ptr, i64, i32, i32, i32, ctypes.c_float]
    lib.lds_quantize.restype = None
    lib.lds_dequantize.argtypes = [ptr, ptr, ptr, i64, i32, i32, i32]
    lib.lds_dequantize.restype = None
    lib.lds_average_range.argtypes = [ptr, ptr, i32, ptr, i64, i64, i32, i32]
    lib.lds_average_range.restype = None
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernels, built on first call; ``None`` if disabled or unavailable (warned once)."""
    global _library, _tried
    if not enabled():
        return None
    if not _tried:
        with _lock:
            if not _tried:
                try:
                    _library = _load(build())
                except (NativeKernelsUnavailable, OSError) as exc:
                    warnings.warn(f"lightning_deepseek: the native CPU quantization kernels are unavailable ({exc}). "
                                  "Gradient compression falls back to eager PyTorch, which gives the same results "
                                  "about twice as slowly on CPU. Install a C compiler (gcc or clang; or point CC "
                                  "at one), point LDS_KERNEL_CACHE at a writable directory if the cache could not be "
                                  "written, or set LDS_NATIVE_KERNELS=0 to choose the eager path and silence this "
                                  "warning.",
                                  RuntimeWarning, stacklevel=3)
                _tried = True
    return _library


def usable(*tensors: torch.Tensor | None) -> bool:
    """Whether the native kernels can run on these tensors: all on CPU and contiguous (``None`` is skipped)."""
    return all(t is None or (t.device.type == "cpu" and t.is_contiguous()) for t in tensors)


def quantize(x: torch.Tensor, residual: torch.Tensor | None, codes: torch.Tensor, scales: torch.Tensor,
             bits: int, block_size: int, residual_alpha: float | None = None) -> None:
    """Round-to-nearest quantize of contiguous float32 CPU ``x`` into ``codes``/``scales`` (see quantize.py)."""
    lib = library()
    assert lib is not None and x.dtype == torch.float32
    lib.lds_quantize(x.data_ptr(), None if residual is None else residual.data_ptr(), codes.data_ptr(),
                     scales.data_ptr(), x.numel() // block_size, block_size, bits, int(residual_alpha is not None),
                     0.0 if residual_alpha is None else residual_alpha)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, bits: int, block_size: int,
               accumulate: bool) -> None:
    """``out (+)= dequantize(codes, scales)`` for contiguous CPU tensors, ``out`` float32."""
    lib = library()
    assert lib is not None and out.dtype == torch.float32
    lib.lds_dequantize(codes.data_ptr(), scales.data_ptr(), out.data_ptr(), scales.numel(), block_size, bits,
                       int(accumulate))


def average_range(rows: Sequence[tuple[torch.Tensor, torch.Tensor]], out: torch.Tensor, first: int, bits: int,
                  block_size: int) -> None:
    """``out = `` the average over ``rows`` (``(codes, scales)`` of quantized rows, contiguous CPU) of their values
    ``[first, first + out.numel())``, summed in order: a block-unaligned slice of the average written straight into
    its destination (``out`` contiguous float32). One row is a plain dequantize of the slice."""
    lib = library()
    assert lib is not None and out.dtype == torch.float32 and out.is_contiguous()
    assert all(first >= 0 and first + out.numel() <= scales.numel() * block_size for _, scales in rows)
    n = len(rows)
    codes = (ctypes.c_void_p * n)(*[c.data_ptr() for c, _ in rows])
    scales = (ctypes.c_void_p * n)(*[s.data_ptr() for _, s in rows])
    lib.lds_average_range(codes, scales, n, out.data_ptr(), first, out.numel(), block_size, bits)


def main() -> None:
    """``python -m lightning_deepseek.compression``: build the kernels now (for example in a container image
    or once per node before training) and print where they are; exit 1 with the reason if they cannot be built."""
    try:
        path = build()
    except NativeKernelsUnavailable as exc:
        raise SystemExit(f"lightning_deepseek: cannot build the native CPU kernels: {exc}") from None
    _load(path)
    print(path)
