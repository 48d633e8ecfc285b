"""Pretrained weights straight into a sharded model, and a consolidated ``safetensors`` export for inference.

:func:`load_pretrained` loads, into a model of any layout of ``HybridParallelStrategy`` (FSDP2, tensor and expert
parallel ``DTensor`` shards, plain replicated parameters; a model built on the meta device once the strategy has
materialised it):

- a Hugging Face folder as ``save_pretrained`` writes it (``model.safetensors``, or shards beside
  ``model.safetensors.index.json``), read by torch DCP's ``HuggingFaceStorageReader``: each rank asks it only for
  the slices of its own shards, which it reads through ``safe_open(...).get_slice`` (torch 2.13's reader; torch
  2.8's first one deserialised whole files), converting the stored dtype to the model's. The reader is public in
  ``torch.distributed.checkpoint`` from torch 2.8 on, with the same constructor, so in every torch this package
  supports (2.11 and later): there is no fallback;
- a one-file Lightning checkpoint (or a ``torch.save`` of a ``state_dict``), memory-mapped: each rank copies its
  slices out of the mapped tensors (``distribute_tensor(..., src_data_rank=None)``, no communication), so only the
  pages under them are read.

Every name and shape is checked against the model before anything is read; a mismatch raises one ``ValueError``
listing the first mismatches. A parameter tied to another (``lm_head`` sharing the embedding) is filled through the
one the file holds.

:func:`export_safetensors` gathers the full weights to rank 0 (collective; rank 0 holds the whole model on the CPU
once, the other ranks nothing extra) and writes them: a transformers ``PreTrainedModel`` through its own
``save_pretrained`` (config, ``model.safetensors`` or shards with an index, tied weights dropped), loadable by
``AutoModelForCausalLM.from_pretrained``; any other module as one ``model.safetensors`` of its ``state_dict``.

When to call them in Lightning: after the strategy has sharded and materialised the model, i.e. in the
LightningModule's ``on_fit_start`` (before that, ``configure_model`` sees an unsharded, possibly meta, model).
When resuming, Lightning restores a strategy's checkpoint that loads after setup (``HybridParallelStrategy``'s,
``ModelParallelStrategy``'s) right after ``on_fit_start``, so the checkpoint's weights win::

    def on_fit_start(self) -> None:
        load_pretrained(self.model, "path/to/hf_folder")

Not supported: models whose parameter names differ from the file's (transformers 5's MoE families that fuse
experts on load convert names and layouts that this loader does not: the error lists the names), loading
optimizer states from these files, remote paths or hub names (a local folder or file only), a single
``.safetensors`` file outside its folder (pass the folder).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_deepseek.parallel.fsdp import has_meta_tensors

_SHOWN = 8


def load_pretrained(module: nn.Module, path: str | Path, strict: bool = True, prefix: str = "") -> None:
    """Load the weights at ``path`` into ``module``'s (possibly sharded) parameters and buffers.

    Args:
        module: the model, after the strategy's setup (sharded, materialised); e.g. the LightningModule's
            ``self.model`` from its ``on_fit_start``.
        path: a folder of ``*.safetensors`` as ``save_pretrained`` writes it, or a one-file checkpoint
            (Lightning's, with its weights under ``"state_dict"``, or a plain ``state_dict``).
        strict: ``True``: every name of the model must be in the file and every name of the file in the model.
            ``False``: load the names both have. Shapes must match either way.
        prefix: the file's names for ``module`` start with it (``"model."`` to load a Lightning checkpoint of a
            LightningModule into its ``self.model``); the file's other names are ignored.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    if has_meta_tensors(module):
        raise ValueError("load_pretrained(module) got a model still on the meta device. Call it after the "
                         "strategy has materialised the model: in the LightningModule's on_fit_start, not in "
                         "configure_model.")
    path = Path(path)
    state = get_model_state_dict(module)
    if path.is_dir():
        loaded = _read_safetensors_folder(state, path, strict, prefix, _aliases(module))
    elif path.is_file():
        loaded = _read_full_file(state, path, strict, prefix, _aliases(module))
    else:
        raise FileNotFoundError(f"load_pretrained(path={str(path)!r}): no such file or folder. Pass a local folder "
                                "written by save_pretrained or a checkpoint file.")
    set_model_state_dict(module, loaded, options=StateDictOptions(strict=False))


def _read_safetensors_folder(state: dict[str, Any], path: Path, strict: bool, prefix: str,
                             aliases: dict[str, str]) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    if not any(path.glob("*.safetensors")):
        raise ValueError(f"load_pretrained(path={str(path)!r}): the folder holds no *.safetensors file. Pass the "
                         "folder that save_pretrained wrote.")
    reader = HuggingFaceStorageReader(str(path))
    stored = {name[len(prefix):]: tuple(meta.size) for name, meta in reader.read_metadata().state_dict_metadata.items()
              if name.startswith(prefix)}
    names = _matching_names(state, stored, strict, aliases, path)
    request = {prefix + name: state[name] for name in names}
    dcp.load(request, storage_reader=HuggingFaceStorageReader(str(path)))
    return {name: request[prefix + name] for name in names}


def _read_full_file(state: dict[str, Any], path: Path, strict: bool, prefix: str,
                    aliases: dict[str, str]) -> dict[str, Any]:
    checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    weights = checkpoint.get("state_dict", checkpoint)
    stored = {name[len(prefix):]: value for name, value in weights.items()
              if name.startswith(prefix) and isinstance(value, torch.Tensor)}
    names = _matching_names(state, {name: tuple(v.shape) for name, v in stored.items()}, strict, aliases, path)
    return {name: _local_slice(stored[name], state[name]) for name in names}


def _local_slice(full: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``full`` laid out as ``target``: for a DTensor, its shard cut from ``full`` locally."""
    if isinstance(target, DTensor):  # slice first: only the slice's pages are read (and converted)
        full = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
    return full.to(target.dtype)


def _aliases(module: nn.Module) -> dict[str, str]:
    """Each tied name (the second and later names of one parameter) -> the first name of that parameter."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def _matching_names(state: dict[str, Any], stored: dict[str, tuple[int, ...]], strict: bool,
                    aliases: dict[str, str], path: Path) -> list[str]:
    """The names to load (in both, shapes equal); raise listing the first mismatches."""
    wanted = {name: tuple(value.shape) for name, value in state.items() if isinstance(value, torch.Tensor)}
    missing = [n for n in wanted if n not in stored and not (n in aliases and aliases[n] in stored)]
    unexpected = [n for n in stored if n not in wanted]
    shapes = [f"{n} (model {list(wanted[n])}, file {list(stored[n])})" for n in wanted
              if n in stored and wanted[n] != stored[n]]
    problems = [f"shapes differ: {', '.join(shapes[:_SHOWN])}"] if shapes else []
    if strict and missing:
        problems.append(f"in the model, not in the file: {', '.join(missing[:_SHOWN])}"
                        + (f" (and {len(missing) - _SHOWN} more)" if len(missing) > _SHOWN else ""))
    if strict and unexpected:
        problems.append(f"in the file, not in the model: {', '.join(unexpected[:_SHOWN])}"
                        + (f" (and {len(unexpected) - _SHOWN} more)" if len(unexpected) > _SHOWN else ""))
    if problems:
        raise ValueError(f"load_pretrained: the weights at {path} do not match the model: {'; '.join(problems)}. "
                         "Load the checkpoint of this model's architecture and size, pass prefix= when the file "
                         "names the model under a parent (prefix='model.' for a LightningModule's self.model), or "
                         "strict=False to load only the names both have.")
    return [n for n in wanted if n in stored]


def export_safetensors(module: nn.Module, path: str | Path, max_shard_size: int | str = "5GB") -> None:
    """Write ``module``'s full weights, gathered from any layout, as ``safetensors`` in the folder ``path``
    (collective: every rank calls it; rank 0 writes).

    Args:
        module: the model (sharded or not); a transformers ``PreTrainedModel`` is saved with its config, loadable by
            ``from_pretrained``.
        path: the folder to write (created).
        max_shard_size: for a ``PreTrainedModel``, the largest file before the weights are split into shards.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not dist.is_initialized() or dist.get_rank() == 0:
        _write(module, full, Path(path), max_shard_size)
    if dist.is_initialized():
        dist.barrier()


def _write(module: nn.Module, full: dict[str, torch.Tensor], path: Path, max_shard_size: int | str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    if callable(getattr(module, "save_pretrained", None)) and hasattr(module, "config"):
        module.save_pretrained(path, state_dict=full, max_shard_size=max_shard_size)
        # FSDP2 renames the model's class (FSDPLlamaForCausalLM); the config names the class transformers knows
        module.config.architectures = [_unwrapped_class(module).__name__]
        module.config.save_pretrained(path)
        return
    from safetensors.torch import save_file

    aliases = _aliases(module)
    save_file({name: tensor.contiguous() for name, tensor in full.items() if name not in aliases},
              str(path / "model.safetensors"), metadata={"format": "pt"})


def _unwrapped_class(module: nn.Module) -> type:
    from torch.distributed.fsdp import FSDPModule

    return next(cls for cls in type(module).__mro__ if not issubclass(cls, FSDPModule))
