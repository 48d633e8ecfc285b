"""Optimizers: AdamW with BF16 moments (DeepSeek-V3's optimizer-state recipe)."""

from lightning_deepseek.optim.adamw import AdamW, OptimizerConfigError

__all__ = ["AdamW", "OptimizerConfigError"]
