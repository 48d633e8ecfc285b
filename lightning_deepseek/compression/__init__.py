"""8/4-bit data-parallel gradient compression with error feedback: quantizer, DDP comm hook, Lightning callback."""

from lightning_deepseek.compression.callback import CompressionStrategyError, GradientCompression
from lightning_deepseek.compression.hook import CompressionConfig, CompressionState, register_compression_hook

__all__ = ["CompressionConfig", "CompressionState", "CompressionStrategyError", "GradientCompression",
           "register_compression_hook"]
