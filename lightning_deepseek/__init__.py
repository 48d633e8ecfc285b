"""lightning-deepseek: DeepSeek-style training efficiency as drop-in PyTorch Lightning components."""

from lightning_deepseek.data import TextDataModule
from lightning_deepseek.models import GPT, GPTConfig, LightningGPT

__all__ = ["GPT", "GPTConfig", "LightningGPT", "TextDataModule"]
