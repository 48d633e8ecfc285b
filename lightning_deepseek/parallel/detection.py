"""Feed-forward blocks found by structure, for models that declare no tensor-parallel plan.

Rules, applied to the linear layers (``nn.Linear``, or transformers' ``Conv1D``, a linear with its weight stored
transposed) among the children of one module, in registration order:

- **a pair**: one or two up-projections ``d -> h`` and a down-projection ``h -> d`` with ``h != d`` (GPT MLPs,
  ``nn.TransformerEncoderLayer``'s ``linear1``/``linear2``, gated SwiGLU MLPs in either order, flat lists);
- **no norm over the hidden width**: a sibling that normalises over ``h`` breaks the pair (it would see only a
  shard). A module is norm-like by shape (a leaf whose parameters are all vectors of that width, and whose class
  is named ``*Norm``) or by behaviour (a leaf whose output does not change when its input is scaled, the defining
  property of LayerNorm/RMSNorm); so HF's ``LlamaRMSNorm``, ``DeepseekV3RMSNorm`` or a user's own norm count;
- **no low-rank projections**: a bottleneck pair (``h < d``) is a feed-forward block only when it is all the
  linear layers of its module. Attention's low-rank paths (DeepSeek's MLA ``q_a_proj -> q_a_layernorm ->
  q_b_proj``) sit beside other projections of the same stream (``kv_a_proj``, ``o_proj``) and are never paired,
  while a small expert MLP (``h < d`` is common in MoE models) still is;
- **sibling blocks**: an up-projection alone in one child module and the down-projection alone in the next child
  (BERT's ``intermediate.dense`` / ``output.dense``), with ``h > d``.

We chose sibling structure over ``torch.fx`` tracing because tracing fails on data-dependent Python control flow
that ordinary models contain (shape checks in ``forward``) and needs no example input. The heuristic assumes that
what sits between the up- and down-projection is element-wise (activation, gating product, dropout), which is
the definition of a feed-forward block; a block with ``h == d`` is not detected (name it in an explicit plan).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn

_NORM_CLASSES = (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())
_PLAIN = (bool, int, float, str, type(None))
_probe_results: dict[tuple, bool] | None = None  # open inside ``cached_probes``


@dataclass(frozen=True)
class FeedForwardBlock:
    """Up-projection(s) ``d -> h`` (one, or two when gated) and the down-projection ``h -> d`` of one block.

    ``source`` says where the block came from: ``"structure"`` (these rules) or ``"declared"`` (the model's own
    tensor-parallel plan, :mod:`lightning_deepseek.parallel.declared`).
    """

    ups: tuple[str, ...]
    down: str
    dim: int
    hidden: int
    num_params: int
    source: str = "structure"


def conv1d_class() -> type | None:
    """transformers' ``Conv1D`` when transformers is loaded (a model built from it has loaded it), else None."""
    module = sys.modules.get("transformers.pytorch_utils")
    return getattr(module, "Conv1D", None)


def is_conv1d(module: nn.Module) -> bool:
    cls = conv1d_class()
    return cls is not None and isinstance(module, cls)


def linear_shape(module: nn.Module) -> tuple[int, int] | None:
    """``(in_features, out_features)`` of an ``nn.Linear`` or a transformers ``Conv1D``; None for anything else."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if is_conv1d(module):
        return module.weight.shape[0], module.weight.shape[1]
    return None


def _linear_children(parent: nn.Module, prefix: str) -> list[tuple[str, nn.Module, tuple[int, int]]]:
    out = []
    for name, child in parent.named_children():
        shape = linear_shape(child)
        if shape is not None:
            out.append((f"{prefix}{name}", child, shape))
    return out


def is_norm_like(module: nn.Module, width: int) -> bool:
    """Whether ``module`` normalises over the last dimension of width ``width`` (see the module docstring)."""
    if isinstance(module, _NORM_CLASSES):
        shape = (getattr(module, "normalized_shape", None)
                 or (getattr(module, "num_features", None) or getattr(module, "num_channels", None),))
        return shape[-1] == width
    if linear_shape(module) is not None or any(True for _ in module.children()):
        return False
    params = list(module.parameters(recurse=False))
    if any(p.dim() != 1 or p.numel() != width for p in params):
        return False
    if params and type(module).__name__.lower().endswith("norm"):
        return True
    key = _probe_key(module, width) if _probe_results is not None and not params else None
    if key is None:
        return _is_scale_invariant(module, width, params[0] if params else None)
    if key not in _probe_results:
        _probe_results[key] = _is_scale_invariant(module, width, None)
    return _probe_results[key]


@contextlib.contextmanager
def cached_probes() -> Iterator[None]:
    """Inside, the scale-invariance probe of a module without parameters, buffers, hooks or non-plain attributes
    (an activation) runs once per (class, plain attributes, width), not once per module: what ``lds-plan`` needs,
    which detects the blocks of one model many times (a probe of a wide activation costs milliseconds). The
    result is the probe's own: such a module's output depends on its class, attributes and input only."""
    global _probe_results
    if _probe_results is not None:  # nested: the outer cache serves
        yield
        return
    _probe_results = {}
    try:
        yield
    finally:
        _probe_results = None


def _probe_key(module: nn.Module, width: int) -> tuple | None:
    """``(class, width, plain attributes)``, or None where the module holds anything else (a buffer, a hook, a
    tensor or callable attribute): then it is probed itself."""
    attributes = []
    for name, value in vars(module).items():
        if isinstance(value, _PLAIN):
            attributes.append((name, value))
        elif not (isinstance(value, (dict, set, list, tuple)) and not value):
            return None
    return type(module), width, tuple(attributes)


@torch.no_grad()
def _is_scale_invariant(module: nn.Module, width: int, param: torch.Tensor | None) -> bool:
    """``module(4x) == module(x)`` on a fixed probe (its own generator: the global RNG is left untouched)."""
    device = param.device if param is not None else torch.device("cpu")
    dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32
    if device.type == "meta":
        return False
    probe = torch.randn(3, width, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    training = module.training
    module.eval()  # no running statistics updated, no dropout
    try:
        out, scaled = module(probe), module(4 * probe)
    except Exception:  # noqa: BLE001 - a module that cannot take a (rows, width) tensor is no norm over width
        return False
    finally:
        module.train(training)
    if not (isinstance(out, torch.Tensor) and isinstance(scaled, torch.Tensor) and out.shape == probe.shape):
        return False
    return bool(out.abs().max() > 0) and torch.allclose(out.float(), scaled.float(), rtol=1e-2, atol=1e-3)


def _normalises_over(modules: list[nn.Module], width: int) -> bool:
    return any(is_norm_like(child, width) for module in modules for child in module.children())


def _num_params(modules: list[nn.Module]) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


def _blocks_in(parent: nn.Module, prefix: str) -> list[FeedForwardBlock]:
    """Pairs among the linear children of ``parent``."""
    blocks = []
    linears = _linear_children(parent, prefix)
    shapes = {shape for _, _, shape in linears}
    for dim, hidden in sorted(shapes):
        if dim == hidden or (hidden, dim) not in shapes or _normalises_over([parent], hidden):
            continue
        ups = [item for item in linears if item[2] == (dim, hidden)]
        downs = [item for item in linears if item[2] == (hidden, dim)]
        if hidden < dim and len(ups) + len(downs) != len(linears):
            continue  # low-rank projections beside others of the same stream: attention, not a feed-forward
        per_block = len(ups) // len(downs)
        first_up_after_down = linears.index(ups[0]) > linears.index(downs[0])  # then (h, d) is the pair
        if first_up_after_down or per_block not in (1, 2) or per_block * len(downs) != len(ups):
            continue  # no consistent grouping: leave it to an explicit plan
        # One block (any order, e.g. Llama's w1, w2, w3), or several in registration order (flat ModuleLists).
        for i, down in enumerate(downs):
            group = ups[i * per_block:(i + 1) * per_block]
            blocks.append(FeedForwardBlock(tuple(n for n, _, _ in group), down[0], dim, hidden,
                                           _num_params([m for _, m, _ in (*group, down)])))
    return blocks


def _sibling_blocks(parent: nn.Module, prefix: str) -> list[FeedForwardBlock]:
    """An up-projection alone in one child and the down-projection alone in the next (BERT's layout)."""
    blocks = []
    children = list(parent.named_children())
    for (a_name, a), (b_name, b) in zip(children, children[1:]):
        ups = _linear_children(a, f"{prefix}{a_name}.")
        downs = _linear_children(b, f"{prefix}{b_name}.")
        if not (1 <= len(ups) <= 2 and len(downs) == 1) or len({shape for _, _, shape in ups}) != 1:
            continue
        dim, hidden = ups[0][2]
        if downs[0][2] != (hidden, dim) or hidden <= dim or _normalises_over([a, b], hidden):
            continue
        blocks.append(FeedForwardBlock(tuple(n for n, _, _ in ups), downs[0][0], dim, hidden,
                                       _num_params([m for _, m, _ in (*ups, *downs)])))
    return blocks


def find_feed_forward_blocks(module: nn.Module) -> list[FeedForwardBlock]:
    """All feed-forward blocks of ``module`` by structure (see the module docstring)."""
    blocks: list[FeedForwardBlock] = []
    for parent_name, parent in module.named_modules():
        prefix = f"{parent_name}." if parent_name else ""
        blocks += _blocks_in(parent, prefix)
        blocks += _sibling_blocks(parent, prefix)
    return blocks
