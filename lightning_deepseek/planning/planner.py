"""``plan``: one training step of ``HybridParallelStrategy`` at any world size, in this process, on torch's fake
process group and fake tensors; what one rank holds and sends, and the step time the cluster's figures predict.

The steps, the strategy's own code for each (:mod:`lightning_deepseek.parallel`), in ``_parallelize``'s order:

1. the model is built under ``FakeTensorMode`` (:mod:`.models`): shapes only;
2. the sizes (``ParallelDims``), the tensor-parallel plan (``decide_plan``), the rank order (``place``, with the
   cluster's islands and link figures: nothing probed), every mesh (``build_mesh``), tensor parallelism
   (``apply_tensor_parallel``), expert parallelism (``setup_expert_parallel``), activation checkpointing
   (``apply_activation_checkpointing``), FSDP2's ``fully_shard`` (``apply_fsdp``, on the fake process group's
   meshes: its all-gathers and reduce-scatters run and are counted), the optimizer (torch's AdamW) and ZeRO-1's
   partition and hooks (``setup_optimizer_states``);
3. one step under torch's ``MemTracker`` (memory by kind), a ``FlopCounter`` and a ``CollectiveCounter``
   (:mod:`.counting`): forward and backward (BF16 autocast where ``dtype="bf16"``), the strategy's reductions of
   the tensor- and expert-parallel gradients (FSDP2 reduces its shards in backward), the optimizer step (ZeRO-1's
   broadcasts in its hooks);
4. DDP's gradient exchange, which the fake step does not run (DDP's reducer calls the process group from C++), is
   added from DDP's buckets (:mod:`.ddp_exchange`: DDP's rule; each bucket an fp32 all-reduce, or with
   ``PlanLayout.bits`` the collectives ``GradientCompression``'s hook issues, its residuals and message buffers in
   memory and its quantise/dequantise time); its buckets are also memory (``gradient_as_bucket_view=False``, the
   default); with it, DDP's broadcast of the module's buffers before forward (``broadcast_buffers=True``, its default).

Only rank 0 is stepped: without a pipeline every rank holds the same shapes but ZeRO-1's owned states, whose maximum
over ranks comes from the partition (``memory_per_rank``, the strategy's own table). Pipelined layouts
(``pipeline_parallel_size > 1``) are planned by :mod:`.pipeline`: one set-up per distinct pipeline rank, composed
over torch's action table of the schedule.

Assumptions (each printed with the plan): routed experts receive tokens evenly (:mod:`.routing`); the compute
reaches ``compute_efficiency`` of the cluster's dense peak for ``dtype``; AdamW's step is memory-bound (28 bytes
per owned FP32 element at the memory bandwidth); the collectives inside forward and backward (tensor-parallel
gathers and scatters, all-to-alls) are exposed, DDP's all-reduce overlaps backward (two thirds of the compute)
except its last bucket, FSDP2's collectives overlap the compute (prefetched) except its first all-gather, the shard
reductions and ZeRO-1's broadcasts after backward are exposed; a group spanning
nodes runs at the across-nodes link, each GPU with its own NIC (no sharing). Memory is what the step's tensors
hold (what must fit; no CUDA context), and the caching allocator's reserved memory an estimate over it
(:data:`.report.ALLOCATOR_RESERVE`).

Costs: seconds to a minute of CPU (benchmarks/planning/REPORT.md), growing with the fake step's op count: with
``depth="representative"`` (:mod:`.depth`) three or four blocks of each kind are stepped, not every block; no
device, no weights. Plans of one model share a :class:`.cache.PlanCache` where given one (``layout="auto"``); block
detection probes each kind of activation once per plan (``cached_probes``; once per search under ``"auto"``).
Not supported: gradient accumulation; uneven routing; optimizers other than torch's AdamW; compression of FSDP2's
reduce-scatters or of a pipeline's exchange.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import _ModState  # module peaks: no public name
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils.flop_counter import sdpa_backward_flop, sdpa_flop

from lightning_deepseek.moe.protocol import find_expert_layers
from lightning_deepseek.parallel.activation_checkpointing import apply_activation_checkpointing
from lightning_deepseek.parallel.detection import cached_probes
from lightning_deepseek.parallel.dims import ParallelDims, WorldMesh
from lightning_deepseek.parallel.expert import reduce_expert_gradients
from lightning_deepseek.parallel.expert_plan import setup_expert_parallel
from lightning_deepseek.parallel.expert_routing import ExpertRouting
from lightning_deepseek.parallel.fsdp import apply_fsdp
from lightning_deepseek.parallel.memory import memory_per_rank, setup_optimizer_states
from lightning_deepseek.parallel.placement import Placement, comm_volume, place
from lightning_deepseek.parallel.plan import Plan, decide_plan
from lightning_deepseek.parallel.styles import apply_tensor_parallel, reduce_tensor_parallel_gradients
from lightning_deepseek.parallel.topology import Topology
from lightning_deepseek.planning.cache import PlanCache
from lightning_deepseek.planning.cluster import ClusterSpec
from lightning_deepseek.planning.counting import (
    CollectiveCall,
    CollectiveCounter,
    FlopCounter,
    LocalOpsOnly,
    RootPeakTracker,
)
from lightning_deepseek.planning.ddp_exchange import check_plannable, ddp_exchange
from lightning_deepseek.planning.depth import check_depth, extrapolate, full_sizes, keep_blocks, layer_kinds
from lightning_deepseek.planning.estimate import GroupInfo, StepMeasurement, estimate
from lightning_deepseek.planning.fake_world import fake_world
from lightning_deepseek.planning.float8 import convert_float8
from lightning_deepseek.planning.fsdp_chunks import one_chunk_per_rank
from lightning_deepseek.planning.layout import PlanLayout, StepShape
from lightning_deepseek.planning.models import ModelSpec
from lightning_deepseek.planning.report import PlanReport, RankMemory
from lightning_deepseek.planning.routing import uniform_routing
from lightning_deepseek.precision.fsdp_policy import fsdp_units, set_mixed_precision, stage_policy

RANK_ZERO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero",
                     "lightning_utilities.core.rank_zero")
CPU = torch.device("cpu")


def _heads(shape: Any, heads: int) -> tuple[int, ...]:
    return (shape[0], heads, *shape[2:])


def _sdpa(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    # Grouped key/value heads (GQA) cost what as many heads as the query's do; torch < 2.13's formula asserts equal.
    return sdpa_flop.__wrapped__(query, _heads(key, query[1]), _heads(value, query[1]), *args, **kwargs)


def _sdpa_backward(grad: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    return sdpa_backward_flop.__wrapped__(grad, query, _heads(key, query[1]), _heads(value, query[1]), *args, **kwargs)


# The CPU's fused attention has no formula in torch's FLOP registry; it does what the GPU kernels do.
# (FlopCounter wraps a custom formula itself: hand it the unwrapped ones.)
CPU_SDPA = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _sdpa,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_backward}


def cluster_topology(world_size: int, gpus_per_node: int) -> Topology:
    """Nodes of ``gpus_per_node`` consecutive ranks."""
    size = min(gpus_per_node, world_size)
    return Topology(tuple(tuple(range(i, min(i + size, world_size))) for i in range(0, world_size, size)))


def local_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of ``tensors`` at this rank (a DTensor's local shard)."""
    return sum((t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size() for t in tensors)


def plan(model: ModelSpec, world_size: int, layout: PlanLayout, cluster: ClusterSpec,
         step: StepShape | None = None, depth: str = "representative", cache: PlanCache | None = None) -> PlanReport:
    """Set up the strategy's layout for rank 0 of a fake world and step once; the report (see the module docstring).

    Args:
        depth: ``"representative"``: step copies with three or four blocks of each kind and extrapolate
            (:mod:`.depth`: model states, FLOPs and bytes exact; the peak approximate); ``"full"``: step every block.
        cache: what plans of the same model share (:mod:`.cache`; ``search`` passes one); None: a fresh one.

    Raises:
        ValueError: a size does not divide the world size or an expert count (the strategy's own messages), or
            compression the planner does not model (:func:`.ddp_exchange.check_plannable`).
    """
    check_depth(depth)
    check_plannable(layout)
    step = step or StepShape()
    if layout.pp > 1:
        from lightning_deepseek.planning.pipeline import plan_pipeline  # it builds on this module

        return plan_pipeline(model, world_size, layout, cluster, step, depth, cache)
    started = time.perf_counter()
    topology = cluster_topology(world_size, cluster.gpus_per_node)
    with fake_world(world_size), one_chunk_per_rank(), cached_probes(), warnings.catch_warnings(), _quiet_set_up():
        warnings.simplefilter("ignore")  # the strategy's and torch's set-up warnings are for real runs
        measured = _measure(model, world_size, layout, step, topology, cluster, depth,
                            PlanCache() if cache is None else cache)
    return estimate(model.name, world_size, layout, cluster, step, measured, time.perf_counter() - started)


def _measure(model: ModelSpec, world_size: int, layout: PlanLayout, step: StepShape, topology: Topology,
             cluster: ClusterSpec, depth: str, cache: PlanCache) -> StepMeasurement:
    """The whole model's step, or its representative copies' extrapolated (:mod:`.depth`); then DDP's buckets."""
    built: list[nn.Module] = []

    def whole() -> nn.Module:  # the whole model, built once and only where a value below is not cached
        if not built:
            with FakeTensorMode(allow_non_fake_inputs=True):
                built.append(model.build())
        return built[0]

    key = _cache_key(model, world_size, cluster, step)
    kinds = cache.get(("kinds", key), lambda: layer_kinds(whole())) if depth == "representative" else None
    if kinds is None or not kinds.worth_it:
        measured = _step(model, world_size, layout, step, topology, cluster, cache)
        sizes, ndims = [size for _, size in measured.param_sizes], [ndim for _, ndim in measured.param_ndims]
    else:  # the placement the whole model's tensor-parallel traffic decides, for every copy
        dims = ParallelDims(world_size, tp=layout.tp, ep=layout.ep, dp_shard=layout.dp_shard)
        placement = cache.get(("placement", key, dims.dp, dims.tp, layout.placement), lambda: _placement(
            whole(), _tp_plan(cache, key, None, whole(), world_size, dims.tp, step), dims, layout.placement, step,
            topology, cluster).policy)
        base = _step(model, world_size, layout, step, topology, cluster, cache, kinds.base, placement)
        extras = {kind: _step(model, world_size, layout, step, topology, cluster, cache, kinds.with_one_more(kind),
                              placement) for kind in kinds.extended}
        measured = extrapolate(base, extras, kinds)
        sizes, ndims = full_sizes(list(base.param_sizes), kinds), full_sizes(list(base.param_ndims), kinds)
        if layout.shard_optimizer_states:  # ZeRO-1 deals the owners over every parameter: its step on the whole
            states = _step(model, world_size, layout, step, topology, cluster, cache, placement=placement,
                           optimizer_only=True)
            measured = _with_optimizer_of(measured, states)
    exchange = ddp_exchange(sizes, ndims, world_size, int(step.bucket_cap_mb * 2**20), dist.group.WORLD.group_name,
                            layout.compression())
    calls = list(exchange.calls)
    if calls and measured.buffer_bytes:  # DDP's broadcast_buffers (its default): rank 0's buffers before forward
        calls.insert(0, CollectiveCall("broadcast", dist.group.WORLD.group_name, measured.buffer_bytes))
    forward, backward, optimizer = measured.phase_peaks  # later steps: forward and backward hold the states too
    steady = max(forward + measured.memory.states, backward + measured.memory.states, optimizer)
    held = exchange.bucket_bytes + exchange.compression_bytes
    memory = dataclasses.replace(measured.memory, ddp_buckets=exchange.bucket_bytes,
                                 compression=exchange.compression_bytes, peak=measured.memory.peak + held,
                                 steady_peak=max(steady, measured.memory.peak) + held)
    return dataclasses.replace(measured, memory=memory, calls=measured.calls + tuple(calls),
                               codec_bytes=exchange.codec_bytes)


def _with_optimizer_of(measured: StepMeasurement, whole: StepMeasurement) -> StepMeasurement:
    """``measured`` with the optimizer states and the optimizer step's collectives of ``whole``."""
    memory = dataclasses.replace(measured.memory, states=whole.memory.states, states_max=whole.memory.states_max)
    calls = [c for c in measured.calls if c.phase != "optimizer"] + [c for c in whole.calls if c.phase == "optimizer"]
    return dataclasses.replace(measured, memory=memory, calls=tuple(calls),
                               owned_state_elements=whole.owned_state_elements)


def _placement(module: nn.Module, tp_plan: Plan, dims: ParallelDims, policy: str, step: StepShape,
               topology: Topology, cluster: ClusterSpec) -> Placement:
    """The strategy's rank order (its ``"auto"`` policy weighs ``module``'s tensor-parallel traffic)."""
    return place(policy, topology, dims.dp, dims.tp, cluster.links,
                 lambda: comm_volume(module, tp_plan, dims.tp, step.tokens, 1))


@contextlib.contextmanager
def _quiet_set_up() -> Iterator[None]:
    """The strategy's set-up tables (Lightning's ``rank_zero_info``) are for real runs: the plan prints its own."""
    loggers = [logging.getLogger(name) for name in RANK_ZERO_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def mesh_groups(mesh: WorldMesh, dims: ParallelDims, topology: Topology) -> dict[str, GroupInfo]:
    """Every group this rank is in, by process-group name: its mesh dimensions (``"tp/world"`` where the ``tp``
    group is the whole world), size and link class."""
    wanted = ["dp", "tp"] + (["pp"] if dims.pp_enabled else []) + (["edp", "ep"] if dims.ep_enabled else [])
    if dims.fsdp_enabled and not dims.pp_enabled:  # under a pipeline FSDP2 shards over each stage's dp (and edp)
        wanted += ["dp_shard", "dp_replicate"] + (["dp_shard_tp", "dp_replicate_tp"] if dims.tp_enabled else [])
        wanted += ["edp_shard", "edp_replicate"] if dims.ep_enabled else []
    named = []
    for dim in wanted:
        try:
            named.append((dim, mesh[dim].get_group()))
        except KeyError:  # a view this version of the strategy's meshes does not have
            continue
    named.append(("world", dist.group.WORLD))
    labels: dict[str, list[str]] = {}
    for dim, group in named:
        key = group.group_name
        if dist.get_process_group_ranks(group) == list(range(dims.world_size)):
            key = dist.group.WORLD.group_name  # one label for the world, whichever group object spans it
        labels.setdefault(key, []).append(dim)
    infos = {}
    for name, dims_of in labels.items():
        group = next(g for d, g in named if d == dims_of[0])
        ranks = dist.get_process_group_ranks(group)
        infos[name] = GroupInfo("/".join(dims_of), len(ranks), "inter" if topology.spans_islands(ranks) else "intra")
    for _dim, group in named:  # a group object of the world other than WORLD's: the same label
        infos.setdefault(group.group_name, infos[dist.group.WORLD.group_name]
                         if dist.get_process_group_ranks(group) == list(range(dims.world_size))
                         else infos[group.group_name])
    return infos


def _cache_key(model: ModelSpec, world_size: int, cluster: ClusterSpec, step: StepShape) -> tuple:
    """What every value a plan caches is computed from, besides the layout."""
    return repr(model), world_size, repr(cluster), step


def _tp_plan(cache: PlanCache, key: tuple, keep: tuple[int, ...] | None, module: nn.Module, world_size: int,
             tp: int, step: StepShape) -> Plan:
    """The strategy's tensor-parallel plan of ``module`` (the copy keeping ``keep``; None: the whole model)."""
    return cache.get(("tp_plan", key, keep, tp),
                     lambda: decide_plan(module, "auto", world_size, tp, False, step.min_shard_params))


def _step(model: ModelSpec, world_size: int, layout: PlanLayout, step: StepShape, topology: Topology,
          cluster: ClusterSpec, cache: PlanCache, keep: tuple[int, ...] | None = None, placement: str | None = None,
          optimizer_only: bool = False) -> StepMeasurement:
    """One step of the model (of the copy keeping the blocks at positions ``keep``), without DDP's buckets (so
    the same under every compression: cached without it); ``optimizer_only``: zero gradients in place of forward
    and backward (the optimizer's states and collectives), the same under every activation checkpointing (it runs
    no forward): cached without it."""
    key = _cache_key(model, world_size, cluster, step)
    checkpointing = "none" if optimizer_only else layout.activation_checkpointing
    settings = dataclasses.replace(layout, placement=placement or layout.placement,
                                   activation_checkpointing=checkpointing, bits=None)
    return cache.get(("step", key, settings, keep, optimizer_only), lambda: _step_once(
        model, world_size, layout, step, topology, cluster, cache, keep, placement, optimizer_only))


def _step_once(model: ModelSpec, world_size: int, layout: PlanLayout, step: StepShape, topology: Topology,
               cluster: ClusterSpec, cache: PlanCache, keep: tuple[int, ...] | None, placement: str | None,
               optimizer_only: bool) -> StepMeasurement:
    """:func:`_step`'s measurement, made."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        module = model.build()
        if step.dtype == "fp8":  # StagedPrecision's FP8 stage, converted before the set-up shards
            convert_float8(module)
    positions = keep_blocks(module, keep) if keep is not None else {}
    dims = ParallelDims(world_size, tp=layout.tp, ep=layout.ep, dp_shard=layout.dp_shard)
    layers = find_expert_layers(module)
    dims.check_experts(layers)
    tp_plan = _tp_plan(cache, _cache_key(model, world_size, cluster, step), keep, module, world_size, dims.tp, step)
    placed = _placement(module, tp_plan, dims, placement or layout.placement, step, topology, cluster)
    mesh = dims.build_mesh("cpu", [rank for row in placed.grid for rank in row])
    if dims.ep_enabled:
        mesh["edp", "ep"]  # made outside the fake mode: DeviceMesh reads the values of its rank tensor
    # Outside the fake mode too: the set-up reads mesh coordinates (real tensors); the fake parameters carry it.
    apply_tensor_parallel(module, tp_plan.styles, mesh["dp", "tp"]["tp"])
    expert_plan = setup_expert_parallel(module, mesh, topology, ExpertRouting(dispatch="flat"))
    apply_activation_checkpointing(module, layout.activation_checkpointing)
    if dims.fsdp_enabled:  # held as a LightningModule holds it: the model is the root unit, as in a real run
        holder = nn.ModuleDict({"model": module})
        apply_fsdp(holder, mesh, layout.reshard_after_forward)
        if step.fsdp_bf16:  # StagedPrecision's BF16 stage on the units
            set_mixed_precision(fsdp_units(holder), stage_policy("bf16-mixed"))
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    zero = setup_optimizer_states([optimizer], 0, world_size, mesh, layout.shard_optimizer_states)
    tracker, counter = RootPeakTracker(module), CollectiveCounter()
    flops = FlopCounter(CPU_SDPA)
    tracker.track_external(module, optimizer)
    autocast = torch.autocast("cpu", torch.bfloat16) if step.dtype != "fp32" else contextlib.nullcontext()
    with mode:
        input_ids = torch.randint(0, model.vocab_size, (step.micro_batch_size, step.seq_len))
    with mode, uniform_routing(layers), tracker, counter:
        with flops, LocalOpsOnly(mode):
            with autocast:
                loss = model.loss(module, input_ids) if not optimizer_only else None
            saved = tracker.get_tracker_snapshot("current")[CPU]
            forward_peak = snapshot_bytes(tracker.get_tracker_snapshot("peak")[CPU], "Total")
            if loss is not None:
                loss.backward()
            for param in params if optimizer_only else []:
                param.grad = torch.zeros_like(param)
        stats = tracker.memory_tracking.get(module)  # the model's own peak in backward (none without one)
        backward_peak = max((snapshot_bytes(s[CPU], "Total")
                             for s in (stats.snapshots.get(_ModState.PEAK_BW, []) if stats else [])), default=0)
        grad_bytes = local_bytes([p.grad for p in params if p.grad is not None])
        counter.phase = "gradients"
        with LocalOpsOnly(mode):
            _reduce_and_step(params, mesh, None if dims.fsdp_enabled else expert_plan.mesh, optimizer, counter,
                             reduce_shards=not dims.fsdp_enabled)
    peak = snapshot_bytes(tracker.get_tracker_snapshot("peak")[CPU], "Total")
    # The optimizer step's own peak where it set the step's; else what it leaves (a lower bound of its peak)
    optimizer_peak = peak if peak > max(forward_peak, backward_peak) else snapshot_bytes(
        tracker.get_tracker_snapshot("current")[CPU], "Total")
    partitions = [z.partition for z in zero] or None
    states_max = (memory_per_rank([optimizer], partitions, world_size)["this layout + ZeRO-1"].states
                  if partitions else None)
    state_bytes = sum(local_bytes([t for t in s.values() if isinstance(t, torch.Tensor)])
                      for s in optimizer.state.values())
    memory = RankMemory(params=local_bytes(list(module.parameters())), grads=grad_bytes, states=state_bytes,
                        states_max=max(states_max or 0, state_bytes),  # the estimate leaves out step counters
                        activations=snapshot_bytes(saved, "Activation") + snapshot_bytes(saved, "Temp"),
                        ddp_buckets=0, peak=peak)
    replicated = [(positions.get(name, -1), p) for name, p in module.named_parameters()
                  if p.requires_grad and not isinstance(p, DTensor)]
    return StepMeasurement(memory=memory, flops=flops.total, calls=tuple(counter.calls),
                           groups=mesh_groups(mesh, dims, topology), num_sharded_layers=len(tp_plan),
                           placement=placed.policy, owned_state_elements=_owned_elements(optimizer),
                           phase_peaks=(forward_peak, backward_peak, optimizer_peak),
                           param_sizes=tuple((at, local_bytes([p])) for at, p in replicated),
                           param_ndims=tuple((at, p.dim()) for at, p in replicated),
                           buffer_bytes=local_bytes(list(module.buffers())), fp8_flops=flops.fp8,
                           cast_bytes=flops.cast_bytes)


def _reduce_and_step(params: list[torch.Tensor], mesh: WorldMesh, expert_mesh: DeviceMesh | None,
                     optimizer: torch.optim.Optimizer, counter: CollectiveCounter, reduce_shards: bool) -> None:
    """What the strategy's ``optimizer_step`` does after the closure: the shard reductions (not under FSDP2, which
    reduces every shard in backward), then the step."""
    if reduce_shards:
        reduce_tensor_parallel_gradients(params, mesh["dp", "tp"])
    if expert_mesh is not None:
        reduce_expert_gradients(params, expert_mesh)
    counter.phase = "optimizer"
    optimizer.step()


def snapshot_bytes(snapshot: dict, name: str) -> int:
    """Bytes of one kind (``_MemRefType`` value, or ``"Total"``) in a ``MemTracker`` snapshot."""
    return sum(v for k, v in snapshot.items() if getattr(k, "value", k) == name)


def _owned_elements(optimizer: torch.optim.Optimizer) -> int:
    """FP32 elements whose AdamW state this rank keeps (what its step reads and writes)."""
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in optimizer.state)
