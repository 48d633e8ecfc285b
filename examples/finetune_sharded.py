"""Fine-tune a model from local ``safetensors`` weights that need not fit on one rank, and export the result.

The pattern (the model here is a tiny Llama so that it runs in seconds on 2 CPU processes; the steps are the same
for a model many times one device's memory):

1. build the model on the meta device (``trainer.init_module(empty_init=True)``): no rank allocates it;
2. ``HybridParallelStrategy(data_parallel_shard_size=2)`` shards it with FSDP2 and each rank materialises only
   its shards;
3. ``load_pretrained`` in ``on_fit_start`` reads, on each rank, only the slices of the files its shards hold
   (when resuming, Lightning restores the checkpoint right after ``on_fit_start``: its weights win);
4. after training, ``export_safetensors`` gathers the weights to rank 0, which writes a folder that
   ``AutoModelForCausalLM.from_pretrained`` loads.

Run: ``.venv/bin/python examples/finetune_sharded.py [--weights DIR] [--out DIR]`` (2 CPU processes, well under a
minute). Where the weights folder (default ``pretrained/``) does not exist, it first writes a randomly initialised
tiny Llama there as the "pretrained" model (nothing is downloaded).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from lightning_deepseek import HybridParallelStrategy
from lightning_deepseek.parallel.pretrained import export_safetensors, load_pretrained

VOCAB, SEQ = 64, 16


class FineTune(pl.LightningModule):
    def __init__(self, weights: str) -> None:
        super().__init__()
        self.weights = weights

    def configure_model(self) -> None:
        if not hasattr(self, "model"):  # the architecture from the folder's config; the weights come later
            self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.weights))

    def on_fit_start(self) -> None:
        load_pretrained(self.model, self.weights)

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        loss = self.model(input_ids=tokens, labels=tokens).loss
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def write_tiny_llama(folder: Path) -> None:
    """A stand-in for downloaded weights: a random tiny Llama saved as ``save_pretrained`` does."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    LlamaForCausalLM(config).save_pretrained(folder)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--weights", default="pretrained", help="a local folder written by save_pretrained")
    parser.add_argument("--out", default="finetuned", help="where the fine-tuned safetensors go")
    args = parser.parse_args()
    weights = Path(args.weights)
    if not weights.is_dir():  # the launching process, before the second process starts (in fit)
        write_tiny_llama(weights)

    pl.seed_everything(0)
    starts = torch.randint(0, VOCAB, (256, 1))
    data = DataLoader(TensorDataset((starts + 3 * torch.arange(SEQ)) % VOCAB), batch_size=8)
    strategy = HybridParallelStrategy(data_parallel_shard_size=2, tensor_parallel_size=1)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=20, logger=False,
                         enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False)
    module = FineTune(str(weights))
    with trainer.init_module(empty_init=True):
        module.configure_model()  # on the meta device
    trainer.fit(module, data)

    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in module.model.parameters())
    total = sum(p.numel() for p in module.model.parameters())
    export_safetensors(module.model, args.out)  # every rank calls it; rank 0 writes
    if trainer.is_global_zero:
        print(f"parameters on this rank: {local} of {total}")
        exported = AutoModelForCausalLM.from_pretrained(args.out)
        tokens = data.dataset.tensors[0][:8]
        with torch.no_grad():
            loss = exported(input_ids=tokens, labels=tokens).loss
        print(f"exported model: {type(exported).__name__}, loss {loss:.4f} "
              f"(last training loss {trainer.callback_metrics['train_loss']:.4f})")


if __name__ == "__main__":
    main()
