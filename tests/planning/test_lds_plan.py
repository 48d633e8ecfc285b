"""``lds-plan`` as a user meets it: a plan as a table and as JSON, ``layout=auto`` ranking what fits, and bad input
(an unknown preset, a cluster file lacking fields, a layout the world cannot hold, a model that fits no layout)
ending in one paragraph and exit code 2, and a search its ``time_limit`` ended."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from lightning_deepseek.app.errors import ConfigError
from lightning_deepseek.app.plan import CONFIG_DIR, _search_table, resolve_cluster, run_plan
from lightning_deepseek.planning import ClusterSpecError, PlanLayout
from lightning_deepseek.planning.search import SearchResult, candidate_layouts

SMALL = ["model=lds-tiny", "world_size=4", "cluster=cpu", "step.seq_len=32", "step.dtype=fp32",
         "strategy.min_shard_params=0"]


def lds_plan(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from lightning_deepseek.app.plan import main; main()", *overrides],
                          capture_output=True, text=True, timeout=300)


def config(*overrides: str):  # noqa: ANN201 - an OmegaConf DictConfig
    with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
        return compose("plan", list(overrides))


def test_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_plan(config(*SMALL, "strategy.tensor_parallel_size=2")) == 0
    table = capsys.readouterr().out
    assert "layout dp=2 tp=2" in table and "| tp | all_gather | 2 | " in table
    assert run_plan(config(*SMALL, "strategy.shard_optimizer_states=true", "output=json")) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["layout"]["shard_optimizer_states"] and report["fits"]
    assert report["memory"]["states_max"] >= report["memory"]["states"]


def test_layout_auto_ranks_what_fits(capsys: pytest.CaptureFixture[str]) -> None:
    candidates = candidate_layouts(2, resolve_cluster("cpu").gpus_per_node, [], 2)  # lds-tiny: 2 blocks
    assert len([c for c in candidates if c.pp == 2]) >= 6  # 1F1B (4 stages for the others: more than 2 blocks)
    two_ranks = [override for override in SMALL if not override.startswith("world_size=")] + ["world_size=2"]
    assert run_plan(config(*two_ranks, "layout=auto", "workers=1")) == 0  # side by side: tests/planning/test_pool.py
    out = capsys.readouterr().out
    assert "| 1 | " in out and "fastest" in out
    counts = re.search(r"\n(\d+) layouts fit, 0 do not, 0 refused by the strategy, (\d+) not planned", out)
    assert counts is not None, out  # the rest pruned by a bound against the 5 fastest (planning/search.py)
    fit, pruned = map(int, counts.groups())
    assert fit >= 5 and fit + pruned == len(candidates)


def test_bad_input_exits_2(tmp_path: Path) -> None:
    unknown = lds_plan("model=llama-9000")
    assert unknown.returncode == 2 and "llama3-8b" in unknown.stderr and "deepseek-v3" in unknown.stderr
    (tmp_path / "c.yaml").write_text("name: mine\ngpus_per_node: 8\n")
    with pytest.raises(ClusterSpecError, match="lacks peak_tflops, memory_gib"):
        run_plan(config(*SMALL, f"cluster={tmp_path / 'c.yaml'}"))
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the world size 4"):
        run_plan(config(*SMALL, "strategy.tensor_parallel_size=3"))
    with pytest.raises(ConfigError, match="workers=0 must be auto"):
        run_plan(config(*SMALL, "layout=auto", "workers=0"))
    with pytest.raises(ConfigError, match="time_limit=-1 must be a positive number of seconds"):
        run_plan(config(*SMALL, "layout=auto", "time_limit=-1"))


def test_time_limit_says_what_it_left() -> None:
    """``time_limit``: a search it ends says how many layouts it left; one that found nothing fitting says to raise
    it (exit 2)."""
    table = _search_table(SearchResult((), (), (), (), (PlanLayout(), PlanLayout(tp=2))), top=5)
    assert "time_limit ended the search: 2 layouts neither planned nor ruled out by a bound" in table
    with pytest.raises(ConfigError, match=r"time_limit=1e-09 s ended the search before a layout of 4 ranks fit "
                                          r"lds-tiny: \d+ layouts were not planned. Raise time_limit"):
        run_plan(config(*SMALL, "layout=auto", "workers=1", "time_limit=1e-9"))


def test_fits_no_layout(tmp_path: Path) -> None:
    tiny = (Path(CONFIG_DIR) / "presets" / "cluster" / "cpu.yaml").read_text().replace("memory_gib: 23.5",
                                                                                         "memory_gib: 0.0002")
    (tmp_path / "tiny.yaml").write_text(tiny)
    with pytest.raises(ConfigError, match=r"fits no supported layout on 4 x cpu: the closest, .* GiB more than"):
        run_plan(config(*SMALL, "layout=auto", "workers=1", f"cluster={tmp_path / 'tiny.yaml'}"))
