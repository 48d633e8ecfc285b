"""``ExpertLoadBalancing``: DeepSeek-V3's auxiliary-loss-free load balancing, as a Lightning ``Callback``.

Every MoE layer (found by :mod:`lightning_deepseek.moe.protocol`) has its routed tokens counted by a forward
pre-hook on its experts module (its ``top_k_index`` argument, or the ``num_tokens_per_expert`` of the ``"grouped"``
convention), in training only. After each optimizer step the
counts of all layers and all ranks are summed by ONE all-reduce of an ``(L, E)`` tensor, then each layer's balancing
bias moves by ``update_rate`` against its load: ``bias += update_rate * sign(mean_load - load)`` (overloaded experts
become less likely to be chosen; the bias never enters the routing weights), or with ``rule="proportional"`` by
``update_rate * (mean_load - load) / mean_load``. Every rank applies the same update to
its replica of the bias, so biases stay identical without a broadcast. The bias is a buffer of the model, so it is
checkpointed with the weights; the callback's own state (the load history) travels in its ``state_dict``.

Logged per step: ``moe_load_imbalance_max`` and ``moe_load_imbalance_mean``, the max and mean over layers of
(max over experts of tokens) / (mean tokens per expert); 1.0 is perfect balance. ``summary()`` adds their
averages over the last 100 steps to ``lds-train``'s run summary and ``expert_load.png`` (in the trainer's root
folder) plots them over training.
Layers without a bias (Mixtral, Qwen-MoE in transformers) are counted and logged, never balanced (a warning says
so). Costs: a ``bincount`` per layer and micro-batch, one all-reduce of ``L x E`` floats per step.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_deepseek.moe.protocol import BIAS_NAMES, SEARCHED, ExpertLayer, find_expert_layers


class LoadCounter:
    """Counts the tokens routed to every expert of ``layers`` (training forwards only) into ``counts`` (L, E)."""

    def __init__(self, layers: list[ExpertLayer]) -> None:
        if len({layer.num_experts for layer in layers}) > 1:
            raise ValueError("ExpertLoadBalancing needs the same number of experts in every MoE layer, got "
                             f"{ {layer.name: layer.num_experts for layer in layers} }.")
        self.layers = layers
        self.counts = torch.zeros(len(layers), layers[0].num_experts if layers else 0)
        self._handles: list[RemovableHandle] = [
            layer.experts.register_forward_pre_hook(self._hook(i), with_kwargs=True) for i, layer in enumerate(layers)]

    def _hook(self, i: int) -> Any:
        # Imported here: parallel imports this package (the MoE protocol); a recomputed forward counts no tokens, nor
        # a pipeline stage's shape inference.
        from lightning_deepseek.parallel.activation_checkpointing import is_recomputing
        from lightning_deepseek.parallel.pipeline import is_inferring_shapes

        grouped = self.layers[i].convention == "grouped"
        owner = self.layers[i].experts  # a copy of the module (a pipeline stage's) carries the hook but counts nothing

        def count(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if module is owner and module.training and torch.is_grad_enabled() and not is_recomputing() \
                    and not is_inferring_shapes():
                # top_k: (hidden, top_k_index, weights); grouped: (rows, num_tokens_per_expert), counted already
                index = args[1] if len(args) > 1 else kwargs["num_tokens_per_expert" if grouped else "top_k_index"]
                self.counts = self.counts.to(index.device)
                counts = index if grouped else torch.bincount(index.flatten(), minlength=self.counts.size(1))
                self.counts[i] += counts.to(self.counts)
        return count

    def take(self) -> torch.Tensor:
        """The counts since the last call, then zero."""
        counts, self.counts = self.counts, torch.zeros_like(self.counts)
        return counts

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def follow(self, root: nn.Module) -> None:
        """Count on the experts modules now in ``root`` (a pipeline replaced the model by its stages' copies): the
        layers found keep their rows (matched by name), the others stay in ``counts`` (zero here, summed over the
        ranks holding them) with nothing to update on this rank."""
        found = {layer.name: layer for layer in find_expert_layers(root)}
        held = {id(layer.experts) for layer in found.values()}
        if all(id(layer.experts) in held for layer in self.layers):
            return  # the same modules (sharded or wrapped in place)
        self.remove()
        elsewhere = {"experts": nn.Module(), "bias": None, "router": None}  # not the discarded whole model's
        self.layers = [found.get(layer.name, dataclasses.replace(layer, **elsewhere)) for layer in self.layers]
        self._handles = [layer.experts.register_forward_pre_hook(self._hook(i), with_kwargs=True)
                         for i, layer in enumerate(self.layers) if layer.name in found]


RULES = ("sign", "proportional")


@torch.no_grad()
def update_biases(layers: list[ExpertLayer], counts: torch.Tensor, update_rate: float, rule: str = "sign"
                  ) -> torch.Tensor:
    """Move each layer's bias by ``update_rate`` against its load (``counts`` summed over all ranks); return the
    per-layer imbalance (max / mean load).

    ``rule="sign"`` (DeepSeek-V3): ``bias += update_rate * sign(mean - load)``; ``rule="proportional"``:
    ``bias += update_rate * (mean - load) / mean``, a step as large as the relative error (up to ``E / k - 1``
    for an expert taking every token, small near balance, where the error is sampling noise)."""
    mean = counts.mean(dim=1, keepdim=True)
    safe_mean = mean.clamp(min=1e-9)  # a layer that routed nothing: no division by zero
    step = torch.sign(mean - counts) if rule == "sign" else (mean - counts) / safe_mean
    for layer, delta in zip(layers, step):
        if layer.bias is not None and update_rate:
            layer.bias.add_(delta.to(layer.bias), alpha=update_rate)
    return counts.max(dim=1).values / safe_mean.squeeze(1)


class ExpertLoadBalancing(Callback):
    """Aux-loss-free expert load balancing (DeepSeek-V3) for any model of the MoE protocol.

    Args:
        update_rate: bias step per optimizer step (DeepSeek-V3's gamma: 1e-3); 0 only counts and logs. Once the
            load is balanced every step reacts to the batch's sampling noise, so a larger step makes the per-step
            load worse (docs/moe.md, "Choosing update_rate"); a smaller one lags a fast-moving router.
        rule: ``"sign"`` (DeepSeek-V3): every bias moves by ``update_rate`` against the sign of its load's error;
            ``"proportional"``: by ``update_rate`` times the relative error ``(mean - load) / mean``, so fast while
            the router is far from balance (an early collapse) and slowly near it (sampling noise).
    """

    def __init__(self, update_rate: float = 1e-3, rule: str = "sign") -> None:
        if update_rate < 0:
            raise ValueError(f"ExpertLoadBalancing(update_rate={update_rate}) must be >= 0 (0: log the load only).")
        if rule not in RULES:
            raise ValueError(f"ExpertLoadBalancing(rule={rule!r}) is not a bias update rule; use one of {RULES} "
                             "(docs/moe.md, 'Choosing update_rate').")
        self.update_rate = update_rate
        self.rule = rule
        self.history: list[tuple[int, float, float]] = []  # (step, max, mean imbalance over layers)
        self._counter: LoadCounter | None = None
        self._last_step = -1
        self._root: Path | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._counter is not None:
            return
        layers = find_expert_layers(pl_module)
        if not layers:
            rank_zero_warn(f"ExpertLoadBalancing: the model has no MoE layer ({SEARCHED}); the callback does "
                           "nothing. Remove it, or register your experts with lightning_deepseek.moe.register_experts.")
            return
        unbiased = [layer.name for layer in layers if layer.bias is None]
        if unbiased and self.update_rate:
            rank_zero_warn(f"ExpertLoadBalancing: {len(unbiased)} MoE layers have no balancing bias (a tensor named "
                           f"one of {BIAS_NAMES} near the experts), e.g. {unbiased[0]}: their load is logged, "
                           "not balanced.")
        self._counter = LoadCounter(layers)
        self._root = Path(trainer.default_root_dir)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._counter is not None:  # the strategy's setup may have replaced the model by its pipeline stages
            self._counter.follow(pl_module)
        self._last_step = trainer.global_step  # the bias moves when global_step does: after an optimizer step

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._counter is not None:
            self._counter.remove()
            self._counter = None

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._counter is None or trainer.global_step == self._last_step:
            return  # accumulating: no optimizer step yet
        self._last_step = trainer.global_step
        counts = trainer.strategy.reduce(self._counter.take(), reduce_op="sum")
        imbalance = update_biases(self._counter.layers, counts, self.update_rate, self.rule)
        worst, mean = imbalance.max().item(), imbalance.mean().item()
        self.history.append((trainer.global_step, worst, mean))
        # Private: Lightning's own monitors read it; there is no public "the loggers write this step" predicate.
        if trainer._logger_connector.should_update_logs:
            pl_module.log_dict({"moe_load_imbalance_max": worst, "moe_load_imbalance_mean": mean},
                               on_step=True, on_epoch=False, sync_dist=False)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank == 0 and self.history and self._root is not None:
            plot_load(self.history, self._root / "expert_load.png")

    def summary(self) -> dict[str, object]:
        """The imbalance averaged over the last 100 steps (or all, if fewer), as a run summary row."""
        if not self.history:
            return {}
        last = self.history[-100:]
        return {f"moe_load_imbalance_max_last{len(last)}": round(sum(row[1] for row in last) / len(last), 3),
                f"moe_load_imbalance_mean_last{len(last)}": round(sum(row[2] for row in last) / len(last), 3)}

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"update_rate": self.update_rate, "rule": self.rule, "history": list(self.history)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = [tuple(row) for row in state_dict["history"]]


def plot_load(history: list[tuple[int, float, float]], path: Path) -> None:
    """Draw the imbalance over training (skipped without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    steps, worst, mean = zip(*history)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, worst, label="max over layers")
    ax.plot(steps, mean, label="mean over layers")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("expert load: max / mean")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
