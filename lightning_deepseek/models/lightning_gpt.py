"""``LightningGPT``: the example GPT as a LightningModule (next-token cross-entropy, AdamW, cosine schedule), ready
for pipeline parallelism (the protocol of :mod:`lightning_deepseek.parallel.pipeline_loop`)."""

from __future__ import annotations

import itertools
import math
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_deepseek.models.gpt import GPT, GPTConfig


class LightningGPT(pl.LightningModule):
    """Trains :class:`GPT` on ``(input, target)`` token batches.

    Args:
        config: model shape.
        learning_rate: peak AdamW learning rate.
        weight_decay: AdamW weight decay on matrices (not on biases, norms or embeddings).
        warmup_steps: linear warm-up steps before the cosine decay.
        min_lr_ratio: final learning rate as a fraction of the peak.
        betas: AdamW betas.
        moment_dtype: ``"fp32"`` (torch's AdamW) or ``"bf16"``: AdamW moments kept in BF16 with stochastic
            rounding, as DeepSeek-V3 does (:class:`lightning_deepseek.optim.AdamW`; half the moment bytes).
    """

    def __init__(
        self,
        config: GPTConfig,
        learning_rate: float = 1e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 20,
        min_lr_ratio: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        moment_dtype: str = "fp32",
    ) -> None:
        super().__init__()
        if learning_rate <= 0:
            raise ValueError(f"optim.learning_rate={learning_rate} must be positive.")
        if moment_dtype not in ("fp32", "bf16"):
            raise ValueError(f"optim.moment_dtype={moment_dtype!r} is not a moment precision: use fp32 (torch's AdamW) "
                             "or bf16 (BF16 moments, half the optimizer bytes).")
        self.save_hyperparameters()
        self.config = config
        self.model = GPT(config)
        self._num_params = sum(p.numel() for p in self.model.parameters())
        self._batch_tokens = 0

    @override
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return self.pipeline_loss(self(x), y)

    pipeline_module = "model"  # the pipeline protocol: the model the strategy splits into stages

    def pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The next-token cross-entropy of one (micro-)batch from its logits (the pipeline protocol's loss)."""
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))

    def on_pipeline_loss(self, loss: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor], step: str) -> None:
        """Under a pipeline, log the loss the strategy's step computed, as ``training_step`` and
        ``validation_step`` do otherwise."""
        if step == "training":
            self._batch_tokens = batch[0].numel()
            self.log("train_loss", loss, prog_bar=True, sync_dist=False)
        else:
            self.log("val_loss" if step == "validation" else "test_loss", loss, prog_bar=True, sync_dist=True)

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self._batch_tokens = batch[0].numel()
        self.log("train_loss", loss, prog_bar=True, sync_dist=False)
        return loss

    @override
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # The gradient norm before clipping, on the steps the loggers write (a sharded gradient's norm is a
        # collective, so not on the others). Reading the gradients changes nothing in the step.
        if (self.trainer.global_step + 1) % max(1, self.trainer.log_every_n_steps):
            return
        squares = []
        for param in self.parameters():
            if param.grad is not None:
                norm = param.grad.detach().float().norm(2)
                squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).pow(2))
        if squares:
            total = torch.stack(squares).sum()
            pipeline = getattr(self.trainer.strategy, "pipeline_group", None)
            if pipeline is not None:  # each rank of a pipeline holds other stages: add their squares
                torch.distributed.all_reduce(total, group=pipeline)
            self.log("grad_norm", total.sqrt(), on_step=True, on_epoch=False)

    @property
    def flops_per_batch(self) -> int:
        """Training FLOPs of the last batch, estimated as 6 x parameters x tokens (forward and backward; the
        attention scores are left out), for Lightning's ``ThroughputMonitor``."""
        return 6 * self._num_params * self._batch_tokens

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    @override
    def configure_optimizers(self) -> Any:
        hp = self.hparams
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        # Under HybridParallelStrategy the sharded feed-forward parameters are DTensors; torch's multi-tensor
        # (foreach) step, its default on CUDA, refuses a group mixing them with plain tensors. Each group is cut
        # where the kind changes rather than sorted by kind: gradient clipping then adds the per-parameter norms
        # in the same order as over the two uncut groups, and the losses stay bitwise the same.
        groups = [{"params": list(run), "weight_decay": weight_decay}
                  for params, weight_decay in ((decay, hp.weight_decay), (no_decay, 0.0))
                  for _, run in itertools.groupby(params, key=lambda p: isinstance(p, DTensor))]
        if hp.get("moment_dtype", "fp32") == "bf16":
            from lightning_deepseek.optim import AdamW

            optimizer = AdamW(groups, lr=hp.learning_rate, betas=tuple(hp.betas), moment_dtype=torch.bfloat16)
        else:
            optimizer = torch.optim.AdamW(groups, lr=hp.learning_rate, betas=tuple(hp.betas))
        total = self.trainer.estimated_stepping_batches if self._trainer is not None else 1000
        total = max(int(total), 1) if math.isfinite(total) else 1000

        def lr_lambda(step: int) -> float:
            if step < hp.warmup_steps:
                return (step + 1) / hp.warmup_steps
            progress = min(1.0, (step - hp.warmup_steps) / max(1, total - hp.warmup_steps))
            return hp.min_lr_ratio + (1 - hp.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
