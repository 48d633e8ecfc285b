"""``PipelineStrategyHooks``: ``DDPStrategy``'s loop hooks and data-parallel handles, routed through this rank's
pipeline (:class:`~lightning_deepseek.parallel.pipeline_loop.PipelineLoop`, the protocol in that module's docstring)
where ``pipeline_parallel_size > 1``, and ``DDPStrategy``'s own otherwise; ``HybridParallelStrategy`` inherits them.

Each hook is one branch: training runs the schedule's forwards and backwards in ``training_step`` (FP16 loss scale and
accumulation passed in) and puts the gradients back in ``backward``; the optimizer step's closure then exchanges them
over ``dp``; validation, test and predict run the schedule's forwards; clipping by norm runs over every stage.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.overrides.distributed import _sync_module_states
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_deepseek.parallel import clipping
from lightning_deepseek.parallel.layout import Layout
from lightning_deepseek.parallel.pipeline_exchange import compress_exchange
from lightning_deepseek.parallel.pipeline_loop import PipelineLoop, split_lightning_module
from lightning_deepseek.parallel.pipeline_scaling import loss_scale, prepare_loss_scaling

if TYPE_CHECKING:
    from lightning_deepseek.compression.config import CompressionConfig
    from lightning_deepseek.compression.state import CompressionState

__all__ = ["PipelineStrategyHooks"]


class PipelineStrategyHooks(pl.strategies.DDPStrategy):
    """``DDPStrategy``'s loop hooks and data-parallel handles, routed through the pipeline where one is set up
    (``_pipeline``) and ``DDPStrategy``'s own otherwise; ``HybridParallelStrategy`` inherits them."""

    _pipeline: PipelineLoop | None = None
    _save_distributed_checkpoint: bool = True

    @property
    def pipeline_group(self) -> dist.ProcessGroup | None:
        """The ranks of this rank's pipeline (the mesh's ``pp``; each holds other stages), or None without one."""
        return self._pipeline.pp_group if self._pipeline is not None else None

    @property
    def data_parallel_group(self) -> dist.ProcessGroup:
        """The process group over which the replicated gradients are averaged: the world, or under a pipeline the
        ranks holding the same stages (the mesh's ``dp``)."""
        return self.world_mesh["dp"].get_group() if self._pipeline is not None else dist.group.WORLD

    @property
    def ddp_module(self) -> DistributedDataParallel | None:
        """The DDP wrapper of the replicated parameters while fitting (register comm hooks on it); None under a
        pipeline."""
        return self.model if isinstance(self.model, DistributedDataParallel) else None

    def compress_pipeline_gradients(self, config: CompressionConfig | None) -> CompressionState | None:
        """Called by ``GradientCompression``: exchange the stages' gradients over ``dp`` compressed with ``config``
        (None: uncompressed again); collective over the world. Returns the exchange's state, None where nothing is
        exchanged (one data-parallel rank, or FSDP2 reducing the stages)."""
        assert self._pipeline is not None, "compress_pipeline_gradients needs pipeline_parallel_size > 1"
        group = self._pipeline.dp_group
        self._pipeline.compression = None if config is None or group is None else compress_exchange(
            group, self.lightning_module.named_parameters(), config)
        return self._pipeline.compression

    def _setup_pipeline(self, module: pl.LightningModule, meta: bool) -> None:
        """Split ``module`` once (a later setup, fit then test, keeps the split) and record the layout."""
        if self._pipeline is None:
            prepare_loss_scaling(self.precision_plugin, self.parallel_dims.pp)  # FP16: one verdict for all ranks
            if not self._save_distributed_checkpoint:
                raise ValueError(
                    f"save_distributed_checkpoint=False with pipeline_parallel_size={self.parallel_dims.pp}: each rank "
                    "holds only its stages, so one file gathered on rank 0 would miss the others. Use "
                    "save_distributed_checkpoint=True (a DCP folder, loadable at any layout).")
            if not meta:  # every rank builds its stages from rank 0's weights
                _sync_module_states(module)
            self._pipeline = split_lightning_module(module, self.world_mesh, self._settings, self.root_device,
                                                    self._topology, self.expert_routing)
            self._expert_plan = self._pipeline.expert_plan  # the summary's rows
        self.layout = self.layout or Layout(self.parallel_dims, "pipeline", self.world_mesh.order)

    def _check_pipeline_checkpoint(self, path: Path) -> None:
        """Refuse, before any collective of the load, what a pipeline cannot resume: a one-file checkpoint (optimizer
        states keyed by the saving optimizer's parameter order, which a rank holding a few stages cannot map). A DCP
        folder loads at any layout: one written without a pipeline (param_groups by group index) is mapped to this
        rank's parameters by name (:mod:`.checkpoint`)."""
        if self._pipeline is not None and path.is_file():
            raise ValueError(
                f"ckpt_path={str(path)!r} is one file and pipeline_parallel_size={self.parallel_dims.pp}: a pipeline "
                "resumes from a torch.distributed.checkpoint folder only (what HybridParallelStrategy writes with "
                "save_distributed_checkpoint=True, at any layout). Convert the file by resuming it with "
                "pipeline_parallel_size=1 and saving a folder, then resume that.")

    def _route_clipping(self) -> None:
        """Clip through the mesh-aware functions; by norm over every stage under a pipeline."""
        clipping.route_clipping(self.precision_plugin)
        if self._pipeline is not None:
            pipeline = self._pipeline
            self.precision_plugin.clip_grad_by_norm = lambda optimizer, value: pipeline._runner().clip_grad_norm_(value)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            return super().training_step(*args, **kwargs)
        with self.precision_plugin.train_step_context():  # FP16: each micro-batch's loss times the loss scale
            scale = loss_scale(self.precision_plugin, self.root_device)
            accumulate = self.lightning_module.trainer.accumulate_grad_batches
            batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)  # Lightning zeroes at window starts
            return self._pipeline.training_step(args[0], scale / accumulate, batch_idx % accumulate != 0)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            return super().validation_step(*args, **kwargs)
        with self.precision_plugin.val_step_context():
            return self._pipeline.eval_step(args[0], "validation")

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            return super().test_step(*args, **kwargs)
        with self.precision_plugin.test_step_context():
            return self._pipeline.eval_step(args[0], "test")

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            return super().predict_step(*args, **kwargs)
        with self.precision_plugin.predict_step_context():
            output = self._pipeline.predict_step(args[0])
        hook = getattr(self.lightning_module, "pipeline_predict", None)
        return output if hook is None else hook(output, args[0])

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Under a pipeline with FSDP2 stages, refuse predict shares of different sizes on the ``dp`` replicas (one
        gather of the sizes over ``dp``): their stages gather parameters in step, so the replica with fewer samples
        would leave the others waiting. Every rank raises, before the first batch."""
        dataloader = super().process_dataloader(dataloader)
        predicting = self.lightning_module.trainer.predicting
        if self._pipeline is None or not self.parallel_dims.fsdp_enabled or not predicting:
            return dataloader
        sampler = getattr(getattr(dataloader, "batch_sampler", None), "sampler", None)
        sizes: list[int | None] = [None] * self.parallel_dims.dp
        dist.all_gather_object(sizes, len(sampler) if hasattr(sampler, "__len__") else None,
                               group=self.world_mesh["dp"].get_group())
        if len(set(sizes)) > 1:
            raise ValueError(
                f"trainer.predict with pipeline_parallel_size={self.parallel_dims.pp} and data_parallel_shard_size="
                f"{self.parallel_dims.dp_shard}: the data-parallel replicas got {sizes} samples, and their FSDP2 "
                "stages gather parameters in step (the shorter share would hang the others). Predict a multiple of "
                f"{self.parallel_dims.dp} samples, or use data_parallel_shard_size=1.")
        return dataloader

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
                 ) -> torch.Tensor:
        if self._pipeline is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        self._pipeline.add_gradients()  # training_step ran the backward of every micro-batch
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if self._pipeline is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        pipeline = self._pipeline

        def closure_then_reduce() -> Any:
            result = closure()
            pipeline.reduce_gradients()
            return result

        return super().optimizer_step(optimizer, closure_then_reduce, model, **kwargs)

    @override
    def configure_ddp(self) -> None:
        if self._pipeline is None:
            super().configure_ddp()
        # Under a pipeline the stages' gradients are averaged over dp by PipelineLoop.reduce_gradients: no wrapper.
