"""Checkpoint I/O of ``HybridParallelStrategy``: torch DCP folders (Lightning ``ModelParallelStrategy``'s layout, a
folder of shards plus ``meta.pt``) and one-file full checkpoints, both loadable at any other layout: FSDP-N, DDP,
tp, FSDP x TP, ep, FSDP x EP, other world sizes, one process (weights and optimizer states arrive exactly as saved;
the state-dict helpers key both by parameter name, whatever the sharding). From a DCP folder each rank reads only
the slices of its new shards; a one-file checkpoint is read whole by every rank. Pretrained weights (safetensors)
and the inference export are :mod:`.pretrained`'s.

A DCP folder counts as complete only when it holds ``meta.pt`` (the loader refuses one without it), and ``meta.pt``
is written last and atomically: an overwritten folder first loses its old ``meta.pt``, the shards are written,
then the new ``meta.pt`` is written aside and renamed into place. A save killed half-way leaves a folder that is
refused, never one that mixes two saves.

With ZeRO-1 (:mod:`.zero`) each rank holds only the optimizer states it owns: a DCP folder then gets the union
of all ranks' keys, a load reads just the keys the rank owns in the new layout, and a one-file checkpoint gathers
every state to rank 0.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.load import _METADATA_FILENAME
from torch import nn
from torch.optim import Optimizer

from lightning_deepseek.parallel.zero import ShardedOptimizerStates


def model_state(model: nn.Module, full: bool) -> dict[str, Any]:
    """``model``'s weights: DTensor shards (``full=False``) or full tensors gathered to every rank, on the CPU."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=full, cpu_offload=True))


def optimizer_state(model: nn.Module, optimizer: Optimizer, full: bool,
                    sharded: ShardedOptimizerStates | None = None, module: nn.Module | None = None,
                    flatten: bool = False) -> dict[str, Any]:
    """``optimizer``'s state, sharded like ``model_state`` (with ZeRO-1: the owned states; ``full``: all of them
    gathered to rank 0 and, given the LightningModule ``module``, keyed by parameter index as Lightning's DDP and
    model-parallel files key them). ``flatten`` (sharded only): states and param-group hyperparameters keyed by
    parameter name, torch's flattened form, as the ranks of a pipeline need (they hold other parameters and other
    groups, so group indices match neither across them nor across layouts); without it the groups are kept by
    index, the form Lightning's ``ModelParallelStrategy`` loads."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=full, cpu_offload=True,
                               flatten_optimizer_state_dict=flatten and not full)
    with _paused(sharded):
        state = get_optimizer_state_dict(model, optimizer, options=options)
    if sharded is not None and full:
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(state["state"], gathered, dst=0)
        if gathered is not None:
            state["state"] = {k: v for rank_states in gathered for k, v in rank_states.items()}
    if full and module is not None and dist.get_rank() == 0:
        from torch.distributed.fsdp import FullyShardedDataParallel, OptimStateKeyType

        # FSDP1's rekeying is torch's only public name -> index conversion (Lightning's strategies use it too).
        state = FullyShardedDataParallel.rekey_optim_state_dict(_compiled_names(state, module, insert=True),
                                                                OptimStateKeyType.PARAM_ID, module)
    return state


def _compiled_names(state: dict[str, Any], module: nn.Module, insert: bool) -> dict[str, Any]:
    """``state`` with the parameter names of compiled submodules given (``insert``) or stripped of ``._orig_mod``:
    ``named_parameters`` has it, torch's optimizer state-dict helpers do not."""
    from torch._dynamo import OptimizedModule  # torch.compile's wrapper class; no public name for it

    prefixes = sorted((n for n, m in module.named_modules() if isinstance(m, OptimizedModule)), key=len, reverse=True)

    def rename(key: Any) -> Any:
        if not isinstance(key, str):
            return key
        if not insert:
            return key.replace("._orig_mod", "").replace("_orig_mod.", "")
        prefix = next((p for p in prefixes if key == p or key.startswith(f"{p}.")), None)
        return key if prefix is None else f"{prefix}._orig_mod{key[len(prefix):]}"

    if insert and not prefixes:
        return state
    groups = [{**g, "params": [rename(p) for p in g["params"]]} for g in state.get("param_groups", [])]
    return {**state, "state": {rename(k): v for k, v in state.get("state", {}).items()}, "param_groups": groups}


def _paused(sharded: ShardedOptimizerStates | None) -> contextlib.AbstractContextManager:
    # torch's state-dict helpers may step with zero gradients on some ranks only: no broadcast inside them
    return sharded.paused() if sharded is not None else contextlib.nullcontext()


def save_distributed(checkpoint: dict[str, Any], path: Path, is_rank_zero: bool, barrier: Callable[[], None]) -> None:
    """Write ``checkpoint`` (Lightning's dict, weights and optimizer states sharded) as a DCP folder at ``path``."""
    import torch.distributed.checkpoint as dcp

    if is_rank_zero:
        if path.is_file():
            path.unlink()  # a one-file checkpoint of the same name (Lightning overwrites what it saves again)
        path.mkdir(parents=True, exist_ok=True)
        (path / _METADATA_FILENAME).unlink(missing_ok=True)  # the folder is incomplete until the new one exists
    barrier()
    state = {"state_dict": checkpoint.pop("state_dict")}
    state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
    dcp.save(state, checkpoint_id=path)
    if is_rank_zero:
        aside = path / f".{_METADATA_FILENAME}.partial"
        torch.save(checkpoint, aside)
        os.replace(aside, path / _METADATA_FILENAME)
    barrier()


def is_distributed_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / _METADATA_FILENAME).is_file()


def has_indexed_param_groups(path: Path) -> bool:
    """Whether the DCP folder at ``path`` holds its optimizer's param_groups by group index (written without a
    pipeline): loadable only where every rank's optimizer has the saved groups."""
    import torch.distributed.checkpoint as dcp

    return "optimizer_0.param_groups.0.params" in dcp.FileSystemReader(path).read_metadata().state_dict_metadata


def load_distributed(model: nn.Module, optimizers: list[Optimizer], path: Path, strict: bool,
                     weights_only: bool | None,
                     sharded: Sequence[ShardedOptimizerStates | None] = ()) -> dict[str, Any]:
    """Load a DCP folder into ``model``'s shards and ``optimizers``; return the rest of Lightning's checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model_state_ = {"state_dict": get_model_state_dict(model)}
    dcp.load(model_state_, checkpoint_id=path)
    set_model_state_dict(model, model_state_["state_dict"], options=StateDictOptions(strict=strict))
    indexed = has_indexed_param_groups(path)
    wrapped = isinstance(model, torch.nn.parallel.DistributedDataParallel)  # its names carry "module."; saved ones not
    held = {f"state_dict.{name.removeprefix('module.') if wrapped else name}" for name in model_state_["state_dict"]}
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    partial = any(k.startswith("state_dict.") and k not in held for k in saved)  # this rank holds a part (pipeline)
    for i, optimizer in enumerate(optimizers):
        key = f"optimizer_{i}"
        zero = sharded[i] if i < len(sharded) else None
        if indexed and partial:
            if zero is not None:
                raise ValueError(
                    f"ckpt_path={str(path)!r} keeps its optimizer param_groups by group index (written without a "
                    "pipeline) and this run shards the optimizer states (shard_optimizer_states=True) over ranks "
                    "holding part of the model: not supported. Resume once with shard_optimizer_states=False and "
                    "save a folder, then resume that.")
            _load_indexed_by_name(model, optimizer, path, key)
            continue
        options = StateDictOptions(strict=zero is None, flatten_optimizer_state_dict=not indexed)
        with _paused(zero):  # with ZeRO-1 the template holds only the owned states: just those keys are read
            optim_state = {key: get_optimizer_state_dict(model, optimizer, options=options)}
        dcp.load(optim_state, checkpoint_id=path)
        set_optimizer_state_dict(model, optimizer, optim_state_dict=optim_state[key], options=options)
    return torch.load(path / _METADATA_FILENAME, weights_only=weights_only)


def _load_indexed_by_name(model: nn.Module, optimizer: Optimizer, path: Path, key: str) -> None:
    """Load optimizer ``key`` of a folder whose param_groups are kept by group index into an optimizer holding a
    part of the saved parameters in other groups (a pipeline stage): the states are keyed by parameter name in both
    forms; each saved group's hyperparameters go to the parameters it lists by name. Collective (every rank reads)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    template = get_optimizer_state_dict(model, optimizer, options=options)  # "state.<name>.<state>", "param_groups.."
    prefix = f"{key}.param_groups."
    saved_groups: dict[str, Any] = {k: None for k in dcp.FileSystemReader(path).read_metadata().state_dict_metadata
                                    if k.startswith(prefix)}
    dcp.load(saved_groups, checkpoint_id=path)  # the groups' hyperparameters and parameter names (small objects)
    groups: dict[int, dict[str, Any]] = {}
    for k, value in saved_groups.items():
        index, _, field = k[len(prefix):].partition(".")
        groups.setdefault(int(index), {})[field] = value
    flat, error = _param_groups_by_name(model, optimizer, template, [groups[i] for i in sorted(groups)], key)
    failed = torch.tensor([error is not None])
    if dist.is_initialized():  # every rank raises, or none: the states' load below is collective
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item():
        raise ValueError(error or f"ckpt_path={str(path)!r}: another rank cannot map the saved param_groups of "
                                  f"{key} to its parameters (see its error).")
    states = {key: {k: v for k, v in template.items() if k.startswith("state.")}}
    dcp.load(states, checkpoint_id=path)
    set_optimizer_state_dict(model, optimizer, optim_state_dict={**states[key], **flat}, options=options)


def _param_groups_by_name(model: nn.Module, optimizer: Optimizer, template: dict[str, Any],
                          saved: list[dict[str, Any]], key: str) -> tuple[dict[str, Any], str | None]:
    """The flattened ``param_groups.<name>.<hyperparameter>`` entries of this rank's parameters from the ``saved``
    groups (a hyperparameter the save lacks keeps the template's value), or why they cannot be mapped: a parameter
    in no saved group, or one of this rank's groups joining saved groups of other hyperparameters."""
    group_of = {name: group for group in saved for name in group.get("params", [])}
    entries = {k: k[len("param_groups."):].rpartition(".") for k in template if k.startswith("param_groups.")}
    missing = sorted({name for name, _, _ in entries.values()} - group_of.keys())
    if missing:
        return {}, (f"{key} of the checkpoint has no param_group holding {missing[:3]} ({len(missing)} parameters): "
                    "the saved optimizer stepped other parameters. Resume with the model and configure_optimizers "
                    "of the saving run.")
    flat = {k: group_of[name].get(field, template[k]) for k, (name, _, field) in entries.items()}
    name_of = {id(p): n.replace("._orig_mod", "").replace("_orig_mod.", "") for n, p in model.named_parameters()}
    for group in optimizer.param_groups:
        names = [name_of[id(p)] for p in group["params"] if id(p) in name_of]
        for field in group:
            values = {repr(flat.get(f"param_groups.{name}.{field}")): name for name in names}
            if field != "params" and len(values) > 1:
                (a, first), (b, second) = list(values.items())[:2]
                return {}, (f"{key}: {first} and {second} are in one param_group of this run, but the checkpoint's "
                            f"groups give them {field}={a} and {field}={b}. Resume with the param_groups of the saving "
                            "run's configure_optimizers.")
    return flat, None


def load_full(model: nn.Module, optimizers: list[Optimizer], checkpoint: dict[str, Any], strict: bool,
              lightning_module: nn.Module, sharded: Sequence[ShardedOptimizerStates | None] = ()) -> None:
    """Load a one-file checkpoint (ours with ``save_distributed_checkpoint=False``, or DDP's): every rank keeps its
    own shards of the full tensors."""
    from lightning.fabric.strategies.model_parallel import _rekey_optimizer_state_if_needed
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, strict=strict)
    set_model_state_dict(model, checkpoint["state_dict"], options=options)
    for i, (optimizer, state) in enumerate(zip(optimizers, checkpoint.get("optimizer_states", []))):
        state = _compiled_names(_rekey_optimizer_state_if_needed(state, lightning_module), model, insert=False)
        set_optimizer_state_dict(model, optimizer, optim_state_dict=state, options=options)
        if i < len(sharded) and sharded[i] is not None:
            sharded[i].drop_unowned_state(optimizer)  # the file holds every state: keep the owned ones


def make_way_for_file(path: Path, is_rank_zero: bool, barrier: Callable[[], None]) -> None:
    """Make way for a one-file checkpoint at ``path`` (collective): a distributed checkpoint folder there is replaced,
    as Lightning does; any other folder is an error, on every rank."""
    replace = is_distributed_checkpoint(path)
    if path.is_dir() and not replace:
        raise IsADirectoryError(f"{path} is a folder; save_distributed_checkpoint=False writes one file.")
    barrier()  # every rank has looked before rank 0 removes it
    if replace and is_rank_zero:
        shutil.rmtree(path)


def load(model: nn.Module, optimizers: list[Optimizer], path: Path, module: Any, weights_only: bool | None,
         sharded: Sequence[ShardedOptimizerStates | None], checkpoint_io: Any) -> dict[str, Any]:
    """Load a one-file checkpoint (through ``checkpoint_io``) or a DCP folder into the (sharded) model and
    optimizers; return the checkpoint's other entries for Lightning."""
    strict = module.strict_loading
    if path.is_file():
        # Lightning < 2.6's CheckpointIO takes no weights_only (and loads everything); Trainer.fit passes None there
        loaded = checkpoint_io.load_checkpoint(path, **({} if weights_only is None else {"weights_only": weights_only}))
        load_full(model, optimizers, loaded, strict, module, sharded)
        return loaded
    if is_distributed_checkpoint(path):
        return load_distributed(model, optimizers, path, strict, weights_only, sharded)
    raise ValueError(f"ckpt_path={str(path)!r} is neither a checkpoint file nor a complete "
                     "torch.distributed.checkpoint folder (with meta.pt, written last). Pass a checkpoint written "
                     "by Lightning.")
