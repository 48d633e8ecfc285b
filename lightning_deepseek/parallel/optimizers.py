"""Optimizer param groups that mix tensor-parallel ``DTensor`` shards and plain tensors.

torch's multi-tensor optimizer steps (``foreach``, the default on CUDA, and ``fused``) refuse a param group that
mixes DTensor shards and plain tensors. ``HybridParallelStrategy`` therefore steps such groups with the for-loop
implementation (``foreach=False``) unless they ask for ``foreach``/``fused`` explicitly, which is an error naming
the fix (split the group by ``isinstance(p, DTensor)``). Homogeneous groups keep the multi-tensor step.
"""

from __future__ import annotations

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer


class MixedParamGroupError(ValueError):
    """A param group mixes DTensor and plain parameters and asks for a multi-tensor (``foreach``/``fused``) step."""


def disable_foreach_on_mixed_groups(optimizers: list[Optimizer]) -> list[str]:
    """Set ``foreach=False`` on every param group that mixes DTensor and plain parameters and leaves ``foreach``
    unset (torch would pick its multi-tensor kernels on CUDA, which fail on the mix); raise where such a group
    sets ``foreach`` or ``fused`` itself. Homogeneous groups are left as they are.

    Returns:
        The groups it changed, as ``"optimizer i (Name) param group j"``.
    """
    changed = []
    for i, optimizer in enumerate(optimizers):
        for j, group in enumerate(optimizer.param_groups):
            if len({isinstance(p, DTensor) for p in group["params"]}) < 2:
                continue
            for setting in ("fused", "foreach"):
                if group.get(setting):
                    raise MixedParamGroupError(
                        f"{type(optimizer).__name__} (optimizer {i}) param group {j} has {setting}={group[setting]!r} "
                        "but mixes tensor-parallel DTensor and plain parameters, which torch's multi-tensor kernels "
                        f"refuse. Leave {setting} unset (HybridParallelStrategy then steps this group parameter by "
                        "parameter), or split the group by `isinstance(p, torch.distributed.tensor.DTensor)`.")
            if group.get("foreach", False) is None:
                group["foreach"] = False
                changed.append(f"optimizer {i} ({type(optimizer).__name__}) param group {j}")
    return changed


def settle_mixed_param_groups(optimizers: list[Optimizer]) -> None:
    """:func:`disable_foreach_on_mixed_groups`, telling the user (once) which groups it changed and why."""
    changed = disable_foreach_on_mixed_groups(optimizers)
    if changed:
        rank_zero_info(f"HybridParallelStrategy: foreach=False on {', '.join(changed)}: they mix tensor-parallel "
                       "DTensor and plain parameters, which torch's multi-tensor optimizer kernels (the default "
                       "on CUDA) refuse. To keep the multi-tensor step, put sharded and replicated parameters in "
                       "separate param groups (`isinstance(p, torch.distributed.tensor.DTensor)` tells them "
                       "apart).")
