"""Progress and health reports from a training job to its controller, as a JSON-lines file.

Rank 0 of the job appends one JSON object per line (``write_report``); the controller tails the file (``Reports``).
A file on storage both can read is the whole transport: it survives a restart of either side, needs no
open port, and a person can ``tail -f`` it. Each line is written with one ``write`` call on a file opened
in append mode, so a reader never sees half a record from a live writer (a record cut by a crash is skipped).

Record fields: ``time``, ``event`` (``progress``, ``resumed``, ``resized``, ``checkpoint``, ``stopping``,
``fatal``, ``done``), ``step``, ``world_size``, and for ``progress``: ``samples_per_s``, ``loss``,
``grad_norm``, ``grad_norm_spike``, ``non_finite_loss``, ``max_steps``.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any


def write_report(path: str | Path, event: str, **fields: Any) -> None:
    """Append one record to the report file at ``path``."""
    record = {"time": time.time(), "event": event, **fields}
    line = json.dumps(record, allow_nan=False, default=str) + "\n"
    with open(path, "a") as handle:
        handle.write(line)


class Reports:
    """Incremental reader of a report file: each ``read_new`` returns the records appended since the last.

    Args:
        path: the report file (it may not exist yet).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._offset = 0
        self.latest: dict[str, Any] | None = None
        self.latest_progress: dict[str, Any] | None = None

    def read_new(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with open(self.path) as handle:
            handle.seek(self._offset)
            chunk = handle.read()
        complete = chunk[: chunk.rfind("\n") + 1]
        self._offset += len(complete.encode())
        records = []
        for line in complete.splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        for record in records:
            self.latest = record
            if record.get("event") == "progress":
                self.latest_progress = record
        return records


class GradNormMonitor:
    """Flags a gradient norm ``spike_factor`` times above its running mean (EMA), or a non-finite one.

    Args:
        spike_factor: ratio to the running mean above which a norm counts as a spike.
        decay: EMA decay of the running mean.
    """

    def __init__(self, spike_factor: float = 5.0, decay: float = 0.9) -> None:
        if spike_factor <= 1:
            raise ValueError(f"grad_norm_spike_factor={spike_factor} must be > 1 (e.g. 5).")
        self.spike_factor = spike_factor
        self.decay = decay
        self.mean: float | None = None

    def update(self, norm: float) -> bool:
        """Feed one norm; True if it is a spike (spikes do not move the running mean)."""
        if not math.isfinite(norm):
            return True
        if self.mean is not None and norm > self.spike_factor * self.mean:
            return True
        self.mean = norm if self.mean is None else self.decay * self.mean + (1 - self.decay) * norm
        return False
