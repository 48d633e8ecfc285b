"""``Layout``: the layout a strategy decided at setup, handed to the components that depend on it; and the steps
that decide it (the sizes, by timed copies where ``"auto"``; the tensor-parallel plan).

``HybridParallelStrategy`` decides its sizes (and, when a ``GradientCompression`` callback asked it to with
``bits="auto"``, the compression bits in the same comparison) once at setup and exposes the result as
``strategy.layout``; ``GradientCompression`` reads the bits from it. The callback announces what it wants with
``strategy.request_compression(config)`` in its ``setup`` hook, which Lightning runs before the strategy's setup.
Nothing searches ``trainer.callbacks``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_deepseek.moe.protocol import find_expert_layers
from lightning_deepseek.parallel.activation_checkpointing import MODES
from lightning_deepseek.parallel.dims import ParallelDims
from lightning_deepseek.parallel.expert_plan import resolve_ep_size
from lightning_deepseek.parallel.pipeline import check_pipeline_composition
from lightning_deepseek.parallel.pipeline_overlap import check_pipeline_overlap
from lightning_deepseek.parallel.placement import (
    POLICIES,
    CommVolume,
    LinkCost,
    candidate_mesh,
    comm_volume,
    place,
    tokens_per_micro_batch,
)
from lightning_deepseek.parallel.plan import Plan, decide_plan
from lightning_deepseek.parallel.topology import Topology

if TYPE_CHECKING:
    from lightning_deepseek.autotune.decision import Decision

Size = int | Literal["auto", "per_node"]


@dataclass(frozen=True)
class Layout:
    """What the strategy decided, once, at setup.

    Args:
        dims: the parallel sizes.
        placement: the rank-order policy placement chose (``"tp_intra_node"`` or ``"dp_intra_node"``), or
            ``"user"`` where the LightningModule parallelised itself in ``configure_model``.
        order: every rank in mesh order (a rank's position is its data shard); every mesh is cut from it.
        bits: the gradient-compression bits decided with the sizes (8 or 4), ``32`` for an uncompressed exchange,
            or None where the strategy did not decide them (no callback asked, or fixed bits).
        decision: the timed copies' comparison when an ``"auto"`` setting was decided by it, else None.
    """

    dims: ParallelDims
    placement: str
    order: tuple[int, ...]
    bits: int | None = None
    decision: Decision | None = None
    estimates: dict[str, float] = field(default_factory=dict)  # placement's estimated seconds per policy

    def data_shard(self, rank: int) -> dict[str, int]:
        """``DistributedSampler``'s arguments for ``rank``: its position in the mesh order (a tp group gathers
        activations in that order); under the user's own tensor parallelism a tp group shares one shard."""
        position = self.order.index(rank)
        if self.dims.pp_enabled:  # every stage of a pipeline reads the same batch: its dp coordinate's shard
            return {"num_replicas": self.dims.dp, "rank": position // self.dims.tp % self.dims.dp}
        if self.placement == "user":
            return {"num_replicas": self.dims.dp, "rank": position // self.dims.tp}
        return {"num_replicas": self.dims.world_size, "rank": position}


@dataclass(frozen=True)
class LayoutSettings:
    """The strategy's arguments that decide the layout, validated at construction (errors name the argument).

    Args:
        tp, ep: ``tensor_parallel_size``, ``expert_parallel_size`` (a size, ``"auto"`` or ``"per_node"``).
        dp_shard: ``data_parallel_shard_size`` (a size, or ``"auto"``: 1, the processes per node or the world, by
            the memory filter and timed copies, :func:`decide_sizes`).
        plan, min_shard_params, placement, micro_batch_tokens, reshard_after_forward, activation_checkpointing,
            shard_optimizer_states: as the strategy's arguments.
        links: the cluster's link figures, or None (probed).
        bucket_bytes, bucket_view: DDP's bucket size and ``gradient_as_bucket_view`` (the timed copies use them).
        bits: what a ``GradientCompression`` callback asked for (``"auto"``, 8, 4), or None without one.
        pp, pp_schedule, pp_microbatches, pp_overlap: ``pipeline_parallel_size``, ``pipeline_schedule``,
            ``pipeline_microbatches`` (None: the schedule's least), ``pipeline_overlap``.
        sp: ``sequence_parallel`` (:mod:`.sequence_parallel`).
        loss_parallel: ``loss_parallel`` (:mod:`.loss_parallel`).
    """

    tp: Size = "auto"
    ep: Size = 1
    dp_shard: int | Literal["auto"] = 1
    plan: str | dict[str, str] = "auto"
    min_shard_params: int = 1 << 16
    placement: str = "auto"
    micro_batch_tokens: int | None = None
    reshard_after_forward: bool = True
    activation_checkpointing: str = "none"
    shard_optimizer_states: bool = False
    links: dict[str, LinkCost] | None = None
    bucket_bytes: int = 25 << 20
    bucket_view: bool = False
    bits: int | str | None = None
    pp: int = 1
    pp_schedule: str = "1F1B"
    pp_microbatches: int | None = None
    pp_overlap: bool = False
    sp: bool = False
    loss_parallel: bool = False

    def __post_init__(self) -> None:
        check_pipeline_composition(self.pp, self.pp_schedule, self.pp_microbatches, tensor_parallel_size=self.tp,
                                   expert_parallel_size=self.ep, data_parallel_shard_size=self.dp_shard,
                                   shard_optimizer_states=self.shard_optimizer_states,
                                   activation_checkpointing=self.activation_checkpointing, bits=self.bits,
                                   reshard_after_forward=self.reshard_after_forward)
        check_pipeline_overlap(self.pp_overlap, self.pp_schedule, self.pp)
        for name, on, what in (("sequence_parallel", self.sp, "splits the stages' tensor-parallel blocks"),
                               ("loss_parallel", self.loss_parallel, "shards the stages' vocabulary over tp")):
            if on and not (self.pp > 1 and isinstance(self.tp, int) and self.tp > 1):
                raise ValueError(f"{name}=True with pipeline_parallel_size={self.pp} and tensor_parallel_size="
                                 f"{self.tp!r}: it {what}, so it needs pipeline_parallel_size > 1 and a "
                                 "tensor_parallel_size > 1 (without a pipeline each rank of a tp group reads its own "
                                 f"batch). Set both, or {name}=False.")
        for name, size in (("tensor_parallel_size", self.tp), ("expert_parallel_size", self.ep)):
            if size not in ("auto", "per_node") and not (isinstance(size, int) and not isinstance(size, bool)
                                                         and size > 0):
                raise ValueError(f"{name}={size!r} must be a positive integer, 'auto' (decided by timing copies of "
                                 "the model) or 'per_node' (by the processes per node).")
        shard = self.dp_shard
        if shard != "auto" and not (isinstance(shard, int) and not isinstance(shard, bool) and shard > 0):
            raise ValueError(f"data_parallel_shard_size={shard!r} must be a positive integer (1: parameters "
                             "replicated) or 'auto' (unsharded, per node or over the world, by the memory filter and "
                             "timed copies).")
        if shard != 1 and self.shard_optimizer_states:
            raise ValueError(f"shard_optimizer_states=True with data_parallel_shard_size={shard!r}: parameter "
                             "sharding already shards the optimizer states. Set shard_optimizer_states=False (or "
                             "data_parallel_shard_size=1 for ZeRO-1 alone).")
        if self.activation_checkpointing not in MODES:
            raise ValueError(f"activation_checkpointing={self.activation_checkpointing!r} is not a mode: use one of "
                             f"{MODES}.")
        if self.placement not in POLICIES:
            raise ValueError(f"placement={self.placement!r} is not a placement policy: use one of {POLICIES}.")
        if self.plan != "auto" and not isinstance(self.plan, dict):
            raise TypeError(f"plan={self.plan!r} must be 'auto' or a dict of module-name patterns to "
                            "'colwise'/'rowwise'.")
        if self.min_shard_params < 0:
            raise ValueError(f"min_shard_params={self.min_shard_params} must be >= 0.")


def provisional_dims(settings: LayoutSettings, world_size: int, local_size: int) -> ParallelDims:
    """The sizes known before the model is (``"auto"`` sizes at 1, ``"per_node"`` tensor parallelism resolved):
    validated when the world size is known, final after :func:`resolve_dims`."""
    tp = {"auto": 1, "per_node": local_size}.get(settings.tp, settings.tp)
    ep = 1 if settings.ep in ("auto", "per_node") else settings.ep
    dp_shard = 1 if settings.dp_shard == "auto" else settings.dp_shard
    return ParallelDims(world_size, tp=tp, ep=ep, dp_shard=dp_shard, pp=settings.pp)


def decide_sizes(module: nn.Module, trainer: pl.Trainer, settings: LayoutSettings, dims: ParallelDims,
                 topology: Topology, untimed: str | None = None) -> Decision | None:
    """The ``"auto"`` sizes (and ``GradientCompression(bits="auto")``) from timed copies of each candidate layout
    (collective; :mod:`lightning_deepseek.autotune`); where the model cannot be timed here (``untimed`` says why),
    ``data_parallel_shard_size="auto"`` alone by the memory filter (``"auto"`` tp and ep sizes then resolve to 1 and
    ``"per_node"``). ``dims`` holds the sizes fixed by the arguments. None: nothing to decide."""
    timed = untimed is None
    if not (settings.dp_shard == "auto" or (timed and "auto" in (settings.tp, settings.ep))):
        return None
    # Imported here: autotune times copies sharded by this package's plans and hooks.
    from lightning_deepseek.autotune.auto_parallel import AUTO_BITS, decide_parallel, divisors, shard_sizes

    world, local_size = dims.world_size, trainer.strategy.num_processes
    per_node_ep = resolve_ep_size("per_node", world, local_size, find_expert_layers(module))
    named = [f"{name}='auto'" for name, arg in (("tensor_parallel_size", settings.tp),
                                                 ("expert_parallel_size", settings.ep),
                                                 ("data_parallel_shard_size", settings.dp_shard))
             if arg == "auto" and (timed or name == "data_parallel_shard_size")]
    named += ["GradientCompression(bits='auto')"] if settings.bits == "auto" and timed else []
    return decide_parallel(
        module, trainer, topology=topology, local_size=local_size, links=settings.links,
        plan_for=lambda tp: decide_plan(module, settings.plan, world, tp, False, settings.min_shard_params),
        tp_sizes=divisors(world, local_size) if settings.tp == "auto" and timed else [dims.tp],
        ep_sizes=None if settings.ep == "auto" and timed else [per_node_ep if settings.ep in ("auto", "per_node")
                                                               else dims.ep],
        bits=AUTO_BITS if settings.bits == "auto" and timed else [None if settings.bits == "auto" else settings.bits],
        tokens=settings.micro_batch_tokens, placement=settings.placement, bucket_bytes=settings.bucket_bytes,
        setting=", ".join(named), bucket_view=settings.bucket_view,
        shard_sizes=shard_sizes(world, local_size, settings.bits) if settings.dp_shard == "auto" else [dims.dp_shard],
        reshard_after_forward=settings.reshard_after_forward, device=trainer.strategy.root_device, untimed=untimed)


def resolve_dims(module: nn.Module, settings: LayoutSettings, dims: ParallelDims, local_size: int,
                 decision: Decision | None) -> ParallelDims:
    """The sizes from the arguments (``dims``), the decision and the model (``"per_node"`` expert sizes)."""
    tp = decision.chosen.tp if decision is not None else dims.tp
    if decision is not None and settings.ep == "auto":
        ep = decision.chosen.ep
    elif settings.ep in ("auto", "per_node"):  # "per_node", or "auto" where nothing was timed (an evaluation)
        ep = resolve_ep_size("per_node", dims.world_size, local_size, find_expert_layers(module))
    else:
        ep = settings.ep
    dp_shard = decision.chosen.dp_shard if decision is not None else dims.dp_shard
    return ParallelDims(dims.world_size, tp=tp, ep=ep, dp_shard=dp_shard)


def warn_user_parallelised(settings: LayoutSettings) -> None:
    """Warn about the settings a LightningModule that parallelised itself in ``configure_model`` makes moot."""
    settings_and_off = (("data_parallel_shard_size", settings.dp_shard, 1), ("expert_parallel_size", settings.ep, 1),
                        ("activation_checkpointing", settings.activation_checkpointing, "none"))
    moot = [f"{name}={value!r}" for name, value, off in settings_and_off if value != off]
    if moot:
        rank_zero_warn(f"HybridParallelStrategy: the model was parallelised in configure_model (its parameters are "
                       f"DTensors), so the strategy applies nothing more and {', '.join(moot)} has no effect; apply "
                       "it there, or leave the model to the strategy.")


def why_untimed(meta: bool, fitting: bool) -> str | None:
    """Why the ``"auto"`` sizes cannot be decided by timed copies in this setup, or None."""
    if meta:
        return "a model on the meta device cannot be timed"
    return None if fitting else "it is decided when fitting; this run only evaluates"


def decide_layout_plan(module: nn.Module, settings: LayoutSettings, dims: ParallelDims,
                       decision: Decision | None, untimed: str | None = None) -> Plan:
    """The tensor-parallel plan at the decided ``tp`` (empty, saying why, where nothing is sharded)."""
    if settings.tp == "auto" and dims.tp == 1 and dims.world_size > 1:
        why = (untimed if untimed is not None or decision is None else
               f"timing the candidate layouts chose tp=1 ({decision.reason})")
        return Plan(reason=f"tensor_parallel_size='auto': {why}, so no layer is tensor-parallel; set "
                    "tensor_parallel_size to shard the feed-forward layers anyway.")
    return decide_plan(module, settings.plan, dims.world_size, dims.tp, settings.tp == "per_node",
                       settings.min_shard_params)


def default_order(settings: LayoutSettings, topology: Topology, dims: ParallelDims) -> list[int]:
    """The rank order before the model is known: the ``placement`` policy's, ``tp_intra_node`` for ``"auto"``."""
    if dims.pp_enabled:  # pp outermost over the launch order (torchtitan's [pp, dp, tp]); no placement search yet
        return list(range(dims.world_size))
    policy = "tp_intra_node" if settings.placement == "auto" else settings.placement
    return [rank for row in candidate_mesh(policy, topology, dims.dp, dims.tp) for rank in row]


def place_layout(module: nn.Module, trainer: pl.Trainer, settings: LayoutSettings, dims: ParallelDims, plan: Plan,
                 topology: Topology, decision: Decision | None) -> Layout:
    """The layout: the decided sizes, and the rank order placement chose for them (by policy, or by the traffic it
    estimates for the plan over the cluster's links; collective where it probes the links)."""

    def volume() -> CommVolume:
        tokens = tokens_per_micro_batch(module, settings.micro_batch_tokens,
                                        warn_on_default=bool(plan) and settings.placement == "auto",
                                        measured=decision.tokens if decision is not None else None)
        return comm_volume(module, plan, dims.tp, tokens, trainer.accumulate_grad_batches)

    placed = place(settings.placement, topology, dims.dp, dims.tp, settings.links, volume)
    bits = (decision.chosen.bits or 32) if decision is not None and settings.bits == "auto" else None
    order = tuple(rank for row in placed.grid for rank in row)
    return Layout(dims, placed.policy, order, bits, decision, placed.estimates)
