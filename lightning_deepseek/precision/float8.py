"""FP8 training for ``Stage("fp8")``: torchao's float8 training on a model's ``nn.Linear`` layers.

At the boundary into an FP8 stage ``StagedPrecision`` swaps the selected ``nn.Linear`` layers for torchao's
``Float8Linear`` (``torchao.float8.convert_to_float8_training``); leaving the stage swaps them back. The swap keeps
the same ``weight`` and ``bias`` Parameter objects, so master weights stay FP32, the optimizer state and the DDP
gradient hooks are untouched, and the state dict keys do not change (a checkpoint written in FP8 loads anywhere).
The remaining ops run under BF16 autocast, as DeepSeek-V3 keeps them in higher precision.

Selection (DeepSeek-V3's split): every ``nn.Linear`` except the output head and MoE routers (``exclude``: names of
modules, matched against each component of the module's path; ``gate`` counts as a router only beside an
``experts`` module, so a SwiGLU ``gate`` projection is converted), layers whose dims are not multiples of 16 (the
FP8 GEMM's requirement; for a tensor-parallel layer, its local shard's dims). Embeddings and norms are not
``nn.Linear`` and stay as they are.

Tensor parallelism: the layers the plan sharded (DTensor weights) are converted like the others, in place. The
``Float8Linear`` takes over the same DTensor Parameters and the tensor-parallel plan's input/output hooks (the
all-gather of the batch-sharded input, the reduce-scatter of the partial output); torchao's float8 casts and GEMM
run on DTensors, whose scales (per tensor or per row) are amaxes that DTensor reduces over the mesh, so each
shard is quantized exactly as the unsharded tensor would be (tested for every recipe).
Why not torchao's ``Float8ColwiseParallel``/``Float8RowwiseParallel``: they must be applied by
``parallelize_module`` to layers that are already ``Float8Linear``, but the plan shards once at setup and an FP8
stage starts and ends mid-run; re-applying a style re-wraps every weight in a new Parameter (the optimizer state,
DDP's hooks and ZeRO's partition hold the old ones); and they support tensorwise scaling only. Their gain, the
all-gather of the activations in FP8 instead of BF16, is what this forgoes: the tensor-parallel collectives move
BF16 bytes.

Sharded parameters (FSDP2): ``StagedPrecision`` converts the selected layers at setup, before ``fully_shard``, as
torchao documents (FSDP2 binds each sharded parameter to the module object it found, so a later swap would leave the
all-gathered weight on the old layer). ``convert(..., toggled=True)`` makes them ``ToggledFloat8Linear``: a
``Float8Linear`` that computes ``F.linear`` (``nn.Linear``'s forward, under the region's autocast) until
:func:`set_float8_enabled` turns its FP8 GEMMs on, so the stages before FP8 compute bitwise as ``nn.Linear``. The
weights are all-gathered in the FSDP policy's dtype and quantized after the all-gather (torchao's
``enable_fsdp_float8_all_gather``, FP8 all-gathers, is not used: its weight subclass would also change the
all-gathers of the stages before FP8). Converted before tensor parallelism too, the selection then reads a layer's
whole dims, not its local shard's.

Recipe: torchao's names (``"tensorwise"``, ``"rowwise"``, ``"rowwise_with_gw_hp"``) or a ``Float8LinearConfig``.
DeepSeek-V3's block-wise 1x128 / 128x128 scaling is not among torchao's stable float8 training recipes.

Devices: CUDA with compute capability >= 8.9 (Ada, Hopper and newer) runs real FP8 GEMMs. On CPU the GEMMs are
emulated (``Float8LinearConfig(emulate=True)``: operands quantized to FP8 and multiplied in higher precision),
which checks the numerics, not the speed. An older GPU gets an error, or emulation with ``fp8_emulate=True``.

Why torchao: it is PyTorch's float8 training library (torchtitan's FP8 path), with the scaling recipes, the
``Float8Linear`` module and the emulation; this module adds only what a stage boundary needs.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_deepseek.versions import require

DEFAULT_EXCLUDE = ("head", "lm_head", "output", "router", "gate", "classifier", "score")
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
INSTALL = "pip install 'lightning-deepseek[fp8]' (or: pip install torchao)"


class Float8ConfigError(ValueError):
    """A bad FP8 setting, a missing torchao or a device without FP8; the message names the fix."""


def torchao_available() -> bool:
    return importlib.util.find_spec("torchao") is not None


@dataclasses.dataclass(frozen=True)
class Float8Training:
    """How an FP8 stage converts a model: which layers, which torchao recipe, emulated or not.

    Args:
        recipe: a torchao recipe name or a ``torchao.float8.Float8LinearConfig``.
        exclude: module names never converted (matched against each component of a module's path).
        emulate: emulate FP8 GEMMs; ``None`` emulates on CPU only.
    """

    recipe: Any = "tensorwise"
    exclude: tuple[str, ...] = DEFAULT_EXCLUDE
    emulate: bool | None = None

    def __post_init__(self) -> None:
        if not torchao_available():
            raise Float8ConfigError(f"Stage('fp8') needs torchao, which is not installed. Install it: {INSTALL}.")
        if isinstance(self.recipe, str) and self.recipe not in RECIPES:
            raise Float8ConfigError(f"fp8_recipe={self.recipe!r} is not a torchao float8 recipe. Use one of "
                                    f"{list(RECIPES)} or a torchao.float8.Float8LinearConfig.")
        if isinstance(self.exclude, str) or not isinstance(self.exclude, Sequence):
            raise Float8ConfigError(f"fp8_exclude={self.exclude!r} must be a list of module names, e.g. ['head'].")
        object.__setattr__(self, "exclude", tuple(self.exclude))

    def config(self, device_type: str) -> Any:
        """torchao's ``Float8LinearConfig`` for ``device_type`` (emulated where the device has no FP8 GEMM)."""
        require("torchao")
        from torchao.float8 import Float8LinearConfig

        config = self.recipe if isinstance(self.recipe, Float8LinearConfig) else (
            Float8LinearConfig.from_recipe_name(self.recipe))
        emulate = device_type != "cuda" if self.emulate is None else self.emulate
        return dataclasses.replace(config, emulate=emulate) if emulate != config.emulate else config

    def check_device(self, device_type: str) -> None:
        """Raise unless ``device_type`` can run this FP8 stage (really, or emulated)."""
        if device_type == "cpu" and self.emulate is False:
            raise Float8ConfigError("fp8_emulate=False but the strategy runs on CPU, which has no FP8 GEMM. Leave "
                                    "fp8_emulate unset (CPU emulates) or train on a GPU of compute capability >= 8.9.")
        if device_type == "cuda" and not self.emulate and torch.cuda.get_device_capability() < (8, 9):
            major, minor = torch.cuda.get_device_capability()
            raise Float8ConfigError(
                f"Stage('fp8') needs FP8 GEMMs (compute capability >= 8.9: Ada, Hopper or newer); this GPU has "
                f"{major}.{minor}. Use 'bf16-mixed' for this stage, or fp8_emulate=True to check numerics (slow).")
        if device_type not in ("cpu", "cuda"):
            raise Float8ConfigError(f"Stage('fp8') runs on 'cpu' (emulated) or 'cuda', not {device_type!r}.")

    def selects(self, module: nn.Module, fqn: str, parent: nn.Module | None) -> bool:
        """Whether the ``nn.Linear`` at ``fqn`` is converted (see the module docstring)."""
        *path, last = fqn.split(".")
        if not isinstance(module, nn.Linear) or any(name in self.exclude for name in path):
            return False
        if last in self.exclude and (last != "gate" or _has_experts(parent)):
            return False  # the head, a router (DeepSeek-V3 keeps gating in higher precision), or excluded by name
        weight = module.weight.to_local() if isinstance(module.weight, DTensor) else module.weight
        out_features, in_features = weight.shape  # a tensor-parallel shard: the GEMM runs on the local shard
        return not (out_features % 16 or in_features % 16)

    def convert(self, model: nn.Module, device_type: str, toggled: bool = False) -> list[str]:
        """Swap the selected ``nn.Linear`` layers of ``model`` for ``Float8Linear``; return their paths.

        Args:
            model: the model; converted in place.
            device_type: the strategy's device type (CPU emulates the FP8 GEMMs).
            toggled: make them ``ToggledFloat8Linear`` with FP8 off (see the module docstring).
        """
        from torchao.float8 import convert_to_float8_training

        parents = {name: module for name, module in model.named_modules()}
        converted: list[str] = []

        def select(module: nn.Module, fqn: str) -> bool:
            parent = parents.get(fqn.rpartition(".")[0]) if "." in fqn else model
            chosen = fqn != "" and self.selects(module, fqn, parent)
            if chosen:
                converted.append(fqn)
            return chosen

        convert_to_float8_training(model, module_filter_fn=select, config=self.config(device_type))
        for fqn in converted:
            layer = model.get_submodule(fqn)
            _carry_hooks(parents[fqn], layer)
            if toggled:
                # torchao's public conversion builds Float8Linear only; the subclass adds one attribute, no state.
                layer.__class__ = toggled_float8_linear()
                layer.float8_enabled = False
        return converted


def _has_experts(parent: nn.Module | None) -> bool:
    return parent is not None and any(name == "experts" for name, _ in parent.named_children())


def is_float8(module: nn.Module) -> bool:
    """Whether ``module`` is one of torchao's ``Float8Linear`` layers (or a subclass: toggled, or FSDP's unit)."""
    return any(cls.__name__ == "Float8Linear" and cls.__module__.startswith("torchao.") for cls in type(module).__mro__)


@functools.cache
def toggled_float8_linear() -> type[nn.Linear]:
    """``ToggledFloat8Linear``: torchao's ``Float8Linear`` computing as ``nn.Linear`` while ``float8_enabled`` is
    False (defined on first use: torchao is optional)."""
    from torchao.float8.float8_linear import Float8Linear

    class ToggledFloat8Linear(Float8Linear):  # type: ignore[misc]
        float8_enabled: bool = False

        @override
        def forward(self, input: torch.Tensor) -> torch.Tensor:
            if self.float8_enabled:
                return super().forward(input)
            return F.linear(input, self.weight, self.bias)

    return ToggledFloat8Linear


def toggled_layers(model: nn.Module) -> list[nn.Module]:
    """The ``ToggledFloat8Linear`` layers of ``model``."""
    if not torchao_available():
        return []
    return [m for m in model.modules() if isinstance(m, toggled_float8_linear())]


def set_float8_enabled(model: nn.Module, enabled: bool) -> int:
    """Turn the FP8 GEMMs of every ``ToggledFloat8Linear`` in ``model`` on or off; return how many layers."""
    layers = toggled_layers(model)
    for layer in layers:
        layer.float8_enabled = enabled
    return len(layers)


def has_float8_layers(model: nn.Module) -> bool:
    return any(is_float8(m) for m in model.modules())


def revert(model: nn.Module) -> int:
    """Swap every ``Float8Linear`` in ``model`` back for an ``nn.Linear`` with the same Parameters; return how many.

    torchao offers no reverse conversion; this is the inverse of its ``Float8Linear.from_float``.
    """
    swaps = [(name, module) for name, module in model.named_modules() if is_float8(module)]
    for name, module in swaps:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        with torch.device("meta"):
            linear = nn.Linear(module.in_features, module.out_features, bias=False)
        linear.weight = module.weight
        linear.bias = module.bias
        _carry_hooks(module, linear)
        setattr(parent, child, linear)
    return len(swaps)


# A tensor-parallel layer's all-gather and reduce-scatter are forward hooks that torch's ``distribute_module``
# registered on the module object; the swap makes a new object. nn.Module has no public way to list or move its
# hooks, so the hook dicts themselves are handed over (they are module attributes since torch 2.0).
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
               "_forward_hooks_with_kwargs", "_forward_hooks_always_called")


def _carry_hooks(old: nn.Module, new: nn.Module) -> None:
    for name in _HOOK_DICTS:
        setattr(new, name, getattr(old, name))
    if getattr(old, "_distribute_module_applied", False):
        new._distribute_module_applied = True
