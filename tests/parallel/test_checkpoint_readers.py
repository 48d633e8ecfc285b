"""The default checkpoint (a DCP folder written at ``tp=2``) is read by ``lds-sample`` as it is, and by
``load_from_checkpoint`` after the two-step conversion that docs/hybrid.md gives: both see exactly the trained
weights. The folder is written by the ``two_ranks`` fixture; the readers run here, in one process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lightning_deepseek import HybridParallelStrategy
from lightning_deepseek.models import GPTConfig, LightningGPT
from tests.parallel.common import CONFIG, full_state, loader, make_trainer, max_relative_error, token_data


def write_gpt_folder(world_size: int, folder: Path) -> dict[str, Any]:
    """Two steps of ``LightningGPT`` at tp=2 (run on 2 ranks by the ``two_ranks`` fixture), saved as a DCP folder."""
    pl.seed_everything(0, verbose=False)
    module = LightningGPT(GPTConfig(**CONFIG), warmup_steps=0)
    strategy = HybridParallelStrategy(tensor_parallel_size=2, min_shard_params=0)
    trainer = make_trainer(world_size, strategy, max_steps=2)
    trainer.fit(module, loader(token_data(8 * world_size), 2))
    trainer.save_checkpoint(folder)
    state = full_state(module)
    if dist.get_rank() != 0:
        return {}
    return {"folder": str(folder), "state": state, "sharded": bool(strategy.plan)}


def test_lds_sample_reads_the_dcp_folder(two_ranks: dict[str, Any]) -> None:
    from lightning_deepseek.app.sampling import load_model

    result = two_ranks["gpt_folder"]
    folder = Path(result["folder"])
    assert result["sharded"] and folder.is_dir()
    model = load_model(folder)  # what lds-sample ckpt=<folder> calls
    assert max_relative_error(full_state(model), result["state"]) == 0.0
    out = model.eval().model.generate(torch.tensor([[1, 2, 3]]), 4, temperature=1.0, top_k=None)
    assert out.shape == (1, 7)


def test_documented_conversion_feeds_load_from_checkpoint(two_ranks: dict[str, Any], tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = Path(two_ranks["gpt_folder"]["folder"])
    # docs/hybrid.md, "Limits": weights and optimizer states from the shards, the rest from meta.pt.
    dcp_to_torch_save(folder, tmp_path / "full.ckpt")
    checkpoint = torch.load(tmp_path / "full.ckpt", weights_only=False)
    checkpoint.update(torch.load(folder / "meta.pt", weights_only=False))
    torch.save(checkpoint, tmp_path / "full.ckpt")
    model = LightningGPT.load_from_checkpoint(tmp_path / "full.ckpt", map_location="cpu")
    assert max_relative_error(full_state(model), two_ranks["gpt_folder"]["state"]) == 0.0
