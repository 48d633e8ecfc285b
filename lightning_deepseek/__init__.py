"""lightning-deepseek: DeepSeek-style training efficiency as drop-in PyTorch Lightning components."""

from lightning_deepseek.compression import GradientCompression, register_compression_hook
from lightning_deepseek.data import TextDataModule
from lightning_deepseek.elastic import ElasticTraining
from lightning_deepseek.hpo import OptunaPruning, search
from lightning_deepseek.models import GPT, GPTConfig, LightningGPT
from lightning_deepseek.parallel import HybridParallelStrategy
from lightning_deepseek.precision import StagedPrecision

__all__ = [
    "ElasticTraining", "GPT", "GPTConfig", "GradientCompression", "HybridParallelStrategy", "LightningGPT",
    "OptunaPruning", "StagedPrecision", "TextDataModule", "register_compression_hook", "search",
]
