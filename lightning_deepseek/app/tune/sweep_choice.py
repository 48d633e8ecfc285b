"""One calibration per sweep: the trials of a Hydra sweep (``lds-train -m``) share the first trial's choice.

A hyper-parameter sweep compares trials; each trial calibrating on its own would re-measure the same candidates
every time (seconds per trial) and, on a noisy machine, could train trials with different system
configurations, which also changes their losses (compression is not lossless). So the first trial of a sweep
calibrates, its table goes to ``<sweep dir>/tune/<key>.json``, and every later trial with the same key trains
with that choice, and says so. The key is a hash of what throughput depends on: the model, the batch shape,
the processes, precision, the ``strategy``/``compression`` groups (a searched ``strategy=`` or ``compression=``
is a forced setting: each value gets a calibration of its own), the optimizer's moment dtype and the ``tune``
group; not the learning rate, weight decay or the number of steps. A sweep that searches ``data.batch_size``
calibrates once per batch size.

Every rank must take the same branch: the launching process decides and publishes the table's path in
``LDS_TUNE_CHOICE`` ("" for "calibrate"), which Lightning's launcher passes to the ranks it starts (as
``run.py`` does for a resolved ``resume``). Ranks started another way (torchrun, a pre-started process group)
look the table up in the sweep folder themselves; they do so before the calibration's first collective, so they
see what the launching process saw.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_deepseek.app.processes import is_launcher

CHOICE_ENV = "LDS_TUNE_CHOICE"
_TRAINER_KEYS = ("accelerator", "devices", "num_nodes", "accumulate_grad_batches")
_DATA_KEYS = ("path", "batch_size", "block_size")


def sweep_table(cfg: DictConfig, forced: list[str]) -> Path | None:
    """Where this sweep keeps the calibration for ``cfg``'s key; ``None`` outside a Hydra multirun."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    key = {"model": cfg.model, "precision": cfg.precision, "strategy": cfg.strategy, "compression": cfg.compression,
           "tune": cfg.tune, "forced": forced, "moment_dtype": cfg.optim.get("moment_dtype"),
           "trainer": {k: cfg.trainer.get(k) for k in _TRAINER_KEYS},
           "data": {k: cfg.data.get(k) for k in _DATA_KEYS}}
    text = json.dumps(OmegaConf.to_container(OmegaConf.create(key), resolve=True), sort_keys=True, default=str)
    return Path(HydraConfig.get().sweep.dir) / "tune" / f"{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"


def shared_choice(table: Path | None) -> Path | None:
    """The sweep's table this run trains with (``None``: calibrate). The launching process decides and
    publishes; a rank it started follows."""
    if not is_launcher():
        published = os.environ.get(CHOICE_ENV)
        if published is not None:
            return Path(published) if published else None
    found = table if table is not None and table.is_file() else None
    if is_launcher():
        os.environ[CHOICE_ENV] = str(found or "")
    return found


def publish(table: Path | None, run_table: Path) -> None:
    """Copy this run's ``tune.json`` to the sweep's table (atomically: a concurrent trial reads all or nothing)."""
    if table is None:
        return
    table.parent.mkdir(parents=True, exist_ok=True)
    partial = table.with_suffix(f".{os.getpid()}.partial")
    partial.write_text(run_table.read_text())
    partial.replace(table)


def reused(table: Path) -> dict[str, Any]:
    """The sweep's recorded calibration: ``tune.json`` of the trial that measured it."""
    return json.loads(table.read_text())
