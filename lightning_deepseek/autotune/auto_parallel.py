"""The ``"auto"`` settings' decision at setup (collective): enumerate, filter by memory, time copies, choose.

``HybridParallelStrategy(tensor_parallel_size="auto")`` / ``expert_parallel_size="auto"`` /
``data_parallel_shard_size="auto"`` call :func:`decide_parallel` once at setup, before sharding (with
``GradientCompression(bits="auto")`` its bits in the same table); under ``"ddp"`` the callback calls
:func:`decide_compression` at fit start. Both run the same steps: the candidates ``(tp, ep, dp_shard, bits)``;
those whose memory per rank fits (the activations measured on one micro-batch); a copy of each, sharded as the
strategy would shard it (unsharded, tensor parallel, expert parallel, parameters by FSDP2, or several) and wrapped
in DDP where parameters are left to it, with its exchange, timed in training steps, the slowest rank's figures; the
margin rule (:mod:`.decision`). Where the copies do not fit beside the model (each is whole until it is sharded),
the model cannot be deep-copied, DDP refuses it or ``repeats=0``, nothing is timed: the simplest candidate that fits
is kept, and the reason says why. Where the model cannot run at all here (built on the meta device, or no fit),
only ``data_parallel_shard_size="auto"`` is decided, by the memory filter alone on the parameters' bytes (no
activations measured). Rank 0 prints the table. Not supported: candidates beyond this machine's world (planning for
a larger cluster), node-limited routing and per-island dispatch in the expert-parallel copies (they time the
default all-to-all), compressed copies with sharded parameters (timed uncompressed).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable, Sequence

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_deepseek.autotune.decision import Candidate, Decision, ModelMemory, candidates, decide, fitting
from lightning_deepseek.autotune.measure import (
    CopyError,
    MicroBatch,
    Shard,
    agree,
    device_memory_bytes,
    measure_activations,
    measure_copy_steps,
    micro_batch,
)
from lightning_deepseek.moe.protocol import find_expert_layers
from lightning_deepseek.parallel.dims import ParallelDims
from lightning_deepseek.parallel.expert import apply_expert_parallel, reduce_expert_gradients
from lightning_deepseek.parallel.fsdp import apply_fsdp
from lightning_deepseek.parallel.placement import (
    CommVolume,
    LinkCost,
    candidate_mesh,
    choose_placement,
    comm_volume,
    probe_links,
)
from lightning_deepseek.parallel.plan import Plan
from lightning_deepseek.parallel.styles import apply_tensor_parallel, reduce_tensor_parallel_gradients
from lightning_deepseek.parallel.topology import Topology

AUTO_BITS: tuple[int | None, ...] = (None, 8, 4)
HEADROOM = 0.9  # the share of the device memory a candidate may plan for
_GIB = 2**30


def divisors(n: int, at_most: int) -> list[int]:
    return [d for d in range(1, min(n, at_most) + 1) if n % d == 0]


def shard_sizes(world_size: int, local_size: int, bits: int | str | None) -> list[int]:
    """``data_parallel_shard_size="auto"``'s candidates: 1, the processes per node (HSDP) and the world. With a
    ``GradientCompression`` callback (``bits``) only the sizes it compresses: 1 and the world (under HSDP FSDP's
    all-reduce across the replicas stays uncompressed), and with ``bits="auto"`` 1 alone (the copies that decide the
    bits compress DDP's exchange only)."""
    sizes = {1, local_size, world_size} if bits is None else {1} if bits == "auto" else {1, world_size}
    return sorted(d for d in sizes if world_size % d == 0)


def decide_parallel(module: pl.LightningModule, trainer: pl.Trainer, *, topology: Topology, local_size: int,
                    links: dict[str, LinkCost] | None, plan_for: Callable[[int], Plan], tp_sizes: Iterable[int],
                    ep_sizes: Iterable[int] | None, bits: Iterable[int | None], tokens: int | None,
                    placement: str, bucket_bytes: int, setting: str, repeats: int = 3,
                    bucket_view: bool = False, shard_sizes: Iterable[int] = (1,), reshard_after_forward: bool = True,
                    device: torch.device | None = None, untimed: str | None = None) -> Decision:
    """Choose ``(tp, ep, dp_shard, bits)`` for ``HybridParallelStrategy`` (collective; module docstring).

    Args:
        local_size: processes per node (they share a host's memory).
        links: configured link figures, or None to probe them where placement ranks rank orders by them.
        plan_for: the plan at a ``tp`` size (candidates whose plan is empty or invalid are dropped, except 1).
        tp_sizes: the allowed ``tp`` sizes; ``ep_sizes``: the allowed expert-parallel sizes (None: the divisors of
            the world size that divide every MoE layer's expert count).
        tokens: rows per rank and micro-batch for placement's estimate (None: the timed micro-batch's).
        placement: the strategy's placement policy: the copies use the rank order it would.
        bucket_bytes, bucket_view: DDP's ``bucket_cap_mb`` (in bytes) and ``gradient_as_bucket_view``.
        setting: the user's setting, named in the table and in errors.
        repeats: timed rounds of each copy (0: nothing timed).
        shard_sizes: the allowed ``data_parallel_shard_size`` values; ``reshard_after_forward``: as the strategy's.
        device: the device whose memory is the budget (default: the model's).
        untimed: why the model cannot run here (a meta model...): nothing measured nor timed, the memory filter
            alone on the parameters' bytes.
    """
    world = topology.world_size
    layers = find_expert_layers(module)
    if ep_sizes is None:
        ep_sizes = [d for d in divisors(world, world) if all(layer.num_experts % d == 0 for layer in layers)]
    batch = micro_batch(module, trainer) if untimed is None else None
    tokens = tokens or (batch.tokens if batch is not None else 1)
    micro = trainer.accumulate_grad_batches
    plans: dict[int, Plan] = {}
    for tp in tp_sizes:
        with warnings.catch_warnings():  # the chosen size's plan warns again when it is applied
            warnings.simplefilter("ignore")
            try:
                plan = plan_for(tp)
            except ValueError:
                continue
        if tp == 1 or plan:
            plans[tp] = plan
    volumes = {tp: comm_volume(module, plan, tp, tokens, micro) for tp, plan in plans.items()}
    expert_ids = {id(p) for layer in layers for p in layer.experts.parameters(recurse=False)
                  if p.dim() >= 1 and p.size(0) == layer.num_experts}
    memory = ModelMemory({1: _param_bytes(module.parameters()), **{tp: v.replicated_grad_bytes
                                                                  for tp, v in volumes.items()}},
                         {tp: v.sharded_grad_bytes for tp, v in volumes.items()},
                         _param_bytes(p for p in module.parameters() if id(p) in expert_ids),
                         _activation_bytes(module, batch) if batch is not None else 0)
    options = candidates(world, sorted(plans), ep_sizes if layers else [1], bits, shard_sizes)
    if len(topology.islands) > 1 and links is None and placement == "auto":
        links = probe_links(topology)  # placement ranks the rank orders by them (collective)
    device_type = next(module.parameters()).device.type

    def shard(candidate: Candidate) -> Shard:
        if candidate.tp == candidate.ep == candidate.dp_shard == 1:
            return _unsharded
        dims = ParallelDims(world, tp=candidate.tp, ep=candidate.ep, dp_shard=candidate.dp_shard)
        grid = _grid(topology, placement, links, dims, volumes[candidate.tp])
        return lambda copy: _shard(copy, dims, plans[candidate.tp], [r for row in grid for r in row], device_type,
                                   reshard_after_forward)

    if batch is None:  # nothing can run: the memory filter alone
        return _decide_by_memory(options, memory, device or next(module.parameters()).device, local_size, setting,
                                 untimed or "", tokens)
    return _decide(module, batch, options, memory, shard, local_size=local_size, bucket_bytes=bucket_bytes,
                   bucket_view=bucket_view, micro_batches=micro, repeats=repeats, setting=setting, tokens=tokens,
                   device=device)


def decide_compression(module: pl.LightningModule, trainer: pl.Trainer, topology: Topology, dp_size: int,
                       bucket_bytes: int, bucket_view: bool = False) -> Decision:
    """Choose the bits of ``GradientCompression(bits="auto")`` under plain data parallelism (collective);
    ``bucket_bytes`` and ``bucket_view`` describe the DDP wrapper (``bucket_cap_mb``, ``gradient_as_bucket_view``)."""
    batch = micro_batch(module, trainer)
    memory = ModelMemory({1: _param_bytes(module.parameters())},
                         activation_bytes=_activation_bytes(module, batch))
    return _decide(module, batch, candidates(dp_size, [1], [1], AUTO_BITS), memory, lambda candidate: _unsharded,
                   local_size=max(len(island) for island in topology.islands), bucket_bytes=bucket_bytes,
                   bucket_view=bucket_view, micro_batches=trainer.accumulate_grad_batches, repeats=3,
                   setting="GradientCompression(bits='auto')", tokens=batch.tokens)


def _budget(device: torch.device, local_size: int) -> float:
    """The smallest rank's usable memory: hosts may differ, and every rank must take the same decision (collective:
    collectives follow)."""
    return -agree([-HEADROOM * device_memory_bytes(device, local_size)])[0]


def _decide_by_memory(options: Sequence[Candidate], memory: ModelMemory, device: torch.device, local_size: int,
                      setting: str, untimed: str, tokens: int) -> Decision:
    """The simplest candidate whose parameters, gradients and optimizer states fit (nothing run), printed."""
    source = f"nothing timed nor measured: {untimed}; the parameters' bytes only, no activations"
    decision = decide(options, memory, _budget(device, local_size), {}, setting, untimed=source, tokens=tokens,
                      source=source)
    rank_zero_info(f"{setting}: by memory (lightning_deepseek.autotune); {decision.source}\n{decision.table()}")
    return decision


def _decide(module: pl.LightningModule, batch: MicroBatch, options: Sequence[Candidate], memory: ModelMemory,
            shard: Callable[[Candidate], Shard], *, local_size: int, bucket_bytes: int, bucket_view: bool,
            micro_batches: int, repeats: int, setting: str, tokens: int, device: torch.device | None = None
            ) -> Decision:
    """Filter by memory, time a copy of each fitting candidate, choose by the margin rule, print (collective)."""
    budget = _budget(device or next(module.parameters()).device, local_size)
    fit = fitting(options, memory, budget, setting)
    seconds: dict[Candidate, float] = {}
    whole = memory.replicated_bytes[1]  # a copy's parameters before it is sharded
    needed = sum(max(memory.bytes_per_rank(c), whole) for c in fit)
    room = budget - memory.bytes_per_rank(Candidate())  # the model itself, replicated
    if repeats < 1:
        source = "nothing timed: repeats=0"
    elif needed > room:
        source = (f"nothing timed: no room for {len(fit)} copies of the model ({needed / _GIB:.2f} GiB beside the "
                  f"model, {room / _GIB:.2f} GiB left)")
    else:
        start = time.perf_counter()
        try:
            timed = measure_copy_steps(module, batch, {c: shard(c) for c in fit}, bucket_bytes, micro_batches,
                                       repeats, bucket_view=bucket_view)
            seconds = dict(zip(timed, agree(list(timed.values()))))  # every rank timed the same copies in order
            wrapped = "DDP-wrapped " if all(c.dp_shard == 1 for c in fit) else ""
            source = (f"{len(fit)} {wrapped}copies timed, {repeats} rounds of training steps each, the slowest "
                      f"rank's median step ({time.perf_counter() - start:.1f} s)")
        except (RuntimeError, CopyError) as exc:  # DDP's own refusal (unused parameters...), alike on every rank
            source = f"nothing timed: {exc}"
    decision = decide(options, memory, budget, seconds, setting, untimed=source, tokens=tokens,
                      source=f"{source}; micro-batch {batch.description}, {tokens} tokens per rank")
    rank_zero_info(f"{setting}: timed copies (lightning_deepseek.autotune); {decision.source}\n{decision.table()}")
    return decision


def _shard(copy: nn.Module, dims: ParallelDims, plan: Plan, order: list[int], device_type: str,
           reshard_after_forward: bool = True) -> Callable[[], None]:
    """Shard ``copy`` as the strategy would at ``dims`` (its ``tp`` plan, its experts over ``ep``, its parameters
    over ``dp_shard``, on the meshes over ``order``); returns the strategy's reduction of the shards' gradients after
    backward (none under parameter sharding: FSDP reduces them)."""
    mesh = dims.build_mesh(device_type, order)
    apply_tensor_parallel(copy, plan.styles, mesh["tp"])
    if dims.ep_enabled:
        apply_expert_parallel(copy, mesh["edp", "ep"])
    if dims.fsdp_enabled:
        apply_fsdp(copy, mesh, reshard_after_forward, announce=False)
        return lambda: None

    def reduce() -> None:
        params = list(copy.parameters())
        reduce_tensor_parallel_gradients(params, mesh["dp", "tp"])
        if dims.ep_enabled:
            reduce_expert_gradients(params, mesh["edp", "ep"])
    return reduce


def _unsharded(copy: nn.Module) -> Callable[[], None]:
    """Plain data parallelism: nothing to shard, nothing to reduce after backward."""
    return lambda: None


def _grid(topology: Topology, placement: str, links: dict[str, LinkCost] | None, dims: ParallelDims,
          volume: CommVolume) -> list[list[int]]:
    """The ``dp x tp`` rank grid the strategy's placement would build at ``dims`` (``placement.place``'s rule)."""
    if len(topology.islands) > 1 and links is not None:
        return choose_placement(placement, topology, dims.dp, dims.tp, volume, links)[1]
    return candidate_mesh("tp_intra_node" if placement == "auto" else placement, topology, dims.dp, dims.tp)


def _activation_bytes(module: nn.Module, batch: MicroBatch) -> int:
    """The bytes saved for backward in one micro-batch, the largest over the ranks (collective)."""
    return int(agree([float(measure_activations(module, batch.step(module)))])[0])


def _param_bytes(params: Iterable[torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in params)


__all__ = ["AUTO_BITS", "decide_compression", "decide_parallel", "divisors", "shard_sizes"]
