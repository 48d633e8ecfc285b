"""Shared pieces of the hybrid-parallel tests: a tiny GPT LightningModule, fixed token data, a Trainer factory,
the single-process reference on the global batch, and gathering full weights out of DTensor shards."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_deepseek.models import GPT, GPTConfig

CONFIG = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, mlp_ratio=4)
SEQ = 16


class LogRecords(logging.Handler):
    """Keeps the messages of the INFO-and-above records logged to the loggers it is added to."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class TinyLM(pl.LightningModule):
    """GPT next-token loss with a constant-rate optimizer: the reference loop reproduces it in a few lines.

    Parity runs use SGD with momentum: the attention key bias has an exactly-zero gradient (softmax ignores a
    constant shift), and Adam would blow its rounding noise up to lr-sized steps, in any two runs alike.
    """

    def __init__(self, lr: float = 0.05, adam: bool = False, **config: Any) -> None:
        super().__init__()
        self.model = GPT(GPTConfig(**{**CONFIG, **config}))
        self.lr = lr
        self.adam = adam
        self.losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return lm_loss(self.model, batch)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(outputs["loss"].item())

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.validated_in_inference_mode = torch.is_inference_mode_enabled()
        self.log("val_loss", lm_loss(self.model, batch), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.adam:
            return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, weight_decay=1e-3)


def lm_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def token_data(num_sequences: int, seed: int = 7) -> TensorDataset:
    """Sequences of a fixed affine recurrence from random starts: learnable within a few steps."""
    gen = torch.Generator().manual_seed(seed)
    vocab = CONFIG["vocab_size"]
    tokens = torch.empty(num_sequences, SEQ + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (num_sequences,), generator=gen)
    for t in range(SEQ):
        tokens[:, t + 1] = (5 * tokens[:, t] + 3) % vocab
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def loader(dataset: TensorDataset, batch_size: int) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, shuffle=False)


def make_trainer(world_size: int, strategy: pl.strategies.Strategy, **kwargs: Any) -> pl.Trainer:
    defaults = dict(accelerator="cpu", devices=world_size, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    return pl.Trainer(strategy=strategy, **{**defaults, **kwargs})


def full_state(module: torch.nn.Module) -> dict[str, np.ndarray]:
    """Full parameter values (DTensor shards gathered); collective when the module is sharded."""
    state = {}
    for name, param in module.named_parameters():
        value = param.full_tensor() if isinstance(param, DTensor) else param
        state[name] = value.detach().numpy().copy()  # numpy: pickled by value across processes
    return state


def reference_run(steps: int, global_batch: int, dataset: TensorDataset, clip: float | None = None,
                  accumulate: int = 1, lr: float = 0.05,
                  after_step: Callable[[TinyLM], Callable[[], None]] | None = None,
                  **config: Any) -> tuple[list[float], dict[str, np.ndarray]]:
    """One process on the global batch (``global_batch`` = world size x micro-batch, ``accumulate`` of them per
    optimizer step): the loss of every global micro-batch and the final weights. ``after_step(module)``, called
    once before training, returns what runs after every optimizer step (e.g. a balancing bias update); ``config``
    goes to the model."""
    pl.seed_everything(0, verbose=False)
    module = TinyLM(lr=lr, **config)
    optimizer = module.configure_optimizers()
    step_done = after_step(module) if after_step is not None else lambda: None
    losses = []
    for step in range(steps):
        for k in range(accumulate):
            x, y = dataset[global_indices(step * accumulate + k, global_batch, len(dataset))]
            loss = lm_loss(module.model, (x, y))
            (loss / accumulate).backward()
            losses.append(loss.item())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        step_done()
    return losses, full_state(module)


def global_indices(batch: int, global_batch: int, num_samples: int) -> torch.Tensor:
    """Sample indices of global micro-batch ``batch``: Lightning shuffles training data through
    ``DistributedSampler(seed=0)``, whose epoch ``e`` permutation is ``randperm`` seeded with ``e``."""
    start = batch * global_batch
    epoch, offset = divmod(start, num_samples)
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(epoch))
    return order[offset:offset + global_batch]


def max_relative_error(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    """The largest ``|a - b| / |b|`` (Frobenius norms) over the parameters."""
    assert a.keys() == b.keys()
    return max(float(np.linalg.norm(a[k] - b[k]) / max(np.linalg.norm(b[k]), 1e-12)) for k in a)


def relative_error(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    """``|a - b| / |b|`` of all parameters as one vector (the per-tensor figure of a near-zero bias is rounding
    noise over a tiny norm after a few chaotic steps, not a measure of the model)."""
    assert a.keys() == b.keys()
    diff = np.sqrt(sum(float(np.sum((a[k] - b[k]) ** 2)) for k in a))
    return diff / np.sqrt(sum(float(np.sum(b[k] ** 2)) for k in b))
