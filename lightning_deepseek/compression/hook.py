"""The compressed DDP communication hook: the exchange of one bucket, its per-bucket plans, and registration.

Supports: any ``torch.nn.parallel.DistributedDataParallel`` module on gloo (CPU) or NCCL (CUDA), uneven bucket
sizes, ``no_sync`` gradient accumulation (the hook only runs on synchronising steps), AMP (fp16/bf16 buckets are
exchanged in fp32 arithmetic), non-finite gradients (propagated to every rank so a loss scaler skips the step;
every residual is then reset).

The exchange of one bucket of N values over W ranks never sums integers:

1. add the residual, pad to a multiple of ``W * block_size``, quantize per destination chunk (on the calling
   thread, so it overlaps with the rest of backward);
2. ``all_to_all_single``: rank r receives every rank's codes for chunk r (a compressed reduce-scatter);
3. dequantize, sum in fp32, average, re-quantize chunk r;
4. ``all_gather`` of the re-quantized chunks on a second communicator, dequantize into the bucket.

With two ranks (and one) the exchange is instead a single ``all_gather`` of every rank's quantized bucket, each
rank dequantizing and summing them in rank order: the same bytes as steps 2 and 4 together, one collective instead
of two on the critical path, no re-quantization (one quantization error, not two), and no phase 2. (With W ranks
it would send W/2 times the bytes of steps 2 and 4, so more ranks take the two-phase exchange.)

Steps 2-4 run in future callbacks chained with ``.then``: nothing waits inside the hook, so buckets are exchanged
while backward computes the next ones. Every rank dequantizes the same gathered bytes, so replicas stay
bit-identical. Phase-2 collectives are issued from callback threads, which complete in any order, so they go to
their own communicator and are chained bucket after bucket: issue order is then the same on every rank. On CUDA,
NCCL's futures complete at launch, so phase 2 runs on the autograd thread: it runs on a stream of its own, which
waits there for the bucket's all-to-all while the stream that runs backward goes on.
On CPU the final write of every bucket but the step's last (dequantize, average, store into the gradients) is held
until the last bucket is on the wire: run when its data arrive, it would take the core from backward, while after
the last launch the core only waits for the wire (``CompressionState.hold``; with ``overlap=False`` nothing is held).

Memory traffic: each bucket has a plan (made on first use) holding its residual and its four message buffers, reused
every step. On CPU every step works tile by tile (2 MiB of fp32): a tile is gathered from the gradients (adding the
residual), quantized straight into the send buffer with the new residual written back in the same pass; phase 2
dequantizes and sums every rank's tile into one cache-resident accumulator; the received rows are averaged straight
into the gradients by one native kernel (on the eager path, one tile at a time through a work buffer and a scatter).
No full-size fp32 temporary exists: about five fp32 passes over the bucket reach DRAM (read gradient and residual,
write residual and result, the owned chunk's residual once more) instead of about fifteen for the straightforward
formulation (concatenate, add, quantize, pack, dequantize all ranks, sum, re-quantize, dequantize, copy back). The
tile-sized work buffers come from a small per-state pool (fresh ones were page-faulted on every call). On CPU the
quantizer runs in native kernels (``native.py``). On accelerators one tile spans the chunk.

Costs per bucket and rank: ``2 * (W - 1) * (N / W * bits / 8 + 2 * N / (W * block_size))`` bytes sent, against
``2 * (W - 1) / W * 4 * N`` for a ring fp32 all-reduce (0.254x for int8 at ``block_size=128``, 0.133x for int4 at
``block_size=64``, the presets); one extra communicator; residual memory equal to one fp32 gradient, message
buffers of about ``N * bits / 2`` bytes.

Error feedback: the phase-1 residual ``e1 = x - Q(x)`` and the phase-2 residual of the owned chunk ``e2`` are
both folded into one per-parameter residual ``e1 + W * e2`` added to the next step's gradient (``e2`` enters the
average once, through the owner; with two ranks there is only ``e1``). Residuals are addressed by parameter name
(views into the plan's buffer), so they follow their parameters when DDP rebuilds its buckets after the first
iteration, and a checkpoint stores them per parameter. Quantization blocks follow the parameters' order in the
model, not DDP's order inside a bucket, so a resumed run (whose fresh DDP starts with the initial bucket order) is
bit-identical to an uninterrupted one when the bucket membership is the same.

Why not torch's hooks: ``quantization_pertensor_hook`` sums integers after an all-gather (W times the traffic,
and it crashes on gloo), PowerSGD is low-rank (biased without warm start, not byte-predictable), and
``fp16_compress_hook`` only halves the bytes.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations against real classes.
import bisect
import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lightning_deepseek.compression import native
from lightning_deepseek.compression.quantize import TILE_VALUES, dequantize, payload_bytes, quantize
from lightning_deepseek.compression.state import (
    CompressionConfig,
    CompressionState,
    _make_generators,
    fp32_allreduce_bytes,
)

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _completed(value: object, device: torch.device) -> torch.futures.Future:
    fut = torch.futures.Future(devices=[device] if device.type == "cuda" else None)
    fut.set_result(value)
    return fut


def begin_step(state: CompressionState) -> None:
    """Start a synchronising step: zero counters, decide whether last step's residuals survive."""
    state.release(hold_again=True)  # nothing is held past a step, even one whose last bucket never reached the hook
    state.reset_counters()
    if state._finite_flags:
        keep = torch.stack(state._finite_flags).all()
        state._finite_flags = []
        buffers = [plan.residual for plan in state.plans.values() if plan.residual is not None]
        if keep.device.type == "cpu":  # free to read here; on an accelerator it would stall backward
            if not keep:
                for buffer in buffers:
                    buffer.zero_()
        else:
            dropped = keep.logical_not()
            for buffer in buffers:
                buffer.masked_fill_(dropped, 0.0)
    state._issued = None


def end_step(state: CompressionState) -> None:
    state.step += 1


def allreduce_average(state: CompressionState, flat: torch.Tensor) -> torch.futures.Future:
    """Uncompressed fp32 all-reduce average (warm-up steps, small and 1-D buckets)."""
    state._add(fp32_allreduce_bytes(flat.numel(), state.world_size),
               fp32_allreduce_bytes(flat.numel(), state.world_size))
    flat.div_(state.world_size)
    fut = dist.all_reduce(flat, group=state.process_group, async_op=True).get_future()
    if not state.compressing:
        return fut.then(lambda f: f.value()[0])

    def record_finite(f: torch.futures.Future) -> torch.Tensor:
        out = f.value()[0]
        state._finite_flags.append(torch.isfinite(out).all())
        return out

    return fut.then(record_finite)


class _Layout:
    """Where each gradient of one bucket lies in the bucket's canonical (parameter-order) flat layout.

    The exchange works on a padded flat vector of ``world_size * chunk`` values that never exists in full outside
    the residual buffer: each tile is gathered from the gradients right before it is quantized and scattered back
    right after it is dequantized, while it is in cache.
    """

    def __init__(self, sizes: Sequence[int], world_size: int, block_size: int) -> None:
        self.sizes = list(sizes)
        self.offsets = [0]
        for size in self.sizes:
            self.offsets.append(self.offsets[-1] + size)
        self.numel = self.offsets[-1]
        self.chunk = math.ceil(self.numel / (world_size * block_size)) * block_size

    def segments(self, lo: int, hi: int) -> list[tuple[int, int, int, int]]:
        """``(tensor index, start in the tensor, start in [lo, hi), length)`` of every piece overlapping."""
        out = []
        for i in range(bisect.bisect_right(self.offsets, lo) - 1, len(self.sizes)):
            start = self.offsets[i]
            if start >= hi:
                break
            a, b = max(lo, start), min(hi, self.offsets[i + 1])
            if b > a:
                out.append((i, a - start, a - lo, b - a))
        return out

    def gather(self, flats: Sequence[torch.Tensor], lo: int, hi: int, dst: torch.Tensor, add: bool) -> None:
        """``dst (+)= values [lo, hi)`` of the canonical vector; the padding past ``numel`` reads as zero."""
        if not add and hi > self.numel:
            dst[max(0, self.numel - lo):].zero_()
        for i, src, pos, n in self.segments(lo, hi):
            piece = dst[pos:pos + n]
            if add:
                piece.add_(flats[i][src:src + n])
            else:
                piece.copy_(flats[i][src:src + n])

    def scatter(self, src: torch.Tensor, lo: int, hi: int, flats: Sequence[torch.Tensor]) -> None:
        """Write ``src`` (values ``[lo, hi)`` of the canonical vector) back into the gradients."""
        for i, dst, pos, n in self.segments(lo, hi):
            flats[i][dst:dst + n].copy_(src[pos:pos + n])


@dataclass
class _Plan:
    """One bucket's persistent buffers: its layout, residual (the error-feedback memory) and message buffers.

    Buffers are reused every step (a fresh >32 MiB tensor is mmap-ed and page-faulted on every CPU allocation).
    """

    layout: _Layout
    residual: torch.Tensor | None  # padded fp32, canonical order; None without error feedback
    send: torch.Tensor  # (W, row bytes): per destination chunk, its codes then its scales
    recv: torch.Tensor
    send2: torch.Tensor  # (row bytes,): the re-quantized own chunk
    gathered: torch.Tensor  # (W, row bytes)
    bits: int
    block_size: int
    single: bool  # one all-gather of whole quantized buckets (W <= 2): `recv` is (W, W, row bytes), no phase 2
    def codes(self, buffer: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """The codes of values ``[lo, hi)`` of a chunk, in a message row (or rows)."""
        return buffer[..., lo * self.bits // 8:hi * self.bits // 8]

    def scales(self, buffer: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """The bfloat16 scales of values ``[lo, hi)`` of a chunk; they follow the chunk's codes in a row."""
        code_bytes = self.layout.chunk * self.bits // 8
        return buffer[..., code_bytes:].view(torch.bfloat16)[..., lo // self.block_size:hi // self.block_size]


def _plan(state: CompressionState, names: Sequence[str], sizes: Sequence[int], device: torch.device) -> _Plan:
    """The bucket's plan, made on first use (or after DDP rebuilt its buckets, or after a state load)."""
    key = tuple(names)
    plan = state.plans.get(key)
    if plan is not None and plan.layout.sizes == list(sizes):
        return plan
    cfg, ws = state.config, state.world_size
    layout = _Layout(sizes, ws, cfg.block_size)
    residual = None
    if cfg.error_feedback:
        residual = torch.zeros(ws * layout.chunk, device=device)
        for name, lo, size in zip(names, layout.offsets, sizes):
            old = state.residuals.get(name)
            if old is not None:
                if old.numel() != size:
                    raise ValueError(f"GradientCompression: the saved error-feedback residual of {name!r} has "
                                     f"{old.numel()} values, the parameter has {size}: the checkpoint is from a "
                                     "different model. Resume from a checkpoint of this model.")
                residual[lo:lo + size].copy_(old.reshape(-1))
            state.residuals[name] = residual[lo:lo + size]
    for other in [k for k in state.plans if set(k) & set(key)]:
        del state.plans[other]  # DDP rebuilt its buckets: the residuals moved into the new plan above
    row = payload_bytes(layout.chunk, cfg.bits, cfg.block_size)
    single = ws <= state.single_exchange_max_world

    def buffer(*shape: int) -> torch.Tensor:
        return torch.empty(*shape, dtype=torch.uint8, device=device)

    plan = _Plan(layout, residual, buffer(ws, row), buffer(ws, ws, row) if single else buffer(ws, row),
                 buffer(0 if single else row), buffer(0 if single else ws, row), cfg.bits, cfg.block_size, single)
    state.plans[key] = plan
    return plan


def _tiles(length: int, device: torch.device, block_size: int) -> list[tuple[int, int]]:
    step = length if device.type != "cpu" else max(block_size, TILE_VALUES // block_size * block_size)
    return [(a, min(a + step, length)) for a in range(0, length, step)]


def _write_average(state: CompressionState, plan: _Plan, flats: Sequence[torch.Tensor],
                   tiles: Sequence[tuple[int, int]], rows: Callable[[int], list[torch.Tensor]]) -> None:
    """For every chunk ``r``: dequantize and sum the message rows ``rows(r)`` in order (the same on every rank, so
    replicas stay identical), average them, and write the result into the gradients: straight from the messages
    with the native CPU kernels when every gradient is contiguous float32, else tile by tile through a work buffer
    and a scatter."""
    layout, chunk, bits, bs = plan.layout, plan.layout.chunk, plan.bits, plan.block_size
    if native.usable(*flats) and all(f.dtype == torch.float32 for f in flats) and native.library() is not None:
        for r in range(plan.send.shape[0]):
            lo, hi = r * chunk, min((r + 1) * chunk, layout.numel)
            if lo >= hi:
                break
            sources = [(plan.codes(row, 0, chunk), plan.scales(row, 0, chunk)) for row in rows(r)]
            for i, start, pos, n in layout.segments(lo, hi):
                native.average_range(sources, flats[i][start:start + n], pos, bits, bs)
        return
    with state.scratch(tiles[0][1], flats[0].device) as acc:
        for r in range(plan.send.shape[0]):  # chunk r of the bucket
            sources = rows(r)
            for a, b in tiles:
                lo = r * chunk + a
                if lo >= layout.numel:
                    break
                total = acc[:b - a]
                for i, row in enumerate(sources):
                    dequantize(plan.codes(row, a, b), plan.scales(row, a, b), bits, bs, out=total,
                               accumulate=i > 0)
                if len(sources) > 1:
                    total.div_(len(sources))
                layout.scatter(total, lo, min(r * chunk + b, layout.numel), flats)


def _average_into(state: CompressionState, plan: _Plan, flats: Sequence[torch.Tensor],
                  tiles: Sequence[tuple[int, int]]) -> None:
    """Single all-gather exchange: every rank's quantized bucket is in ``plan.recv``; average them."""
    _write_average(state, plan, flats, tiles, lambda r: list(plan.recv[:, r]))


def _dequantize_into(state: CompressionState, plan: _Plan, flats: Sequence[torch.Tensor],
                     tiles: Sequence[tuple[int, int]]) -> None:
    """Two-phase exchange: the owners' re-quantized averages are in ``plan.gathered``; write them."""
    _write_average(state, plan, flats, tiles, lambda r: [plan.gathered[r]])


def compressed_average(state: CompressionState, tensors: Sequence[torch.Tensor], names: Sequence[str],
                       out: torch.Tensor, hold: bool = False) -> torch.futures.Future:
    """Average ``tensors`` over the group in compressed form, in place; the future's value is ``out``.

    Args:
        state: the hook state (residuals are read and written under ``names``).
        tensors: contiguous gradients (any float dtype) in a canonical order, laid end to end before quantization,
            so the blocks do not depend on how DDP happened to order them in its bucket.
        names: one name per tensor, the key of its residual.
        out: what the future returns once ``tensors`` hold the average (the bucket buffer for DDP).
        hold: on CPU, keep the final write for ``state.release()`` if the data arrive before it is called (the
            hook holds every bucket but the step's last: see ``CompressionState.hold``). A held future completes
            only after ``state.release()`` or the next ``begin_step``: do not wait on it before either.
    """
    cfg, ws, bits, bs = state.config, state.world_size, state.config.bits, state.config.block_size
    device = out.device
    flats = [t.view(-1) for t in tensors]
    plan = _plan(state, names, [f.numel() for f in flats], device)
    layout, chunk, numel = plan.layout, plan.layout.chunk, plan.layout.numel
    if state.generators is None and cfg.stochastic_rounding:
        state.generators = _make_generators(cfg.seed, device)
    gen1, gen2 = state.generators if cfg.stochastic_rounding else (None, None)
    tiles = _tiles(chunk, device, bs)
    keep_residual = plan.residual is not None or state.track_error
    scratch_or_none = state.scratch(tiles[0][1], device) if plan.residual is None else contextlib.nullcontext()
    with state.timed(device), scratch_or_none as scratch:
        for r in range(ws):  # phase 1: gather a tile (+ residual), quantize it into destination r's row of `send`
            for a, b in tiles:
                lo, hi = r * chunk + a, r * chunk + b
                x = plan.residual[lo:hi] if plan.residual is not None else scratch[:b - a]
                layout.gather(flats, lo, hi, x, add=plan.residual is not None)
                if state.track_error:
                    state.input_sq.append(x.square().sum())
                quantize(x, bits, bs, gen1, residual=x if keep_residual else None,
                         codes=plan.codes(plan.send[r], a, b), scales=plan.scales(plan.send[r], a, b))
                if state.track_error:
                    state.error_sq.append(x.square().sum())
    result = torch.futures.Future(devices=[device] if device.type == "cuda" else None)
    hold = hold and device.type == "cpu"

    def finish(fut: torch.futures.Future, received: torch.Tensor, write: Callable[..., None], sent: int) -> None:
        """The last collective is done: write the average (now, or held on CPU: see ``CompressionState.hold``)."""
        try:
            fut.value()
        except BaseException as exc:  # noqa: BLE001 - handed to DDP through the future
            result.set_exception(exc)
            return
        if hold:
            state.hold(lambda: complete(received, write, sent))
        else:
            complete(received, write, sent)

    def complete(received: torch.Tensor, write: Callable[..., None], sent: int) -> None:
        """Write the average into the gradients, check finiteness, count."""
        try:
            with state.timed(device):
                write(state, plan, flats, tiles)
            if plan.residual is not None:
                # A non-finite bucket leaves NaN residuals: the next step's begin_step zeroes them all.
                state._finite_flags.append(torch.isfinite(plan.scales(received, 0, chunk)).all())
            state._add(sent, fp32_allreduce_bytes(numel, ws))
            state.num_compressed_buckets += 1
        except BaseException as exc:  # noqa: BLE001 - handed to DDP through the future
            result.set_exception(exc)
            return
        result.set_result(out)

    if plan.single:  # every rank's whole quantized bucket, to every other rank
        gathered = _all_gather_single(plan.recv.view(-1), plan.send.view(-1), group=state.process_group,
                                      async_op=True).get_future()
        gathered.then(lambda f: finish(f, plan.recv, _average_into, (ws - 1) * plan.send.numel()))
        return result

    a2a = dist.all_to_all_single(plan.recv, plan.send, group=state.process_group, async_op=True).get_future()
    issued = torch.futures.Future()
    previous = state._issued if state._issued is not None else _completed(None, torch.device("cpu"))
    state._issued = issued

    def reduce_and_regather() -> dist.Work:
        """Phase 2 (chunk r = this rank): dequantize and sum every rank's codes, re-quantize, launch the all-gather."""
        # wait(), not value(): collect_all's future carries no CUDA events, so on NCCL (whose futures complete at
        # launch) only wait() makes the current (phase-2) stream wait for the all-to-all before reading `recv`.
        a2a.wait()
        own = state.rank * chunk
        with state.timed(device), state.scratch(tiles[0][1], device) as acc:
            for a, b in tiles:  # dequantize and sum every rank's codes for this chunk, re-quantize, per tile
                total = acc[:b - a]
                for r in range(ws):
                    dequantize(plan.codes(plan.recv[r], a, b), plan.scales(plan.recv[r], a, b), bits, bs,
                               out=total, accumulate=r > 0)
                total.div_(ws)
                # The owner's re-quantization residual enters the next average once, through the owner.
                quantize(total, bits, bs, gen2,
                         residual=plan.residual[own + a:own + b] if plan.residual is not None else None,
                         codes=plan.codes(plan.send2, a, b), scales=plan.scales(plan.send2, a, b),
                         residual_alpha=ws)
        return _all_gather_single(plan.gathered.view(-1), plan.send2, group=state.exchange_group, async_op=True)

    def reduce_chunk(_: torch.futures.Future) -> None:
        try:
            with state.phase2_stream(device):
                work = reduce_and_regather()
        except BaseException as exc:  # noqa: BLE001 - handed to DDP through the future
            issued.set_result(None)
            result.set_exception(exc)
            return
        issued.set_result(None)
        # Sent: a row to each other rank in the all-to-all, the re-quantized chunk to each in the all-gather.
        sent = (ws - 1) * (plan.send.shape[1] + plan.send2.numel())
        work.get_future().then(lambda f: finish(f, plan.gathered, _dequantize_into, sent))

    torch.futures.collect_all([a2a, previous]).then(reduce_chunk)
    return result


def compression_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: compressed average of one gradient bucket (see module docstring)."""
    if bucket.is_last():  # backward has computed every gradient: what follows until it returns is exposed
        state.last_bucket_time = time.perf_counter()
        if bucket.buffer().is_cuda:
            state.last_bucket_event = torch.cuda.Event(enable_timing=True)
            state.last_bucket_event.record()
    if bucket.index() == 0:
        begin_step(state)
    flat = bucket.buffer()
    params = bucket.parameters()
    small = flat.numel() < state.config.min_bucket_numel or all(p.dim() <= 1 for p in params)
    if not state.compressing or small:
        fut = allreduce_average(state, flat)
    else:
        order = sorted(range(len(params)), key=lambda i: state.param_order[id(params[i])])
        grads = bucket.gradients()
        fut = compressed_average(state, [grads[i] for i in order], [state.param_names[id(params[i])] for i in order],
                                 flat, hold=state.hold_writes and state.config.overlap and not bucket.is_last())
    if not state.config.overlap:
        fut.wait()
    if bucket.is_last():
        end_step(state)
        state.release()
    return fut


def _exchange_group(process_group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A second communicator over the ranks of ``process_group``.

    ``new_group`` is collective over the whole world, so every rank learns every data-parallel group (there are
    several under tensor parallelism) and all create them in the same order.
    """
    ranks = dist.get_process_group_ranks(process_group)
    everyone: list[list[int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, ranks)
    backend = dist.get_backend(process_group)
    mine = None
    for group_ranks in sorted({tuple(r) for r in everyone if r is not None}):
        group = dist.new_group(list(group_ranks), backend=backend)
        if dist.get_rank() in group_ranks:
            mine = group
    assert mine is not None
    return mine


def register_compression_hook(ddp_module: DistributedDataParallel, config: CompressionConfig | None = None,
                              **kwargs: object) -> CompressionState:
    """Install the compressed exchange on ``ddp_module``; every rank of the world must call this together.

    Args:
        ddp_module: a ``DistributedDataParallel`` module; its own process group is used.
        config: exchange settings; or pass them as keyword arguments (``bits=4, block_size=64``).

    Returns:
        The hook state (residuals, counters); keep it to read telemetry or to save/restore residuals.
    """
    if not isinstance(ddp_module, DistributedDataParallel):
        raise TypeError(f"register_compression_hook needs a torch DistributedDataParallel module, got "
                        f"{type(ddp_module).__name__}. Wrap the model in DistributedDataParallel first.")
    if config is not None and kwargs:
        raise ValueError("register_compression_hook: pass either `config=` or keyword settings, not both.")
    config = config or CompressionConfig(**kwargs)  # type: ignore[arg-type]
    group = ddp_module.process_group
    state = CompressionState(config, group, _exchange_group(group))
    named = list(ddp_module.module.named_parameters())
    state.param_names = {id(p): name for name, p in named}
    state.param_order = {id(p): i for i, (_, p) in enumerate(named)}
    ddp_module.register_comm_hook(state, compression_hook)
    return state
