"""The package's public names: all importable, and the light ones without Optuna or Hydra installed."""

from __future__ import annotations

import subprocess
import sys

import lightning_deepseek


def test_every_public_name_resolves() -> None:
    for name in lightning_deepseek.__all__:
        assert getattr(lightning_deepseek, name) is not None, name


def test_training_components_import_without_optuna_or_hydra() -> None:
    # The GPU machines have torch and Lightning but not the search stack: benchmarks there import these names.
    code = ("import sys\nfor m in ('optuna', 'hydra', 'omegaconf'): sys.modules[m] = None\n"
            "from lightning_deepseek import (GPTConfig, GradientCompression, HybridParallelStrategy, LightningGPT,\n"
            "                                StagedPrecision, TextDataModule)\n"
            "assert 'optuna' not in [m for m, v in sys.modules.items() if v is not None]\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
