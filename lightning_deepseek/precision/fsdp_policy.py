"""FSDP2's mixed-precision policy set from a precision stage, on modules that are already sharded.

``StagedPrecision`` changes the compute precision mid-run. Autocast alone would leave FSDP all-gathering FP32
parameters and reduce-scattering FP32 gradients in every stage; with a stage's policy the parameters are
all-gathered in the stage's dtype (half the bytes of FP32, and the forward and backward run on those copies) and
the gradients, computed in that dtype, are cast to ``reduce_dtype`` (FP32 by default) just before the
reduce-scatter, as ``fully_shard(mp_policy=MixedPrecisionPolicy(param_dtype, reduce_dtype))`` does. The sharded
FP32 parameters (the optimizer's master weights) and their FP32 gradient shards do not change.

Stages: FP32 has no policy (no casts: the same computation as a module sharded without one); FP16 and BF16 set
``param_dtype`` to the stage's dtype (FP8 stages to BF16: their float8 layers quantize the gathered BF16 weights)
and ``reduce_dtype`` to the caller's choice (``None``: reduce in the stage's dtype, half the reduce-scatter bytes,
at the risk of FP16 overflow in the sum).

Why our own: FSDP2 takes the policy only in ``fully_shard`` and offers no public way to change it on a live
module. This module sets it where ``fully_shard`` stored it (each unit's state, its parameter groups and each
``FSDPParam``) and re-derives each parameter's dtypes with FSDP's own ``init_dtype_attrs``, the step FSDP itself
repeats at its lazy initialisation; the buffers FSDP reuses across all-gathers (fixed to the dtype of the first
one) are dropped so that the next all-gather allocates them in the new dtype. The same names in torch 2.11 and
2.13; on both, a switched module computes bitwise what ``fully_shard`` given that policy computes.

Costs: at a stage change, every unit is resharded (a no-op between steps) and its all-gather buffers are
reallocated once; nothing per step.

FP8 stages: FSDP2 binds each sharded parameter to the module object it found in ``fully_shard``, so
``StagedPrecision`` converts the float8 layers before sharding and toggles their FP8 GEMMs (see
:mod:`lightning_deepseek.precision.float8`); the all-gathers stay BF16 (torchao's FP8 all-gather is not used).

Does not support: parameters with FSDP all-gather extensions (tensor subclasses defining ``fsdp_pre_all_gather``,
such as torchao's FP8 all-gather weights), which are not re-derived. A policy the user passed to
``fully_shard`` is replaced by the stage's. Not checked on CUDA streams yet (tested on CPU with gloo).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

# FP8 stages gather BF16: their float8 layers quantize the gathered weight, the rest runs under BF16 autocast.
STAGE_DTYPES: dict[str, torch.dtype | None] = {"32-true": None, "16-mixed": torch.float16,
                                               "bf16-mixed": torch.bfloat16, "fp8-mixed": torch.bfloat16}
_REDUCE_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                  "float16": torch.float16, "fp16": torch.float16}


def fsdp_units(model: nn.Module) -> list[FSDPModule]:
    """Every module of ``model`` that ``fully_shard`` was applied to (an FSDP unit), in module order."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def reduce_dtype_of(value: torch.dtype | str | None) -> torch.dtype | None:
    """The reduce-scatter dtype ``fsdp_reduce_dtype`` names (a ``torch.dtype``, or ``"float32"``, ``"bf16"``...
    as a config file gives it); ``None`` stays ``None``. Raises ``ValueError`` for anything else."""
    dtype = _REDUCE_DTYPES.get(value, value) if isinstance(value, str) else value
    if dtype is not None and dtype not in _REDUCE_DTYPES.values():
        raise ValueError(f"fsdp_reduce_dtype={value!r} is not a gradient reduce dtype. Use torch.float32 (default), "
                         "torch.bfloat16, torch.float16 (or their names, e.g. 'float32'), or None for the stage's.")
    return dtype


def stage_policy(precision: str, reduce_dtype: torch.dtype | None = torch.float32) -> MixedPrecisionPolicy:
    """FSDP2's policy for a stage's Lightning precision string: none for ``"32-true"``; ``param_dtype`` the stage's
    dtype (BF16 for ``"fp8-mixed"``) and ``reduce_dtype`` as given for the others. Raises ``ValueError`` for
    unknown strings.

    Args:
        precision: ``"32-true"``, ``"16-mixed"``, ``"bf16-mixed"`` or ``"fp8-mixed"``.
        reduce_dtype: dtype of the gradient reduce-scatter in half-precision stages; ``None``: the stage's dtype.
    """
    if precision not in STAGE_DTYPES:
        raise ValueError(f"precision={precision!r} has no FSDP mixed-precision policy here. Use one of "
                         f"{list(STAGE_DTYPES)}.")
    param_dtype = STAGE_DTYPES[precision]
    if param_dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def set_mixed_precision(units: list[FSDPModule], policy: MixedPrecisionPolicy) -> None:
    """Give every unit in ``units`` the mixed-precision ``policy`` from its next all-gather on (between steps).

    Args:
        units: FSDP units (:func:`fsdp_units`).
        policy: what ``fully_shard(mp_policy=...)`` would have been given.
    """
    for unit in units:
        unit.reshard()  # its parameters sharded: the unsharded copies are rebuilt at the next all-gather
        # Private: FSDP2 has no public setter of the policy (see the module docstring).
        state = unit._get_fsdp_state()
        state._mp_policy = policy  # the forward-input and output casts
        for group in _param_groups(state):
            group.mp_policy = policy
            for param in group.fsdp_params:
                param.mp_policy = policy
                param.all_gather_outputs = []  # reused by every all-gather, in the dtype of the first one
                if hasattr(param, "_unsharded_param"):
                    del param._unsharded_param  # likewise: a view of those buffers
            group._init_mp_dtypes()  # each FSDPParam's init_dtype_attrs, then the group's uniform dtypes


def _param_groups(state: Any) -> list[Any]:
    # torch 2.13 keeps a list (per-parameter meshes), torch 2.11 one group or None.
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    return [state._fsdp_param_group] if state._fsdp_param_group is not None else []
