from lightning_deepseek.models.gpt import GPT, PRESETS, GPTConfig
from lightning_deepseek.models.lightning_gpt import LightningGPT

__all__ = ["GPT", "GPTConfig", "LightningGPT", "PRESETS"]
