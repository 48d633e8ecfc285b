"""The compressed DDP communication hook: the exchange of one bucket, and registration.

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

Memory traffic: each bucket has a plan (``plan.py``, made on first use) holding its residual and its four message
buffers, reused every step. On CPU every step works tile by tile (2 MiB of fp32): a tile is gathered from the
gradients (adding the residual), quantized straight into the send buffer with the new residual written back in the
same pass; phase 2 dequantizes and sums every rank's tile into one cache-resident accumulator; the received rows are
averaged straight into the gradients by one native kernel (on the eager path, one tile at a time through a work
buffer and a scatter).
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
import contextlib
import time
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lightning_deepseek.compression import native
from lightning_deepseek.compression.config import CompressionConfig
from lightning_deepseek.compression.plan import BucketPlan
from lightning_deepseek.compression.quantize import TILE_VALUES, dequantize, quantize
from lightning_deepseek.compression.state import CompressionState, fp32_allreduce_bytes
from lightning_deepseek.parallel.groups import reused

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def allreduce_average(state: CompressionState, flat: torch.Tensor) -> torch.futures.Future:
    """Uncompressed fp32 all-reduce average (warm-up steps, small and 1-D buckets)."""
    state.count_bucket(fp32_allreduce_bytes(flat.numel(), state.world_size),
                       fp32_allreduce_bytes(flat.numel(), state.world_size))
    flat.div_(state.world_size)
    fut = dist.all_reduce(flat, group=state.process_group, async_op=True).get_future()
    if not state.compressing:
        return fut.then(lambda f: f.value()[0])

    def record_finite(f: torch.futures.Future) -> torch.Tensor:
        out = f.value()[0]
        state.record_finite(torch.isfinite(out).all())
        return out

    return fut.then(record_finite)


def _tiles(length: int, device: torch.device, block_size: int) -> list[tuple[int, int]]:
    step = length if device.type != "cpu" else max(block_size, TILE_VALUES // block_size * block_size)
    return [(a, min(a + step, length)) for a in range(0, length, step)]


def _quantize_bucket(state: CompressionState, plan: BucketPlan, flats: Sequence[torch.Tensor],
                     tiles: Sequence[tuple[int, int]], generator: torch.Generator | None) -> None:
    """Phase 1: for every destination ``r``, gather each tile of chunk ``r`` (plus the residual) and quantize it
    into row ``r`` of ``plan.send``, writing the new residual back in the same pass."""
    layout, chunk, device = plan.layout, plan.layout.chunk, flats[0].device
    keep_residual = plan.residual is not None or state.track_error
    scratch_or_none = state.scratch(tiles[0][1], device) if plan.residual is None else contextlib.nullcontext()
    with state.timed(device), scratch_or_none as scratch:
        for r in range(plan.world_size):
            for a, b in tiles:
                lo, hi = r * chunk + a, r * chunk + b
                x = plan.residual[lo:hi] if plan.residual is not None else scratch[:b - a]
                layout.gather(flats, lo, hi, x, add=plan.residual is not None)
                if state.track_error:
                    state.input_sq.append(x.square().sum())
                quantize(x, plan.bits, plan.block_size, generator, residual=x if keep_residual else None,
                         codes=plan.codes(plan.send[r], a, b), scales=plan.scales(plan.send[r], a, b))
                if state.track_error:
                    state.error_sq.append(x.square().sum())


def _reduce_and_regather(state: CompressionState, plan: BucketPlan, tiles: Sequence[tuple[int, int]],
                         generator: torch.Generator | None, a2a: torch.futures.Future) -> dist.Work:
    """Phase 2 (chunk r = this rank): dequantize and sum every rank's codes, re-quantize, launch the all-gather."""
    # wait(), not value(): collect_all's future carries no CUDA events, so on NCCL (whose futures complete at
    # launch) only wait() makes the current (phase-2) stream wait for the all-to-all before reading `recv`.
    a2a.wait()
    ws, bits, bs, device = plan.world_size, plan.bits, plan.block_size, plan.recv.device
    own = state.rank * plan.layout.chunk
    with state.timed(device), state.scratch(tiles[0][1], device) as acc:
        for a, b in tiles:  # dequantize and sum every rank's codes for this chunk, re-quantize, per tile
            total = acc[:b - a]
            for r in range(ws):
                dequantize(plan.codes(plan.recv[r], a, b), plan.scales(plan.recv[r], a, b), bits, bs,
                           out=total, accumulate=r > 0)
            total.div_(ws)
            # The owner's re-quantization residual enters the next average once, through the owner.
            quantize(total, bits, bs, generator,
                     residual=plan.residual[own + a:own + b] if plan.residual is not None else None,
                     codes=plan.codes(plan.send2, a, b), scales=plan.scales(plan.send2, a, b), residual_alpha=ws)
    return _all_gather_single(plan.gathered.view(-1), plan.send2, group=state.exchange_group, async_op=True)


def _write_average(state: CompressionState, plan: BucketPlan, flats: Sequence[torch.Tensor],
                   tiles: Sequence[tuple[int, int]]) -> None:
    """For every chunk ``r``: dequantize and sum the received rows ``plan.rows(r)`` in order (the same on every
    rank, so replicas stay identical), average them, and write the result into the gradients: straight from the
    messages with the native CPU kernels when every gradient is contiguous float32, else tile by tile through a
    work buffer and a scatter."""
    layout, chunk, bits, bs = plan.layout, plan.layout.chunk, plan.bits, plan.block_size
    if native.usable(*flats) and all(f.dtype == torch.float32 for f in flats) and native.library() is not None:
        for r in range(plan.world_size):
            lo, hi = r * chunk, min((r + 1) * chunk, layout.numel)
            if lo >= hi:
                break
            sources = [(plan.codes(row, 0, chunk), plan.scales(row, 0, chunk)) for row in plan.rows(r)]
            for i, start, pos, n in layout.segments(lo, hi):
                native.average_range(sources, flats[i][start:start + n], pos, bits, bs)
        return
    with state.scratch(tiles[0][1], flats[0].device) as acc:
        for r in range(plan.world_size):  # chunk r of the bucket
            sources = plan.rows(r)
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


def _failing_into(result: torch.futures.Future, step: Callable[..., None], *args: object) -> None:
    """Run one step of the exchange; its exception (or the collective's, raised by a ``value()`` in it) completes
    ``result``, so that DDP raises it from backward instead of it vanishing in a callback thread."""
    try:
        step(*args)
    except BaseException as exc:  # noqa: BLE001 - handed to DDP through the future
        result.set_exception(exc)


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
    device = out.device
    flats = [t.view(-1) for t in tensors]
    plan = state.plan(names, [f.numel() for f in flats], device)
    tiles = _tiles(plan.layout.chunk, device, plan.block_size)
    phase1_generator, phase2_generator = state.rounding_generators(device)
    result = torch.futures.Future(devices=[device] if device.type == "cuda" else None)
    hold = hold and device.type == "cpu"

    def write() -> None:
        """Last step: write the average into the gradients, record finiteness, count, complete ``result``."""
        with state.timed(device):
            _write_average(state, plan, flats, tiles)
        if plan.residual is not None:
            # A non-finite bucket leaves NaN residuals: the next step's begin_step zeroes them all.
            state.record_finite(torch.isfinite(plan.scales(plan.received, 0, plan.layout.chunk)).all())
        state.count_bucket(plan.bytes_sent, fp32_allreduce_bytes(plan.layout.numel, state.world_size),
                           compressed=True)
        result.set_result(out)

    def arrived(last: torch.futures.Future) -> None:
        """The last collective is done: write now, or (CPU) hold the write (``CompressionState.hold``)."""
        last.value()  # raises the collective's error
        if hold:
            state.hold(lambda: _failing_into(result, write))
        else:
            write()

    def phase2(a2a: torch.futures.Future, issued: torch.futures.Future) -> None:
        """This bucket's all-to-all and the previous bucket's phase 2 are issued: run phase 2, then chain on."""
        try:
            with state.phase2_stream(device):
                work = _reduce_and_regather(state, plan, tiles, phase2_generator, a2a)
        finally:
            issued.set_result(None)  # even on error: the next bucket's phase 2 waits for it
        work.get_future().then(lambda f: _failing_into(result, arrived, f))

    _quantize_bucket(state, plan, flats, tiles, phase1_generator)  # on the calling thread: overlaps with backward
    if plan.single:  # every rank's whole quantized bucket, to every other rank; then average them
        gathered = _all_gather_single(plan.recv.view(-1), plan.send.view(-1), group=state.process_group,
                                      async_op=True).get_future()
        gathered.then(lambda f: _failing_into(result, arrived, f))
        return result
    a2a = dist.all_to_all_single(plan.recv, plan.send, group=state.process_group, async_op=True).get_future()
    previous, issued = state.phase2_turn()
    torch.futures.collect_all([a2a, previous]).then(lambda _: _failing_into(result, phase2, a2a, issued))
    return result


def compression_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: compressed average of one gradient bucket (see module docstring)."""
    if bucket.is_last():  # backward has computed every gradient: what follows until it returns is exposed
        state.last_bucket_time = time.perf_counter()
        if bucket.buffer().is_cuda:
            state.last_bucket_event = torch.cuda.Event(enable_timing=True)
            state.last_bucket_event.record()
    if bucket.index() == 0:
        state.begin_step()
    flat = bucket.buffer()
    params = bucket.parameters()
    small = flat.numel() < state.config.min_bucket_numel or all(p.dim() <= 1 for p in params)
    if not state.compressing or small:
        fut = allreduce_average(state, flat)
    else:
        order = sorted(range(len(params)), key=lambda i: state.param_order[id(params[i])])
        grads = bucket.gradients()
        fut = compressed_average(state, [grads[i] for i in order], [state.param_names[id(params[i])] for i in order],
                                 flat, hold=state.config.hold_writes and state.config.overlap and not bucket.is_last())
    if not state.config.overlap:
        fut.wait()
    if bucket.is_last():
        state.end_step()
        state.release()
    return fut


def exchange_communicator(ranks: tuple[int, ...], backend: str) -> dist.ProcessGroup:
    """The phase-2 communicator over ``ranks``: made once (collective over the world), the same one for every later
    exchange over these ranks in the same processes (:mod:`~lightning_deepseek.parallel.groups`)."""
    return reused(("exchange_group", backend, tuple(ranks)), lambda: dist.new_group(list(ranks), backend=backend))


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
        group = exchange_communicator(group_ranks, backend)
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
    config = CompressionConfig.from_settings("register_compression_hook", config, kwargs)
    config.check_decided("register_compression_hook")
    state = compression_state(ddp_module.process_group, ddp_module.module.named_parameters(), config)
    ddp_module.register_comm_hook(state, compression_hook)
    return state


def compression_state(process_group: dist.ProcessGroup, named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
                      config: CompressionConfig) -> CompressionState:
    """The state of the compressed exchange over ``process_group`` for ``named_parameters`` (residuals keyed by
    these names, blocks in this order); collective over the world (it makes the phase-2 communicator)."""
    state = CompressionState(config, process_group, _exchange_group(process_group))
    named = list(named_parameters)
    state.param_names = {id(p): name for name, p in named}
    state.param_order = {id(p): i for i, (_, p) in enumerate(named)}
    return state
