"""A HybridParallelStrategy (tensor-parallel, DTensor) checkpoint of 2 ranks resumes in 1 process.

The 2-rank job shards the feed-forward layers over ``tp=2``; ElasticTraining saves them with DCP, which
records global shapes. A single process without any sharding then resumes from it: DCP reassembles the
shards, and the weights, step and data position must be exactly those of the 2-rank job.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.distributed.tensor import DTensor

from lightning_deepseek import GPTConfig, HybridParallelStrategy, LightningGPT, TextDataModule
from lightning_deepseek.data import read_corpus
from lightning_deepseek.elastic import ElasticTraining
from tests.helpers import run_distributed

GLOBAL_BATCH = 8


def _fit(run_dir: Path, devices: int, strategy: Any) -> tuple[LightningGPT, ElasticTraining]:
    pl.seed_everything(0, verbose=False)
    data = TextDataModule(path=str(run_dir / "corpus.txt"), block_size=16, batch_size=2, cache_dir=run_dir)
    model = LightningGPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32), learning_rate=3e-3)
    elastic = ElasticTraining(run_dir / "ckpt", GLOBAL_BATCH, checkpoint_every_n_steps=3)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, num_sanity_val_steps=0, callbacks=[elastic])
    trainer.fit(model, datamodule=data)
    return model, elastic


def _two_ranks_tp2(rank: int, world_size: int, run_dir: str) -> dict[str, Any]:
    model, elastic = _fit(Path(run_dir), world_size, HybridParallelStrategy(tensor_parallel_size=2, min_shard_params=0))
    # numpy, not tensors: tensors sent through a multiprocessing queue die with the sending process.
    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    state = {k: v.detach().numpy().copy() for k, v in full.items()}
    sharded = [k for k, v in model.state_dict().items() if isinstance(v, DTensor)]
    return {"state": state, "sharded": sharded, "consumed": elastic.consumed_samples}


def test_tensor_parallel_checkpoint_resumes_at_world_size_one(tmp_path: Path) -> None:
    (tmp_path / "corpus.txt").write_bytes(read_corpus(None)[:1139])
    saved = run_distributed(_two_ranks_tp2, 2, str(tmp_path), timeout=240)[0]
    assert any("mlp.fc1" in name for name in saved["sharded"])  # the checkpoint really held shards
    resumed, elastic = _fit(tmp_path, 1, "auto")
    assert resumed.trainer.global_step == 3 and elastic.consumed_samples == saved["consumed"] == 3 * GLOBAL_BATCH
    for name, expected in saved["state"].items():
        torch.testing.assert_close(resumed.state_dict()[name], torch.from_numpy(expected), rtol=0, atol=0, msg=name)
