"""The ``"auto"`` settings' side of the cost model: gather the facts, measure, decide, print (collective).

``HybridParallelStrategy(tensor_parallel_size="auto")`` / ``expert_parallel_size="auto"`` call
:func:`decide_parallel` once at setup, before sharding, with the plan of every candidate ``tp``; when a
``GradientCompression(bits="auto")`` callback is in the Trainer, its bits are decided in the same table. With a
strategy that has no such decision (``"ddp"``), the callback calls :func:`decide_compression` itself at fit start.
Every rank measures and then agrees on the slowest figures (:func:`~lightning_deepseek.autotune.measure.agree`),
so every rank takes the same decision; rank 0 prints the table once.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_deepseek.autotune.cost_model import (
    Candidate,
    ComputeProfile,
    Decision,
    Machine,
    ModelFacts,
    candidate_grid,
    candidates,
    decide,
    exchange_bytes,
    memory_bytes,
)
from lightning_deepseek.autotune.measure import (
    CopyError,
    MicroBatch,
    Shard,
    agree,
    agree_compute,
    agree_exchange,
    agree_quantize,
    device_memory_bytes,
    measure_compute,
    measure_copy_steps,
    measure_exchange,
    measure_quantize,
    measure_sharded,
    micro_batch,
)
from lightning_deepseek.moe.protocol import find_expert_layers
from lightning_deepseek.parallel.dims import ParallelDims
from lightning_deepseek.parallel.expert import (
    ExpertParallelDims,
    apply_expert_parallel,
    build_expert_mesh,
    reduce_expert_gradients,
)
from lightning_deepseek.parallel.placement import CommVolume, LinkCost, comm_volume, probe_links
from lightning_deepseek.parallel.plan import Plan
from lightning_deepseek.parallel.styles import apply_tensor_parallel, reduce_tensor_parallel_gradients
from lightning_deepseek.parallel.topology import Topology

AUTO_BITS: tuple[int | None, ...] = (None, 8, 4)


@dataclass(frozen=True)
class Measured:
    """The figures of one setup: compute (agreed over ranks), tokens per micro-batch, links, the micro-batch."""

    compute: ComputeProfile
    tokens: int
    links: dict[str, LinkCost]
    batch: MicroBatch | None = None


def divisors(n: int, at_most: int) -> list[int]:
    return [d for d in range(1, min(n, at_most) + 1) if n % d == 0]


def measure(module: pl.LightningModule, trainer: pl.Trainer | None, topology: Topology,
            links: dict[str, LinkCost] | None, experts: Sequence[nn.Module] = ()) -> Measured:
    """Time the model on a real micro-batch and probe the links (unless given); collective."""
    batch = micro_batch(module, trainer)
    compute = agree_compute(measure_compute(module, batch.step(module), batch.description, experts=list(experts)))
    return Measured(compute, batch.tokens, links if links is not None else probe_links(topology), batch)


def decide_parallel(module: pl.LightningModule, trainer: pl.Trainer, *, topology: Topology, local_size: int,
                    links: dict[str, LinkCost] | None, plan_for: Callable[[int], Plan], tp_sizes: Iterable[int],
                    ep_sizes: Iterable[int] | None, bits: Iterable[int | None], tokens: int | None,
                    placement: str, bucket_bytes: int, setting: str, sharded_repeats: int = 3,
                    exchange_repeats: int = 3, bucket_view: bool = False) -> Decision:
    """Choose ``(tp, ep, bits)`` for ``HybridParallelStrategy`` (collective).

    Args:
        plan_for: the plan at a ``tp`` size (candidates whose plan is empty or invalid are dropped, except 1).
        tp_sizes: the allowed ``tp`` sizes; ``ep_sizes``: the allowed expert-parallel sizes (None: the divisors of
            the world size that divide every MoE layer's expert count).
        tokens: rows per rank and micro-batch entering a feed-forward layer (None: the measured batch's).
        setting: the user's setting, named in the table and in errors.
        sharded_repeats: timed steps of each sharded copy (0: predict sharding by the formulas alone).
        exchange_repeats: timed gradient exchanges of each compressed candidate's bytes, fp32 and compressed (0:
            predict compression from the kernels' speed and the links alone).
        bucket_view: DDP's ``gradient_as_bucket_view`` (no copies of the gradients into its buckets and back).
    """
    world = topology.world_size
    layers = find_expert_layers(module)
    if ep_sizes is None:
        ep_sizes = [d for d in divisors(world, world) if all(layer.num_experts % d == 0 for layer in layers)]
    measured = measure(module, trainer, topology, links, [layer.experts for layer in layers])
    tokens = tokens or measured.tokens
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
    facts = ModelFacts(param_bytes=_param_bytes(module.parameters()), volumes=volumes,
                       expert_bytes=_param_bytes(p for p in module.parameters() if id(p) in expert_ids),
                       num_moe_layers=len(layers))
    bits = tuple(bits)
    machine = _machine(topology, measured.links, next(module.parameters()).device, local_size, bits,
                       max(v.replicated_grad_bytes for v in volumes.values()), bucket_bytes, placement,
                       bucket_view)
    options = candidates(world, sorted(plans), ep_sizes if layers else [1], bits)
    machine = _measure_exchange(machine, options, facts, next(module.parameters()).device, exchange_repeats)
    measured = _measure_copies(module, measured, options, plans, facts, machine, repeats=sharded_repeats)
    decision = dataclasses.replace(decide(options, facts, measured.compute, machine, setting), tokens=tokens)
    _print(decision, setting, measured, tokens, machine)
    return decision


def _measure_copies(module: pl.LightningModule, measured: Measured, options: Sequence[Candidate],
                    plans: dict[int, Plan], facts: ModelFacts, machine: Machine, repeats: int) -> Measured:
    """``measured`` with what copies of the model measure (collective): the sharding overheads of every ``tp`` and
    ``ep`` size among ``options`` (:func:`~lightning_deepseek.autotune.measure.measure_sharded`), and the training
    steps of DDP-wrapped copies of every layout among them, unsharded or sharded one way, with each exchange
    (:func:`~lightning_deepseek.autotune.measure.measure_copy_steps`), which the cost model predicts those
    candidates from. Skipped (the formulas and the exchange timed alone then predict them) with ``repeats=0``, where
    the copies would not fit the device memory, or where the model cannot be deep-copied."""
    device_type, world = next(module.parameters()).device.type, machine.world_size
    shardings: dict[tuple[str, int], Shard] = {}
    for tp in sorted({c.tp for c in options if c.tp > 1}):
        grid = candidate_grid(Candidate(tp), facts, machine)
        shardings[("tp", tp)] = functools.partial(_shard_tp, plans[tp].styles, ParallelDims(world, tp=tp), grid,
                                                  device_type)
    for ep in sorted({c.ep for c in options if c.ep > 1}):
        shardings[("ep", ep)] = functools.partial(_shard_ep, ExpertParallelDims(world, ep), device_type)
    # every candidate unsharded or sharded one way (tp or ep): a DDP-wrapped copy of its layout and exchange, timed
    # in this order within each round (per layout: int8, int4, then fp32: the order session 29's runs measured)
    copies = sorted({(*c.layout, c.bits) for c in options if c.layout is not None},
                    key=lambda k: (k[0], k[1], -1 if k[2] is None else -k[2]))
    layouts = {key: shard for key, shard in {("tp", 1): _unsharded, **shardings}.items()
               if any(k[:2] == key for k in copies)}
    if not (shardings or layouts) or repeats < 1 or measured.batch is None:
        why = " (every candidate predicted by its parts: copies not measured)" if shardings or layouts else ""
        return dataclasses.replace(measured, compute=dataclasses.replace(
            measured.compute, source=measured.compute.source + why))
    replicated = memory_bytes(Candidate(), facts, measured.compute)
    needed = (bool(shardings) + len(shardings) + len(copies)) * replicated
    room = machine.headroom * machine.device_memory_bytes - replicated
    if agree([float(needed > room)])[0]:  # hosts may differ in memory: all ranks skip, or none (collectives follow)
        why = " (every candidate predicted by its parts: no room for copies of the model)"
        return dataclasses.replace(measured, compute=dataclasses.replace(
            measured.compute, source=measured.compute.source + why))
    start = time.perf_counter()
    optimizer, sharded, source = measured.compute.optimizer_seconds, {}, measured.compute.source
    if shardings:
        try:
            optimizer, sharded = measure_sharded(module, measured.batch, shardings, repeats)
        except CopyError as exc:
            return dataclasses.replace(measured, compute=dataclasses.replace(
                measured.compute, source=f"{source} (sharding predicted by the formulas: {exc})"))
        source += (f"; sharding measured on copies ({', '.join(f'{k}={n}' for k, n in shardings)}, "
                   f"{repeats} interleaved steps each, {time.perf_counter() - start:.1f} s)")
    middle = time.perf_counter()
    copy_steps: dict[tuple[str, int, int | None], float] = {}
    try:
        copy_steps = measure_copy_steps(module, measured.batch, layouts, copies, machine.bucket_bytes, repeats)
    except (RuntimeError, CopyError) as exc:  # DDP's own refusal (unused parameters...), alike on every rank
        rank_zero_info(f"cost model: the layouts' training steps not timed ({exc}); predicted by their parts")
    if copy_steps:
        named = ", ".join("unsharded" if n == 1 else f"{k}={n}" for k, n in layouts)
        source += (f"; training steps measured on {len(copies)} DDP-wrapped copies ({named}, "
                   f"{time.perf_counter() - middle:.1f} s)")
    compute = agree_compute(dataclasses.replace(measured.compute, optimizer_seconds=optimizer, sharded=sharded,
                                                copy_steps=copy_steps))
    return dataclasses.replace(measured, compute=dataclasses.replace(compute, source=source))


def _measure_exchange(machine: Machine, options: Sequence[Candidate], facts: ModelFacts, device: torch.device,
                      repeats: int) -> Machine:
    """``machine`` with the fp32 and compressed exchanges of every compressed candidate's replicated gradient
    bytes timed on the world's process group (:func:`~lightning_deepseek.autotune.measure.measure_exchange`;
    collective). Skipped (the kernels' formula then predicts compression) with ``repeats=0``, without a process
    group or compressed candidates."""
    compressed = [c for c in options if c.bits is not None]
    if repeats < 1 or not compressed or not (dist.is_available() and dist.is_initialized()):
        return machine
    sizes = sorted({exchange_bytes(c, facts) for c in compressed} - {0})
    bits = tuple(sorted({c.bits for c in compressed}, reverse=True))
    seconds = agree_exchange(measure_exchange(sizes, bits, device, repeats, copies=not machine.bucket_view)
                             ) if sizes else {}
    return dataclasses.replace(machine, exchange_seconds=seconds)


def _shard_tp(styles: dict[str, str], dims: ParallelDims, grid: list[list[int]], device_type: str,
              copy: nn.Module) -> Callable[[], None]:
    """Shard ``copy`` as the strategy would at ``dims.tp``; returns the strategy's reduction of its shards'
    gradients over ``dp`` (``HybridParallelStrategy.reduce_tensor_parallel_gradients``)."""
    mesh = dims.build_mesh(device_type, grid)
    apply_tensor_parallel(copy, styles, mesh["tp"])
    return functools.partial(reduce_tensor_parallel_gradients, list(copy.parameters()), mesh)


def _unsharded(copy: nn.Module) -> Callable[[], None]:
    """The unsharded layout (plain data parallelism): nothing to shard, nothing to reduce after backward."""
    return lambda: None


def _shard_ep(dims: ExpertParallelDims, device_type: str, copy: nn.Module) -> Callable[[], None]:
    """Shard ``copy``'s experts as the strategy would at ``dims.ep_size``; returns the reduction of the experts'
    gradients over their replicas."""
    mesh = build_expert_mesh(device_type, dims)
    apply_expert_parallel(copy, mesh)
    return functools.partial(reduce_expert_gradients, list(copy.parameters()), mesh)


def decide_compression(module: pl.LightningModule, trainer: pl.Trainer, topology: Topology, dp_size: int,
                       bucket_bytes: int, bucket_view: bool = False) -> Decision:
    """Choose the bits of ``GradientCompression(bits="auto")`` under plain data parallelism (collective);
    ``bucket_bytes`` and ``bucket_view`` describe the DDP wrapper (``bucket_cap_mb``, ``gradient_as_bucket_view``)."""
    measured = measure(module, trainer, topology, None)
    grad_bytes = _param_bytes(p for p in module.parameters() if p.requires_grad)
    volume = CommVolume(0, 0, 0, 0, grad_bytes, trainer.accumulate_grad_batches)
    facts = ModelFacts(param_bytes=_param_bytes(module.parameters()), volumes={1: volume})
    machine = _machine(topology, measured.links, next(module.parameters()).device, dp_size, AUTO_BITS, grad_bytes,
                       bucket_bytes, "tp_intra_node", bucket_view)
    setting = "GradientCompression(bits='auto')"
    options = candidates(dp_size, [1], [1], AUTO_BITS)
    machine = _measure_exchange(machine, options, facts, next(module.parameters()).device, repeats=3)
    measured = _measure_copies(module, measured, options, {}, facts, machine, repeats=3)
    decision = decide(options, facts, measured.compute, machine, setting)
    _print(decision, setting, measured, measured.tokens, machine)
    return decision


def _param_bytes(params: Iterable[torch.Tensor]) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _machine(topology: Topology, links: dict[str, LinkCost], device: torch.device, local_size: int,
             bits: tuple[int | None, ...], grad_bytes: int, bucket_bytes: int, placement: str,
             bucket_view: bool = False) -> Machine:
    compressed = tuple(b for b in bits if b is not None)
    costs = agree_quantize(measure_quantize(grad_bytes, compressed, device)) if compressed else {}
    busy = device.type == "cpu" and local_size * torch.get_num_threads() >= (os.cpu_count() or 1)
    return Machine(topology, links, device_memory_bytes(device, local_size), costs, bucket_bytes=bucket_bytes,
                   busy_cores=busy, placement=placement, bucket_view=bucket_view)


def _print(decision: Decision, setting: str, measured: Measured, tokens: int, machine: Machine) -> None:
    compute = measured.compute
    links = ", ".join(f"{k} {c.bandwidth * 8 / 1e9:.2f} Gbit/s {c.latency * 1e6:.0f} us"
                      for k, c in measured.links.items())
    sizes = sorted({n for n, _ in machine.exchange_seconds})
    exchange = "; ".join(f"{n / 2**20:.1f} MiB " + ", ".join(
        f"{'fp32' if b is None else f'int{b}'} {s * 1e3:.1f} ms" for (m, b), s in machine.exchange_seconds.items()
        if m == n) for n in sizes)
    exchange = f"; gradient exchange measured on the world's group: {exchange}" if exchange else ""
    if compute.copy_steps:
        exchange += "; training steps of the copies: " + ", ".join(
            f"{'unsharded' if size == 1 else f'{kind}={size}'} {'fp32' if b is None else f'int{b}'} {s * 1e3:.1f} ms"
            for (kind, size, b), s in compute.copy_steps.items())
    rank_zero_info(f"{setting}: cost model (lightning_deepseek.autotune.cost_model); compute {compute.source}: "
                   f"forward {compute.forward_seconds * 1e3:.1f} ms, backward {compute.backward_seconds * 1e3:.1f} ms, "
                   f"{tokens} tokens per rank; links {links}{exchange}\n{decision.table()}")


__all__ = ["decide_compression", "decide_parallel", "divisors", "measure"]
