"""lightning-deepseek: DeepSeek-style training efficiency as drop-in PyTorch Lightning components."""

from lightning_deepseek.compression import GradientCompression, register_compression_hook
from lightning_deepseek.data import TextDataModule
from lightning_deepseek.models import GPT, GPTConfig, LightningGPT
from lightning_deepseek.precision import StagedPrecision

__all__ = ["GPT", "GPTConfig", "GradientCompression", "LightningGPT", "StagedPrecision", "TextDataModule",
           "register_compression_hook"]
