"""The compressed reduce-scatter of FSDP2's sharded gradients (what DeepSpeed's ZeRO++ calls qgZ), with error feedback.

Extension point: ``FSDPModule.set_custom_reduce_scatter(comm)`` with a ``ReduceScatter`` (torch's
``torch.distributed.fsdp._fully_shard._fsdp_api``; the same ``__call__(output_tensor, input_tensor, group, op,
async_op)`` and ``allocate`` in torch 2.11 and 2.13). FSDP hands the comm each unit's flat gradient (``W`` rows of
``C`` values, row ``r`` the part rank ``r`` keeps), the unit's own group and the reduce op that its
``set_gradient_divide_factor`` / ``set_force_sum_reduction_for_comms`` settings chose (``AVG``, ``SUM`` with FSDP
dividing afterwards, or ``PREMUL_SUM``); FSDP keeps doing everything else (the copy-in, its streams, the division,
the sharded-gradient views, accumulation). Why this point: an all-reduce hook (``set_all_reduce_hook``) runs after
the reduce-scatter, on the already reduced shard, so it can only touch the HSDP replicate step; and writing our own
FSDP would give up torch's maintained ZeRO-3 (DTensor parameters that DCP and the clipping handle). Torch exports
no public name for ``ReduceScatter``: the private import below is the only way to type the comm.

The exchange of one unit (``N = W * C`` values) never sums integers (gloo has no int8 reduce-scatter, and a sum of
int8 codes with different scales is meaningless anyway):

1. add the unit's residual to each row, quantize the row (blocks of ``block_size`` values, one bfloat16 scale each;
   the row padded to whole blocks), keeping the new residual (error feedback);
2. one ``all_to_all_single`` of the quantized rows: rank ``r`` receives every rank's row ``r`` (works on gloo and
   NCCL);
3. dequantize and sum the ``W`` received rows in fp32, in rank order, apply the op (``AVG``: divide by ``W``;
   ``PREMUL_SUM``: multiply by its factor) and write the shard into FSDP's output (its dtype).

One quantization error per value (no re-quantization: unlike the DDP all-reduce, the result stays sharded).
Bytes one rank sends per unit: ``(W - 1) * (C' * bits / 8 + 2 * C' / block_size)`` (``C'`` = ``C`` padded to whole
blocks), against ``(W - 1) * 4 * C`` for an fp32 reduce-scatter: per gradient value, ``(W - 1) / W * (bits / 8 +
2 / block_size)`` bytes instead of ``(W - 1) / W * 4``, i.e. 0.254x for int8 at ``block_size=128`` and 0.133x for int4
at 64 (:func:`compressed_reduce_scatter_bytes`, what the counters and the benchmark report).

Error feedback: each unit keeps, per rank, the fp32 residual of its whole unsharded gradient (``W * C'`` values):
what this rank's quantization dropped from every other rank's shard is added back next step. That memory is one
unsharded fp32 gradient per unit, ``W`` times the unit's sharded gradient: error feedback gives back, for the
gradients, the memory that sharding saved (``error_feedback=False`` keeps no residual; stochastic rounding then
keeps the exchange unbiased). A unit whose quantized rows are non-finite (an overflow a loss scaler will skip)
drops its residual at its next exchange.

Overlap: FSDP calls the comm synchronously from its reduce-scatter stream. On CUDA the quantize, all-to-all and
dequantize kernels therefore run on that stream, overlapped with the next block's backward as FSDP's own
reduce-scatter is. On CPU (gloo) FSDP's reduce-scatter is synchronous, and so is this one: the compression time
adds to the step, and what it saves is wire time.

Settings (``CompressionConfig``): ``bits``, ``block_size``, ``error_feedback``, ``stochastic_rounding``, ``seed``;
``warmup_steps`` (each unit's first exchanges run torch's own fp32 reduce-scatter, bitwise FSDP's);
``min_bucket_numel`` (a unit with fewer gradient values stays fp32). Not used here: ``overlap``, ``hold_writes`` and
``single_exchange_max_world`` (properties of the DDP hook's exchange). Not supported: HSDP's replicate all-reduce (FSDP
issues it itself, uncompressed), and ``PREMUL_SUM`` on a torch whose reduce op does not expose its factor (2.11 and
older; only reached with a divide factor and ``set_force_sum_reduction_for_comms(False)``): a clear error.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

# Private: torch has no public name for FSDP2's reduce-scatter comm interface (set_custom_reduce_scatter's argument).
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from lightning_deepseek.compression import native
from lightning_deepseek.compression.config import CompressionConfig
from lightning_deepseek.compression.quantize import (
    SCALE_BYTES,
    SCALE_DTYPE,
    TILE_VALUES,
    dequantize,
    payload_bytes,
    quantize,
)

_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # 2.13 / 2.11


def _row_bytes(padded: int, bits: int, block_size: int) -> int:
    # An even number of bytes, so that every row's scales stay 2-byte aligned (odd only for int4 with odd blocks/2).
    size = payload_bytes(padded, bits, block_size)
    return size + size % 2


def compressed_reduce_scatter_bytes(numel: int, world_size: int, bits: int, block_size: int) -> int:
    """Bytes one rank sends in the compressed reduce-scatter of ``numel`` values (``world_size`` rows; each row
    padded to whole blocks, scales included)."""
    chunk = -(-numel // world_size)
    padded = -(-chunk // block_size) * block_size
    return (world_size - 1) * _row_bytes(padded, bits, block_size)


def fp32_reduce_scatter_bytes(numel: int, world_size: int) -> int:
    """Bytes one rank sends in a bandwidth-optimal fp32 reduce-scatter of ``numel`` values."""
    return (world_size - 1) * (numel // world_size) * 4


def _reduce_scale(op: Any, world_size: int) -> float:
    """What multiplies the fp32 sum of the ranks' rows for FSDP's reduce ``op``."""
    kind = getattr(op, "op", op)  # PREMUL_SUM is a ReduceOp wrapping its RedOpType; AVG and SUM are RedOpTypes
    if kind == dist.ReduceOp.SUM:
        return 1.0
    if kind == dist.ReduceOp.AVG:
        return 1.0 / world_size
    if kind == dist.ReduceOp.PREMUL_SUM and hasattr(op, "factor"):
        return float(op.factor)
    raise ValueError(f"GradientCompression's FSDP reduce-scatter got reduce op {op!r}, which it cannot apply in "
                     f"fp32 (torch {torch.__version__} does not expose a PREMUL_SUM's factor). Call "
                     "set_force_sum_reduction_for_comms(True) on the FSDP module that has a gradient divide factor "
                     "(HybridParallelStrategy does), or remove GradientCompression.")


class CompressedReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter of one unit in int8/int4 with error feedback (see the module docstring).

    Args:
        name: the unit's module name (its residual's key in checkpoints).
        state: the state shared by every unit of the model (settings, step, counters).
    """

    def __init__(self, name: str, state: FSDPCompressionState) -> None:
        self.name = name
        self.state = state
        self.calls = 0  # exchanges done: one per backward that reduce-scatters this unit
        self.residual: torch.Tensor | None = None  # (W, C') fp32
        self.saved_residual: torch.Tensor | None = None  # from a checkpoint, taken at the first exchange
        self._finite: torch.Tensor | None = None  # 0-d bool: were the last exchange's quantized rows finite
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # send, recv: (W, row bytes) uint8

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device,
                 ) -> torch.Tensor:
        """FSDP's input and output buffers: plain allocations, as torch's default comm makes them."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> dist.Work | None:
        """Reduce-scatter ``input_tensor`` (``W`` rows) over ``group`` into ``output_tensor`` (this rank's row)."""
        state, config = self.state, self.state.config
        world_size = group.size()
        numel = input_tensor.numel()
        if self.calls >= state.step:
            state.reset_counters()  # the first unit of a new backward
        self.calls += 1
        if self.calls <= config.warmup_steps or numel < max(config.min_bucket_numel, world_size):
            state.count(fp32_reduce_scatter_bytes(numel, world_size), fp32_reduce_scatter_bytes(numel, world_size))
            start = time.perf_counter()
            work = _reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
            state.comm_seconds += time.perf_counter() - start
            return work
        scale = _reduce_scale(op, world_size)
        rows = input_tensor.view(world_size, -1)
        chunk = rows.shape[1]
        padded = -(-chunk // config.block_size) * config.block_size
        send, recv = self._message_buffers(world_size, padded, input_tensor.device)
        start = time.perf_counter()
        self._quantize_rows(rows, send, padded)
        quantized = time.perf_counter()
        dist.all_to_all_single(recv, send, group=group)
        exchanged = time.perf_counter()
        self._reduce_rows(recv, padded, output_tensor, scale)
        done = time.perf_counter()
        state.compress_seconds += (quantized - start) + (done - exchanged)
        state.comm_seconds += done - start
        state.count((world_size - 1) * send.shape[1], fp32_reduce_scatter_bytes(numel, world_size), compressed=True)
        return None

    def _message_buffers(self, world_size: int, padded: int, device: torch.device,
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """The send and receive buffers and the residual, reused every step (made on first use, or when the unit's
        shape changed); the residual starts from a checkpoint's where one was loaded."""
        row = _row_bytes(padded, self.state.config.bits, self.state.config.block_size)
        if self._buffers is None or self._buffers[0].shape != (world_size, row) or self._buffers[0].device != device:
            self._buffers = tuple(torch.empty(world_size, row, dtype=torch.uint8, device=device) for _ in range(2))
            if self.state.config.error_feedback:
                self.residual = torch.zeros(world_size, padded, device=device)
                saved, self.saved_residual = self.saved_residual, None
                if saved is not None:
                    if saved.shape != self.residual.shape:
                        raise ValueError(
                            f"GradientCompression: the saved error-feedback residual of FSDP unit {self.name!r} has "
                            f"shape {tuple(saved.shape)}, this run's is {tuple(self.residual.shape)}: the checkpoint "
                            "is from another model or shard size. Resume from a checkpoint of this layout.")
                    self.residual.copy_(saved)
        return self._buffers

    def _codes(self, row: torch.Tensor, padded: int, lo: int, hi: int) -> torch.Tensor:
        """The codes of values ``[lo, hi)`` in a message row (or rows): they follow the row's scales."""
        bits, first = self.state.config.bits, padded // self.state.config.block_size * SCALE_BYTES
        return row[..., first + lo * bits // 8:first + hi * bits // 8]

    def _scales(self, row: torch.Tensor, padded: int, lo: int, hi: int) -> torch.Tensor:
        """The bfloat16 scales of values ``[lo, hi)``, first in a row (so they stay 2-byte aligned)."""
        block = self.state.config.block_size
        return row[..., :padded // block * SCALE_BYTES].view(SCALE_DTYPE)[..., lo // block:hi // block]

    def _tiles(self, padded: int, device: torch.device) -> Iterator[tuple[int, int]]:
        block = self.state.config.block_size
        step = padded if device.type != "cpu" else max(block, TILE_VALUES // block * block)
        return ((a, min(a + step, padded)) for a in range(0, padded, step))

    def _quantize_rows(self, rows: torch.Tensor, send: torch.Tensor, padded: int) -> None:
        """Step 1: every row plus its residual, quantized into ``send`` (the new residual written in the same
        pass), tile by tile on CPU so that each tile is read from DRAM once."""
        state, config = self.state, self.state.config
        chunk, device = rows.shape[1], rows.device
        residual = self.residual
        if residual is not None and self._finite is not None:  # an overflow last time: its residual is NaN
            if device.type == "cpu":
                if not bool(self._finite):
                    residual.zero_()
            else:
                residual.masked_fill_(self._finite.logical_not(), 0.0)
        generator = state.generator(device)
        keep = residual is not None or state.track_error
        with state.scratch(min(padded, TILE_VALUES), device) as scratch:
            for r in range(rows.shape[0]):
                for a, b in self._tiles(padded, device):
                    x = residual[r, a:b] if residual is not None else scratch[:b - a]
                    valid = max(0, min(b, chunk) - a)
                    if residual is not None:
                        x[:valid].add_(rows[r, a:a + valid])
                    else:
                        x[:valid].copy_(rows[r, a:a + valid])
                        x[valid:].zero_()
                    if state.track_error:
                        state.input_sq.append(x.square().sum())
                    quantize(x, config.bits, config.block_size, generator, residual=x if keep else None,
                             codes=self._codes(send[r], padded, a, b), scales=self._scales(send[r], padded, a, b))
                    if state.track_error:
                        state.error_sq.append(x.square().sum())
        if residual is not None:
            self._finite = torch.isfinite(self._scales(send, padded, 0, padded)).all()

    def _reduce_rows(self, recv: torch.Tensor, padded: int, output: torch.Tensor, scale: float) -> None:
        """Step 3: the fp32 sum of the received rows, in rank order, times ``scale``, into ``output``."""
        config, world_size, chunk = self.state.config, recv.shape[0], output.numel()
        bits, block = config.bits, config.block_size
        out = output.view(-1)
        if (native.usable(recv, out) and out.dtype == torch.float32 and native.library() is not None):
            sources = [(self._codes(row, padded, 0, padded), self._scales(row, padded, 0, padded)) for row in recv]
            native.average_range(sources, out, 0, bits, block)  # sum / W in one pass, straight into the shard
            if scale != 1.0 / world_size:
                out.mul_(scale * world_size)
            return
        with self.state.scratch(min(padded, TILE_VALUES), recv.device) as scratch:
            for a, b in self._tiles(padded, recv.device):
                if a >= chunk:
                    break
                total = scratch[:b - a]
                for r in range(world_size):
                    dequantize(self._codes(recv[r], padded, a, b), self._scales(recv[r], padded, a, b), bits, block,
                               out=total, accumulate=r > 0)
                hi = min(b, chunk)
                out[a:hi].copy_(total[:hi - a].div_(world_size) if scale == 1.0 / world_size
                                else total[:hi - a].mul_(scale))

    def state_dict(self) -> dict[str, Any]:
        """The unit's exchange count and residual (a CPU copy; None without error feedback or before any)."""
        residual = self.residual if self.residual is not None else self.saved_residual
        return {"calls": self.calls, "residual": None if residual is None else residual.detach().cpu().clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned; the residual is placed at the next exchange."""
        self.calls = int(state["calls"])
        self.saved_residual = state["residual"]
        self._buffers, self.residual, self._finite = None, None, None


class FSDPCompressionState:
    """The compressed reduce-scatters of one model's FSDP units: their settings, counters and residuals.

    Read by ``GradientCompression`` like the DDP hook's ``CompressionState``: ``step``, ``bytes_sent`` /
    ``bytes_fp32`` (this step's; ``total_*`` over the run), ``compress_seconds`` and ``comm_seconds`` (host time
    inside the comms: on CPU all of it is on the step's critical path), ``relative_error()`` when ``track_error``.

    Args:
        config: the exchange's settings (``bits`` 8 or 4).
    """

    def __init__(self, config: CompressionConfig) -> None:
        config.check_decided("FSDP gradient compression")
        self.config = config
        self.units: dict[str, CompressedReduceScatter] = {}
        self.track_error = False
        self.total_bytes_sent = 0
        self.total_bytes_fp32 = 0
        self.num_compressed = 0
        self._generator: torch.Generator | None = None
        self._generator_state: torch.Tensor | None = None
        self._spare: list[torch.Tensor] = []
        self.reset_counters()

    @property
    def step(self) -> int:
        """Backward passes that reduce-scattered (every unit exchanges once per such pass)."""
        return max((unit.calls for unit in self.units.values()), default=0)

    @step.setter
    def step(self, value: int) -> None:
        for unit in self.units.values():
            unit.calls = value

    def reset_counters(self) -> None:
        """Zero this step's counters (at the first unit of every backward)."""
        self.bytes_sent = 0
        self.bytes_fp32 = 0
        self.compress_seconds = 0.0
        self.comm_seconds = 0.0
        self.error_sq: list[torch.Tensor] = []
        self.input_sq: list[torch.Tensor] = []

    def count(self, bytes_sent: int, bytes_fp32: int, compressed: bool = False) -> None:
        """Add one unit's exchange to the byte counters."""
        self.bytes_sent += bytes_sent
        self.bytes_fp32 += bytes_fp32
        self.total_bytes_sent += bytes_sent
        self.total_bytes_fp32 += bytes_fp32
        self.num_compressed += int(compressed)

    def relative_error(self) -> float | None:
        """``||x - Q(x)|| / ||x||`` of this step's quantization (residual included), if it was tracked."""
        if not self.error_sq:
            return None
        den = torch.stack(self.input_sq).sum()
        return float(torch.stack(self.error_sq).sum().sqrt() / den.sqrt().clamp_min(1e-30))

    def timings_ms(self, device: torch.device) -> tuple[float, float] | None:
        """This step's (exchange, compression) milliseconds on CPU; None on accelerators (the host only launches)."""
        return None if device.type != "cpu" else (1e3 * self.comm_seconds, 1e3 * self.compress_seconds)

    def generator(self, device: torch.device) -> torch.Generator | None:
        """The stochastic-rounding generator (seeded from ``seed`` and the global rank); None without."""
        if not self.config.stochastic_rounding:
            return None
        if self._generator is None:
            rank = dist.get_rank() if dist.is_initialized() else 0
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.config.seed * 1_000_003 + 2 * rank)
            if self._generator_state is not None:
                self._generator.set_state(self._generator_state)
        return self._generator

    def scratch(self, numel: int, device: torch.device) -> _Scratch:
        """A float32 work buffer of ``numel`` values, reused on CPU (a fresh one is page-faulted every time)."""
        return _Scratch(self._spare, numel, device)

    def state_dict(self) -> dict[str, Any]:
        """This rank's exchange counts and residuals by unit (CPU copies) and the rounding generator's state."""
        generator = self._generator.get_state() if self._generator is not None else self._generator_state
        return {"step": self.step, "units": {name: unit.state_dict() for name, unit in self.units.items()},
                "generator": generator}

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        """Restore what ``state_dict`` returned (units missing from it start afresh)."""
        for name, unit_state in state["units"].items():
            if name in self.units:
                self.units[name].load_state_dict(unit_state)
        self._generator, self._generator_state = None, state.get("generator")


class _Scratch:
    def __init__(self, pool: list[torch.Tensor], numel: int, device: torch.device) -> None:
        self.pool, self.numel, self.device = pool, numel, device
        self.buffer: torch.Tensor | None = None

    def __enter__(self) -> torch.Tensor:
        if self.device.type != "cpu":
            return torch.empty(self.numel, device=self.device)
        fits = [i for i, b in enumerate(self.pool) if b.numel() >= self.numel]
        self.buffer = self.pool.pop(fits[0]) if fits else torch.empty(self.numel)
        return self.buffer[:self.numel]

    def __exit__(self, *exc: object) -> None:
        if self.buffer is not None:
            self.pool.append(self.buffer)


def fsdp_units(module: nn.Module) -> dict[str, FSDPModule]:
    """The FSDP2 units inside ``module`` (``fully_shard``-ed modules), by module name."""
    return {name: m for name, m in module.named_modules() if isinstance(m, FSDPModule)}


def install_fsdp_compression(module: nn.Module, config: CompressionConfig) -> FSDPCompressionState:
    """Give every FSDP2 unit inside ``module`` a :class:`CompressedReduceScatter`; return their shared state.

    Args:
        module: a model whose FSDP units are already made (``fully_shard`` applied).
        config: the exchange's settings (``bits`` 8 or 4).

    Raises:
        ValueError: ``module`` holds no FSDP unit.
    """
    units = fsdp_units(module)
    if not units:
        raise ValueError(f"install_fsdp_compression found no FSDP2 unit in {type(module).__name__}: apply "
                         "torch's fully_shard (or HybridParallelStrategy(data_parallel_shard_size>1)) first.")
    state = FSDPCompressionState(config)
    for name, unit in units.items():
        comm = CompressedReduceScatter(name or "(root)", state)
        unit.set_custom_reduce_scatter(comm)
        state.units[comm.name] = comm
    return state
