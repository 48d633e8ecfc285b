"""The examples of the README and docs run as documented (2 real gloo processes where they train with DDP or
hybrid parallelism) and print what they promise.

Each one is a plain Lightning script a user copies from; an API change that breaks one would otherwise show only
to the next reader. ~10-15 s each on a 2-core machine; the elastic example is run by tests/elastic/test_torchrun.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run_example(name: str, *args: str, cwd: Path) -> str:
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


def test_compression_example_matches_fp32_ddp(tmp_path: Path) -> None:
    out = run_example("compression_ddp_cpu.py", "--bits", "4", cwd=tmp_path)
    found = re.search(r"final train loss: fp32 DDP ([\d.]+), int4 DDP ([\d.]+)", out)
    assert found, out[-2000:]
    baseline, compressed = map(float, found.groups())
    assert compressed == pytest.approx(baseline, rel=0.05)
    assert "'compression': 'int4" in out


def test_precision_example_walks_its_stages(tmp_path: Path) -> None:
    out = run_example("precision_ddp.py", cwd=tmp_path)
    assert "stage changes: [(12, '32-true -> 16-mixed'), (96, '16-mixed -> bf16-mixed')]" in out
    assert "'precision_final': 'bf16-mixed'" in out


def test_hybrid_example_shards_the_encoder_feed_forward(tmp_path: Path) -> None:
    out = run_example("hybrid_transformer.py", cwd=tmp_path)
    assert "HybridParallelStrategy plan (tp=2, dp=1)" in out
    assert "| encoder.layers.1.linear2 | rowwise |" in out
    assert "`Trainer.fit` stopped: `max_steps=30` reached." in out


def test_train_gpt_example_trains_and_checkpoints(tmp_path: Path) -> None:
    out = run_example("train_gpt.py", cwd=tmp_path)
    assert "`Trainer.fit` stopped: `max_steps=200` reached." in out
    assert list((tmp_path / "outputs" / "example").rglob("*.ckpt"))  # Lightning's checkpoint, after validation


def test_hpo_example_runs_a_resumable_search(tmp_path: Path) -> None:
    out = run_example("hpo_search.py", "--trials", "3", "--steps", "20", "--out", str(tmp_path / "hpo"), cwd=tmp_path)
    assert re.search(r"best trial \d: val_loss=[\d.]+ params=\{'learning_rate'", out), out[-2000:]
    assert (tmp_path / "hpo" / "trials.csv").is_file()
    again = run_example("hpo_search.py", "--trials", "3", "--steps", "20", "--out", str(tmp_path / "hpo"), cwd=tmp_path)
    assert "[hpo] trial" not in again  # every trial is in the study already: nothing runs again


def test_finetune_sharded_example_loads_trains_and_exports(tmp_path: Path) -> None:
    out = run_example("finetune_sharded.py", cwd=tmp_path)
    assert "parameters on this rank: 41120 of 82240" in out  # FSDP-2: half of the model
    assert re.search(r"exported model: LlamaForCausalLM, loss [\d.]+", out), out[-2000:]
    assert (tmp_path / "finetuned" / "model.safetensors").is_file()
