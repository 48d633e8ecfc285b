"""DCP folders count as complete only with ``meta.pt``, written last and atomically (one process, no group:
torch DCP then saves without collectives)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_deepseek.parallel import checkpoint


def _checkpoint(value: float) -> dict:
    return {"state_dict": {"w": torch.full((4,), value)}, "optimizer_states": [], "epoch": int(value)}


def test_save_writes_meta_last_and_leaves_nothing_aside(tmp_path: Path) -> None:
    folder = tmp_path / "last.ckpt"
    checkpoint.save_distributed(_checkpoint(1.0), folder, is_rank_zero=True, barrier=lambda: None)
    assert checkpoint.is_distributed_checkpoint(folder)
    assert torch.load(folder / "meta.pt", weights_only=False) == {"epoch": 1}
    assert not list(folder.glob(".*partial"))


def test_a_save_killed_half_way_leaves_a_folder_that_is_refused(tmp_path: Path, monkeypatch) -> None:
    folder = tmp_path / "last.ckpt"
    checkpoint.save_distributed(_checkpoint(1.0), folder, is_rank_zero=True, barrier=lambda: None)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed while writing shards")

    monkeypatch.setattr("torch.distributed.checkpoint.save", killed)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_distributed(_checkpoint(2.0), folder, is_rank_zero=True, barrier=lambda: None)
    assert not checkpoint.is_distributed_checkpoint(folder)  # never the old meta.pt beside half-new shards
