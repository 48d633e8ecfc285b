"""The measurements the cost model (:mod:`.cost_model`) decides from, taken at setup on this machine.

- compute: a few timed forward (with the loss) and backward passes of the user's own model on a real micro-batch
  (``example_input_array``, else the first batch of the training data through ``training_step``), before any
  wrapping or sharding, so nothing communicates. The random state, the buffers (batch-norm statistics...) and the
  gradients are put back afterwards: the measurement leaves training as it found it. Autograd's saved tensors
  during one forward give the activation bytes.
- sharding: a replicated copy of the model and one copy per tensor- or expert-parallel size of the candidates, each
  sharded as the strategy would shard it (its plan, its mesh, over the real process group), take a few steps each
  (forward, backward, a step of the module's own optimizer), interleaved and aligned by a barrier; the differences
  of the medians are what sharding adds (:func:`measure_sharded`). The model itself is not touched. Cost at setup:
  ``(1 + repeats) (1 + sizes)`` training steps of one micro-batch plus the copies' memory (skipped where it does
  not fit), e.g. ~1-2 s for the demo model with ``tp`` in {1, 2}.
- compression kernels: quantize (with the error-feedback residual) and dequantize of a gradient-sized buffer, the
  kernels the hook runs (:mod:`lightning_deepseek.compression.quantize`), seconds per fp32 byte (the fallback).
- the gradient exchange: the fp32 all-reduce and the compression hook's own exchange of each candidate's replicated
  gradient bytes, on the world's process group, all ranks at once, interleaved (:func:`measure_exchange`): what
  the compressed exchange costs against the fp32 one where the ranks share the cores and gloo's threads.
- training steps of whole layouts: copies of the model, whole and sharded at each ``tp`` or ``ep`` size, wrapped
  in DDP as the strategy wraps them, one per exchange (fp32 and each compression, the hook registered as training
  registers it), training steps timed back to back, the copies taking turns (:func:`measure_copy_steps`): each
  layout's step as training runs it, its DDP exchange beside backward, tensor or expert parallelism's collectives
  and their gradient reduction, and the optimizer, which parts timed apart and summed do not see: the ranks share
  the cores, and the parts overlap (benchmarks/RESULTS.md, "Session 13", "Session 15", "Session 28", "Session 29").
- links: :func:`lightning_deepseek.parallel.placement.probe_links` (reused, not duplicated).
- device memory: the GPU's total memory, or the host's physical memory shared by its processes.
Ranks measure different figures; :func:`agree` takes the slowest of every figure so that every rank decides the
same (a decision that differed between ranks would build different meshes).
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities import move_data_to_device
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from lightning_deepseek.autotune.cost_model import DEFAULT_BLOCK_SIZE, ComputeProfile
from lightning_deepseek.compression.config import CompressionConfig
from lightning_deepseek.compression.hook import compressed_average, exchange_communicator, register_compression_hook
from lightning_deepseek.compression.quantize import dequantize, quantize
from lightning_deepseek.compression.state import CompressionState
from lightning_deepseek.parallel.placement import probe_device


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _loss_of(output: Any) -> torch.Tensor:
    """A scalar to differentiate: the loss itself, a dict's ``loss``, or the sum of a model's float outputs."""
    if isinstance(output, dict):
        output = output.get("loss", next(iter(output.values())))
    if isinstance(output, (tuple, list)):
        return sum(_loss_of(o) for o in output if isinstance(o, torch.Tensor) and o.is_floating_point())
    if hasattr(output, "loss") and getattr(output, "loss", None) is not None:  # transformers' ModelOutput
        return output.loss
    if hasattr(output, "logits"):
        return output.logits.float().sum()
    return output.float().sum() if output.dim() else output


def _tokens(batch: Any) -> int:
    """Rows entering a feed-forward layer: the first tensor's elements (token ids), or all but its last dimension."""
    if isinstance(batch, dict):
        batch = list(batch.values())
    first = next((t for t in (batch if isinstance(batch, (tuple, list)) else [batch]) if isinstance(t, torch.Tensor)),
                 None)
    if first is None:
        return 0
    return first.numel() if not first.is_floating_point() else first[..., 0].numel()


@dataclass(frozen=True)
class MicroBatch:
    """One real micro-batch: ``example_input_array`` (called as ``module(data)``) or a training batch (through
    ``training_step(data, 0)``), its description and its tokens per rank."""

    data: Any
    example: bool
    description: str
    tokens: int

    def step(self, module: pl.LightningModule) -> Callable[[], Any]:
        """A zero-argument forward of this micro-batch through ``module`` (returns what to differentiate)."""
        data = self.data
        if not self.example:
            return lambda: module.training_step(data, 0)
        if isinstance(data, dict):
            return lambda: module(**data)
        if isinstance(data, (tuple, list)):
            return lambda: module(*data)
        return lambda: module(data)


def micro_batch(module: pl.LightningModule, trainer: pl.Trainer | None) -> MicroBatch:
    """``example_input_array`` when the module sets one; else the first batch of the training data (for
    ``training_step``, with ``self.log`` silenced: the loop's logging is not set up yet)."""
    device = next(module.parameters()).device
    example = getattr(module, "example_input_array", None)
    if example is not None:
        moved = move_data_to_device(example, device)
        shape = f" {tuple(moved.shape)}" if isinstance(moved, torch.Tensor) else ""
        return MicroBatch(moved, True, f"example_input_array{shape}", _tokens(moved))
    fix = ("set the module's example_input_array (one micro-batch), or set the sizes the cost model would decide "
           "(tensor_parallel_size, expert_parallel_size, bits) explicitly")
    if trainer is None or not module.automatic_optimization:
        why = "there is no Trainer" if trainer is None else "training_step steps the optimizer itself (manual)"
        raise ValueError(f"The cost model times {type(module).__name__} on one micro-batch, but it sets no "
                         f"example_input_array and {why}: {fix}.")
    try:
        # Lightning keeps where the training data comes from (a datamodule, the module's hook, or the loaders given
        # to fit()) only in the fit loop's data source; the setup hooks have run by now.
        batch = move_data_to_device(next(iter(trainer.fit_loop._data_source.dataloader())), device)
    except Exception as exc:  # noqa: BLE001 - any failure to produce a batch gets the same advice
        raise ValueError(f"The cost model could not take a training batch to time {type(module).__name__} "
                         f"({type(exc).__name__}: {exc}): {fix}.") from exc
    first = batch[0] if isinstance(batch, (tuple, list)) else batch
    shape = tuple(first.shape) if isinstance(first, torch.Tensor) else "?"
    return MicroBatch(batch, False, f"a training batch {shape}", _tokens(batch))


def micro_batch_step(module: pl.LightningModule, trainer: pl.Trainer | None) -> tuple[Callable[[], Any], str, int]:
    """A zero-argument forward of one real micro-batch (:func:`micro_batch`), its description and its tokens per
    rank."""
    batch = micro_batch(module, trainer)
    return batch.step(module), batch.description, batch.tokens


def measure_compute(module: nn.Module, step: Callable[[], Any], description: str = "", repeats: int = 3,
                    experts: list[nn.Module] = ()) -> ComputeProfile:
    """Median forward and backward seconds of ``step`` (after one warm-up), the bytes saved for backward and,
    for MoE models, the bytes routed to one layer's ``experts`` (their inputs ``(T, d)`` times ``k``).

    The random state, buffers and gradients of ``module`` are restored afterwards.
    """
    routed: list[int] = []

    def record(_: nn.Module, args: tuple, kwargs: dict) -> None:
        values = [*args, kwargs.get("hidden_states"), kwargs.get("top_k_index")]
        hidden, top_k_index = [v for v in values if isinstance(v, torch.Tensor)][:2]
        routed.append(hidden.numel() * hidden.element_size() * top_k_index.shape[-1])

    handles = [e.register_forward_pre_hook(record, with_kwargs=True) for e in experts]
    device = next(module.parameters()).device
    buffers = {k: v.clone() for k, v in module.named_buffers()}
    grads = {p: p.grad for p in module.parameters()}
    if isinstance(module, pl.LightningModule):
        # training_step logs; the loop's result collection does not exist before fit starts.
        module.log = module.log_dict = lambda *args, **kwargs: None
    forward, backward, saved = [], [], 0
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            for i in range(repeats + 1):
                sizes: list[int] = []

                def pack(t: torch.Tensor, sizes: list[int] = sizes) -> torch.Tensor:
                    sizes.append(t.numel() * t.element_size())
                    return t

                _synchronize(device)
                start = time.perf_counter()
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    loss = _loss_of(step())
                _synchronize(device)
                middle = time.perf_counter()
                loss.backward()
                _synchronize(device)
                end = time.perf_counter()
                if i:  # the first pass warms allocators and caches
                    forward.append(middle - start)
                    backward.append(end - middle)
                saved = sum(sizes)
    finally:
        for handle in handles:
            handle.remove()
        if isinstance(module, pl.LightningModule):
            del module.log, module.log_dict  # back to the class's methods
        with torch.no_grad():
            for name, buffer in module.named_buffers():
                buffer.copy_(buffers[name])
        for p, g in grads.items():
            p.grad = g
    return ComputeProfile(statistics.median(forward), statistics.median(backward), saved, max(routed, default=0),
                          f"measured: {repeats} forward/backward passes of {description or 'a micro-batch'}")


# Shards a copy of the model in place and returns the strategy's reduction of its shards' gradients after backward.
# The process groups of its mesh stay open: torch's DeviceMesh resolves groups by name, and a mesh the strategy
# builds later for the same ranks may be handed a closed one.
Shard = Callable[[nn.Module], Callable[[], None]]


class CopyError(RuntimeError):
    """The model cannot be deep-copied, so its sharding cannot be timed on a copy."""


def replica(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` that shares its Trainer (a LightningModule refers to it) instead of copying it."""
    trainer = getattr(module, "_trainer", None)
    try:
        return copy.deepcopy(module, memo={id(trainer): trainer} if trainer is not None else None)
    except Exception as exc:  # noqa: BLE001 - whatever an attribute's __deepcopy__ raises
        raise CopyError(f"{type(module).__name__} cannot be deep-copied ({type(exc).__name__}: {exc})") from exc


def first_optimizer(module: nn.Module) -> torch.optim.Optimizer | None:
    """The (first) optimizer ``configure_optimizers`` builds for ``module``, in any of the forms Lightning accepts;
    None where there is none or it needs the running Trainer."""
    try:
        config: Any = module.configure_optimizers()
    except Exception:  # noqa: BLE001 - a hook that needs the fit loop (schedulers' stepping batches...)
        return None
    while not isinstance(config, torch.optim.Optimizer):
        if isinstance(config, dict):
            config = config.get("optimizer")
        elif isinstance(config, (tuple, list)) and config:
            config = config[0]
        else:
            return None
    for group in config.param_groups:  # torch's multi-tensor kernels refuse DTensor and plain tensors together
        if len({type(p).__name__ == "DTensor" for p in group["params"]}) > 1 and group.get("foreach") is None:
            group["foreach"] = False
    return config


def measure_sharded(module: pl.LightningModule, batch: MicroBatch, shardings: Mapping[tuple[str, int], Shard],
                    repeats: int = 3) -> tuple[float, dict[tuple[str, int], tuple[float, float]]]:
    """What each sharding adds to a micro-batch's forward + backward and to an optimizer step (collective).

    A replicated copy of ``module`` and one copy per entry of ``shardings`` (each sharded in place by its function)
    run ``repeats`` timed steps each (after one warm-up): forward, backward, a step of the
    module's own optimizer, every copy once per round, the ranks aligned by a barrier before each pass, so that
    load that drifts during setup falls on all copies alike. ``module`` itself is not touched.

    Raises:
        CopyError: ``module`` cannot be deep-copied (raised before any collective, on every rank alike).

    Returns:
        The replicated copy's median optimizer step seconds (0 without an optimizer), and for each sharding the
        differences of its medians from the replicated copy's: ``(forward + backward, optimizer step)``.
    """
    device = next(module.parameters()).device
    # every copy before any collective: a model that cannot be copied fails alike on every rank, before a barrier
    copies: dict[tuple[str, int] | None, nn.Module] = {key: replica(module) for key in [None, *shardings]}
    for key, shard in shardings.items():
        shard(copies[key])
    steps = {key: batch.step(m) for key, m in copies.items()}
    optimizers = {key: first_optimizer(m) for key, m in copies.items()}
    if any(o is None for o in optimizers.values()):
        optimizers = dict.fromkeys(copies)
    passes: dict[tuple[str, int] | None, list[float]] = {key: [] for key in copies}
    steps_of_optimizer: dict[tuple[str, int] | None, list[float]] = {key: [] for key in copies}
    aligned = dist.is_available() and dist.is_initialized()
    for m in copies.values():
        if isinstance(m, pl.LightningModule):
            m.log = m.log_dict = lambda *args, **kwargs: None
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for i in range(repeats + 1):
            for key in copies:
                if aligned:
                    dist.barrier()
                _synchronize(device)
                start = time.perf_counter()
                _loss_of(steps[key]()).backward()
                _synchronize(device)
                middle = time.perf_counter()
                if optimizers[key] is not None:
                    optimizers[key].step()
                    optimizers[key].zero_grad(set_to_none=True)
                    _synchronize(device)
                end = time.perf_counter()
                if i:  # the first round warms allocators, caches and the optimizer states
                    passes[key].append(middle - start)
                    steps_of_optimizer[key].append(end - middle)
    med = {key: (statistics.median(passes[key]), statistics.median(steps_of_optimizer[key])) for key in copies}
    base = med.pop(None)
    return base[1], {key: (f - base[0], o - base[1]) for key, (f, o) in med.items()}


def _exchange_settings(bits_options: tuple[int, ...]) -> tuple[dict[int, CompressionConfig], dist.ProcessGroup]:
    """The hook's settings for each ``bits`` (the presets' block sizes, no warm-up) and the communicator of the
    two-phase exchange's phase 2 over the world (a new one, collective; the world itself where every exchange is a
    single all-gather)."""
    world = dist.group.WORLD
    ranks = dist.get_process_group_ranks(world)
    configs = {bits: CompressionConfig(bits=bits, block_size=DEFAULT_BLOCK_SIZE[bits], warmup_steps=0)
               for bits in bits_options}
    single = all(len(ranks) <= c.single_exchange_max_world for c in configs.values())
    return configs, world if single else exchange_communicator(tuple(ranks), dist.get_backend(world))


class _Forward(nn.Module):
    """A module whose forward is ``step`` (a micro-batch through ``module``): DDP wraps it and runs its forward,
    which prepares DDP's reducer for the backward that follows (as Lightning's wrapper does with
    ``training_step``)."""

    def __init__(self, module: nn.Module, step: Callable[[], Any]) -> None:
        super().__init__()
        self.module = module
        self._step = step

    def forward(self) -> Any:
        return self._step()


def measure_copy_steps(module: pl.LightningModule, batch: MicroBatch, shardings: Mapping[tuple[str, int], Shard],
                       copies: Iterable[tuple[str, int, int | None]], bucket_bytes: int, repeats: int = 3,
                       steps: int = 2) -> dict[tuple[str, int, int | None], float]:
    """``{(kind, size, bits): seconds}`` for each of ``copies``: the median training step of a DDP-wrapped copy of
    ``module`` sharded by ``shardings[(kind, size)]`` (``("tp", 2)``, ``("ep", 4)``..., ``("tp", 1)`` with a
    function that shards nothing: plain data parallelism) with the exchange ``bits`` (None: fp32) (collective).

    Each copy is sharded, wrapped in ``DistributedDataParallel`` over the world with the shards (``DTensor``
    parameters) ignored and ``bucket_bytes`` buckets, as ``HybridParallelStrategy`` wraps it, and, compressed, the
    compression hook registered on it (warm-up steps 0). Every copy runs ``repeats`` rounds (after one warm-up round:
    DDP's bucket rebuild, the hook's plans, the optimizer states) of ``steps`` training steps back to back after a
    barrier: forward, backward (which returns once DDP's exchange has completed), the sharding's reduction of the
    shards' gradients, a step of the module's own optimizer; the copies take turns round by round. Steps back to
    back, not single passes after a barrier: on the 1 Gbit testbed single aligned passes saw compression under tp=2
    save 6-16 ms where training measured it 13-18 ms slower (benchmarks/RESULTS.md, "Session 15"). ``module`` and
    the random state are not touched.

    Raises:
        CopyError: ``module`` cannot be deep-copied (raised before any collective, on every rank alike).
    """
    device = next(module.parameters()).device
    keys = [((kind, size), bits) for kind, size, bits in copies]
    replicas = {key: replica(module) for key in keys}
    configs, _ = _exchange_settings(tuple(sorted({bits for _, bits in keys if bits is not None}, reverse=True)))
    wrapped: dict[tuple[tuple[str, int], int | None], DistributedDataParallel] = {}
    reductions: dict[tuple[tuple[str, int], int | None], Callable[[], None]] = {}
    optimizers: dict[tuple[tuple[str, int], int | None], torch.optim.Optimizer | None] = {}
    for (sharding, bits), m in replicas.items():
        reductions[(sharding, bits)] = shardings[sharding](m)
        optimizers[(sharding, bits)] = first_optimizer(m)
        if isinstance(m, pl.LightningModule):
            m.log = m.log_dict = lambda *args, **kwargs: None
        forward = _Forward(m, batch.step(m))
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            forward, [name for name, p in forward.named_parameters() if isinstance(p, DTensor)])
        ddp = DistributedDataParallel(forward, device_ids=[device.index] if device.type == "cuda" else None,
                                      bucket_cap_mb=bucket_bytes / 2**20)
        if bits is not None:
            register_compression_hook(ddp, configs[bits])  # its communicator: the one measure_exchange reuses
        wrapped[(sharding, bits)] = ddp
    seconds: dict[tuple[tuple[str, int], int | None], list[float]] = {key: [] for key in keys}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for i in range(repeats + 1):
            for key, ddp in wrapped.items():
                dist.barrier()
                for _ in range(steps):
                    _synchronize(device)
                    start = time.perf_counter()
                    _loss_of(ddp()).backward()
                    reductions[key]()
                    if optimizers[key] is not None:
                        optimizers[key].step()
                    _synchronize(device)
                    if i:  # the first round rebuilds DDP's buckets and makes the hook's plans
                        seconds[key].append(time.perf_counter() - start)
                    ddp.zero_grad(set_to_none=True)
    return {(*sharding, bits): statistics.median(times) for (sharding, bits), times in seconds.items()}


def measure_quantize(num_bytes: int, bits_options: tuple[int, ...] = (8, 4), device: torch.device | None = None,
                     repeats: int = 5) -> dict[int, tuple[float, float]]:
    """``{bits: (quantize, dequantize)}`` seconds per fp32 byte on a buffer of up to ``num_bytes`` (at least 1 MiB,
    at most 4 MiB: the per-byte cost of the hook's tiled kernels, which work 2 MiB at a time, does not depend on
    size beyond that). The fastest of ``repeats`` passes: a kernel's cost, not the load spikes of a shared machine
    (on the testbed a median of 3 over 16 MiB once put int8 at 6x int4)."""
    device = device or torch.device("cpu")
    numel = max(1 << 18, min(num_bytes // 4, 1 << 20)) // 256 * 256
    x = torch.randn(numel, device=device)
    residual = torch.empty_like(x)
    out = torch.empty_like(x)
    result = {}
    for bits in bits_options:
        block = DEFAULT_BLOCK_SIZE[bits]
        q_times, dq_times = [], []
        for i in range(repeats + 1):
            _synchronize(device)
            start = time.perf_counter()
            codes, scales = quantize(x, bits, block, residual=residual)
            _synchronize(device)
            middle = time.perf_counter()
            dequantize(codes, scales, bits, block, out=out)
            _synchronize(device)
            if i:
                q_times.append(middle - start)
                dq_times.append(time.perf_counter() - middle)
        result[bits] = (min(q_times) / (numel * 4), min(dq_times) / (numel * 4))
    return result


EXCHANGE_MAX_BYTES = 32 * 2**20  # above DDP's default bucket (25 MiB): one exchange is one real bucket's


def measure_exchange(sizes: list[int], bits_options: tuple[int, ...], device: torch.device, repeats: int = 3,
                     max_bytes: int = EXCHANGE_MAX_BYTES, copies: bool = True) -> dict[tuple[int, int | None], float]:
    """``{(fp32 bytes, bits or None): seconds}`` of one exchange of that many gradient bytes over the world, on
    every rank at once (collective), with the ``copies`` DDP makes around it unless its ``gradient_as_bucket_view``
    is on (off by default: the buckets are not the gradients' storage): ``None`` the fp32 all-reduce DDP runs (the
    gradients copied into the bucket divided by the world, the all-reduce, the bucket copied back), ``bits`` the
    compression hook's own exchange (the gradients copied into the bucket, then
    :func:`~lightning_deepseek.compression.hook.compressed_average`: quantize with the residual, the collectives,
    phase 2, the write; the bucket copied back), each timed from a barrier until the copy back, interleaved, the
    median of ``repeats`` (after one warm-up). So what the ranks' competition for the cores and gloo's threads cost
    the exchange is in the figure, as it is in training; the quantize kernels timed alone on one rank miss it
    (:mod:`.cost_model`). The copies added 4-10 ms to the wide FFN's 18.6 MiB exchanges on this project's 2-core
    machine (4 ranks); left out, its unsharded candidates were predicted 10-16 ms too fast (benchmarks/RESULTS.md,
    "Session 24"). A size above ``max_bytes`` is timed at ``max_bytes`` and scaled by the
    bytes (setup cost: ``(1 + repeats)`` rounds of every size and compression; the payloads are random, the global
    random state is not touched). The world's process group gets one more communicator for the two-phase exchange's
    phase 2."""
    world = dist.group.WORLD
    ranks = dist.get_process_group_ranks(world)
    configs, second = _exchange_settings(bits_options)
    generator = torch.Generator().manual_seed(dist.get_rank())
    timed = {n: min(n, max_bytes) // 4 * 4 for n in sizes if n > 0}
    grads = {n: torch.randn(m // 4, generator=generator).to(device) for n, m in timed.items()}
    written = {n: torch.empty_like(g) for n, g in grads.items()}  # the gradients after the exchange (grads stays)
    buckets = {n: torch.empty_like(g) for n, g in grads.items()} if copies else written
    states = {(n, bits): CompressionState(config, world, second) for n in timed for bits, config in configs.items()}
    times: dict[tuple[int, int | None], list[float]] = {(n, b): [] for n in timed for b in (None, *bits_options)}
    for i in range(repeats + 1):
        for n in timed:
            for bits in (None, *bits_options):
                bucket = buckets[n]
                if not copies:  # the gradients are the bucket's storage: a fresh payload, untimed
                    bucket.copy_(grads[n])
                dist.barrier()
                _synchronize(device)
                start = time.perf_counter()
                if bits is None:
                    if copies:  # DDP without a hook: the gradients copied into the bucket, divided by the world
                        torch.mul(grads[n], 1.0 / len(ranks), out=bucket)
                    else:
                        bucket.div_(len(ranks))
                    dist.all_reduce(bucket, group=world, async_op=True).get_future().wait()
                else:
                    if copies:  # with a hook: the gradients copied into the bucket
                        bucket.copy_(grads[n])
                    state = states[(n, bits)]
                    state.begin_step()
                    compressed_average(state, [bucket], ["exchange"], bucket).wait()
                if copies:  # the bucket copied back into the gradients
                    written[n].copy_(bucket)
                _synchronize(device)
                if i:  # the first round makes the plans and warms the communicators
                    times[(n, bits)].append(time.perf_counter() - start)
    return {(n, b): statistics.median(v) * n / timed[n] for (n, b), v in times.items()}


def device_memory_bytes(device: torch.device, processes_per_node: int) -> int:
    """Memory one rank may plan for: the GPU's, or the host's physical memory over its processes."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host // max(1, processes_per_node)


def agree(values: list[float]) -> list[float]:
    """The maximum of each figure over all ranks (collective when a process group is up; else ``values``)."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=probe_device(dist.get_backend_config()))
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def agree_compute(profile: ComputeProfile) -> ComputeProfile:
    """``profile`` with the slowest rank's figures (collective; every rank measured the same shardings)."""
    keys = sorted(profile.sharded)
    steps = sorted(profile.copy_steps, key=lambda k: (k[0], k[1], -1 if k[2] is None else k[2]))
    f, b, a, r, o, *rest = agree([profile.forward_seconds, profile.backward_seconds,
                                  float(profile.activation_bytes), float(profile.routed_bytes),
                                  profile.optimizer_seconds, *(v for k in keys for v in profile.sharded[k]),
                                  *(profile.copy_steps[k] for k in steps)])
    sharded, copy_steps = rest[:2 * len(keys)], rest[2 * len(keys):]
    return ComputeProfile(f, b, int(a), int(r), profile.source, o,
                          {k: (sharded[2 * i], sharded[2 * i + 1]) for i, k in enumerate(keys)},
                          dict(zip(steps, copy_steps)))


def agree_exchange(seconds: dict[tuple[int, int | None], float]) -> dict[tuple[int, int | None], float]:
    """``seconds`` with the slowest rank's figures (collective; every rank measured the same keys)."""
    keys = sorted(seconds, key=lambda k: (k[0], -1 if k[1] is None else k[1]))
    return dict(zip(keys, agree([seconds[k] for k in keys])))


def agree_quantize(costs: dict[int, tuple[float, float]]) -> dict[int, tuple[float, float]]:
    """``costs`` with the slowest rank's figures (collective)."""
    keys = sorted(costs)
    flat = agree([v for k in keys for v in costs[k]])
    return {k: (flat[2 * i], flat[2 * i + 1]) for i, k in enumerate(keys)}
