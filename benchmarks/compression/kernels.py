"""Quantize + dequantize throughput next to a memory copy of the same fp32 bytes (the physical limit).

Runs on CUDA when available (``--device cuda``), otherwise on CPU with one thread per process as in training::

    .venv/bin/python benchmarks/compression/kernels.py [--device cuda] [--numel 16777216] [--compile]

Throughput is fp32 input bytes per second of a full round trip (quantize, with or without writing the
error-feedback residual, then dequantize; int8 at block 128, int4 at block 64, the presets); the copy is
``dst.copy_(src)`` of the same fp32 tensor. On CPU the native kernels (``native.py``) and the eager torch path are
measured side by side; on CUDA the fused kernels (``fused.py``, the product's path there) and the eager path.
Interleaved repetitions, medians; the table reports the ratio. Dequantize writes into a
preallocated ``out``. ``--compile`` adds ``torch.compile`` (inductor) of the plain formulation, with its one-off
compile time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_deepseek.compression import fused, native  # noqa: E402
from lightning_deepseek.compression.quantize import dequantize, quantize  # noqa: E402


def timed(fn, device: torch.device) -> float:  # noqa: ANN001 - a zero-argument callable
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _plain_round_trip(x: torch.Tensor) -> torch.Tensor:
    """int8 RTN round trip as one functional expression, the form inductor fuses best."""
    blocks = x.view(-1, 128)
    scales = (blocks.abs().amax(dim=1) / 127).to(torch.bfloat16).float()
    inverse = torch.where(scales > 0, scales.reciprocal(), torch.zeros_like(scales))
    codes = (blocks * inverse.unsqueeze(1)).round().clamp(-127, 127).nan_to_num(0.0).to(torch.int8)
    return (codes.float() * scales.unsqueeze(1)).view(-1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--numel", type=int, default=1 << 24)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    x = torch.randn(args.numel, device=device)
    dst = torch.empty_like(x)
    out = torch.empty_like(x)

    residual = torch.empty_like(x)

    def round_trip(bits: int, gen: torch.Generator | None = None, eager: bool = False, keep: bool = True) -> None:
        os.environ["LDS_NATIVE_KERNELS"] = os.environ["LDS_FUSED_KERNELS"] = "0" if eager else "1"
        block = 128 if bits == 8 else 64  # the presets
        dequantize(*quantize(x, bits, block, gen, residual=residual if keep else None), bits, block, out=out)

    gen = torch.Generator(device=device).manual_seed(0)
    cases = {"memory copy": lambda: dst.copy_(x)}
    if device.type == "cpu":
        paths = [("native kernels", False)] if native.library() is not None else []
    else:  # the product's path on CUDA, compiled here (its one-off compile time is left out of the timing)
        start = time.perf_counter()
        for bits in (8, 4):
            round_trip(bits)
            round_trip(bits, keep=False)
        paths = [(f"fused kernels (torch.compile, compiled in {time.perf_counter() - start:.0f} s)", False)]
        if not fused.usable(x):
            paths = [("fused kernels unavailable here: see the warning; eager", False)]
    paths.append(("eager torch", True))
    for bits in (8, 4):
        for path, eager in paths:
            cases[f"int{bits} RTN + residual, {path}"] = lambda bits=bits, eager=eager: round_trip(bits, eager=eager)
            cases[f"int{bits} RTN, {path}"] = lambda bits=bits, eager=eager: round_trip(bits, eager=eager, keep=False)
    cases["int8 stochastic, eager torch"] = lambda: round_trip(8, gen, eager=True, keep=False)
    if args.compile:
        start = time.perf_counter()
        compiled = torch.compile(_plain_round_trip, dynamic=False)
        compiled(x)
        seconds = time.perf_counter() - start
        cases[f"int8 RTN, torch.compile of the plain formulation (compiled in {seconds:.0f} s)"] = lambda: compiled(x)
    times: dict[str, list[float]] = {k: [] for k in cases}
    for fn in cases.values():
        fn()
    for _ in range(args.reps):
        for name, fn in cases.items():
            times[name].append(timed(fn, device))
    nbytes = x.numel() * 4
    copy_gbs = nbytes / statistics.median(times["memory copy"]) / 1e9
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {args.threads} thread(s)"
    print(f"command: {' '.join(sys.argv)}\ndevice: {name}, {args.numel} fp32 values ({nbytes / 2**20:.0f} MiB)\n")
    print("| kernel | GB/s (fp32 input) | vs memory copy |\n|---|---|---|")
    for case, ts in times.items():
        gbs = nbytes / statistics.median(ts) / 1e9
        print(f"| {case} | {gbs:.2f} | {gbs / copy_gbs:.2f}x |")


if __name__ == "__main__":
    main()
