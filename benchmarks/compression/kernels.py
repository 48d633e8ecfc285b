"""Quantize + dequantize throughput next to a memory copy of the same fp32 bytes (the physical limit).

Runs on CUDA when available (``--device cuda``), otherwise on CPU with one thread per process as in training::

    .venv/bin/python benchmarks/compression/kernels.py [--device cuda] [--numel 16777216]

Throughput is fp32 input bytes per second of a full round trip (quantize then dequantize); the copy is
``dst.copy_(src)`` of the same fp32 tensor. Interleaved repetitions, medians; the table reports the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_deepseek.compression.quantize import dequantize, quantize  # noqa: E402


def timed(fn, device: torch.device) -> float:  # noqa: ANN001 - a zero-argument callable
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--numel", type=int, default=1 << 24)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    x = torch.randn(args.numel, device=device)
    dst = torch.empty_like(x)
    cases = {"memory copy": lambda: dst.copy_(x)}
    for bits in (8, 4):
        cases[f"int{bits} quantize+dequantize (RTN)"] = lambda b=bits: dequantize(*quantize(x, b, 128), b, 128)
    gen = torch.Generator(device=device).manual_seed(0)
    cases["int8 quantize+dequantize (stochastic)"] = lambda: dequantize(*quantize(x, 8, 128, gen), 8, 128)
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
