"""Settings and per-rank state of the compressed exchange: error-feedback residuals, counters, held writes, timing.

Split from ``hook.py`` (the exchange itself) so that the state's contract reads on its own: what a checkpoint
holds (``state_dict``: the step, every residual by parameter name, the stochastic-rounding generators), how the
callback reads telemetry (``bytes_sent``, ``compress_seconds`` or CUDA event spans, ``relative_error``), and the
CPU-only scheduling aid that holds final writes until the step's last bucket is on the wire (``hold``/``release``).
The message buffers and residual storage themselves live in the hook's per-bucket plans (``plans``).

The byte formulas here are what tests and benchmarks compare the counters against.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from lightning_deepseek.compression.quantize import payload_bytes, validate

if TYPE_CHECKING:
    from lightning_deepseek.compression.hook import _Plan


@dataclass
class CompressionConfig:
    """Settings of the compressed exchange.

    Args:
        bits: 8 (int8) or 4 (int4 packed two per byte).
        block_size: values sharing one bfloat16 scale; even, 16..4096.
        error_feedback: add each step's quantization residual to the next step's gradient.
        warmup_steps: synchronising steps exchanged uncompressed (fp32) before compression starts.
        min_bucket_numel: buckets smaller than this, or holding only 1-D parameters (biases, norms), stay fp32.
        stochastic_rounding: unbiased stochastic rounding instead of round-to-nearest.
        overlap: if False the hook waits for its exchange before returning (no overlap; for measurements).
        seed: seed of the stochastic-rounding generators (offset by the global rank).
    """

    bits: int = 8
    block_size: int = 128
    error_feedback: bool = True
    warmup_steps: int = 10
    min_bucket_numel: int = 4096
    stochastic_rounding: bool = False
    overlap: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        validate(self.bits, self.block_size)
        for name in ("warmup_steps", "min_bucket_numel"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"compression {name}={value!r} must be a non-negative integer.")


class CompressionState:
    """Per-rank state of the hook: residuals by parameter name, step counter, byte and time counters.

    Args:
        config: exchange settings.
        process_group: the data-parallel group (DDP's own); phase 1 and uncompressed buckets run on it.
        exchange_group: a second communicator with the same ranks, for phase 2 (see module docstring).
    """

    def __init__(self, config: CompressionConfig, process_group: dist.ProcessGroup,
                 exchange_group: dist.ProcessGroup) -> None:
        self.config = config
        self.process_group = process_group
        self.exchange_group = exchange_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.step = 0
        self.residuals: dict[str, torch.Tensor] = {}  # views into the plans' residual buffers
        self.plans: dict[tuple[str, ...], _Plan] = {}
        self.param_names: dict[int, str] = {}
        self.param_order: dict[int, int] = {}
        self.generators: tuple[torch.Generator, torch.Generator] | None = None
        self.last_bucket_time = 0.0  # when DDP handed over the step's last bucket (backward compute done)
        self.last_bucket_event: torch.cuda.Event | None = None  # the same moment on the GPU's timeline (CUDA)
        self.total_bytes_sent = 0
        self.total_bytes_fp32 = 0
        self.reset_counters()
        self._lock = threading.Lock()
        self._spare: list[torch.Tensor] = []  # CPU work buffers, see scratch()
        self._finite_flags: list[torch.Tensor] = []
        self._issued: torch.futures.Future | None = None
        self._phase2_stream: torch.cuda.Stream | None = None
        self.hold_writes = True  # on CPU, see hold(); False only to measure what holding buys
        self.single_exchange_max_world = 2  # up to this world size, one all-gather (module docstring); 0: tests
        self._held: list[Callable[[], None]] = []  # final writes waiting for the step's last bucket
        self._last_launched = False
        self.track_error = False

    def reset_counters(self) -> None:
        """Zero the per-step counters (called at the first bucket of every synchronising step)."""
        self.bytes_sent = 0
        self.bytes_fp32 = 0
        self.compress_seconds = 0.0
        self._gpu_spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # CUDA: see timed()
        self.num_compressed_buckets = 0
        self.error_sq: list[torch.Tensor] = []
        self.input_sq: list[torch.Tensor] = []

    @property
    def compressing(self) -> bool:
        """Whether the current step is past the warm-up."""
        return self.step >= self.config.warmup_steps

    def relative_error(self) -> float | None:
        """``||x - Q(x)|| / ||x||`` of the last step's phase-1 quantization, if it was tracked."""
        if not self.error_sq:
            return None
        den = torch.stack(self.input_sq).sum()
        return float(torch.stack(self.error_sq).sum().sqrt() / den.sqrt().clamp_min(1e-30))

    def state_dict(self) -> dict:
        """This rank's residuals (CPU copies), step counter and generator states."""
        gens = [g.get_state() for g in self.generators] if self.generators else None
        return {"step": self.step, "residuals": {k: v.detach().cpu().clone() for k, v in self.residuals.items()},
                "generators": gens}

    def load_state_dict(self, state: dict, device: torch.device) -> None:
        self.step = int(state["step"])
        self.residuals = {k: v.to(device) for k, v in state["residuals"].items()}
        self.plans = {}  # rebuilt on first use, from the loaded residuals
        if state.get("generators") is not None:
            self.generators = _make_generators(self.config.seed, device)
            for gen, gen_state in zip(self.generators, state["generators"]):
                gen.set_state(gen_state)

    @contextlib.contextmanager
    def scratch(self, numel: int, device: torch.device) -> Iterator[torch.Tensor]:
        """A float32 work buffer of ``numel`` values for the duration of the ``with`` block.

        On CPU buffers are reused across buckets and steps: a fresh tile-sized (2 MiB) tensor is ``mmap``-ed and
        page-faulted on every allocation, which cost more than the kernels that use it. The pool holds as many
        buffers as phases ever ran at once (about three). On accelerators the caching allocator already does this.
        """
        if device.type != "cpu":
            yield torch.empty(numel, device=device)
            return
        with self._lock:
            fits = [i for i, b in enumerate(self._spare) if b.numel() >= numel]
            buffer = self._spare.pop(fits[0]) if fits else None
        if buffer is None:
            buffer = torch.empty(numel)
        try:
            yield buffer[:numel]
        finally:
            with self._lock:
                self._spare.append(buffer)

    def phase2_stream(self, device: torch.device) -> contextlib.AbstractContextManager:
        """Where phase 2 runs: on CUDA its own stream, so that waiting there for a bucket's all-to-all leaves the
        stream that runs backward free (NCCL futures complete at launch; phase 2 runs on the autograd thread)."""
        if device.type != "cuda":
            return contextlib.nullcontext()
        if self._phase2_stream is None:
            self._phase2_stream = torch.cuda.Stream(device)
        return torch.cuda.stream(self._phase2_stream)

    def hold(self, write: Callable[[], None]) -> None:
        """Run a bucket's final write now if the step's last bucket is already on the wire, else hold it.

        On CPU the write (dequantize, average, store) of an early bucket would otherwise run while backward still
        computes, on the same cores; held until the last bucket is launched, it runs while that bucket is on the
        wire, when the core would wait anyway. Nothing waits: a bucket whose data arrives later writes on arrival.
        """
        with self._lock:
            if not self._last_launched:
                self._held.append(write)
                return
        write()

    def release(self, hold_again: bool = False) -> None:
        """The step's last bucket is launched: run the held writes (on the calling thread) and stop holding; with
        ``hold_again`` (a new step begins) hold from now on."""
        with self._lock:
            self._last_launched = True
            held, self._held = self._held, []
        for write in held:
            write()
        if hold_again:
            with self._lock:
                self._last_launched = False

    @contextlib.contextmanager
    def timed(self, device: torch.device) -> Iterator[None]:
        """Count the enclosed compression work: on CPU in ``compress_seconds``; on CUDA, where the host only
        launches kernels, as a pair of events on the current stream, read later (``take_gpu_spans``)."""
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            with self._lock:
                self._gpu_spans.append((start, end))
            return
        t0 = time.perf_counter()
        yield
        with self._lock:
            self.compress_seconds += time.perf_counter() - t0

    def take_gpu_spans(self) -> list[tuple[torch.cuda.Event, torch.cuda.Event]]:
        """The CUDA event pairs of the compression work since the last call (``start.elapsed_time(end)`` is valid
        once ``end`` has completed)."""
        with self._lock:
            spans, self._gpu_spans = self._gpu_spans, []
        return spans

    def _add(self, bytes_sent: int, bytes_fp32: int) -> None:
        with self._lock:
            self.bytes_sent += bytes_sent
            self.bytes_fp32 += bytes_fp32
            self.total_bytes_sent += bytes_sent
            self.total_bytes_fp32 += bytes_fp32


def _make_generators(seed: int, device: torch.device) -> tuple[torch.Generator, torch.Generator]:
    # One per phase: phase 1 draws on the autograd thread, phase 2 on callback threads (chained in bucket
    # order), so each generator sees a deterministic sequence of draws.
    rank = dist.get_rank() if dist.is_initialized() else 0
    gens = (torch.Generator(device=device), torch.Generator(device=device))
    gens[0].manual_seed(seed * 1_000_003 + 2 * rank)
    gens[1].manual_seed(seed * 1_000_003 + 2 * rank + 1)
    return gens


def fp32_allreduce_bytes(numel: int, world_size: int) -> int:
    """Bytes one rank sends in a bandwidth-optimal (ring) fp32 all-reduce of ``numel`` values."""
    return 2 * (world_size - 1) * numel * 4 // world_size


def compressed_bytes(numel: int, world_size: int, bits: int, block_size: int) -> int:
    """Bytes one rank sends in the compressed exchange of ``numel`` values (padding and scales included)."""
    padded = math.ceil(numel / (world_size * block_size)) * world_size * block_size
    return 2 * (world_size - 1) * payload_bytes(padded // world_size, bits, block_size)
