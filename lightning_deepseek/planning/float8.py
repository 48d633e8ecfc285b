"""FP8 in a plan (``StepShape(dtype="fp8")``): ``StagedPrecision``'s FP8 stage on the planned model, its GEMMs told
apart from the others.

The planned model's ``nn.Linear`` layers are converted as ``StagedPrecision`` converts them at setup before the
strategy shards (:mod:`lightning_deepseek.precision.float8`: torchao's float8 training, tensorwise scaling, the
same selection: every ``nn.Linear`` but the output head and routers) and their FP8 GEMMs turned on. On the CPU torchao
emulates them, but their operands reach the dispatcher as torchao's float8 tensors: :func:`is_float8` marks the GEMMs
the :class:`~lightning_deepseek.planning.counting.FlopCounter` counts at the cluster's fp8 peak (every other FLOP at
the bf16 peak, under BF16 autocast), and :func:`cast_bytes` the memory traffic of each cast to FP8 (its dynamic scale
reads the high-precision tensor once, the cast reads it again and writes one byte per element).

Costs: torchao's casts and scale reductions add ops to the fake step (and, on tensor-parallel weights, DTensor's
reductions of their amax over ``tp``: counted as the collectives they are). Not modelled: FSDP2's FP8 all-gathers
(torchao's ``enable_fsdp_float8_all_gather``), which the strategy's FSDP path does not use: its gathers stay BF16 or
FP32; the casts' fusion under ``torch.compile``; FP8 tensor-parallel collectives (torchao's ``Float8ColwiseParallel``).
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_deepseek.precision.float8 import Float8Training, set_float8_enabled

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
CAST_READS = 2  # the dynamic scale's amax and the cast each read the high-precision tensor


def convert_float8(module: nn.Module) -> int:
    """Convert ``module``'s selected ``nn.Linear`` layers to torchao's float8 training with FP8 GEMMs on (before
    any sharding, as ``StagedPrecision`` does under FSDP2); return how many. Raises ``Float8ConfigError`` naming the
    install command without torchao."""
    Float8Training("tensorwise").convert(module, "cpu", toggled=True)
    return set_float8_enabled(module, True)


def is_float8(value: object) -> bool:
    """Whether ``value`` is one of torchao's float8 training tensors (an FP8 GEMM's operand)."""
    return isinstance(value, torch.Tensor) and type(value).__name__ == "Float8TrainingTensor"


def cast_bytes(out: object) -> int:
    """Memory traffic of a cast whose output is ``out``, if it is a plain FP8 tensor: the high-precision input read
    :data:`CAST_READS` times (taken as BF16) and one byte written per element; 0 otherwise."""
    if not isinstance(out, torch.Tensor) or is_float8(out) or out.dtype not in FP8_DTYPES:
        return 0
    return out.numel() * (2 * CAST_READS + 1)
