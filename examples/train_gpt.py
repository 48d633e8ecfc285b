"""Train the example GPT from plain Python, no Hydra: the same job as ``lds-train``, in a dozen lines.

    .venv/bin/python examples/train_gpt.py   # 2 CPU processes, 200 steps (or `python ...` in the activated venv)
"""

import lightning.pytorch as pl

from lightning_deepseek.data import TextDataModule
from lightning_deepseek.models import PRESETS, GPTConfig, LightningGPT


def main() -> None:
    pl.seed_everything(1234)
    data = TextDataModule(block_size=64, batch_size=16, cache_dir="outputs/example")
    model = LightningGPT(GPTConfig(**PRESETS["tiny"]), learning_rate=1e-3)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=200, val_check_interval=100,
                         limit_val_batches=10, default_root_dir="outputs/example")
    trainer.fit(model, datamodule=data)


if __name__ == "__main__":
    main()
