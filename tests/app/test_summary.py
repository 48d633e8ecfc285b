"""``RunSummary``: the curves survive a resume, the plot smooths the train loss as TensorBoard does."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_deepseek.app.summary import RunSummary, smooth


def test_smoothing_starts_at_the_first_value_and_follows_the_trend() -> None:
    values = [5.0, 4.0, 6.0, 3.0, 3.0, 3.0]
    smoothed = smooth(values)
    assert smoothed[0] == 5.0
    assert smoothed[1] == pytest.approx((0.9 * 0.1 * 5.0 + 0.1 * 4.0) / (1 - 0.81))
    assert min(values) < smoothed[-1] < max(values)
    assert smooth([2.0] * 5) == pytest.approx([2.0] * 5)


def test_state_round_trip_and_plot(tmp_path: Path) -> None:
    summary = RunSummary(tmp_path / "2026-12-01" / "10-00-00-000001")
    summary.train_curve = [(s, 5.0 - 0.1 * s) for s in range(1, 30)]
    summary.val_curve = [(10, 4.0), (20, 3.5)]
    summary.lr_curve = [(s, 1e-3 * min(1.0, s / 10)) for s in range(1, 30)]
    restored = RunSummary(tmp_path)
    restored.load_state_dict(summary.state_dict())
    assert restored.train_curve == summary.train_curve and restored.lr_curve == summary.lr_curve
    summary.run_dir.mkdir(parents=True)
    summary._plot(events=[(5, "32-true -> 16-mixed")])
    assert (summary.run_dir / "loss.png").read_bytes()[:4] == b"\x89PNG"
