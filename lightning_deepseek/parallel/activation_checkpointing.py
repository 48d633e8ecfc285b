"""Activation checkpointing per transformer block: ``"none"``, ``"full"`` or ``"selective"`` (per op).

``apply_activation_checkpointing(model, mode)`` makes each transformer block of ``model`` keep only what ``mode``
says from its forward and recompute the rest during backward, with torch's non-reentrant
``torch.utils.checkpoint.checkpoint`` (public API). Gradients are bitwise those of no checkpointing: the recompute
runs the same ops on the same inputs, with the forward's RNG state (dropout masks repeat).

- ``"full"``: a block keeps only its input; its whole forward runs again in backward (about one more forward).
- ``"selective"``: torchtitan's op-level policy through ``torch.utils.checkpoint.create_selective_checkpoint_contexts``:
  the outputs of the compute-heavy ops are kept (attention kernels, every second matrix multiply of a block, the
  reduce-scatter of tensor parallelism, ``max``), everything else (norms, activations, element-wise ops, the other
  matrix multiplies) is recomputed. torchtitan counts ``aten.mm`` only; here ``addmm``/``bmm``/``baddbmm`` count
  as matrix multiplies too, since biased linears and batched attention products reach the dispatcher as those.

Blocks are found by the same detection as the tensor-parallel plan (:func:`.plan.plan_blocks`): the elements of
the outermost ``nn.ModuleList`` that holds a feed-forward block (declared by an HF model or found by structure: our
GPT's ``blocks``, HF's ``model.layers``, GPT-2's ``transformer.h``, a user's list of blocks), and the elements of
lists whose class an HF model names in ``_no_split_modules`` (its own unit of a transformer block, which covers MoE
families whose experts are fused weights). Every element of such a list is checkpointed, dense and MoE blocks alike.

How a block is wrapped: its class is swapped for a subclass whose ``forward`` calls the original one under
``checkpoint`` (what FSDP2's ``fully_shard`` does to the modules it shards). Names, ``state_dict`` keys and
``isinstance`` are unchanged, so plans, checkpoints and FSDP2 see the same model. torch's ``checkpoint_wrapper``
(torchtitan's choice) is private and inserts a ``_checkpoint_wrapped_module`` level into every name.

Order with parallelism (torchtitan's): tensor and expert parallelism first (the blocks' layers may hold DTensors),
then this, then FSDP2's ``fully_shard`` on each checkpointed block: its all-gathers stay outside the recompute,
and its pre-backward all-gather feeds it. An FSDP unit inside a block (routed experts sharded over ``edp``) runs
its hooks inside the recompute; under ``"selective"`` they run outside torch's selective contexts (recomputed as
under ``"full"``), since they run a different number of ops in forward and in the recompute. ``torch.compile`` of
a checkpointed block (after this) traces the checkpoint without a graph break; its backward then recomputes inside
the compiled graph (there the hooks stay inside: not tried with a nested FSDP unit).

Costs: ``"full"`` recomputes each block's forward (about a third more compute per step), plus the collectives
inside a tensor-parallel block; ``"selective"`` recomputes the cheap ops and half the matrix multiplies.
Does not support: reentrant checkpointing, checkpointing finer than a block (e.g. only attention), checkpointing
every n-th block, pickling the whole model (the swapped classes are made at run time; ``state_dict`` is
unaffected). A key/value cache passed to a block while gradients are recorded is dropped, as HF's own gradient
checkpointing does (the recompute would append to it twice). Forward hooks with side effects inside a block run
again during the recompute: they can skip it with :func:`is_recomputing`.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
import torch.nn as nn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed.fsdp import FSDPModule
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode  # no public path to either
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_deepseek.parallel.plan import plan_blocks

MODES = ("none", "full", "selective")
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")  # HF's names across releases

__all__ = ["MODES", "apply_activation_checkpointing", "find_transformer_blocks", "is_recomputing"]


def _existing_ops(namespace: Any, names: tuple[str, ...]) -> set[Any]:
    """The ``.default`` overloads of the ops in ``names`` that this torch build has (names vary across releases)."""
    return {getattr(namespace, name).default for name in names if hasattr(namespace, name)}


_MATMUL_OPS = _existing_ops(torch.ops.aten, ("mm", "addmm", "bmm", "baddbmm"))
_SAVE_OPS = _existing_ops(torch.ops.aten, (
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_attention_math", "_scaled_dot_product_fused_attention_overrideable", "max",
)) | _existing_ops(torch.ops._c10d_functional, ("reduce_scatter_tensor",))

_state = threading.local()


def is_recomputing() -> bool:
    """Whether a checkpointed block is being recomputed during backward on this thread (for forward hooks with side
    effects, such as counting routed tokens, that must run once per step)."""
    return getattr(_state, "recomputing", False)


@contextmanager
def _recomputing() -> Iterator[None]:
    _state.recomputing = True
    try:
        yield
    finally:
        _state.recomputing = False


def _flag_recompute(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, whose calls after the first (the checkpoint's recompute) run with ``is_recomputing()`` true."""
    calls = 0

    def run(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            return fn(*args, **kwargs)
        with _recomputing():
            return fn(*args, **kwargs)

    return run


def _selective_contexts() -> tuple[Any, Any]:
    """Fresh contexts for one checkpointed call: keep the outputs of the ops in ``_SAVE_OPS`` and of every odd
    matrix multiply (counted separately in forward and recompute, so both pick the same ones)."""
    counts: dict[bool, int] = defaultdict(int)

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in _MATMUL_OPS:
            counts[ctx.is_recompute] += 1
            keep = counts[ctx.is_recompute] % 2 == 1
        else:
            keep = op in _SAVE_OPS
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    forward, recompute = create_selective_checkpoint_contexts(policy)
    if torch.compiler.is_compiling():  # traced, torch's own contexts are what it understands
        return forward, recompute
    return _SuspendableContext(forward), _SuspendableContext(recompute)


class _SuspendableContext:
    """One of torch's selective contexts (a dispatch mode), which the hooks of an FSDP unit nested in the block
    leave while they run and enter again after (:func:`_keep_unit_hooks_out`)."""

    def __init__(self, mode: TorchDispatchMode) -> None:
        self.mode, self.suspended = mode, False

    def __enter__(self) -> None:
        self.mode.__enter__()
        _entered().append(self)

    def __exit__(self, *exc: Any) -> None:
        _entered().pop()
        if not self.suspended:
            self.mode.__exit__(*exc)

    # The base class's enter and exit only push and pop the mode: the recompute's own enter restarts its op counts.
    def suspend(self) -> None:
        if not self.suspended and _get_current_dispatch_mode() is self.mode:
            TorchDispatchMode.__exit__(self.mode, None, None, None)
            self.suspended = True

    def resume(self) -> None:
        if self.suspended:
            TorchDispatchMode.__enter__(self.mode)
            self.suspended = False


def _entered() -> list[_SuspendableContext]:
    """This thread's entered selective contexts, innermost last."""
    if not hasattr(_state, "entered"):
        _state.entered = []
    return _state.entered


def _suspend(*_: Any) -> None:
    if _entered():
        _entered()[-1].suspend()


def _resume(*_: Any) -> None:
    if _entered():
        _entered()[-1].resume()


def _keep_unit_hooks_out(block: nn.Module) -> None:
    """Run the forward hooks of the FSDP2 units nested in ``block`` (routed experts sharded over ``edp``) outside the
    selective contexts, once per unit. Inside, they broke the recompute on torch 2.13 ("... invocation index N
    encountered during backward but not found in storage"): a unit's hooks run a different number of ops in forward
    and in the recompute (there the unit may already be gathered by its pre-backward hook; profiler annotations),
    and torch 2.13 replays a selective region by each op's call count in forward. Outside, the hooks' ops are
    recomputed as under ``"full"``; the unit's forward (matrix multiplies, all-to-all) stays selective. FSDP2 puts
    its pre-forward hook first and its post-forward hook last, so these go around them."""
    for module in block.modules():
        if module is block or not isinstance(module, FSDPModule) or getattr(module, "_hooks_out_of_selective", False):
            continue
        module.register_forward_pre_hook(_suspend, prepend=True)
        module.register_forward_pre_hook(_resume)
        module.register_forward_hook(_suspend, prepend=True)
        module.register_forward_hook(_resume, always_call=True)
        module._hooks_out_of_selective = True


class CheckpointedForward(nn.Module):
    """Mixin put before a block's own class: its ``forward`` runs under non-reentrant ``checkpoint``."""

    activation_checkpointing: str = "full"

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        original = super().forward
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        if not getattr(self, "_can_checkpoint_with_cache", False):  # HF's mark of a layer that only reads its cache
            kwargs.update({name: None for name in _CACHE_KWARGS if kwargs.get(name) is not None})
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False
        # Compiled, the block is traced once and its backward recomputes inside the graph, without Python.
        run = original if torch.compiler.is_compiling() else _flag_recompute(original)
        if self.activation_checkpointing == "selective":
            _keep_unit_hooks_out(self)
            return checkpoint(run, *args, use_reentrant=False, context_fn=_selective_contexts, **kwargs)
        return checkpoint(run, *args, use_reentrant=False, **kwargs)  # no context_fn: torch.compile traces it


_checkpointed_classes: dict[type, type] = {}


def _checkpoint_block(block: nn.Module, mode: str) -> None:
    cls = type(block)
    if not issubclass(cls, CheckpointedForward):
        if cls not in _checkpointed_classes:
            _checkpointed_classes[cls] = type(f"Checkpointed{cls.__name__}", (CheckpointedForward, cls), {})
        block.__class__ = _checkpointed_classes[cls]
    block.activation_checkpointing = mode


def _outermost_list_element(name: str, modules: dict[str, nn.Module]) -> str | None:
    """The shortest prefix ``L.i`` of ``name`` where ``L`` is an ``nn.ModuleList`` and ``L.i`` is a proper ancestor."""
    parts = name.split(".")
    for end in range(1, len(parts)):
        parent = ".".join(parts[:end - 1])
        if isinstance(modules.get(parent), nn.ModuleList):
            return ".".join(parts[:end])
    return None


def find_transformer_blocks(model: nn.Module) -> list[str]:
    """Names (relative to ``model``) of its transformer blocks, in registration order (see the module docstring)."""
    modules = dict(model.named_modules())
    lists: set[str] = set()
    for block in plan_blocks(model):
        element = _outermost_list_element(block.down, modules)
        if element is not None and all(up.startswith(f"{element}.") for up in block.ups):
            lists.add(element.rpartition(".")[0])
    declared = {cls for m in modules.values() for cls in (getattr(m, "_no_split_modules", None) or ())}
    for name, module in modules.items():
        # by the class or one it derives from: a checkpointed block's class is a subclass of its own (the second
        # call, FSDP2's units after checkpointing, sees those)
        if isinstance(module, nn.ModuleList) and any(cls.__name__ in declared for c in module.children()
                                                     for cls in type(c).__mro__):
            lists.add(name)
    names = [f"{prefix}.{child}" if prefix else child
             for prefix in lists for child, _ in modules[prefix].named_children()]
    names = [n for n in names if not any(n.startswith(f"{other}.") for other in names)]
    order = {name: i for i, name in enumerate(modules)}
    return sorted(names, key=order.__getitem__)


def apply_activation_checkpointing(model: nn.Module, mode: Literal["none", "full", "selective"]) -> list[str]:
    """Checkpoint every transformer block of ``model`` in place; return the names of the blocks checkpointed.

    Args:
        model: the model (or the LightningModule holding it); its blocks may already hold tensor-parallel DTensors.
            Apply FSDP2's ``fully_shard`` after this, not before.
        mode: ``"none"`` (nothing changes), ``"full"`` (keep each block's input, recompute the block) or
            ``"selective"`` (keep the outputs of the compute-heavy ops, recompute the rest).

    Raises:
        ValueError: ``mode`` is not one of ``MODES``.
    """
    if mode not in MODES:
        raise ValueError(f"activation_checkpointing={mode!r} is not a mode: use one of {MODES}.")
    if mode == "none":
        return []
    names = find_transformer_blocks(model)
    if not names:
        rank_zero_warn(
            f"activation_checkpointing={mode!r}: no transformer block found in {type(model).__name__}, so nothing is "
            "checkpointed. Looked for the elements of an nn.ModuleList that hold a feed-forward block (a linear d->h "
            "then h->d, or one the model declares in its tensor-parallel plan) and for block classes an HF model "
            "names in `_no_split_modules`. Hold the blocks in an nn.ModuleList to checkpoint them.")
    modules = dict(model.named_modules())
    for name in names:
        _checkpoint_block(modules[name], mode)
    return names
