"""What a real run of ``HybridParallelStrategy`` holds and sends in one training step, counted the way a plan counts
it: the model states from the real sharded tensors, the bytes at the real collectives (``CollectiveCounter`` on the
dispatcher, DDP's buckets through a comm hook), and the peak of the step's allocations as torch's ``MemTracker`` sees
them (DDP's buckets, allocated when DDP wraps the model, from the reducer's first copy of gradients into them on).
Each rank returns plain numbers for the parent to compare."""

from __future__ import annotations

import dataclasses
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import _clear_sharding_prop_cache
from torch.utils._python_dispatch import _disable_current_modes

from lightning_deepseek import GradientCompression, HybridParallelStrategy
from lightning_deepseek.parallel import Cluster
from lightning_deepseek.planning import ModelSpec, PlanLayout
from lightning_deepseek.planning.counting import CollectiveCounter, LocalOpsOnly, MicroBatchMemTracker
from lightning_deepseek.planning.planner import cluster_topology, local_bytes, mesh_groups, snapshot_bytes


class PlannedModule(pl.LightningModule):
    """The model of a ``ModelSpec``, trained on random tokens with torch's AdamW (the plan's optimizer)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.model = spec.build()

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.spec.loss(self.model, batch[0])

    def pipeline_batch(self, batch: tuple[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return batch[0], batch[0]

    def pipeline_loss(self, logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return self.spec.loss_from_logits(logits, input_ids)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-4)


class StepCounter(pl.Callback):
    """Counts one training step: collectives by (mesh dimension, op), gradient bytes before the optimizer step,
    parameter and optimizer-state bytes after it; under a pipeline, the step ``counted`` (the first step also
    infers the stages' shapes) and the receive buffers torch's stages hold."""

    def __init__(self, gpus_per_node: int, counted: int = 0, split_backward: bool = False) -> None:
        self.gpus_per_node = gpus_per_node
        self.counted = counted
        self.counter = CollectiveCounter()
        self.tracker = MicroBatchMemTracker(module_hooks=not split_backward)
        self.local_ops = LocalOpsOnly()
        self.ddp_bytes: list[int] = []
        self.result: dict[str, Any] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        ddp = trainer.strategy.ddp_module
        if ddp is not None:
            def counting(state: Any, bucket: dist.GradBucket) -> torch.futures.Future:
                self.ddp_bytes.append(bucket.buffer().numel() * bucket.buffer().element_size())
                with _disable_current_modes():  # counted here, by bucket, as the plan counts DDP
                    return allreduce_hook(state, bucket)
            # DDP checks the annotations as objects; this module's are strings (postponed evaluation)
            counting.__annotations__ = {"state": object, "bucket": dist.GradBucket,
                                        "return": torch.futures.Future[torch.Tensor]}
            ddp.register_comm_hook(None, counting)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if idx != self.counted:
            return
        self.tracker.track_external(pl_module, *trainer.strategy.optimizers, *_compression_buffers(trainer.strategy))
        self.tracker.__enter__()
        self.counter.__enter__()
        self.local_ops.__enter__()

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if trainer.global_step != self.counted:
            return
        self.result["grads"] = local_bytes([p.grad for p in pl_module.parameters() if p.grad is not None])

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           idx: int) -> None:
        if idx != self.counted:
            return
        self.local_ops.__exit__(None, None, None)
        self.counter.__exit__(None, None, None)
        self.tracker.__exit__(None, None, None)
        peak = self.tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
        strategy = trainer.strategy
        optimizer = strategy.optimizers[0]
        states = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        topology = cluster_topology(trainer.world_size, self.gpus_per_node)
        groups = mesh_groups(strategy.world_mesh, strategy.parallel_dims, topology)
        traffic: dict[tuple[str, str], int] = {}
        for call in self.counter.calls:
            key = (groups[call.group].dim if call.group in groups else f"?{call.group}", call.op)
            traffic[key] = traffic.get(key, 0) + call.num_bytes
        if self.ddp_bytes:
            traffic["ddp (world)", "all_reduce"] = sum(self.ddp_bytes)
        self.result.update(params=local_bytes(list(pl_module.parameters())),
                           states=local_bytes(states),
                           traffic=traffic, peak=snapshot_bytes(peak, "Total"),
                           sharded=any(isinstance(p, DTensor) for p in pl_module.parameters()),
                           buffers=_receive_buffers(strategy))


def _compression_buffers(strategy: HybridParallelStrategy) -> list[torch.Tensor]:
    """What ``GradientCompression``'s exchange under a pipeline holds from its first step on (residuals, message
    buffers): made before the counted step, so given to the tracker as a model's parameters are."""
    pipeline = getattr(strategy, "_pipeline", None)
    state = pipeline.compression if pipeline is not None else None
    if state is None:
        return []
    return [t for plan in state.plans.values()
            for t in (plan.residual, plan.send, plan.recv, plan.send2, plan.gathered) if t is not None]


def _receive_buffers(strategy: HybridParallelStrategy) -> int:
    """Bytes of the receive buffers torch's pipeline stages keep between steps (none without a pipeline)."""
    pipeline = strategy._pipeline
    if pipeline is None or pipeline.runner is None:
        return 0
    storages = {}
    for stage in pipeline.runner.stages:  # torch's stages hold them in these dicts of chunk -> infos (no public API)
        for infos in [*stage.args_recv_info.values(), *stage.grad_recv_info.values()]:
            for info in infos:
                buffer = getattr(info, "buffer", None)
                if isinstance(buffer, torch.Tensor):
                    storages[buffer.untyped_storage().data_ptr()] = buffer.untyped_storage().nbytes()
    return sum(storages.values())


def real_step(spec: ModelSpec, layout: PlanLayout, world_size: int, micro_batch_size: int, seq_len: int,
              gpus_per_node: int) -> dict[str, Any]:
    """One training step of ``spec`` at ``layout`` on this rank's real process group (collective)."""
    pl.seed_everything(0, verbose=False)
    # DTensor caches sharding by a mesh's value (ranks, names): an equal mesh of an earlier fit would lend this one's
    # tensor-parallel collectives its groups, unlabelled here (torch's debug module holds the only reset)
    _clear_sharding_prop_cache()
    module = PlannedModule(spec)
    topology = ";".join(",".join(map(str, island)) for island in cluster_topology(world_size, gpus_per_node).islands)
    cluster = Cluster(topology=topology, link_costs={"intra": {"bandwidth_gbit": 16}, "inter": {"bandwidth_gbit": 1}})
    pipeline = dict(pipeline_parallel_size=layout.pp, pipeline_schedule=layout.pp_schedule,
                    pipeline_microbatches=layout.pp_microbatches, sequence_parallel=layout.sequence_parallel,
                    loss_parallel=layout.loss_parallel) if layout.pp > 1 else {}
    strategy = HybridParallelStrategy(tensor_parallel_size=layout.tp, expert_parallel_size=layout.ep,
                                      shard_optimizer_states=layout.shard_optimizer_states, min_shard_params=0,
                                      data_parallel_shard_size=layout.dp_shard,
                                      reshard_after_forward=layout.reshard_after_forward,
                                      activation_checkpointing=layout.activation_checkpointing,
                                      placement=layout.placement, cluster=cluster, **pipeline)
    steps = 2 if layout.pp > 1 else 1  # a pipeline's first step also infers the stages' shapes: count the second
    counter = StepCounter(gpus_per_node, counted=steps - 1,
                          split_backward=layout.pp_schedule in ("ZBVZeroBubble", "DualPipeV"))
    compression = [GradientCompression(config=dataclasses.replace(layout.compression(), warmup_steps=0))
                   ] if layout.bits is not None else []  # a plan is of a step past the warm-up
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=world_size, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, callbacks=[*compression, counter])
    batch = micro_batch_size * layout.num_microbatches
    tokens = torch.randint(0, spec.vocab_size, (world_size * batch * steps, seq_len))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=batch)
    trainer.fit(module, data)
    return counter.result
