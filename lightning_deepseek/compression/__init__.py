"""8/4-bit data-parallel gradient compression with error feedback: quantizer, DDP comm hook, Lightning callback."""

from lightning_deepseek.compression.callback import CompressionStrategyError, GradientCompression
from lightning_deepseek.compression.config import CompressionConfig
from lightning_deepseek.compression.hook import register_compression_hook
from lightning_deepseek.compression.state import CompressionState

__all__ = ["CompressionConfig", "CompressionState", "CompressionStrategyError", "GradientCompression",
           "register_compression_hook"]
