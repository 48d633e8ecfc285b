"""lightning-deepseek: DeepSeek-style training efficiency as drop-in PyTorch Lightning components."""

from lightning_deepseek.data import TextDataModule
from lightning_deepseek.models import GPT, GPTConfig, LightningGPT
from lightning_deepseek.precision import StagedPrecision

__all__ = ["GPT", "GPTConfig", "LightningGPT", "StagedPrecision", "TextDataModule"]
