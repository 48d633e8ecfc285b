"""``CompressionConfig``: the settings of the compressed exchange, validated once, in one place.

``GradientCompression`` and ``register_compression_hook`` both take these fields as keyword arguments (or a
``CompressionConfig``); their defaults and their documentation live only here.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from lightning_deepseek.compression.quantize import validate


@dataclass(frozen=True)
class CompressionConfig:
    """Settings of the compressed exchange.

    Args:
        bits: 8 (int8, ~0.25x the bytes of fp32) or 4 (int4 packed two per byte, ~0.13x). ``"auto"`` (the
            ``GradientCompression`` callback only): fp32, 8 or 4, decided at fit start by timing a copy of the
            model's training step with each (:mod:`lightning_deepseek.autotune`): compressed only where it is faster
            by the margin. Needs 2 or more data-parallel ranks (one is an error).
        block_size: values sharing one bfloat16 scale; even, 16..4096 (64-256 usual).
        error_feedback: add each step's quantization residual to the next step's gradient (keeps training
            unbiased).
        warmup_steps: synchronising steps exchanged uncompressed (fp32) before compression starts.
        min_bucket_numel: DDP buckets smaller than this, or holding only 1-D parameters (biases, norms), stay fp32.
        stochastic_rounding: unbiased stochastic rounding instead of round-to-nearest.
        overlap: if False the hook waits for each bucket's exchange before returning (no overlap; for
            measurements only).
        seed: seed of the stochastic-rounding generators (offset by the global rank).
        hold_writes: on CPU, hold each bucket's final write until the step's last bucket is on the wire
            (``CompressionState.hold``); False only to measure what holding buys. Same numbers either way.
        single_exchange_max_world: up to this data-parallel world size the exchange is one all-gather of whole
            quantized buckets, above it the two-phase exchange (``hook.py``); 0 forces the two-phase exchange
            (tests of it on one or two ranks).
    """

    bits: int | Literal["auto"] = 8
    block_size: int = 128
    error_feedback: bool = True
    warmup_steps: int = 10
    min_bucket_numel: int = 4096
    stochastic_rounding: bool = False
    overlap: bool = True
    seed: int = 0
    hold_writes: bool = True
    single_exchange_max_world: int = 2

    def __post_init__(self) -> None:
        validate(8 if self.bits == "auto" else self.bits, self.block_size)
        for name in ("warmup_steps", "min_bucket_numel", "single_exchange_max_world"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"compression {name}={value!r} must be a non-negative integer.")

    @classmethod
    def from_settings(cls, owner: str, config: CompressionConfig | None, settings: dict[str, object],
                      ) -> CompressionConfig:
        """``config``, or one built from keyword ``settings``; ``owner`` names the caller in errors."""
        if config is not None and settings:
            raise ValueError(f"{owner}: pass either `config=` or keyword settings ({', '.join(settings)}), not both.")
        if config is not None:
            if not isinstance(config, CompressionConfig):
                raise TypeError(f"{owner}: config={config!r} is not a CompressionConfig. Pass settings by keyword "
                                "(bits=4, block_size=64) or config=CompressionConfig(...).")
            return config
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise TypeError(f"{owner} got unknown setting(s) {', '.join(unknown)}; the settings are "
                            f"{', '.join(sorted(known))} (see CompressionConfig).")
        return cls(**settings)  # type: ignore[arg-type]

    def check_decided(self, owner: str) -> None:
        """Raise where ``bits`` is still ``"auto"``: only the ``GradientCompression`` callback decides it."""
        if self.bits == "auto":
            raise ValueError(f"{owner}: bits='auto' is decided by the GradientCompression callback at fit start "
                             "(it measures the model and the links). Pass bits=8 or bits=4 here, or use "
                             "GradientCompression(bits='auto').")
