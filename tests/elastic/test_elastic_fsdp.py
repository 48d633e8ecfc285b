"""ElasticTraining with sharded parameters (FSDP2) on real gloo processes: a job stopped by SIGTERM after step 4
resumes from its DCP checkpoint at another world size and shard size, and goes on as if never stopped.

- FSDP-2 on 2 ranks, stopped after step 4, resumed on 4 ranks with ``data_parallel_shard_size=4``;
- FSDP-4 on 4 ranks, stopped after step 4, resumed on 2 ranks with ``data_parallel_shard_size=2``.

ElasticTraining keeps the global batch (8: micro-batches of 2, accumulating 2 at 2 ranks, 1 at 4) and its sampler
gives every step the same samples at any world size, so each step's mean loss over the global batch is the same
computation as in the uninterrupted FSDP-2 run of 8 steps, summed in another order: within 1e-5 (relative) at every
step, and the final weights within 1e-5 (measured: 1e-7 to 5e-7); the stopped run's own steps equal the
reference's bitwise at the same world size. Each rank holds 1/shard of the parameters before and after the resize.

With ``StagedPrecision`` (FP32 for 2 steps, then BF16), stopped mid-BF16 at 2 ranks and resumed at 4: the resumed
run's FSDP all-gathers BF16 weights from its first step (the stage comes back with the checkpoint, the policy with
the stage), and its losses and final weights are within the same 1e-5 of the uninterrupted staged run (measured:
bitwise equal here).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_deepseek import HybridParallelStrategy, StagedPrecision
from lightning_deepseek.data import TextDataModule
from lightning_deepseek.elastic import ElasticTraining
from lightning_deepseek.models import GPTConfig, LightningGPT
from tests.elastic.audit import write_corpus
from tests.helpers import run_distributed
from tests.parallel.common import full_state, make_trainer, relative_error

STEPS, STOP, GLOBAL_BATCH, TOL = 8, 4, 8, 1e-5
SCHEDULE = [("32-true", 2), ("bf16-mixed",)]


class RecordingGPT(LightningGPT):
    """Keeps ``(optimizer step, loss)`` of every micro-batch it trains."""

    def __init__(self) -> None:
        super().__init__(GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32), learning_rate=3e-3)
        self.step_losses: list[tuple[int, float]] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.step_losses.append((self.trainer.global_step, loss.item()))
        return loss


class SignalAfter(pl.Callback):
    """Flags a SIGTERM after optimizer step ``step`` on every rank: ElasticTraining checkpoints it and stops."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == self.step:
            next(c for c in trainer.callbacks if isinstance(c, ElasticTraining))._sigterm = True


def _run(world_size: int, run_dir: Path, shard: int, stop: int | None = None, staged: bool = False) -> dict[str, Any]:
    """Train (or resume) the FSDP job of ``run_dir`` to ``STEPS``, or until the stop after step ``stop``; return
    each step's mean loss over the global batch (the steps this launch trained), the fraction of the parameters
    this rank holds, the full weights and the dtype of the weights each step's forward saw."""
    if dist.get_rank() == 0 and not (run_dir / "corpus.txt").exists():
        write_corpus(run_dir / "corpus.txt")
    dist.barrier()
    pl.seed_everything(0, verbose=False)
    data = TextDataModule(path=str(run_dir / "corpus.txt"), block_size=16, batch_size=2, cache_dir=run_dir)
    model = RecordingGPT()
    gathered: dict[int, str] = {}
    model.model.blocks[0].mlp.fc1.register_forward_pre_hook(
        lambda fc1, args: gathered.setdefault(model.trainer.global_step + 1, str(fc1.weight.dtype)) and None)
    callbacks: list[pl.Callback] = [SignalAfter(stop)] if stop is not None else []  # before ElasticTraining looks
    callbacks.append(ElasticTraining(run_dir / "ckpt", GLOBAL_BATCH, checkpoint_every_n_steps=100, async_save=False))
    strategy = HybridParallelStrategy(tensor_parallel_size=1, data_parallel_shard_size=shard)
    plugins = [StagedPrecision(SCHEDULE)] if staged else None
    trainer = make_trainer(world_size, strategy, max_steps=STEPS, callbacks=callbacks, limit_val_batches=0,
                           plugins=plugins)
    try:
        trainer.fit(model, datamodule=data)
    except SystemExit as stop_for_resize:  # ElasticStop: the checkpoint of step `stop` is written
        assert stop_for_resize.code == 75
    per_rank: list[Any] = [None] * world_size
    dist.all_gather_object(per_rank, model.step_losses)
    by_step: dict[int, list[float]] = {}
    for step, loss in (entry for rank in per_rank for entry in rank):
        by_step.setdefault(step + 1, []).append(loss)
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
    return {"losses": {step: sum(losses) / len(losses) for step, losses in sorted(by_step.items())},
            "local_fraction": local / sum(p.numel() for p in model.parameters()), "state": full_state(model),
            "gathered": gathered}


def _resumes(run_dir: Path) -> list[tuple[int, int]]:
    records = map(json.loads, (run_dir / "ckpt" / "reports.jsonl").read_text().splitlines())
    return [(r["from_step"], r["from_world_size"]) for r in records if r["event"] == "resumed"]


def _first_launch(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    root = Path(folder)
    return {"reference": _run(world_size, root / "reference", shard=2),
            "grow": _run(world_size, root / "grow", shard=2, stop=STOP),
            "staged_reference": _run(world_size, root / "staged_reference", shard=2, staged=True),
            "staged": _run(world_size, root / "staged", shard=2, stop=STOP, staged=True)}


def _second_launch(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    root = Path(folder)
    return {"grow": _run(world_size, root / "grow", shard=4), "shrink": _run(world_size, root / "shrink", shard=4,
                                                                               stop=STOP),
            "staged": _run(world_size, root / "staged", shard=4, staged=True)}


def _third_launch(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    return {"shrink": _run(world_size, Path(folder) / "shrink", shard=2)}


@pytest.fixture(scope="module")
def launches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = str(tmp_path_factory.mktemp("elastic_fsdp"))
    first = run_distributed(_first_launch, 2, folder, timeout=240)[0]
    second = run_distributed(_second_launch, 4, folder, timeout=280)[0]
    third = run_distributed(_third_launch, 2, folder, timeout=240)[0]
    return {"reference": first["reference"], "grow": (first["grow"], second["grow"]),
            "staged_reference": first["staged_reference"], "staged": (first["staged"], second["staged"]),
            "shrink": (second["shrink"], third["shrink"]), "folder": Path(folder)}


def _assert_continues(stopped: dict[str, Any], resumed: dict[str, Any], reference: dict[str, Any],
                      shards: tuple[int, int]) -> None:
    assert [stopped["local_fraction"], resumed["local_fraction"]] == pytest.approx([1 / s for s in shards], abs=0.01)
    assert sorted(stopped["losses"]) == list(range(1, STOP + 1))
    assert sorted(resumed["losses"]) == list(range(STOP + 1, STEPS + 1))
    for step, loss in {**stopped["losses"], **resumed["losses"]}.items():
        want = reference["losses"][step]
        assert abs(loss - want) <= TOL * abs(want), (step, loss, want)
    assert relative_error(resumed["state"], reference["state"]) <= TOL


def test_fsdp_job_grows_from_two_to_four_ranks(launches: dict[str, Any]) -> None:
    stopped, resumed = launches["grow"]
    reference = launches["reference"]
    assert stopped["losses"] == {step: reference["losses"][step] for step in range(1, STOP + 1)}  # same layout
    _assert_continues(stopped, resumed, reference, shards=(2, 4))
    assert _resumes(launches["folder"] / "grow") == [(STOP, 2)]


def test_fsdp_job_shrinks_from_four_to_two_ranks(launches: dict[str, Any]) -> None:
    _assert_continues(*launches["shrink"], launches["reference"], shards=(4, 2))
    assert _resumes(launches["folder"] / "shrink") == [(STOP, 4)]


def test_staged_fsdp_job_resumed_mid_bf16_gathers_bf16_from_its_first_step(launches: dict[str, Any]) -> None:
    stopped, resumed = launches["staged"]
    reference = launches["staged_reference"]
    assert reference["gathered"] == {s: "torch.float32" if s <= 2 else "torch.bfloat16" for s in range(1, STEPS + 1)}
    assert stopped["gathered"] == {s: reference["gathered"][s] for s in range(1, STOP + 1)}
    assert resumed["gathered"] == {s: "torch.bfloat16" for s in range(STOP + 1, STEPS + 1)}
    assert stopped["losses"] == {step: reference["losses"][step] for step in range(1, STOP + 1)}
    _assert_continues(stopped, resumed, reference, shards=(2, 4))
    assert _resumes(launches["folder"] / "staged") == [(STOP, 2)]
