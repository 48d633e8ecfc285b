"""What the ``"auto"`` settings measure at setup (collective where a process group is up).

- one real micro-batch (:func:`micro_batch`) and the bytes autograd saves for backward in one forward of it
  (:func:`measure_activations`, for the memory filter; the random state and buffers are put back);
- the training step of each candidate layout (:func:`measure_copy_steps`): a deep copy of the model per candidate,
  sharded as the strategy would shard it, wrapped in DDP as the strategy wraps it (not where FSDP holds every
  parameter), with the candidate's exchange
  (fp32 or the compression hook), timed in training steps taking turns: the exchange beside backward, the
  sharding's collectives, the ranks' competition for the cores and the optimizer are all in the figure. Cost: one
  copy of the model per candidate at once (the caller checks the room) and ``(1 + repeats) * steps`` steps of each.
- the memory one rank may plan for (:func:`device_memory_bytes`; ``$LDS_DEVICE_MEMORY_GIB`` sets it).

:func:`agree` takes the slowest rank's figures, so that every rank takes the same decision.
"""

from __future__ import annotations

import contextlib
import copy
import os
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities import move_data_to_device
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from lightning_deepseek.autotune.decision import Candidate
from lightning_deepseek.compression.config import CompressionConfig
from lightning_deepseek.compression.hook import register_compression_hook
from lightning_deepseek.parallel.placement import probe_device

MEMORY_VARIABLE = "LDS_DEVICE_MEMORY_GIB"
BLOCK_SIZE = {8: 128, 4: 64}  # the lds-train presets' block sizes (app/conf/compression/int8.yaml, int4.yaml)


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
    fix = ("set the module's example_input_array (one micro-batch), or set the sizes the 'auto' settings would decide "
           "(tensor_parallel_size, expert_parallel_size, data_parallel_shard_size, bits) explicitly")
    if trainer is None or not module.automatic_optimization:
        why = "there is no Trainer" if trainer is None else "training_step steps the optimizer itself (manual)"
        raise ValueError(f"The 'auto' settings time {type(module).__name__} on one micro-batch, but it sets no "
                         f"example_input_array and {why}: {fix}.")
    try:
        # Lightning keeps where the training data comes from (a datamodule, the module's hook, or the loaders given
        # to fit()) only in the fit loop's data source; the setup hooks have run by now.
        batch = move_data_to_device(next(iter(trainer.fit_loop._data_source.dataloader())), device)
    except Exception as exc:  # noqa: BLE001 - any failure to produce a batch gets the same advice
        raise ValueError(f"The 'auto' settings could not take a training batch to time {type(module).__name__} "
                         f"({type(exc).__name__}: {exc}): {fix}.") from exc
    first = batch[0] if isinstance(batch, (tuple, list)) else batch
    shape = tuple(first.shape) if isinstance(first, torch.Tensor) else "?"
    return MicroBatch(batch, False, f"a training batch {shape}", _tokens(batch))


def measure_activations(module: nn.Module, step: Callable[[], Any]) -> int:
    """The bytes autograd saves for backward in one forward of ``step`` (no backward runs); the random state and
    buffers of ``module`` are put back afterwards."""
    device = next(module.parameters()).device
    buffers = {k: v.clone() for k, v in module.named_buffers()}
    sizes: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        sizes.append(t.numel() * t.element_size())
        return t

    if isinstance(module, pl.LightningModule):
        # training_step logs; the loop's result collection does not exist before fit starts.
        module.log = module.log_dict = lambda *args, **kwargs: None
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            step()
    finally:
        if isinstance(module, pl.LightningModule):
            del module.log, module.log_dict  # back to the class's methods
        with torch.no_grad():
            for name, buffer in module.named_buffers():
                buffer.copy_(buffers[name])
    return sum(sizes)


# Shards a copy of the model in place and returns the strategy's reduction of its shards' gradients after backward.
# The process groups of its mesh stay open: torch's DeviceMesh resolves groups by name, and a mesh the strategy
# builds later for the same ranks may be handed a closed one.
Shard = Callable[[nn.Module], Callable[[], None]]


class CopyError(RuntimeError):
    """The model cannot be deep-copied, so its layouts cannot be timed on copies."""


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


def _training_step(module: nn.Module, batch: MicroBatch, candidate: Candidate, shard: Shard, bucket_bytes: int,
                   bucket_view: bool) -> tuple[nn.Module, Callable[[int], None]]:
    """``module`` sharded by ``shard`` and wrapped as ``HybridParallelStrategy`` wraps it (DDP over the world, the
    shards ignored, the candidate's compression hook with no warm-up; no DDP where every trainable parameter is a
    shard), and its training step of ``m`` micro-batches: DDP exchanges after the last, then the sharding's reduction
    and the optimizer."""
    device = next(module.parameters()).device
    reduce, optimizer = shard(module), first_optimizer(module)
    if isinstance(module, pl.LightningModule):
        module.log = module.log_dict = lambda *args, **kwargs: None
    forward = _Forward(module, batch.step(module))
    # torch's only way to keep parameters out of DDP's buckets (the strategy leaves the shards to their reduction)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        forward, [name for name, p in forward.named_parameters() if isinstance(p, DTensor)])
    if not any(p.requires_grad and not isinstance(p, DTensor) for p in forward.parameters()):
        return forward, _plain_step(forward, reduce, optimizer)  # FSDP holds every parameter (as the strategy)
    ddp = DistributedDataParallel(forward, device_ids=[device.index] if device.type == "cuda" else None,
                                  bucket_cap_mb=bucket_bytes / 2**20, gradient_as_bucket_view=bucket_view)
    if candidate.bits is not None:
        register_compression_hook(ddp, CompressionConfig(bits=candidate.bits, block_size=BLOCK_SIZE[candidate.bits],
                                                         warmup_steps=0))

    def step(micro_batches: int) -> None:
        for i in range(micro_batches):
            with ddp.no_sync() if i < micro_batches - 1 else contextlib.nullcontext():
                _loss_of(ddp()).backward()
        reduce()
        if optimizer is not None:
            optimizer.step()
    return ddp, step


def _plain_step(forward: nn.Module, reduce: Callable[[], None], optimizer: torch.optim.Optimizer | None
                ) -> Callable[[int], None]:
    """The training step of a copy with nothing for DDP: every micro-batch's backward reduces its shards (FSDP)."""

    def step(micro_batches: int) -> None:
        for _ in range(micro_batches):
            _loss_of(forward()).backward()
        reduce()
        if optimizer is not None:
            optimizer.step()
    return step


def measure_copy_steps(module: pl.LightningModule, batch: MicroBatch, layouts: Mapping[Candidate, Shard],
                       bucket_bytes: int, micro_batches: int = 1, repeats: int = 3, steps: int = 2,
                       bucket_view: bool = False) -> dict[Candidate, float]:
    """``{candidate: seconds}``: the median training step of a DDP-wrapped copy of ``module`` for each candidate of
    ``layouts``, sharded by its function (one that shards nothing: plain data parallelism), with the candidate's
    exchange (collective).

    Every copy runs ``repeats`` rounds (after one warm-up round: DDP's bucket rebuild, the hook's plans, the
    optimizer states) of ``steps`` training steps back to back after a barrier; the copies take turns round by
    round, so that load that drifts during setup falls on all alike. Steps back to back rather than single passes
    after a barrier: a compressed exchange's cost beside backward shows only in steady training. ``module`` and the
    random state are not touched.

    Args:
        micro_batches: micro-batches per training step (gradient accumulation; DDP exchanges after the last).
        bucket_bytes, bucket_view: DDP's ``bucket_cap_mb`` (in bytes) and ``gradient_as_bucket_view``.

    Raises:
        CopyError: ``module`` cannot be deep-copied (raised before any collective, on every rank alike).
    """
    device = next(module.parameters()).device
    replicas = {candidate: replica(module) for candidate in layouts}  # every copy before any collective
    copies = {c: _training_step(m, batch, c, layouts[c], bucket_bytes, bucket_view) for c, m in replicas.items()}
    seconds: dict[Candidate, list[float]] = {c: [] for c in copies}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for i in range(repeats + 1):
            for candidate, (ddp, step) in copies.items():
                dist.barrier()
                for _ in range(steps):
                    _synchronize(device)
                    start = time.perf_counter()
                    step(micro_batches)
                    _synchronize(device)
                    if i:  # the first round rebuilds DDP's buckets and makes the hook's plans
                        seconds[candidate].append(time.perf_counter() - start)
                    ddp.zero_grad(set_to_none=True)
    return {c: statistics.median(times) for c, times in seconds.items()}


def device_memory_bytes(device: torch.device, processes_per_node: int) -> int:
    """Memory one rank may plan for: ``$LDS_DEVICE_MEMORY_GIB`` GiB where set (a smaller device than this one, a
    host shared with other jobs), else the GPU's, or the host's physical memory over its processes."""
    configured = os.environ.get(MEMORY_VARIABLE)
    if configured:
        try:
            gib = float(configured)
        except ValueError:
            gib = -1.0
        if not gib > 0:
            raise ValueError(f"{MEMORY_VARIABLE}={configured!r} must be a positive number of GiB (the memory one "
                             "rank may use), e.g. 8 or 0.5; unset it to use the device's.")
        return int(gib * 2**30)
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
