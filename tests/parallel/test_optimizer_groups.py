"""Optimizer param groups mixing DTensor shards and plain tensors (2 real gloo processes, in the ``two_ranks`` spawn).

torch's multi-tensor (``foreach``) optimizer step, its default on CUDA, fails on such a group. CPU is not one of
torch's foreach default devices, so these scenarios declare it one (``_cuda_foreach_default``): optimizers then
choose their step as on CUDA, and without the strategy's fix fail as on CUDA ("got mixed torch.Tensor and DTensor").

- a mixed group that leaves ``foreach`` unset gets ``foreach=False`` and trains, also when resumed from a DDP
  checkpoint, whose param groups carry their own ``foreach``;
- ``foreach=True`` or ``fused=True`` on a mixed group is a ``MixedParamGroupError`` at setup, on every rank;
- the example ``LightningGPT``'s groups are homogeneous under the strategy, and stepping them with the multi-tensor
  kernels gives the for-loop step's weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.tensor import DTensor
from torch.utils.data import TensorDataset

from lightning_deepseek import HybridParallelStrategy
from lightning_deepseek.models import GPTConfig, LightningGPT
from tests.parallel.common import CONFIG, TinyLM, full_state, loader, make_trainer, relative_error, token_data

MICRO = 2


@contextmanager
def _cuda_foreach_default() -> Iterator[None]:
    """Optimizers left at ``foreach=None`` pick the multi-tensor step on CPU too, as they do on CUDA."""
    import torch.optim.optimizer as optimizer_module

    devices = optimizer_module._get_foreach_kernels_supported_devices()
    with mock.patch.object(optimizer_module, "_get_foreach_kernels_supported_devices", lambda: [*devices, "cpu"]):
        assert optimizer_module._default_to_fused_or_foreach([torch.zeros(1)], differentiable=False) == (False, True)
        yield


class _AdamLM(TinyLM):
    """TinyLM with one AdamW group over all parameters (mixed under the strategy) and the given step settings."""

    def __init__(self, **step_kwargs: Any) -> None:
        super().__init__(lr=1e-2, adam=True)
        self.step_kwargs = step_kwargs

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, **self.step_kwargs)


class _StepGPT(LightningGPT):
    """The example model, its param groups forced to the multi-tensor (True) or for-loop (False) step."""

    def __init__(self, foreach: bool) -> None:
        super().__init__(GPTConfig(**CONFIG), learning_rate=1e-2, warmup_steps=1)
        self.foreach = foreach

    def configure_optimizers(self) -> Any:
        config = super().configure_optimizers()
        for group in config["optimizer"].param_groups:
            group["foreach"] = self.foreach
        return config


class _RecordForeach(pl.Callback):
    """Each param group's ``foreach`` as training starts (after the strategy set up and restored the optimizer)."""

    foreach: list[bool | None] | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.foreach = [group["foreach"] for group in trainer.optimizers[0].param_groups]


def _hybrid() -> HybridParallelStrategy:
    return HybridParallelStrategy(tensor_parallel_size=2, min_shard_params=0)


def _fit(trainer: pl.Trainer, module: pl.LightningModule, dataset: TensorDataset, **kwargs: Any) -> str:
    """``trainer.fit``; ``""``, or its error as ``"Type: message"``: a scenario that fails (on every rank alike)
    fails its own test, not the spawn that every ``two_ranks`` test shares."""
    try:
        trainer.fit(module, loader(dataset, MICRO), **kwargs)
    except Exception as exc:  # noqa: BLE001 - reported to the test of this scenario
        return f"{type(exc).__name__}: {exc}"
    return ""


def _mixed_groups(world_size: int, folder: Path) -> dict[str, Any]:
    """A mixed AdamW group left at ``foreach=None``: 3 steps from scratch, then from a DDP checkpoint."""
    dataset = token_data(6 * world_size * MICRO)
    pl.seed_everything(0, verbose=False)
    module, record = _AdamLM(), _RecordForeach()
    trainer = make_trainer(world_size, _hybrid(), max_steps=3, callbacks=[record])
    error = _fit(trainer, module, dataset)
    fresh = {"error": error, "foreach": record.foreach, "losses": module.losses, "sharded": bool(trainer.strategy.plan)}
    pl.seed_everything(0, verbose=False)
    module = _AdamLM()
    trainer = make_trainer(world_size, DDPStrategy(), max_steps=3)
    trainer.fit(module, loader(dataset, MICRO))
    trainer.save_checkpoint(folder / "adam_ddp.ckpt")
    saved_foreach = trainer.optimizers[0].param_groups[0]["foreach"]
    module, record = _AdamLM(), _RecordForeach()
    trainer = make_trainer(world_size, _hybrid(), max_steps=6, callbacks=[record])
    error = _fit(trainer, module, dataset, ckpt_path=folder / "adam_ddp.ckpt")
    resumed = {"error": error, "saved_foreach": saved_foreach, "foreach": record.foreach, "losses": module.losses}
    return {"fresh": fresh, "resumed": resumed}


def _explicit_settings(world_size: int) -> dict[str, str]:
    """The error of ``foreach=True`` and of ``fused=True`` on a mixed group, as this rank sees it."""
    return {setting: _fit(make_trainer(world_size, _hybrid(), max_steps=1), _AdamLM(**{setting: True}), token_data(8))
            for setting in ("foreach", "fused")}


def _example_groups(world_size: int) -> dict[str, Any]:
    """The example model at tp=2, 4 steps with multi-tensor and with for-loop steps, same seed: groups and weights."""
    dataset = token_data(4 * world_size * MICRO)
    result = {}
    for foreach in (True, False):
        pl.seed_everything(0, verbose=False)
        module, record = _StepGPT(foreach), _RecordForeach()
        trainer = make_trainer(world_size, _hybrid(), max_steps=4, callbacks=[record])
        error = _fit(trainer, module, dataset)
        groups = trainer.optimizers[0].param_groups
        result[foreach] = {"error": error, "foreach": record.foreach, "state": full_state(module),
                           "kinds": [sorted({isinstance(p, DTensor) for p in g["params"]}) for g in groups]}
    return result if dist.get_rank() == 0 else {}


def optimizer_group_scenarios(world_size: int, folder: Path) -> dict[str, Any]:
    """Every scenario of this file, run by ``two_rank_scenarios`` in the ``two_ranks`` spawn."""
    with _cuda_foreach_default():
        explicit: list[Any] = [None] * world_size
        dist.all_gather_object(explicit, _explicit_settings(world_size))
        return {"explicit": explicit, "mixed": _mixed_groups(world_size, folder),
                "example": _example_groups(world_size)}


def test_mixed_group_left_unset_steps_per_parameter_and_trains(two_ranks: dict[str, Any]) -> None:
    fresh = two_ranks["optimizer_groups"]["mixed"]["fresh"]
    assert fresh["error"] == "" and fresh["sharded"] and fresh["foreach"] == [False]
    assert len(fresh["losses"]) == 3 and fresh["losses"][-1] < fresh["losses"][0]


def test_mixed_group_restored_from_a_ddp_checkpoint_steps_per_parameter(two_ranks: dict[str, Any]) -> None:
    resumed = two_ranks["optimizer_groups"]["mixed"]["resumed"]
    # DDP's plain-tensor group kept foreach unset; loading restores it into the strategy's mixed group.
    assert resumed["saved_foreach"] is None
    assert resumed["error"] == "" and resumed["foreach"] == [False] and len(resumed["losses"]) == 3


@pytest.mark.parametrize("setting", ["foreach", "fused"])
def test_explicit_multi_tensor_step_on_a_mixed_group_fails_on_every_rank(two_ranks: dict[str, Any],
                                                                         setting: str) -> None:
    for messages in two_ranks["optimizer_groups"]["explicit"]:
        message = messages[setting]
        assert message.startswith(f"MixedParamGroupError: AdamW (optimizer 0) param group 0 has {setting}=True")
        assert f"Leave {setting} unset" in message and "isinstance(p, torch.distributed.tensor.DTensor)" in message


def test_example_groups_are_homogeneous_and_multi_tensor_step_matches_for_loop(two_ranks: dict[str, Any]) -> None:
    result = two_ranks["optimizer_groups"]["example"]
    multi_tensor, for_loop = result[True], result[False]
    assert multi_tensor["error"] == for_loop["error"] == ""
    assert [True] in multi_tensor["kinds"] and all(len(kinds) == 1 for kinds in multi_tensor["kinds"])
    assert set(multi_tensor["foreach"]) == {True}  # homogeneous groups are left as they are
    # Same gradients, the same AdamW arithmetic in other kernels: torch does not promise the two agree to the last
    # bit (they do on this CPU, 0.0 after 4 steps), so a tolerance of float32 rounding, not of a different update.
    assert relative_error(multi_tensor["state"], for_loop["state"]) <= 1e-6
