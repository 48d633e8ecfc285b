"""8/4-bit data-parallel gradient compression with error feedback: quantizer, DDP comm hook, FSDP2 reduce-scatter,
Lightning callback."""

from lightning_deepseek.compression.callback import CompressionStrategyError, GradientCompression
from lightning_deepseek.compression.config import CompressionConfig
from lightning_deepseek.compression.hook import register_compression_hook
from lightning_deepseek.compression.reduce_scatter import FSDPCompressionState, install_fsdp_compression
from lightning_deepseek.compression.state import CompressionState

__all__ = ["CompressionConfig", "CompressionState", "CompressionStrategyError", "FSDPCompressionState",
           "GradientCompression", "install_fsdp_compression", "register_compression_hook"]
