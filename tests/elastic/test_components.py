"""Other components' state through ElasticTraining's checkpoints, on 2 real gloo ranks.

- HybridParallelStrategy: the 2-rank job shards the feed-forward layers over ``tp=2``; DCP records global
  shapes, so a single process without sharding resumes from it with exactly the 2-rank job's weights.
- GradientCompression (int8, error feedback, stochastic rounding): a 2-rank DDP job interrupted after a
  checkpoint and resumed must end bitwise equal to an uninterrupted one, which needs every rank's residuals
  and rounding generators back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.tensor import DTensor

from lightning_deepseek import GradientCompression, HybridParallelStrategy
from lightning_deepseek.data import TextDataModule
from lightning_deepseek.elastic import ElasticTraining
from lightning_deepseek.models import GPTConfig, LightningGPT
from tests.elastic.audit import write_corpus
from tests.helpers import run_distributed

GLOBAL_BATCH = 8


def _fit(run_dir: Path, devices: int, strategy: Any, max_steps: int = 3,
         callbacks: tuple[pl.Callback, ...] = ()) -> tuple[LightningGPT, ElasticTraining]:
    pl.seed_everything(0, verbose=False)
    data = TextDataModule(path=str(run_dir / "corpus.txt"), block_size=16, batch_size=2, cache_dir=run_dir)
    model = LightningGPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32), learning_rate=3e-3)
    elastic = ElasticTraining(run_dir / "ckpt", GLOBAL_BATCH, checkpoint_every_n_steps=3)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=max_steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0, callbacks=[*callbacks, elastic])
    trainer.fit(model, datamodule=data)
    return model, elastic


def _numpy_state(model: LightningGPT) -> dict[str, Any]:
    # numpy, not tensors: tensors sent through a multiprocessing queue die with the sending process.
    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    return {k: v.detach().numpy().copy() for k, v in full.items()}


def _compression() -> GradientCompression:
    return GradientCompression(bits=8, warmup_steps=0, min_bucket_numel=0, stochastic_rounding=True)


def _two_ranks(rank: int, world_size: int, run_dir: str) -> dict[str, Any]:
    root = Path(run_dir)
    model, elastic = _fit(root / "tp2", world_size, HybridParallelStrategy(tensor_parallel_size=2, min_shard_params=0))
    tp2 = {"state": _numpy_state(model), "consumed": elastic.consumed_samples,
           "sharded": [k for k, v in model.state_dict().items() if isinstance(v, DTensor)]}
    ddp = lambda: DDPStrategy(process_group_backend="gloo")  # noqa: E731
    uninterrupted, _ = _fit(root / "int8-ref", world_size, ddp(), max_steps=6, callbacks=(_compression(),))
    _fit(root / "int8", world_size, ddp(), max_steps=3, callbacks=(_compression(),))  # stops after checkpoint 3
    compression = _compression()
    resumed, _ = _fit(root / "int8", world_size, ddp(), max_steps=6, callbacks=(compression,))
    int8 = {"reference": _numpy_state(uninterrupted), "resumed": _numpy_state(resumed),
            "residual_steps": compression.hook_state.step}
    return {"tp2": tp2, "int8": int8}


def _resumed_from(run_dir: Path) -> list[int]:
    lines = (run_dir / "ckpt" / "reports.jsonl").read_text().splitlines()
    return [r["from_step"] for r in map(json.loads, lines) if r["event"] == "resumed"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("components")
    for name in ("tp2", "int8-ref", "int8"):
        write_corpus(root / name / "corpus.txt")
    return root, run_distributed(_two_ranks, 2, str(root), timeout=280)[0]


def test_tensor_parallel_checkpoint_resumes_at_world_size_one(two_ranks: tuple[Path, dict[str, Any]]) -> None:
    root, results = two_ranks
    saved = results["tp2"]
    assert any("mlp.fc1" in name for name in saved["sharded"])  # the checkpoint really held shards
    resumed, elastic = _fit(root / "tp2", 1, "auto")
    assert _resumed_from(root / "tp2") == [3]
    assert resumed.trainer.global_step == 3 and elastic.consumed_samples == saved["consumed"] == 3 * GLOBAL_BATCH
    for name, expected in saved["state"].items():
        torch.testing.assert_close(resumed.state_dict()[name], torch.from_numpy(expected), rtol=0, atol=0, msg=name)


def test_gradient_compression_residuals_resume_bitwise(two_ranks: tuple[Path, dict[str, Any]]) -> None:
    root, results = two_ranks
    int8 = results["int8"]
    assert int8["residual_steps"] == 6
    assert _resumed_from(root / "int8") == [3]  # so the equality below is not two runs from scratch
    for name, expected in int8["reference"].items():
        torch.testing.assert_close(torch.from_numpy(int8["resumed"][name]), torch.from_numpy(expected), rtol=0, atol=0,
                                   msg=name)
