"""``HybridParallelStrategy``: data-parallel attention, tensor-parallel feed-forward, topology-aware mesh.

Every rank consumes its own micro-batch (global batch = world size x micro-batch). Large feed-forward linear
pairs (``nn.Linear``, transformers' ``Conv1D``) are sharded over the ``tp`` dimension of a 2-D ``(dp, tp)``
``DeviceMesh`` (torch DTensor tensor parallelism: batch-sharded activations all-gathered before the block,
reduce-scattered after it); every other parameter is replicated. Gradients:
- replicated parameters see different data on every rank, so they are averaged over the whole world by torch
  ``DistributedDataParallel`` (the tensor-parallel parameters are in DDP's ignore list); ``ddp_module`` is that
  DDP and ``data_parallel_group`` its process group, where a comm hook (``GradientCompression``) plugs in;
- a tensor-parallel shard already holds the gradient summed over its ``tp`` group's micro-batches (the
  reduce-scatter's backward is an all-gather of the output gradients), so it is summed over ``dp`` and divided
  by the world size: once per optimizer step, after the closure, so accumulation adds no collective. A model whose
  every trainable parameter is sharded gets no DDP wrapper (``ddp_module`` is then None).

The result is the training of the same model on the global batch (tested to 1e-5 against one process, and
against DDP on HF Llama, GPT-2, BERT, ViT, Mixtral and DeepSeek-V3).

The strategy is a thin coordinator over values decided once: ``ParallelDims`` (:mod:`.dims`, sizes and mesh), the
``Plan`` (:mod:`.plan`: declared by the model or found by structure), the ``Placement`` (:mod:`.placement`) and the
``ExpertParallelPlan`` (:mod:`.expert_plan`); sharding is :mod:`.styles`, the shards' gradient reduction
:mod:`.gradients`, the memory table and ZeRO-1's set-up :mod:`.memory`, mixed param groups :mod:`.optimizers`,
clipping :mod:`.clipping`, checkpoint I/O :mod:`.checkpoint`. ``_parallelize`` is the flat list of steps of a first
setup.
Reused from Lightning: ``DDPStrategy`` (launch, process group, DDP wrapping, ``no_sync`` under gradient
accumulation, ``reduce`` for ``sync_dist``) and the DCP checkpoint layout of ``ModelParallelStrategy`` (a folder
of shards plus ``meta.pt``). Lightning's ``ModelParallelStrategy`` itself shards over ``dp`` with FSDP2 and
expects the user to parallelize in ``configure_model``; this strategy keeps the attention replicated and plans
the model itself; like it, teardown leaves sharded weights where they are (moving DTensor parameters to the CPU
fails while an exception's traceback holds the autograd graph, and would hide the user's exception).
Checkpoints are torch DCP folders that reload at another ``tp`` or world size, or (with
``save_distributed_checkpoint=False``) one full file gathered on rank 0; full files, also DDP's, load at any ``tp``.

With nothing to shard (one process, ``tensor_parallel_size`` resolving to 1, no feed-forward block found or none
reaching ``min_shard_params``) it trains as plain DDP, and warns why and which setting changes that.

Costs: per micro-batch and sharded block, two all-gathers and two reduce-scatters of one rank's activations
over ``tp``; per step, one all-reduce of the replicated gradients (world) and one of the shards (``dp``).
Optimizers: a param group mixing DTensor shards and plain tensors is stepped with ``foreach=False``
(:mod:`.optimizers`).
Not supported: sharding anything but ``nn.Linear`` and ``Conv1D`` (routed experts are expert parallelism's);
ranks of a ``tp`` group feeding micro-batches of different shapes (the last batch of an epoch must be full or
dropped).
"""

from __future__ import annotations

import logging
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_deepseek.moe.node_limited import check_max_islands
from lightning_deepseek.parallel import checkpoint as _checkpoint_io
from lightning_deepseek.parallel import clipping, zero
from lightning_deepseek.parallel.arguments import check_ddp_kwargs
from lightning_deepseek.parallel.dims import ParallelDims
from lightning_deepseek.parallel.expert import reduce_expert_gradients
from lightning_deepseek.parallel.expert_dispatch import check_expert_dispatch
from lightning_deepseek.parallel.expert_plan import ExpertParallelPlan, setup_expert_parallel
from lightning_deepseek.parallel.memory import setup_optimizer_states
from lightning_deepseek.parallel.optimizers import (
    disable_foreach_on_mixed_groups,
    settle_mixed_param_groups,
)
from lightning_deepseek.parallel.placement import (
    POLICIES,
    CommVolume,
    LinkCost,
    comm_volume,
    place,
    tokens_per_micro_batch,
)
from lightning_deepseek.parallel.plan import Plan, decide_plan, format_plan_table
from lightning_deepseek.parallel.styles import apply_tensor_parallel, reduce_tensor_parallel_gradients
from lightning_deepseek.parallel.topology import Topology, discover_topology, parse_topology
from lightning_deepseek.parallel.zero import ShardedOptimizerStates

if TYPE_CHECKING:
    from lightning_deepseek.autotune.cost_model import Decision

log = logging.getLogger(__name__)
_AUTO = ("auto", "per_node")


class HybridParallelStrategy(DDPStrategy):
    """Attention (and everything else) data-parallel, large feed-forward layers tensor-parallel.

    Args:
        tensor_parallel_size: size of the ``tp`` mesh dimension; must divide the world size. ``"auto"``: decided
            at setup by the cost model (:mod:`lightning_deepseek.autotune.cost_model`) from the measured links and
            the measured compute of the model: the size up to the processes per node with the lowest predicted
            step time, 1 (plain data parallelism) unless sharding is predicted to pay or memory requires it; a
            ``GradientCompression(bits="auto")`` callback is decided in the same table. ``"per_node"``: the
            number of processes per node (the former ``"auto"``).
        plan: ``"auto"`` (detect feed-forward blocks, see :mod:`lightning_deepseek.parallel.plan`) or a mapping
            of module-name patterns (``fnmatch``, relative to the LightningModule) to ``"colwise"``/``"rowwise"``.
        min_shard_params: ``plan="auto"`` shards a block only from this many parameters on.
        placement: ``"auto"``, ``"tp_intra_node"`` or ``"dp_intra_node"`` (see
            :mod:`lightning_deepseek.parallel.placement`).
        topology: declared islands, ``"0,1;2,3"`` or ``[[0, 1], [2, 3]]``; default: ``$LDS_TOPOLOGY``, else
            discovered from hostnames (and NVML on NVIDIA machines).
        link_costs: ``{"intra": {"bandwidth_gbit": ..., "latency_us": ...}, "inter": {...}}`` for the cost model;
            default: measured by a short probe at start-up when there is more than one island.
        micro_batch_tokens: tokens (rows entering a feed-forward layer) per rank and micro-batch, for the cost
            model; default: the micro-batch the ``"auto"`` sizes were decided from, else from
            ``example_input_array``, else 2048.
        expert_parallel_size: ranks over which the routed experts of MoE layers are sharded (E/ep each, tokens
            dispatched by all-to-all; :mod:`lightning_deepseek.parallel.expert`); must divide the world size and
            every layer's expert count. 1: experts replicated like everything else. ``"auto"``: decided by the cost
            model (all-to-all of the routed tokens against the expert gradients' all-reduce it saves, inside or
            across islands; 1 without MoE layers). ``"per_node"``: the largest size inside a node that divides
            every layer's expert count (the former ``"auto"``).
        max_islands_per_token: node-limited routing (DeepSeek-V3): each token's routed experts lie on at most this
            many islands of ``topology`` (:mod:`lightning_deepseek.moe.node_limited`); None: no limit.
        expert_dispatch: ``"auto"`` (per island under node-limited routing when an expert-parallel group spans
            islands, else flat), ``"flat"`` or ``"per_island"`` (each token crosses to an island once;
            :mod:`lightning_deepseek.parallel.expert_dispatch`).
        save_distributed_checkpoint: ``True``: a DCP folder, one shard file per rank. ``False``: full weights and
            optimizer states gathered to rank 0 into one file (readable by ``load_from_checkpoint``).
        shard_optimizer_states: ZeRO-1: each replica of a parameter keeps the optimizer state of only the
            parameters it owns (replicated ones over the world, tensor-parallel shards over ``dp``); updated
            parameters are broadcast after each step (:mod:`lightning_deepseek.parallel.zero`).
        process_group_backend, timeout, start_method: as in Lightning's ``DDPStrategy``.
        **ddp_kwargs: passed to torch ``DistributedDataParallel`` (or Lightning's ``DDPStrategy``, e.g.
            ``cluster_environment``); any other name is an ``UnknownArgumentError`` naming the closest valid one
            (:mod:`lightning_deepseek.parallel.arguments`).
    """

    strategy_name = "hybrid"

    def __init__(
        self,
        tensor_parallel_size: int | Literal["auto", "per_node"] = "auto",
        plan: Literal["auto"] | dict[str, str] = "auto",
        min_shard_params: int = 1 << 16,
        placement: Literal["auto", "tp_intra_node", "dp_intra_node"] = "auto",
        topology: str | list[list[int]] | None = None,
        link_costs: dict[str, dict[str, float]] | None = None,
        micro_batch_tokens: int | None = None,
        expert_parallel_size: int | Literal["auto", "per_node"] = 1,
        max_islands_per_token: int | None = None,
        expert_dispatch: Literal["auto", "flat", "per_island"] = "auto",
        save_distributed_checkpoint: bool = True,
        shard_optimizer_states: bool = False,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **ddp_kwargs: Any,
    ) -> None:
        check_ddp_kwargs(type(self), ddp_kwargs)
        super().__init__(process_group_backend=process_group_backend, timeout=timeout, start_method=start_method,
                         **ddp_kwargs)
        if tensor_parallel_size not in _AUTO and not (isinstance(tensor_parallel_size, int) and
                                                          tensor_parallel_size > 0):
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size!r} must be a positive integer or 'auto' "
                             "(decided by the cost model), or 'per_node' (the processes per node).")
        if placement not in POLICIES:
            raise ValueError(f"placement={placement!r} is not a placement policy: use one of {POLICIES}.")
        if plan != "auto" and not isinstance(plan, dict):
            raise TypeError(f"plan={plan!r} must be 'auto' or a dict of module-name patterns to 'colwise'/'rowwise'.")
        if expert_parallel_size not in _AUTO and not (isinstance(expert_parallel_size, int) and
                                                          expert_parallel_size > 0):
            raise ValueError(f"expert_parallel_size={expert_parallel_size!r} must be a positive integer or 'auto' "
                             "(decided by the cost model), or 'per_node' (the largest size inside a node).")
        check_max_islands(max_islands_per_token)
        check_expert_dispatch(expert_dispatch)
        if min_shard_params < 0:
            raise ValueError(f"min_shard_params={min_shard_params} must be >= 0.")
        self._tp_arg = tensor_parallel_size
        self._plan_arg = dict(plan) if isinstance(plan, dict) else plan
        self._min_shard_params = min_shard_params
        self._placement_arg = placement
        self._topology_arg = parse_topology(topology).islands if topology is not None else None
        self._links = ({k: LinkCost.from_config(link_costs.get(k), f"link_costs[{k!r}]") for k in ("intra", "inter")}
                       if link_costs is not None else None)
        self._micro_batch_tokens = micro_batch_tokens
        self._ep_size = expert_parallel_size
        self._max_islands = max_islands_per_token
        self._expert_dispatch = expert_dispatch
        self._expert_plan: ExpertParallelPlan | None = None
        self._has_shards = True  # set at setup; until then every step reduces what it finds
        self._save_distributed_checkpoint = save_distributed_checkpoint
        self._dims: ParallelDims | None = None
        self._shard_optimizer_states = shard_optimizer_states
        self._zero: list[ShardedOptimizerStates] = []
        self._topology: Topology | None = None
        self._mesh: DeviceMesh | None = None
        self._plan = Plan()
        self.placement: str | None = None
        self.placement_estimates: dict[str, float] = {}
        self.autotune_decision: Decision | None = None
        self.autotune_decides_bits = False

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls, description="hybrid data/tensor parallelism")

    @property
    def tensor_parallel_size(self) -> int:
        if self._dims is not None:
            return self._dims.tp
        return self.num_processes if self._tp_arg in _AUTO else self._tp_arg

    @property
    def parallel_dims(self) -> ParallelDims:
        """World, tp and ep sizes (after ``setup_environment``)."""
        if self._dims is None:
            raise RuntimeError("HybridParallelStrategy.parallel_dims exists only after setup_environment().")
        return self._dims

    @property
    def device_mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("HybridParallelStrategy.device_mesh exists only after the strategy's setup().")
        return self._mesh

    @property
    def topology(self) -> Topology | None:
        return self._topology

    @property
    def plan(self) -> Plan:
        """The sharded layers (empty before setup); iterating it gives its ``PlanEntry`` items."""
        return self._plan

    @property
    def data_parallel_group(self) -> dist.ProcessGroup:
        """The process group over which ``ddp_module`` averages the replicated gradients (the world)."""
        return dist.group.WORLD

    @property
    def ddp_module(self) -> DistributedDataParallel | None:
        """The DDP wrapper of the replicated parameters while fitting (register comm hooks on it)."""
        return self.model if isinstance(self.model, DistributedDataParallel) else None

    def summary(self) -> dict[str, object]:
        """Mesh, placement and parameter memory per rank against DDP, for ``lds-train``'s run summary."""
        if self._mesh is None:
            return {}
        params = list(self.lightning_module.parameters())
        full = sum(p.numel() * p.element_size() for p in params)
        local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in params)
        dims = self.parallel_dims
        summary = {
            "hybrid_mesh": f"dp={dims.dp} x tp={dims.tp} ({self.placement})",
            "hybrid_sharded_layers": len(self._plan),
            "hybrid_param_bytes_vs_ddp": round(local / max(full, 1), 3),
            **(self._expert_plan.summary() if self._expert_plan is not None else {}),
            **(self.autotune_decision.summary() if self.autotune_decision is not None else {}),
        }
        if self.optimizers:
            summary["hybrid_optimizer_state_bytes"] = sum(zero.state_bytes(o) for o in self.optimizers)
        if self._zero:
            state = sum(z.partition.state_fraction(self.global_rank) * local for z in self._zero) / len(self._zero)
            summary["hybrid_optimizer_state_bytes_vs_ddp"] = round(state / max(full, 1), 3)
        return summary

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # The data shard follows the rank's mesh coordinate, not its global rank: under a permuted placement
        # the tp group gathers activations in coordinate order (DeviceMesh.get_local_rank is not the coordinate).
        if self._mesh is None:
            return super().distributed_sampler_kwargs
        dp_index, tp_index = self._mesh.get_coordinate()
        return {"num_replicas": self.world_size, "rank": dp_index * self.tensor_parallel_size + tp_index}

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        ep = 1 if self._ep_size in _AUTO else self._ep_size  # resolved with the model, at setup
        tp = {"auto": 1, "per_node": self.num_processes}.get(self._tp_arg, self._tp_arg)  # "auto": at setup
        self._dims = ParallelDims(self.world_size, tp=tp, ep=ep)
        self._topology = discover_topology(self.root_device, self.local_rank, self._topology_arg)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        module = self.lightning_module
        if not any(isinstance(p, DTensor) for p in module.parameters()):
            self._parallelize(module, trainer)
        # Decided once: at the plain layout nothing is sharded and each step is DDPStrategy's own.
        self._has_shards = any(isinstance(p, DTensor) for p in module.parameters())
        if trainer.state.fn == TrainerFn.FITTING:
            if self._layer_sync:
                self.model = self._layer_sync.apply(self.model)
            self.configure_ddp()
            self.setup_optimizers(trainer)
            settle_mixed_param_groups(self.optimizers)
            self._shard_states()
        self.setup_precision_plugin()
        clipping.route_clipping(self.precision_plugin)
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _parallelize(self, module: pl.LightningModule, trainer: pl.Trainer) -> None:
        """Plan, place, build the mesh and shard ``module`` (first setup only): the flat list of steps."""
        from lightning.pytorch.overrides.distributed import _sync_module_states

        dims = self.parallel_dims
        _sync_module_states(module)  # tp groups shard from their first rank: make every rank hold rank 0's weights
        ep_size = "auto" if self._ep_size == "per_node" else self._ep_size  # resolve_ep_size's name for the rule
        # The cost model times training steps: an evaluation without fit (trainer.test) runs data-parallel.
        fitting = trainer.state.fn == TrainerFn.FITTING
        if self._mesh is None and (self._tp_arg == "auto" or self._ep_size == "auto") and dims.world_size > 1 \
                and fitting:
            decision = self._decide(module, trainer)
            ep = decision.chosen.ep if self._ep_size == "auto" else dims.ep
            dims = self._dims = ParallelDims(dims.world_size, tp=decision.chosen.tp, ep=ep)
        if self.autotune_decision is not None and self._ep_size == "auto":  # also on a later setup (fit, then test)
            ep_size = self.autotune_decision.chosen.ep
        if self._tp_arg == "auto" and dims.tp == 1 and dims.world_size > 1:
            why = (f"the cost model chose tp=1 ({self.autotune_decision.reason})" if self.autotune_decision is not None
                   else "the cost model decides when fitting; this run only evaluates")
            self._plan = Plan(reason=f"tensor_parallel_size='auto': {why}, so nothing is sharded and this runs as "
                              "plain DDP; set tensor_parallel_size to shard anyway.")
        else:
            self._plan = decide_plan(module, self._plan_arg, dims.world_size, dims.tp, self._tp_arg == "per_node",
                                     self._min_shard_params)
        if self._mesh is None:  # built once: a later setup of an unsharded model (fit, then test) reuses it
            self._mesh = self._build_mesh(module, trainer)
        module._device_mesh = self._mesh
        apply_tensor_parallel(module, self._plan.styles, self._mesh["tp"])
        self._log_plan(module)
        self._expert_plan = setup_expert_parallel(module, self.root_device.type, self.world_size, ep_size,
                                                  self.num_processes, self._topology, self._max_islands,
                                                  self._expert_dispatch)

    def _decide(self, module: pl.LightningModule, trainer: pl.Trainer) -> Decision:
        """``tensor_parallel_size`` / ``expert_parallel_size`` (and ``GradientCompression(bits="auto")``) by the
        cost model, from measured compute and links (collective; :mod:`lightning_deepseek.autotune`)."""
        # Imported here: the cost model reads compression's payload sizes, and compression imports this package.
        from lightning_deepseek.autotune.auto_parallel import AUTO_BITS, decide_parallel, divisors
        from lightning_deepseek.compression.config import CompressionConfig as _Config

        assert self._topology is not None
        dims = self.parallel_dims
        # A GradientCompression callback: bits="auto" is decided here, in the same table; fixed bits are costed.
        fixed = next((c.config.bits for c in trainer.callbacks if isinstance(getattr(c, "config", None), _Config)),
                     None)
        compression = fixed == "auto"
        bits = AUTO_BITS if compression else [fixed]
        tp_sizes = divisors(dims.world_size, self.num_processes) if self._tp_arg == "auto" else [dims.tp]
        ep_sizes = None if self._ep_size == "auto" else [dims.ep]
        settings = [f"{name}='auto'" for name, arg in (("tensor_parallel_size", self._tp_arg),
                                                        ("expert_parallel_size", self._ep_size)) if arg == "auto"]
        settings += ["GradientCompression(bits='auto')"] if compression else []
        self.autotune_decision = decide_parallel(
            module, trainer, topology=self._topology, local_size=self.num_processes, links=self._links,
            plan_for=lambda tp: decide_plan(module, self._plan_arg, dims.world_size, tp, False, self._min_shard_params),
            tp_sizes=tp_sizes, ep_sizes=ep_sizes, bits=bits, tokens=self._micro_batch_tokens,
            placement=self._placement_arg, bucket_bytes=int((self._ddp_kwargs.get("bucket_cap_mb") or 25) * 2**20),
            setting=", ".join(settings), bucket_view=bool(self._ddp_kwargs.get("gradient_as_bucket_view", False)))
        self.autotune_decides_bits = compression
        return self.autotune_decision

    def _log_plan(self, module: nn.Module) -> None:
        if not self._plan and self._plan.warn:
            rank_zero_warn(f"HybridParallelStrategy: {self._plan.reason}")
        table = (format_plan_table(module, self._plan, self.parallel_dims.tp) if self._plan
                 else f"empty plan: {self._plan.reason}")
        rank_zero_info(f"HybridParallelStrategy plan (tp={self.parallel_dims.tp}, dp={self.parallel_dims.dp}):\n"
                       f"{table}")

    def _shard_states(self) -> None:
        """ZeRO-1 on every optimizer (``shard_optimizer_states=True``); prints the memory per rank."""
        for handle in self._zero:
            handle.remove()
        expert_mesh = self._expert_plan.mesh if self._expert_plan is not None else None
        self._zero = setup_optimizer_states(self.optimizers, self.global_rank, self.world_size, self._mesh,
                                            expert_mesh, self._shard_optimizer_states)

    def _build_mesh(self, module: nn.Module, trainer: pl.Trainer) -> DeviceMesh:
        assert self._topology is not None
        dims, topology = self.parallel_dims, self._topology

        def volume() -> CommVolume:
            decided = self.autotune_decision.tokens if self.autotune_decision is not None else None
            tokens = tokens_per_micro_batch(module, self._micro_batch_tokens,
                                            warn_on_default=bool(self._plan) and self._placement_arg == "auto",
                                            measured=decided)
            return comm_volume(module, self._plan, dims.tp, tokens, trainer.accumulate_grad_batches)
        placed = place(self._placement_arg, topology, dims.dp, dims.tp, self._links, volume)
        self.placement, self.placement_estimates = placed.policy, placed.estimates
        return dims.build_mesh(self.root_device.type, placed.grid)

    @override
    def configure_ddp(self) -> None:
        if any(p.requires_grad and not isinstance(p, DTensor) for p in self.model.parameters()):
            super().configure_ddp()
            return
        # DDP refuses a module with nothing to reduce; the strategy reduces the shards itself.
        rank_zero_info("HybridParallelStrategy: every trainable parameter is tensor-parallel, so there is no DDP "
                       "wrapper (ddp_module is None); the strategy reduces the shard gradients over dp.")

    @override
    def teardown(self) -> None:
        module = self.lightning_module
        if module is None or not any(isinstance(p, DTensor) for p in module.parameters()):
            super().teardown()
            return
        # As Lightning's ModelParallelStrategy: sharded weights stay where they are. Module.cpu() swaps each DTensor
        # parameter, which fails while an exception's traceback still holds the autograd graph and would replace
        # the user's exception by "Couldn't swap Linear.weight".
        if isinstance(self.model, DistributedDataParallel):
            self.model = module
        if self._layer_sync and module._trainer is not None and module._trainer.state.fn == TrainerFn.FITTING:
            self.model = self._layer_sync.revert(self.model)
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @override
    def _setup_model(self, model: nn.Module) -> DistributedDataParallel:
        ignored = [name for name, p in model.named_parameters() if isinstance(p, DTensor)]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
        return super()._setup_model(model)

    def reduce_tensor_parallel_gradients(self, optimizer: Optimizer) -> None:
        """Sum the tensor-parallel gradients of ``optimizer``'s parameters over ``dp``, divide by the world size."""
        reduce_tensor_parallel_gradients([p for group in optimizer.param_groups for p in group["params"]],
                                         self.device_mesh)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        if not self._has_shards:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        inner = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer

        def closure_then_reduce() -> Any:
            result = closure()
            self.reduce_tensor_parallel_gradients(inner)
            if self._expert_plan is not None and self._expert_plan.mesh is not None:
                reduce_expert_gradients([p for g in inner.param_groups for p in g["params"]], self._expert_plan.mesh)
            return result

        return super().optimizer_step(optimizer, closure_then_reduce, model, **kwargs)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return _checkpoint_io.model_state(self.model, full=not self._save_distributed_checkpoint)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        return _checkpoint_io.optimizer_state(self.model, optimizer, full=not self._save_distributed_checkpoint,
                                              sharded=self._zero_of(optimizer))

    def _zero_of(self, optimizer: Optimizer) -> ShardedOptimizerStates | None:
        """The ZeRO-1 state of ``optimizer`` (a torch optimizer), if its states are sharded."""
        return next((z for z, o in zip(self._zero, self.optimizers)
                     if (o._optimizer if isinstance(o, LightningOptimizer) else o) is optimizer), None)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # load_checkpoint() has already loaded the weights into the shards

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # load_checkpoint() has already loaded the optimizer states

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("HybridParallelStrategy.save_checkpoint(storage_options=...) is not supported: "
                            "checkpoints are written by torch.distributed.checkpoint, not a CheckpointIO.")
        path = Path(self.broadcast(filepath))
        if self._save_distributed_checkpoint:
            _checkpoint_io.save_distributed(checkpoint, path, self.global_rank == 0, self.barrier)
            return
        if path.is_dir():
            raise IsADirectoryError(f"{path} is a folder; save_distributed_checkpoint=False writes one file.")
        super().save_checkpoint(checkpoint, path)
        self.barrier()

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        strict = self.lightning_module.strict_loading
        sharded = [self._zero_of(o) for o in self.optimizers]
        if path.is_file():
            loaded = self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)
            _checkpoint_io.load_full(self.model, self.optimizers, loaded, strict, self.lightning_module, sharded)
        elif _checkpoint_io.is_distributed_checkpoint(path):
            loaded = _checkpoint_io.load_distributed(self.model, self.optimizers, path, strict, weights_only, sharded)
        else:
            raise ValueError(f"ckpt_path={str(path)!r} is neither a checkpoint file nor a complete "
                             "torch.distributed.checkpoint folder (with meta.pt, written last). Pass a checkpoint "
                             "written by Lightning.")
        disable_foreach_on_mixed_groups(self.optimizers)  # loaded groups carry the saved run's foreach
        return loaded
