"""``HybridParallelStrategy``: data-parallel attention, tensor-parallel feed-forward, expert-parallel MoE layers and
sharded parameters, over one topology-aware device mesh.

Every rank consumes its own micro-batch (global batch = world size x micro-batch). Large feed-forward linear pairs
are sharded over ``tp`` (DTensor tensor parallelism: batch-sharded activations all-gathered before the block,
reduce-scattered after it), routed experts over ``ep`` (all-to-all dispatch, :mod:`.expert`), and with
``data_parallel_shard_size`` every parameter over the ranks that replicate it (FSDP2, :mod:`.fsdp`). Unsharded
parameters are averaged over the world by torch ``DistributedDataParallel`` (``ddp_module``, where a comm hook such as
``GradientCompression`` plugs in); a tp/ep shard already holds the gradient summed over its group's micro-batches,
so it is summed over its replicas and divided by the world size once per optimizer step. The result is the training
of the same model on the global batch (tested to 1e-5 against one process and DDP, on HF families too). With
``pipeline_parallel_size`` the model is split into stages by layers instead, run by a schedule (:mod:`.pipeline_loop`).

A thin coordinator over values decided once at setup: the ``Cluster`` (:mod:`.cluster`), the ``Layout``
(:mod:`.layout`: sizes, rank order, the ``"auto"`` decision), every mesh (``WorldMesh``, :mod:`.dims`), the ``Plan``
(:mod:`.plan`), the ``ExpertParallelPlan`` (:mod:`.expert_plan`); ``_parallelize`` is the flat list of setup steps.
Reused from Lightning: ``DDPStrategy`` (launch, process group, DDP wrapping, ``no_sync``, ``reduce``), and
``ModelParallelStrategy``'s meta-device contract and DCP checkpoint layout (:mod:`.checkpoint`). With nothing to
shard it trains as plain DDP, and says why and which setting changes that.

Costs: per micro-batch and tp block, two all-gathers and two reduce-scatters of one rank's activations; per MoE
layer, two all-to-alls each way; per step, one all-reduce of the unsharded gradients and one of the tp/ep shards;
with parameter sharding, FSDP's all-gather per block forward and backward and reduce-scatter per block backward.
Not supported: tensor-sharding anything but ``nn.Linear``, ``Conv1D`` and routed experts; ranks of a ``tp`` group
feeding micro-batches of different shapes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_deepseek.parallel import checkpoint as _checkpoint_io
from lightning_deepseek.parallel.activation_checkpointing import apply_activation_checkpointing
from lightning_deepseek.parallel.arguments import check_ddp_kwargs
from lightning_deepseek.parallel.cluster import Cluster
from lightning_deepseek.parallel.dims import ParallelDims, WorldMesh
from lightning_deepseek.parallel.expert import reduce_expert_gradients
from lightning_deepseek.parallel.expert_plan import ExpertParallelPlan, setup_expert_parallel
from lightning_deepseek.parallel.expert_routing import ExpertRouting
from lightning_deepseek.parallel.fsdp import apply_fsdp, check_no_legacy_fsdp, has_meta_tensors, materialize
from lightning_deepseek.parallel.layout import (
    Layout,
    LayoutSettings,
    decide_layout_plan,
    decide_sizes,
    default_order,
    place_layout,
    provisional_dims,
    resolve_dims,
    warn_user_parallelised,
    why_untimed,
)
from lightning_deepseek.parallel.memory import setup_optimizer_states, summary_rows
from lightning_deepseek.parallel.optimizers import disable_foreach_on_mixed_groups, settle_mixed_param_groups
from lightning_deepseek.parallel.pipeline_hooks import PipelineStrategyHooks
from lightning_deepseek.parallel.plan import Plan, log_plan
from lightning_deepseek.parallel.styles import apply_tensor_parallel, reduce_tensor_parallel_gradients
from lightning_deepseek.parallel.topology import Topology, discover_topology
from lightning_deepseek.parallel.zero import ShardedOptimizerStates

if TYPE_CHECKING:
    from lightning_deepseek.compression.config import CompressionConfig


class HybridParallelStrategy(PipelineStrategyHooks):
    """Attention (and the rest) data-parallel, large feed-forward layers tensor-parallel, routed experts over ``ep``.

    Args:
        tensor_parallel_size: size of the ``tp`` mesh dimension, dividing the world size. ``"auto"``: by timed
            copies of each candidate layout at setup (:mod:`lightning_deepseek.autotune`), 1 unless sharding is
            faster by the margin or memory requires it. ``"per_node"``: the processes per node.
        expert_parallel_size: ranks sharing the routed experts of MoE layers (E/ep each, tokens dispatched by
            all-to-all), dividing the world size and every expert count. 1: replicated. ``"auto"``: decided with
            ``tensor_parallel_size``. ``"per_node"``: the largest size inside a node that divides the expert counts.
        plan: ``"auto"`` (detect feed-forward blocks, :mod:`lightning_deepseek.parallel.plan`) or a mapping of
            module-name patterns (``fnmatch``, relative to the LightningModule) to ``"colwise"``/``"rowwise"``.
        min_shard_params: ``plan="auto"`` shards a block only from this many parameters on.
        placement: ``"auto"``, ``"tp_intra_node"`` or ``"dp_intra_node"``: the rank order of every mesh
            dimension (:mod:`lightning_deepseek.parallel.placement`).
        data_parallel_shard_size: ranks sharding every parameter, its gradient and optimizer state (ZeRO-3 by
            FSDP2, :mod:`lightning_deepseek.parallel.fsdp`); the other ranks replicate the shards (HSDP). 1: off.
            ``"auto"``: 1, the processes per node or the world, by memory and timed copies (with the tp/ep sizes).
        reshard_after_forward: free each block's gathered parameters after forward (False: ZeRO-2-like).
        activation_checkpointing: ``"none"``, ``"full"`` or ``"selective"`` per transformer block
            (:mod:`lightning_deepseek.parallel.activation_checkpointing`); with or without sharding.
        shard_optimizer_states: ZeRO-1: each replica of a parameter keeps the optimizer state of only the
            parameters it owns (:mod:`lightning_deepseek.parallel.zero`).
        pipeline_parallel_size, pipeline_schedule, pipeline_microbatches, pipeline_overlap, sequence_parallel: ``pp``
            stages (1: off) run by the schedule (protocol: :mod:`.pipeline_loop`), micro-batches per batch (None: its
            least), DualPipeV's MoE all-to-all hidden behind the paired micro-batch (:mod:`.pipeline_overlap`), the
            stages' tp blocks on 1/tp of the sequence between their sharded layers (:mod:`.sequence_parallel`).
        loss_parallel: with pp and tp, the embedding, head and loss sharded by vocabulary (:mod:`.loss_parallel`).
        save_distributed_checkpoint: ``True``: a DCP folder. ``False``: one full file gathered on rank 0.
        cluster: the machines' islands and link figures (``Cluster``); None: discovered and probed at start-up.
        expert_routing: node-limited routing and the dispatch of MoE layers (``ExpertRouting``).
        micro_batch_tokens: tokens per rank and micro-batch for placement's traffic estimate (default: measured).
        process_group_backend, timeout, start_method: as in Lightning's ``DDPStrategy``.
        **ddp_kwargs: passed to torch ``DistributedDataParallel`` (or Lightning's ``DDPStrategy``); any other name
            is an ``UnknownArgumentError`` naming the closest valid one (:mod:`lightning_deepseek.parallel.arguments`).
    """

    strategy_name = "hybrid"

    def __init__(
        self,
        tensor_parallel_size: int | Literal["auto", "per_node"] = "auto",
        expert_parallel_size: int | Literal["auto", "per_node"] = 1,
        plan: Literal["auto"] | dict[str, str] = "auto",
        min_shard_params: int = 1 << 16,
        placement: Literal["auto", "tp_intra_node", "dp_intra_node"] = "auto",
        data_parallel_shard_size: int | Literal["auto"] = 1,
        reshard_after_forward: bool = True,
        activation_checkpointing: Literal["none", "full", "selective"] = "none",
        shard_optimizer_states: bool = False,
        pipeline_parallel_size: int = 1,
        pipeline_schedule: Literal["1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"] = "1F1B",
        pipeline_microbatches: int | None = None,
        pipeline_overlap: bool = False,
        sequence_parallel: bool = False,
        loss_parallel: bool = False,
        save_distributed_checkpoint: bool = True,
        cluster: Cluster | None = None,
        expert_routing: ExpertRouting | None = None,
        micro_batch_tokens: int | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **ddp_kwargs: Any,
    ) -> None:
        check_ddp_kwargs(type(self), ddp_kwargs)
        super().__init__(process_group_backend=process_group_backend, timeout=timeout, start_method=start_method,
                         **ddp_kwargs)
        for name, value, kind in (("cluster", cluster, Cluster), ("expert_routing", expert_routing, ExpertRouting)):
            if value is not None and not isinstance(value, kind):
                raise TypeError(f"{name}={value!r} must be a lightning_deepseek.parallel.{kind.__name__} or None.")
        self.cluster = cluster or Cluster()
        self.expert_routing = expert_routing or ExpertRouting()
        self._settings = LayoutSettings(
            tensor_parallel_size, expert_parallel_size, data_parallel_shard_size,
            dict(plan) if isinstance(plan, dict) else plan, min_shard_params, placement, micro_batch_tokens,
            reshard_after_forward, activation_checkpointing, shard_optimizer_states, self.cluster.links,
            int((self._ddp_kwargs.get("bucket_cap_mb") or 25) * 2**20),
            bool(self._ddp_kwargs.get("gradient_as_bucket_view", False)), None, pipeline_parallel_size,
            pipeline_schedule, pipeline_microbatches, pipeline_overlap, sequence_parallel, loss_parallel)
        self._save_distributed_checkpoint = save_distributed_checkpoint
        self._dims: ParallelDims | None = None
        self._mesh: WorldMesh | None = None
        self._topology: Topology | None = None
        self._plan = Plan()
        self._expert_plan: ExpertParallelPlan | None = None
        self._zero: list[ShardedOptimizerStates] = []
        self._has_shards = True  # set at setup
        self.layout: Layout | None = None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls, description="hybrid data/tensor/expert parallelism")

    @property
    def parallel_dims(self) -> ParallelDims:
        """World, tp and ep sizes (after ``setup_environment``; final after ``setup``)."""
        if self._dims is None:
            raise RuntimeError("HybridParallelStrategy.parallel_dims exists only after setup_environment().")
        return self._dims

    @property
    def world_mesh(self) -> WorldMesh:
        """Every mesh of the run, by name: ``world_mesh["tp"]``, ``world_mesh["edp", "ep"]`` (after ``setup``)."""
        if self._mesh is None:
            raise RuntimeError("HybridParallelStrategy.world_mesh exists only after the strategy's setup().")
        return self._mesh

    @property
    def device_mesh(self) -> DeviceMesh:
        """The ``(dp, tp)`` mesh (the LightningModule's ``self.device_mesh``)."""
        return self.world_mesh["dp", "tp"]

    @property
    def plan(self) -> Plan:
        """The sharded layers (empty before setup); iterating it gives its ``PlanEntry`` items."""
        return self._plan

    def request_compression(self, config: CompressionConfig) -> None:
        """Called by ``GradientCompression.setup``: bits to weigh with the layout (the decided: ``layout.bits``)."""
        self._settings = dataclasses.replace(self._settings, bits=config.bits)

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        with torch.device("meta") if empty_init else nullcontext(), self.precision_plugin.tensor_init_context():
            yield

    def summary(self) -> dict[str, object]:
        """Mesh, placement and memory per rank against DDP, as rows of a run summary."""
        if self.layout is None:
            return {}
        rows = summary_rows(self.lightning_module, self.layout, len(self._plan), self.optimizers, self._zero,
                            self.global_rank)
        return {**rows, **(self._expert_plan.summary() if self._expert_plan is not None else {})}

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return super().distributed_sampler_kwargs if self.layout is None else self.layout.data_shard(self.global_rank)

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
        self._dims = dims = provisional_dims(self._settings, self.world_size, self.num_processes)
        self._topology = discover_topology(self.root_device, self.local_rank, self.cluster.topology)
        # As Lightning's ModelParallelStrategy, `self.device_mesh` exists in configure_model: the fixed sizes in
        # placement's default order; setup() may choose the "auto" sizes and another order for its own sharding.
        self._mesh = dims.build_mesh(self.root_device.type, default_order(self._settings, self._topology, dims))
        self.lightning_module._device_mesh = self.device_mesh  # what LightningModule.device_mesh reads

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        module, meta = self.lightning_module, has_meta_tensors(self.lightning_module)
        check_no_legacy_fsdp(module)
        if not meta:
            self.model_to_device()
        if not any(isinstance(p, DTensor) for p in module.parameters()):
            self._parallelize(module, trainer, meta)
        elif self.layout is None:  # the user's own parallelisation in configure_model: kept as it is
            self.layout = Layout(self.parallel_dims, "user", self.world_mesh.order)
            warn_user_parallelised(self._settings)
        materialize(module, self.root_device)  # a meta model: each rank allocates and initialises its shards
        self.model_to_device()
        # Unsharded, each step is DDPStrategy's own; FSDP reduces its parameters' gradients itself.
        sharded = self._pipeline is None and any(isinstance(p, DTensor) for p in module.parameters())  # else its loop
        self._has_shards = sharded and not self.parallel_dims.fsdp_enabled and self.layout.placement != "user"
        if trainer.state.fn == TrainerFn.FITTING:
            if self._layer_sync:
                self.model = self._layer_sync.apply(self.model)
            self.configure_ddp()
            self.setup_optimizers(trainer)
            settle_mixed_param_groups(self.optimizers)
            self._zero = setup_optimizer_states(self.optimizers, self.global_rank, self.world_size, self._mesh,
                                                self._settings.shard_optimizer_states, previous=self._zero)
        self.setup_precision_plugin()
        self._route_clipping()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _parallelize(self, module: pl.LightningModule, trainer: pl.Trainer, meta: bool) -> None:
        """Decide the sizes, plan, place, build the meshes and shard ``module`` (tensor, expert, then parameter
        sharding): the flat list of steps. Decided once; a later setup (fit, then test) reuses the layout."""
        if self.parallel_dims.pp_enabled:
            return self._setup_pipeline(module, meta)
        if not meta:  # tp groups shard from their first rank: make every rank hold rank 0's weights
            _sync_module_states(module)
        assert self._topology is not None
        settings = self._settings
        decision = self.layout.decision if self.layout is not None else None
        untimed = why_untimed(meta, trainer.state.fn == TrainerFn.FITTING)
        if self.layout is None and self.world_size > 1:
            decision = decide_sizes(module, trainer, settings, self.parallel_dims, self._topology, untimed)
        self._dims = dims = resolve_dims(module, settings, self.parallel_dims, self.num_processes, decision)
        self._plan = decide_layout_plan(module, settings, dims, decision, untimed)
        if self.layout is None:
            self.layout = place_layout(module, trainer, settings, dims, self._plan, self._topology, decision)
            self._mesh = dims.build_mesh(self.root_device.type, self.layout.order)
        module._device_mesh = self.device_mesh  # Lightning has no setter
        apply_tensor_parallel(module, self._plan.styles, self.device_mesh["tp"])
        log_plan(module, self._plan, dims)
        self._expert_plan = setup_expert_parallel(module, self.world_mesh, self._topology, self.expert_routing)
        apply_activation_checkpointing(module, settings.activation_checkpointing)
        if dims.fsdp_enabled:
            apply_fsdp(module, self.world_mesh, settings.reshard_after_forward)

    @override
    def configure_ddp(self) -> None:
        if any(p.requires_grad and not isinstance(p, DTensor) for p in self.model.parameters()):
            return super().configure_ddp()
        # DDP refuses a module with nothing to reduce; FSDP or the strategy reduces the shards.
        rank_zero_info("HybridParallelStrategy: every trainable parameter is sharded, so there is no DDP wrapper "
                       "(ddp_module is None).")

    @override
    def teardown(self) -> None:
        module = self.lightning_module
        if module is None or not any(isinstance(p, DTensor) for p in module.parameters()):
            return super().teardown()
        # As ModelParallelStrategy: shards stay (Module.cpu() fails while a traceback holds the autograd graph).
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
        reduce_tensor_parallel_gradients([p for g in optimizer.param_groups for p in g["params"]], self.device_mesh)

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
                                              sharded=self._zero_of(optimizer), module=self.lightning_module,
                                              flatten=self._pipeline is not None)

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
        _checkpoint_io.make_way_for_file(path, self.global_rank == 0, self.barrier)
        super().save_checkpoint(checkpoint, path)
        self.barrier()

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        self._check_pipeline_checkpoint(path)
        loaded = _checkpoint_io.load(self.model, self.optimizers, path, self.lightning_module, weights_only,
                                     [self._zero_of(o) for o in self.optimizers], self.checkpoint_io)
        disable_foreach_on_mixed_groups(self.optimizers)  # loaded groups carry the saved run's foreach
        return loaded
