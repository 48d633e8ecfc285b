"""A pipelined run's DCP checkpoint resumes at the same and at other layouts, on real gloo processes.

Each run fits ``ScheduledLM`` (AdamW with two parameter groups, decayed and not, and a cosine LR schedule stepped
every optimizer step; FP32, no biases) for 10 optimizer steps, saves a DCP folder, and a model seeded differently
resumes from it for 10 more. The data is one epoch of 10 global batches of 4 sequences, so the checkpoint falls on
an epoch boundary and every layout sees the same global batches (dealt to other ranks). Checked against 20
uninterrupted steps of the saving layout: the 10 resumed losses (the mean over the ranks' batches) and the final
weights within 1e-6 relative.

- 2 ranks: ``pp=2`` -> ``pp=2`` (the same layout), ``pp=2`` -> unsharded data parallelism (no pipeline); one-file
  checkpoints raise under a pipeline, naming the setting (a folder written without a pipeline resumes under one:
  ``test_pipeline_predict_resume.py``);
- 4 ranks: ``pp=2 x dp=2`` -> ``pp=4``.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Subset

from lightning_deepseek import HybridParallelStrategy
from tests.helpers import run_distributed
from tests.parallel.common import full_state, loader, make_trainer, relative_error, token_data
from tests.parallel.test_pipeline_strategy import PipelinedLM

STEPS, GLOBAL_BATCH, LAYERS, TOL = 10, 8, 4, 1e-6
pytestmark = pytest.mark.timeout(900)


class ScheduledLM(PipelinedLM):
    """PipelinedLM under AdamW with a decayed and a not-decayed group, and a cosine LR schedule per step."""

    def configure_optimizers(self) -> dict[str, Any]:
        decayed = [p for p in self.parameters() if p.dim() >= 2]
        others = [p for p in self.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW([{"params": decayed, "weight_decay": 0.1}, {"params": others,
                                                                               "weight_decay": 0.0}], lr=1e-2)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=2 * STEPS, eta_min=1e-3)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _strategy(pp: int, tp: int = 1) -> HybridParallelStrategy:
    if pp == 1:
        return HybridParallelStrategy(tensor_parallel_size=1, min_shard_params=0)
    return HybridParallelStrategy(pipeline_parallel_size=pp, pipeline_microbatches=4, tensor_parallel_size=tp,
                                  min_shard_params=0)


def _shard(world_size: int, pp: int) -> DataLoader:
    """This rank's share of the one global batch: ranks 0..dp-1 are the data-parallel replicas (pp is the outer
    mesh dimension), the ranks of a pipeline read the same share."""
    dp = world_size // pp
    share = GLOBAL_BATCH // dp
    start = dist.get_rank() % dp * share
    return loader(Subset(token_data(GLOBAL_BATCH), range(start, start + share)), share)


def _fit(world_size: int, pp: int, save: Path | None = None, resume: Path | None = None, tp: int = 1
         ) -> dict[str, Any]:
    """Fit ScheduledLM at ``pp`` (1: no pipeline) and ``tp`` for 20 steps, saving the checkpoint after step 10 at
    ``save``, or from ``resume`` (seeded apart from the saving run, so that only the checkpoint can make them agree).
    The mean loss of each global batch, the full weights and the last learning rates."""
    if resume is None:
        pl.seed_everything(0, verbose=False)
    else:
        torch.manual_seed(1 + dist.get_rank())
    module = ScheduledLM(n_layer=LAYERS, bias=False)
    saving = [SaveAtStep(STEPS, save)] if save is not None else []
    trainer = make_trainer(world_size, _strategy(pp, tp), max_steps=2 * STEPS, callbacks=saving,
                           use_distributed_sampler=False)
    trainer.fit(module, _shard(world_size, pp * tp), ckpt_path=resume)  # a stage's tp ranks read the same share
    losses: list[Any] = [None] * world_size
    dist.all_gather_object(losses, module.losses)
    states: list[Any] = [None] * world_size
    dist.all_gather_object(states, full_state(module))
    replicas = losses[:world_size // pp:tp]
    return {"losses": [float(np.mean(step)) for step in zip(*replicas)],
            "state": {k: v for s in states for k, v in s.items()},
            "lrs": trainer.lr_scheduler_configs[0].scheduler.get_last_lr()}


class SaveAtStep(pl.Callback):
    """Saves the checkpoint at ``path`` once ``step`` optimizer steps are done (at the start of the next epoch: one
    batch per epoch)."""

    def __init__(self, step: int, path: Path) -> None:
        self.step, self.path = step, path

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def _errors(world_size: int, folder: Path) -> dict[str, str]:
    """The message of a one-file checkpoint saved, and resumed, under a pipeline."""
    messages = {}
    file = folder / "one.ckpt"
    if dist.get_rank() == 0:
        torch.save({}, file)
    dist.barrier()
    cases = {"save_file": (HybridParallelStrategy(pipeline_parallel_size=2, save_distributed_checkpoint=False), None),
             "resume_file": (_strategy(2), file)}
    for name, (strategy, ckpt_path) in cases.items():
        try:
            make_trainer(world_size, strategy, max_steps=1).fit(
                ScheduledLM(n_layer=LAYERS), loader(token_data(GLOBAL_BATCH), GLOBAL_BATCH), ckpt_path=ckpt_path)
            messages[name] = "no error"
        except ValueError as exc:
            messages[name] = str(exc)
    return messages


def _shared_folder() -> Path:
    folder = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    return Path(folder[0])


def _two_ranks(rank: int, world_size: int) -> dict[str, Any]:
    root = _shared_folder()
    try:
        results = {"pp2": _fit(world_size, 2, save=root / "pp2.ckpt")}
        results["pp2->pp2"] = _fit(world_size, 2, resume=root / "pp2.ckpt")
        results["pp2->dp"] = _fit(world_size, 1, resume=root / "pp2.ckpt")
        results["errors"] = _errors(world_size, root)
        return results
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(root)


def _four_ranks(rank: int, world_size: int) -> dict[str, Any]:
    root = _shared_folder()
    try:
        return {"pp2xdp2": _fit(world_size, 2, save=root / "pp2xdp2.ckpt"),
                "pp2xdp2->pp4": _fit(world_size, 4, resume=root / "pp2xdp2.ckpt")}
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(root)


@pytest.fixture(scope="module")
def two_ranks() -> dict[str, Any]:
    return run_distributed(_two_ranks, 2, timeout=840)[0]


def check_resumed(uninterrupted: dict[str, Any], resumed: dict[str, Any]) -> None:
    assert len(resumed["losses"]) == STEPS  # the resumed run starts at step 10
    np.testing.assert_allclose(resumed["losses"], uninterrupted["losses"][STEPS:], rtol=TOL)
    assert relative_error(resumed["state"], uninterrupted["state"]) <= TOL
    np.testing.assert_allclose(resumed["lrs"], uninterrupted["lrs"], rtol=TOL)


def test_pp2_resumes_at_pp2(two_ranks: dict[str, Any]) -> None:
    check_resumed(two_ranks["pp2"], two_ranks["pp2->pp2"])


def test_pp2_resumes_without_a_pipeline(two_ranks: dict[str, Any]) -> None:
    check_resumed(two_ranks["pp2"], two_ranks["pp2->dp"])


@pytest.mark.parametrize(("case", "message"), [
    ("save_file", "save_distributed_checkpoint=False with pipeline_parallel_size=2"),
    ("resume_file", "is one file and pipeline_parallel_size=2: a pipeline resumes from a torch.distributed.checkpoint "
                    "folder only"),
])
def test_checkpoints_a_pipeline_cannot_resume_raise(two_ranks: dict[str, Any], case: str, message: str) -> None:
    assert message in two_ranks["errors"][case]


def test_pp2_x_dp2_resumes_at_pp4() -> None:
    result = run_distributed(_four_ranks, 4, timeout=840)[0]
    check_resumed(result["pp2xdp2"], result["pp2xdp2->pp4"])
