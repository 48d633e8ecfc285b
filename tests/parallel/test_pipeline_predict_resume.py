"""``trainer.predict`` through a pipeline, the run summary's memory rows under one, and resuming at ``pp=2`` from a
DCP folder written without a pipeline, on real gloo processes.

- 2 ranks: ``ScheduledLM`` (AdamW, two param groups, a cosine schedule) fitted 20 steps without a pipeline, once
  replicated (DDP) and once sharded (FSDP2, ``data_parallel_shard_size=2``), each saving a DCP folder after step 10
  (param_groups by group index); each folder resumed at ``pp=2`` for 10 more steps: losses, final weights and
  learning rates within 1e-6 of the uninterrupted run. Then ``trainer.predict`` on the resumed ``pp=2`` model, the
  last batch smaller than the micro-batch count: the logits on both ranks within 1e-6 of one process with the same
  weights; the strategy's summary rows, ``RunSummary``'s (tokens counted once per global batch) and the memory table
  of its setup: per pipeline rank, against the whole model.
  A module whose one param group joins saved groups of other hyperparameters raises on every rank, naming them.
- 4 ranks (``pp=2 x dp=2``, replicated and FSDP2 stages): predict with Lightning's distributed sampler (each
  replica its share of 10 samples) through a ``BasePredictionWriter`` and the ``pipeline_predict`` hook
  (log-probabilities): every sample written by the two ranks of one pipeline, within 1e-6 of one process; under
  FSDP2, 9 samples (shares of 5 and 4) raise on every rank before the first batch.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import BasePredictionWriter
from torch.distributed.tensor import DTensor

from lightning_deepseek import HybridParallelStrategy
from lightning_deepseek.app.summary import RunSummary
from tests.helpers import run_distributed
from tests.parallel.common import SEQ, LogRecords, full_state, loader, make_trainer, token_data
from tests.parallel.test_pipeline_checkpoint import (
    GLOBAL_BATCH,
    LAYERS,
    STEPS,
    TOL,
    SaveAtStep,
    ScheduledLM,
    _shard,
    _shared_folder,
    check_resumed,
)
from tests.parallel.test_pipeline_strategy import PipelinedLM

pytestmark = pytest.mark.timeout(600)
SAVERS = {"ddp": dict(tensor_parallel_size=1, min_shard_params=0),
          "fsdp": dict(tensor_parallel_size=1, data_parallel_shard_size=2)}
PIPELINE = dict(pipeline_parallel_size=2, pipeline_microbatches=4)


class OneGroupLM(ScheduledLM):
    """ScheduledLM with all parameters in one group: its weight decay differs between the saved groups."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fit(world_size: int, strategy: dict[str, Any], save: Path | None = None, resume: Path | None = None,
         callbacks: list[pl.Callback] = ()) -> tuple[dict[str, Any], pl.Trainer, ScheduledLM]:
    """Fit ScheduledLM for 20 steps, saving after step 10 at ``save``, or from ``resume`` (seeded apart, so that only
    the checkpoint can make the runs agree): the mean loss of each global batch, the full weights, the last rates."""
    if resume is None:
        pl.seed_everything(0, verbose=False)
    else:
        torch.manual_seed(1 + dist.get_rank())
    module = ScheduledLM(n_layer=LAYERS, bias=False)
    trainer = make_trainer(world_size, HybridParallelStrategy(**strategy), max_steps=2 * STEPS,
                           callbacks=[*callbacks, *([SaveAtStep(STEPS, save)] if save is not None else [])],
                           use_distributed_sampler=False)
    pp = strategy.get("pipeline_parallel_size", 1)
    trainer.fit(module, _shard(world_size, pp), ckpt_path=resume)
    losses: list[Any] = [None] * world_size
    dist.all_gather_object(losses, module.losses)
    states: list[Any] = [None] * world_size
    dist.all_gather_object(states, full_state(module))
    return ({"losses": [float(np.mean(step)) for step in zip(*losses[:world_size // pp])],
             "state": {k: v for s in states for k, v in s.items()},
             "lrs": trainer.lr_scheduler_configs[0].scheduler.get_last_lr(),
             "sharded": any(isinstance(p, DTensor) for p in module.parameters())}, trainer, module)


def _memory(trainer: pl.Trainer, module: ScheduledLM) -> dict[str, Any]:
    """The strategy's summary rows, and this rank's parameter and optimizer-state bytes as counted here."""
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    states = sum(t.numel() * t.element_size() for s in trainer.optimizers[0].state.values() for t in s.values())
    return {"rows": trainer.strategy.summary(), "params": params, "states": states}


def _predict(trainer: pl.Trainer, module: pl.LightningModule, samples: int, batch: int) -> dict[str, Any]:
    """``trainer.predict`` through the pipeline with a writer: this rank's predictions and their sample indices."""
    writer = Recorder()
    trainer.callbacks.append(writer)
    returned = trainer.predict(module, loader(token_data(samples, seed=5), batch))
    indices = [i for batch_indices in writer.indices for i in batch_indices]
    return {"returned": torch.cat(returned).numpy(), "written": torch.cat(writer.predictions).numpy(),
            "indices": indices}


class Recorder(BasePredictionWriter):
    """Keeps what Lightning hands a prediction writer at the end of the epoch."""

    def __init__(self) -> None:
        super().__init__(write_interval="epoch")
        self.predictions: list[torch.Tensor] = []
        self.indices: list[list[int]] = []

    def write_on_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, predictions: Any,
                           batch_indices: Any) -> None:
        self.predictions, self.indices = list(predictions), list(batch_indices[0])


class LogProbLM(PipelinedLM):
    """PipelinedLM whose predictions are log-probabilities (the protocol's ``pipeline_predict``)."""

    def pipeline_predict(self, logits: torch.Tensor, batch: Any) -> torch.Tensor:
        return torch.log_softmax(logits, dim=-1)


def _two_ranks(rank: int, world_size: int) -> dict[str, Any]:
    root = _shared_folder()
    records = LogRecords()
    logging.getLogger("lightning.pytorch").addHandler(records)
    try:
        results: dict[str, Any] = {}
        for name, strategy in SAVERS.items():
            results[name] = _fit(world_size, strategy, save=root / name)[0]
            del records.messages[:]
            summary = RunSummary(root / f"summary_{rank}", plot=False)
            results[f"{name}->pp2"], trainer, module = _fit(world_size, PIPELINE, resume=root / name,
                                                            callbacks=[summary])
        results["table"] = next((m for m in records.messages if "memory per rank" in m), None)
        results["memory"] = _memory(trainer, module)
        results["run_summary"] = {"tokens": summary.num_tokens, "report": summary.report}
        results["predict"] = _predict(trainer, module, samples=10, batch=4)  # after fitting: the split is kept
        results["weights"] = results["fsdp->pp2"]["state"]
        try:
            trainer = make_trainer(world_size, HybridParallelStrategy(**PIPELINE), max_steps=2 * STEPS,
                                   use_distributed_sampler=False)
            trainer.fit(OneGroupLM(n_layer=LAYERS, bias=False), _shard(world_size, 2), ckpt_path=root / "ddp")
            results["mixed_groups"] = "no error"
        except ValueError as exc:
            results["mixed_groups"] = str(exc)
        return results
    finally:
        logging.getLogger("lightning.pytorch").removeHandler(records)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(root)


def _four_ranks(rank: int, world_size: int) -> dict[str, Any]:
    """Predict at ``pp=2 x dp=2`` with replicated and with FSDP2 stages; the error of shares of unequal size under
    FSDP2 (9 samples: 5 and 4)."""
    results: dict[str, Any] = {}
    for name, samples in (("replicated", 10), ("fsdp", 10), ("uneven", 9)):
        pl.seed_everything(0, verbose=False)
        strategy = HybridParallelStrategy(pipeline_parallel_size=2, data_parallel_shard_size=1 if name == "replicated"
                                          else 2)
        try:
            results[name] = _predict(make_trainer(world_size, strategy), LogProbLM(n_layer=LAYERS), samples, batch=2)
        except ValueError as exc:
            results[name] = str(exc)
    return results


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_distributed(_two_ranks, 2, timeout=540)


def _reference_logits(state: dict[str, np.ndarray] | None, samples: int) -> np.ndarray:
    """One process: the model's logits on the predicted samples (``state``: these weights, else seed 0's)."""
    pl.seed_everything(0, verbose=False)
    module = PipelinedLM(n_layer=LAYERS, **({"bias": False} if state is not None else {}))
    if state is not None:
        module.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=False)
    module.eval()
    with torch.no_grad():
        return module(token_data(samples, seed=5).tensors[0]).numpy()


@pytest.mark.parametrize("saver", list(SAVERS))
def test_a_folder_written_without_a_pipeline_resumes_at_pp2(two_ranks: list[dict[str, Any]], saver: str) -> None:
    check_resumed(two_ranks[0][saver], two_ranks[0][f"{saver}->pp2"])
    assert two_ranks[0][saver]["sharded"] == (saver == "fsdp")


def test_a_param_group_joining_saved_groups_of_other_hyperparameters_raises_on_every_rank(
        two_ranks: list[dict[str, Any]]) -> None:
    messages = [r["mixed_groups"] for r in two_ranks]
    assert all("are in one param_group of this run, but the checkpoint's groups give them weight_decay=" in m
               for m in messages), messages


def test_predict_through_pp2_returns_the_logits_on_every_rank(two_ranks: list[dict[str, Any]]) -> None:
    reference = _reference_logits(two_ranks[0]["weights"], 10)
    for result in two_ranks:
        predicted = result["predict"]
        assert predicted["indices"] == list(range(10))  # the last batch of 2 runs as 2 micro-batches
        np.testing.assert_allclose(predicted["returned"], reference, rtol=TOL, atol=TOL)
        np.testing.assert_array_equal(predicted["written"], predicted["returned"])


def test_summary_memory_rows_are_per_pipeline_rank(two_ranks: list[dict[str, Any]]) -> None:
    memory = [r["memory"] for r in two_ranks]
    whole = sum(v.nbytes for v in two_ranks[0]["weights"].values())
    assert sum(m["params"] for m in memory) == whole  # each rank holds its stages only
    rows = memory[0]["rows"]
    assert rows == memory[1]["rows"]
    model_state = [2 * m["params"] + m["states"] for m in memory]
    assert rows["hybrid_model_state_bytes_per_pp_rank"] == model_state
    assert rows["hybrid_model_state_bytes"] == max(model_state)
    assert rows["hybrid_optimizer_state_bytes"] == max(m["states"] for m in memory)
    assert rows["hybrid_param_bytes_vs_ddp"] == round(max(m["params"] for m in memory) / whole, 3) < 0.6
    assert rows["hybrid_mesh"] == "pp=2 x dp=1 x tp=1 (pipeline)"
    assert len(rows["peak_memory_bytes_per_pp_rank"]) == 2
    assert rows["peak_memory_bytes"] == max(rows["peak_memory_bytes_per_pp_rank"]) > 0
    table = two_ranks[0]["table"]  # printed at setup: DDP holds the whole model, each pipeline rank its stages
    assert "| DDP | pp rank 0 | pp rank 1 |" in table and "ZeRO-1" not in table
    params_row = next(line for line in table.splitlines() if line.startswith("| parameters |"))
    cells = [cell.split()[0] for cell in params_row.strip("|").split("|")[1:]]
    assert cells == [f"{b / 2**20:.2f}" for b in (whole, memory[0]["params"], memory[1]["params"])]
    # lds-train's RunSummary prints the same rows, and counts each global batch once (both ranks read it)
    report = two_ranks[0]["run_summary"]["report"]
    assert {k: report[k] for k in rows if k not in ("peak_memory_bytes", "peak_memory_bytes_per_pp_rank")} == {
        k: v for k, v in rows.items() if k not in ("peak_memory_bytes", "peak_memory_bytes_per_pp_rank")}
    assert [r["run_summary"]["tokens"] for r in two_ranks] == [STEPS * GLOBAL_BATCH * SEQ] * 2


def test_predict_through_pp2_x_dp2_with_the_distributed_sampler_and_a_writer() -> None:
    results = run_distributed(_four_ranks, 4, timeout=300)
    reference = _reference_logits(None, 10)
    reference = reference - np.log(np.exp(reference).sum(-1, keepdims=True))
    for name in ("replicated", "fsdp"):
        predicted = [r[name] for r in results]
        # pp outermost: ranks 0 and 2 form one pipeline (dp replica 0), ranks 1 and 3 the other
        for first, second in ((0, 2), (1, 3)):
            assert predicted[first]["indices"] == predicted[second]["indices"]
            np.testing.assert_array_equal(predicted[first]["written"], predicted[second]["written"])
        assert sorted(predicted[0]["indices"] + predicted[1]["indices"]) == list(range(10))
        for result in predicted:
            np.testing.assert_array_equal(result["written"], result["returned"])
            np.testing.assert_allclose(result["written"], reference[result["indices"]], rtol=TOL, atol=TOL)
    for result in results:
        assert "the data-parallel replicas got [5, 4] samples, and their FSDP2 stages gather" in result["uneven"]
