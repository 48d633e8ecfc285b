"""The calibration's result: one :class:`Row` per candidate, the :class:`Calibration` (table, choice, summary
rows, ``tune.txt``/``tune.json``) and :class:`TuneReport`, which carries its rows into the run summary.

Kept apart from :mod:`~lightning_deepseek.app.tune.calibrate`, which measures the candidates and decides: this
module is only the record of what was measured and how it is shown.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback

from lightning_deepseek.app.tune.configurations import Configuration

STEAL_WARNING = 0.05  # the table warns from this share of the CPU taken by the host during the calibration


@dataclass(frozen=True)
class Row:
    """One line of the table: a candidate and what its measurement gave.

    Args:
        candidate: the configuration.
        state: ``measured``, ``pruned``, ``failed`` or ``reference`` (plain DDP measured for the
            ratios although the forced settings exclude it).
        tokens_per_s: measured throughput (``None`` when not measured to the end).
        note: why it was pruned or failed.
        step_seconds: each timed step's time, every round one after the other: the increments of the slowest
            rank's elapsed time (the same on every rank, so every rank decides alike).
        seconds: this rank's wall time of the candidate's fits, by phase: ``setup`` (``Trainer`` and strategy
            set-up up to the first batch), ``warmup`` (untimed steps), ``timed`` (timed steps), ``teardown``.
    """

    candidate: Configuration
    state: str
    tokens_per_s: float | None = None
    note: str = ""
    step_seconds: tuple[float, ...] = ()
    seconds: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Calibration:
    """The measured table and the choice.

    Args:
        mode: ``quick`` or ``grid``.
        rows: every candidate, plain DDP first.
        choice: the configuration training uses.
        seconds: wall time of the calibration once every process is up.
        kept: the forced settings, ``compression=int8``-style (empty: none).
        min_gain: the margin by which a candidate must beat plain DDP to be chosen.
        launch_seconds: starting the other processes (in the first fit; any run pays it, so not counted above).
        reason: why the choice (``calibrate.choose``): its gain over plain DDP against the margin, or why plain
            DDP stayed.
        margin: the gain over plain DDP the fastest other needed (``min_gain`` or the measured noise, the larger).
        stolen: the share of this machine's CPU its hypervisor gave to other guests during the calibration
            (:mod:`~lightning_deepseek.app.tune.steal`; 0 on bare metal or where unknown).
        paired: the others measured against plain DDP in paired rounds (``tune.budget``; empty: none ran), each
            round's plain DDP mean step time over the other's.
    """

    mode: str
    rows: list[Row]
    choice: Configuration
    seconds: float
    kept: str = ""
    min_gain: float = 0.0
    launch_seconds: float = 0.0
    reason: str = ""
    margin: float = 0.0
    stolen: float = 0.0
    paired: dict[str, tuple[float, ...]] = field(default_factory=dict)

    def phases(self) -> dict[str, float]:
        """Where the calibration's seconds went (this rank): each phase summed over the candidates."""
        out: dict[str, float] = {}
        for row in self.rows:
            for phase, value in row.seconds.items():
                out[phase] = out.get(phase, 0.0) + value
        out["other"] = self.seconds - sum(out.values())  # Optuna, configs, the all-reduces between trials
        return {k: round(v, 2) for k, v in out.items()}

    @property
    def baseline(self) -> float | None:
        return next((r.tokens_per_s for r in self.rows if r.candidate.is_plain_ddp), None)

    def ratio(self, row: Row) -> float | None:
        if row.tokens_per_s is None or not self.baseline:
            return None
        return row.tokens_per_s / self.baseline

    @property
    def choice_ratio(self) -> float | None:
        return next((self.ratio(r) for r in self.rows if r.candidate == self.choice), None)

    def table(self) -> str:
        """The table as printed and written to ``tune.txt``."""
        width = max(len(r.candidate.name) for r in self.rows)
        lines = [f"calibration (tune={self.mode}, {self.seconds:.1f} s once the processes were up): tokens/s of each "
                 "configuration, side by side with plain DDP in the same processes",
                 f"{'configuration':<{width}}  {'tokens/s':>9}  {'vs ddp':>6}  state"]
        for row in self.rows:
            tps = f"{row.tokens_per_s:9.0f}" if row.tokens_per_s is not None else f"{'-':>9}"
            ratio = self.ratio(row)
            shown = f"{ratio:5.2f}x" if ratio is not None else f"{'-':>6}"
            mark = "  <- chosen" if row.candidate == self.choice else ""
            note = f" ({row.note})" if row.note else ""
            lines.append(f"{row.candidate.name:<{width}}  {tps}  {shown}  {row.state}{note}{mark}")
        if self.kept:
            lines.append(f"kept as set (forced): {self.kept}; candidates that would change it were not tried")
        lines.append(f"choice: {self.choice.name} = lds-train {' '.join(self.choice.overrides())} tune=none")
        lines.append(f"why: {self.reason}")
        for name, ratios in self.paired.items():
            lines.append(f"paired rounds (tune.budget): plain DDP's step time over {name}'s, each round back to back: "
                         f"{' '.join(f'{r:.3f}' for r in ratios)}")
        if self.stolen >= STEAL_WARNING:
            lines.append(f"host: the hypervisor took {self.stolen:.0%} of this machine's CPU during the calibration "
                         "(steal), so its timings are less reliable than usual; calibrate again when the host is "
                         "quieter, or give the settings (strategy=..., compression=...) with tune=none")
        return "\n".join(lines)

    def summary(self) -> dict[str, Any]:
        """Rows of the run summary."""
        ratio = self.choice_ratio
        return {"tune_choice": self.choice.name,
                "tune_vs_plain_ddp": round(ratio, 3) if ratio is not None else None,
                "tune_candidates": ", ".join(f"{sum(r.state == s for r in self.rows)} {s}"
                                             for s in ("measured", "pruned", "skipped")
                                             if any(r.state == s for r in self.rows)) + f" of {len(self.rows)}",
                "tune_reason": self.reason,
                "tune_seconds": round(self.seconds, 1)}

    def write(self, folder: Path) -> None:
        """``tune.txt`` (the table) and ``tune.json`` (the same, for scripts) in the run folder."""
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "tune.txt").write_text(self.table() + "\n")
        rows = [{"name": r.candidate.name, "overrides": r.candidate.overrides(), "state": r.state,
                 "tokens_per_s": r.tokens_per_s, "vs_plain_ddp": self.ratio(r), "note": r.note,
                 "step_seconds": list(r.step_seconds), "seconds": r.seconds} for r in self.rows]
        (folder / "tune.json").write_text(json.dumps(
            {"mode": self.mode, "seconds": self.seconds, "launch_seconds": self.launch_seconds,
             "phases": self.phases(), "kept": self.kept, "min_gain": self.min_gain, "margin": self.margin,
             "reason": self.reason, "cpu_stolen_by_host": self.stolen,
             "choice": self.choice.name, "choice_overrides": self.choice.overrides(),
             "choice_fields": asdict(self.choice), "rows": rows,
             "paired": {name: list(ratios) for name, ratios in self.paired.items()}}, indent=2))


class TuneReport(Callback):
    """Puts the calibration's rows into the run summary (``RunSummary`` reads ``summary()`` of callbacks)."""

    def __init__(self, rows: dict[str, Any]) -> None:
        self.rows = dict(rows)

    def summary(self) -> dict[str, Any]:
        return dict(self.rows)
