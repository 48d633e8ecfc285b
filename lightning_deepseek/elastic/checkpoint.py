"""Step checkpoints that a job resumes from at any world size: DCP for tensors, Lightning's dict for the rest.

Layout of one checkpoint, ``<dir>/step-00000120/``:

- the model and optimizer state of ``torch.distributed.checkpoint.state_dict.get_state_dict`` saved with
  ``torch.distributed.checkpoint`` (DCP). DCP stores each tensor's global shape and loads into whatever
  sharding the resuming job has, so a DDP job or a DTensor-sharded one resumes at another world size;
- ``trainer.pt``: Lightning's own checkpoint dict (``dump_checkpoint``: loops, callbacks' and the
  datamodule's ``state_dict``, precision plugin, LR schedulers) without the tensors above. As with
  Lightning's own checkpoints, every rank builds it (components may gather per-rank state in their
  ``state_dict``), rank 0 writes it, and every rank loads it on resume; a component whose state depends on
  the world size checks it in its ``load_state_dict``;
- ``COMPLETE``: written last, with the step, world size and a fingerprint of the model's parameter names
  and shapes.

A checkpoint is written into ``step-N.tmp/`` and renamed to ``step-N/`` by rank 0 only after DCP's
finishing collective, i.e. after every rank has written its part; a job killed while writing leaves a
``.tmp`` folder (or, on a foreign file system without atomic rename, a folder without ``COMPLETE``) that
``find_latest`` skips and the next job deletes. Saving can be asynchronous (``dcp.async_save``: the state
is copied to host memory, written by a background thread on its own gloo group); only one save is in
flight at a time. We wrote this instead of Lightning's ``ModelCheckpoint`` because that writes one rank-0
file for DDP, has no completeness marker, and is restored only through ``trainer.fit(ckpt_path=...)``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

log = logging.getLogger(__name__)

MARKER = "COMPLETE"
TRAINER_STATE = "trainer.pt"
_NAME = re.compile(r"^step-(\d+)$")
_TENSOR_KEYS = ("state_dict", "optimizer_states")


class CheckpointMismatchError(ValueError):
    """The checkpoint folder holds a checkpoint of another model; the message says which folder to change."""


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint on disk."""

    path: Path
    step: int
    world_size: int
    fingerprint: str


def model_fingerprint(module: torch.nn.Module) -> str:
    """Hash of the class name and every parameter's name and global shape (independent of sharding)."""
    text = type(module).__qualname__ + ";".join(f"{n}:{tuple(p.shape)}" for n, p in module.named_parameters())
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def find_latest(directory: str | Path) -> CheckpointInfo | None:
    """The newest complete checkpoint in ``directory``; half-written ones are skipped with a log line."""
    return max(_complete(Path(directory)), key=lambda info: info.step, default=None)


def _complete(root: Path) -> list[CheckpointInfo]:
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _NAME.match(path.name)
        if match is None or not path.is_dir():
            continue
        try:
            meta = json.loads((path / MARKER).read_text())
            found.append(CheckpointInfo(path, int(meta["step"]), int(meta["world_size"]), meta["fingerprint"]))
        except (OSError, ValueError, KeyError):
            log.warning(f"ElasticTraining: skipping incomplete checkpoint {path} (no valid {MARKER} marker).")
    return found


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


@contextlib.contextmanager
def _without_weights(strategy: pl.strategies.Strategy) -> Iterator[None]:
    """Lightning's checkpoint dict without the model and optimizer states, which DCP writes: meanwhile the
    strategy returns none, so that a sharding strategy (``HybridParallelStrategy`` gathers them and copies them to
    the host) does not build them only for them to be dropped."""
    strategy.lightning_module_state_dict = lambda: {}  # type: ignore[method-assign]
    strategy.optimizer_state = lambda optimizer: {}  # type: ignore[method-assign]
    try:
        yield
    finally:
        del strategy.lightning_module_state_dict, strategy.optimizer_state


class ElasticCheckpointer:
    """Writes, commits, finds and loads step checkpoints of a Lightning ``Trainer``.

    Args:
        directory: the checkpoint folder, on storage every node of the job can read.
        keep_last: complete checkpoints kept; older ones are deleted after each commit.
        async_save: write with ``dcp.async_save`` (training continues while the files are written).
    """

    def __init__(self, directory: str | Path, keep_last: int = 2, async_save: bool = True) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last={keep_last} must be at least 1: the newest checkpoint is what resumes.")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.async_save = async_save
        self._group: dist.ProcessGroup | None = None
        self._pending: tuple[Future, int, Path, str] | None = None
        self.last_committed_step = -1
        self.last_started_step = -1

    def setup(self) -> None:
        """Create the checkpoint group (collective) and, on rank 0, delete folders of interrupted saves."""
        if dist.is_initialized():
            # Background writes must not share a gloo context with the training collectives.
            self._group = dist.new_group(backend="gloo")
        if _rank() == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            for stale in self.directory.glob("step-*.tmp"):
                log.warning(f"ElasticTraining: deleting {stale}, a checkpoint whose writing was interrupted.")
                shutil.rmtree(stale, ignore_errors=True)

    def save(self, trainer: pl.Trainer, step: int, blocking: bool = False) -> None:
        """Write the checkpoint of ``step`` on every rank (collective); asynchronous unless ``blocking``."""
        self.wait()
        if step <= self.last_started_step:
            return
        tmp = self.directory / f"step-{step:08d}.tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        with _without_weights(trainer.strategy):
            # Private: Lightning's only public way to its checkpoint dict, trainer.save_checkpoint, writes one file.
            lightning_state = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        for key in _TENSOR_KEYS:
            lightning_state.pop(key, None)
        if _rank() == 0:
            torch.save(lightning_state, tmp / TRAINER_STATE)
        model_sd, optim_sd = get_state_dict(trainer.lightning_module, trainer.optimizers)
        state = {"model": model_sd, "optim": optim_sd}
        fingerprint = model_fingerprint(trainer.lightning_module)
        self.last_started_step = step
        if self.async_save and not blocking and self._group is not None:
            future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self._group)
            self._pending = (future, step, tmp, fingerprint)
            return
        dcp.save(state, checkpoint_id=str(tmp), process_group=self._group, no_dist=self._group is None)
        self._commit(step, tmp, fingerprint)

    def poll(self) -> None:
        """Commit the asynchronous save if it has finished (cheap; call every step)."""
        if self._pending is not None and self._pending[0].done():
            self.wait()

    def wait(self) -> None:
        """Block until the asynchronous save in flight (if any) is written and committed."""
        if self._pending is None:
            return
        future, step, tmp, fingerprint = self._pending
        self._pending = None
        future.result()
        self._commit(step, tmp, fingerprint)

    def _commit(self, step: int, tmp: Path, fingerprint: str) -> None:
        self.last_committed_step = step
        if _rank() != 0:
            return
        meta = {"step": step, "world_size": _world_size(), "fingerprint": fingerprint, "time": time.time()}
        (tmp / MARKER).write_text(json.dumps(meta))
        final = self.directory / f"step-{step:08d}"
        os.replace(tmp, final) if not final.exists() else shutil.rmtree(tmp, ignore_errors=True)
        for old in sorted(_complete(self.directory), key=lambda info: info.step)[: -self.keep_last]:
            shutil.rmtree(old.path, ignore_errors=True)

    def barrier(self) -> None:
        """Wait until every rank got here (used so that no rank exits before rank 0 has committed)."""
        if self._group is not None:
            dist.barrier(group=self._group)

    def latest(self) -> CheckpointInfo | None:
        """The newest complete checkpoint as chosen by rank 0 (collective when distributed)."""
        choice = [find_latest(self.directory) if _rank() == 0 else None]
        if dist.is_initialized():
            dist.broadcast_object_list(choice, src=0)
        return choice[0]

    def load(self, trainer: pl.Trainer, info: CheckpointInfo) -> None:
        """Restore model, optimizers and Lightning's state (loops, callbacks, schedulers...) from ``info``."""
        module = trainer.lightning_module
        if info.fingerprint != model_fingerprint(module):
            raise CheckpointMismatchError(
                f"ElasticTraining(checkpoint_dir={str(self.directory)!r}) holds {info.path.name}, written by a "
                f"model with different parameters (names or shapes) than {type(module).__name__}. Point "
                "checkpoint_dir at this job's own folder, or delete the folder to start from scratch."
            )
        model_sd, optim_sd = get_state_dict(module, trainer.optimizers)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(info.path), process_group=self._group, no_dist=self._group is None)
        set_state_dict(module, trainer.optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"])
        lightning_state: dict[str, Any] = torch.load(info.path / TRAINER_STATE, map_location="cpu",
                                                     weights_only=False)
        # Private: Lightning restores a checkpoint publicly only through trainer.fit(ckpt_path=...), chosen before
        # the job knows which checkpoint is complete; its connector's restore_* steps read `_loaded_checkpoint`.
        connector = trainer._checkpoint_connector
        connector._loaded_checkpoint = lightning_state
        try:
            module.on_load_checkpoint(lightning_state)
            connector.restore_datamodule()
            connector.restore_callbacks()
            connector.restore_precision_plugin_state()
            connector.restore_loops()
            connector.restore_lr_schedulers()
        finally:
            connector._loaded_checkpoint = {}
        self.last_committed_step = self.last_started_step = info.step
