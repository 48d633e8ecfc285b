"""Per-rank state of the compressed exchange: error-feedback residuals, bucket plans, counters, held writes, timing.

Split from ``hook.py`` (the exchange itself) so that the state's contract reads on its own: what a checkpoint
holds (``state_dict``: the step, every residual by parameter name, the stochastic-rounding generators), how the
callback reads telemetry (``bytes_sent``, ``compress_seconds`` or CUDA event spans, ``relative_error``), the
CPU-only scheduling aid that holds final writes until the step's last bucket is on the wire (``hold``/``release``),
and what the hook asks of it each step (``begin_step``, ``plan``, ``record_finite``, ``count_bucket``,
``phase2_turn``, ``end_step``). The message buffers and residual storage themselves live in the per-bucket plans
(``plan.py``); the settings in ``CompressionConfig`` (``config.py``).

The byte formulas here are what tests and benchmarks compare the counters against.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from lightning_deepseek.compression.config import CompressionConfig
from lightning_deepseek.compression.plan import BucketPlan, make_plan
from lightning_deepseek.compression.quantize import payload_bytes


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
        self.plans: dict[tuple[str, ...], BucketPlan] = {}
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
        self._issued: torch.futures.Future | None = None  # the last bucket's phase 2 is issued, see phase2_turn()
        self._phase2_stream: torch.cuda.Stream | None = None
        self._held: list[Callable[[], None]] = []  # final writes waiting for the step's last bucket
        self._last_launched = False
        self.track_error = False

    def begin_step(self) -> None:
        """Start a synchronising step: zero the counters, drop last step's residuals if any bucket was non-finite."""
        self.release(hold_again=True)  # nothing is held past a step, even one whose last bucket never reached the hook
        self.reset_counters()
        with self._lock:
            flags, self._finite_flags = self._finite_flags, []
        if flags:
            keep = torch.stack(flags).all()
            buffers = [plan.residual for plan in self.plans.values() if plan.residual is not None]
            if keep.device.type == "cpu":  # free to read here; on an accelerator it would stall backward
                if not keep:
                    for buffer in buffers:
                        buffer.zero_()
            else:
                dropped = keep.logical_not()
                for buffer in buffers:
                    buffer.masked_fill_(dropped, 0.0)
        self._issued = None

    def end_step(self) -> None:
        """The step's last bucket is handed over: count the step."""
        self.step += 1

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
        """Restore what ``state_dict`` returned (the plans are rebuilt from the residuals on first use)."""
        self.step = int(state["step"])
        self.residuals = {k: v.to(device) for k, v in state["residuals"].items()}
        self.plans = {}
        if state.get("generators") is not None:
            self.generators = _make_generators(self.config.seed, device)
            for gen, gen_state in zip(self.generators, state["generators"]):
                gen.set_state(gen_state)

    def plan(self, names: Sequence[str], sizes: Sequence[int], device: torch.device) -> BucketPlan:
        """The plan of the bucket holding parameters ``names`` (of ``sizes`` values), made on first use, or after
        DDP rebuilt its buckets, or after a state load; its residual starts from the one kept by name."""
        key = tuple(names)
        plan = self.plans.get(key)
        if plan is not None and plan.layout.sizes == list(sizes):
            return plan
        plan = make_plan(names, sizes, self.world_size, self.config, device, self.residuals)
        for other in [k for k in self.plans if set(k) & set(key)]:
            del self.plans[other]  # DDP rebuilt its buckets: the residuals moved into the new plan
        self.residuals.update(plan.residual_views())
        self.plans[key] = plan
        return plan

    def rounding_generators(self, device: torch.device) -> tuple[torch.Generator | None, torch.Generator | None]:
        """The stochastic-rounding generators of (phase 1, phase 2), made on first use; ``None`` without
        stochastic rounding."""
        if not self.config.stochastic_rounding:
            return None, None
        if self.generators is None:
            self.generators = _make_generators(self.config.seed, device)
        return self.generators

    def record_finite(self, finite: torch.Tensor) -> None:
        """Record whether a bucket's exchanged values were finite (a 0-d bool tensor, read at the next
        ``begin_step``, where a non-finite bucket resets every residual)."""
        with self._lock:
            self._finite_flags.append(finite)

    def count_bucket(self, bytes_sent: int, bytes_fp32: int, compressed: bool = False) -> None:
        """Add one bucket's exchange to the byte counters (``bytes_fp32``: what a ring fp32 all-reduce sends)."""
        with self._lock:
            self.bytes_sent += bytes_sent
            self.bytes_fp32 += bytes_fp32
            self.total_bytes_sent += bytes_sent
            self.total_bytes_fp32 += bytes_fp32
            self.num_compressed_buckets += int(compressed)

    def phase2_turn(self) -> tuple[torch.futures.Future, torch.futures.Future]:
        """``(previous, mine)``: phase-2 collectives are issued in bucket order on every rank, so a bucket's phase 2
        starts after ``previous`` (the prior bucket's is issued) and must complete ``mine`` once its own is."""
        mine: torch.futures.Future = torch.futures.Future()
        with self._lock:
            previous, self._issued = self._issued, mine
        if previous is None:
            previous = torch.futures.Future()
            previous.set_result(None)
        return previous, mine

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
