"""The package's public names: all importable, and the light ones without Optuna or Hydra installed."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import lightning_deepseek


def test_every_public_name_resolves() -> None:
    for name in lightning_deepseek.__all__:
        assert getattr(lightning_deepseek, name) is not None, name


def test_importing_the_strategy_registers_hybrid_with_lightning() -> None:
    """What the README's snippets rely on: ``Trainer(strategy="hybrid")`` after the strategy's import."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_deepseek import HybridParallelStrategy

    assert StrategyRegistry["hybrid"]["strategy"] is HybridParallelStrategy
    trainer = pl.Trainer(strategy="hybrid", accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    assert isinstance(trainer.strategy, HybridParallelStrategy)


def test_training_components_import_without_optuna_or_hydra() -> None:
    # The GPU machines have torch and Lightning but not the search stack: benchmarks there import these names.
    code = ("import sys\nfor m in ('optuna', 'hydra', 'omegaconf'): sys.modules[m] = None\n"
            "from lightning_deepseek import GradientCompression, HybridParallelStrategy, StagedPrecision\n"
            "from lightning_deepseek.data import TextDataModule\n"
            "from lightning_deepseek.models import GPTConfig, LightningGPT\n"
            "assert 'optuna' not in [m for m, v in sys.modules.items() if v is not None]\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_a_built_wheel_carries_the_hydra_configs(tmp_path: Path) -> None:
    # lds-train reads its configs next to cli.py: a plain (non-editable) install must ship every one of them.
    import setuptools

    if importlib.util.find_spec("wheel") is None and _version(setuptools.__version__) < (70, 1):
        pytest.skip(f"setuptools {setuptools.__version__} needs the `wheel` package to build wheels offline")
    root = Path(__file__).resolve().parents[1]
    made_here = not (root / "build").exists()  # setuptools builds in the tree: remove what this test made
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path), str(root)], capture_output=True, text=True, timeout=300,
                           cwd=tmp_path)
    if made_here:
        shutil.rmtree(root / "build", ignore_errors=True)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = tmp_path.glob("*.whl")
    shipped = {name for name in zipfile.ZipFile(wheel).namelist() if name.startswith("lightning_deepseek/app/conf/")}
    configs = {str(p.relative_to(root)) for p in (root / "lightning_deepseek" / "app" / "conf").rglob("*.yaml")}
    assert configs and shipped == configs


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")[:2] if part.isdigit())
