"""``lds-sample``'s work after its settings are checked (``cli.run_sampling``): load a checkpoint, generate text.
Importing this module imports torch and Lightning."""

from __future__ import annotations

from pathlib import Path

import torch

from lightning_deepseek.models import LightningGPT


def load_model(path: Path) -> LightningGPT:
    """``LightningGPT`` from a checkpoint file, or from a sharded DCP folder (``strategy=hybrid``)."""
    if not path.is_dir():
        return LightningGPT.load_from_checkpoint(path, map_location="cpu")
    from lightning.fabric.utilities.load import _load_distributed_checkpoint

    checkpoint = _load_distributed_checkpoint(path)  # gathers the shards into full tensors on CPU
    model = LightningGPT(**checkpoint["hyper_parameters"])
    model.load_state_dict(checkpoint["state_dict"])
    return model


def generate(path: Path, prompt: str, max_new_tokens: int, temperature: float, top_k: int | None, seed: int) -> str:
    """Text that the model at ``path`` writes after ``prompt`` (byte-level; an empty prompt starts at a newline)."""
    torch.manual_seed(seed)
    model = load_model(path).eval()
    idx = torch.tensor([list(prompt.encode("utf-8") or b"\n")], dtype=torch.long)
    out = model.model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k)
    return bytes(out[0].tolist()).decode("utf-8", errors="replace")
