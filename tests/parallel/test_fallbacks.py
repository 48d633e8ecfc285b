"""When the strategy ends up sharding nothing it says so and names the knob; the placement line states what it
measured (on one node: nothing, there is nothing to choose).

- one process (``Trainer(devices=1, strategy="hybrid")``, in this pytest process): a warning and a plan line that
  explains the empty plan;
- two gloo ranks at ``tp=2`` (the ``two_ranks`` fixture): a model whose feed-forward blocks are all under
  ``min_shard_params`` (warning with the largest block's size as the setting to use), one with no feed-forward
  block at all, and the one-node placement line;
- the placement line of two islands, with and without link figures (pure function).
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import pytest
import torch.distributed as dist

from lightning_deepseek import HybridParallelStrategy
from lightning_deepseek.parallel.placement import LinkCost, describe_placement
from lightning_deepseek.parallel.topology import Topology
from tests.parallel.common import LogRecords, TinyLM, loader, make_trainer, token_data


@contextmanager
def captured() -> Iterator[dict[str, list[str]]]:
    """Lightning's rank-zero info lines and every warning raised inside the block."""
    handler, out = LogRecords(), {"info": [], "warnings": []}
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield out
        out["warnings"] = [str(w.message) for w in caught]
        out["info"] = handler.messages
    finally:
        for lg, level in zip(loggers, levels):
            lg.removeHandler(handler)
            lg.setLevel(level)


def _fit_one_step(world_size: int, strategy: HybridParallelStrategy, **model_kwargs: Any) -> dict[str, Any]:
    with captured() as out:
        trainer = make_trainer(world_size, strategy, max_steps=1)
        trainer.fit(TinyLM(**model_kwargs), loader(token_data(4 * world_size), 2))
    return {**out, "plan": list(strategy.plan)}


def fallback_scenarios(world_size: int) -> dict[str, Any]:
    """tp=2 runs whose automatic plan comes out empty (run on 2 ranks by the ``two_ranks`` fixture)."""
    result = {
        "small_blocks": _fit_one_step(world_size, HybridParallelStrategy(tensor_parallel_size=2)),
        "no_block": _fit_one_step(world_size, HybridParallelStrategy(tensor_parallel_size=2, min_shard_params=0),
                                  mlp_ratio=1),  # hidden width = model width: not a feed-forward block
    }
    return result if dist.get_rank() == 0 else {}


def _one(messages: list[str], needle: str) -> str:
    found = [m for m in messages if needle in m]
    assert len(found) == 1, (needle, messages)
    return found[0]


@pytest.fixture
def one_process() -> Iterator[dict[str, Any]]:
    """``Trainer(devices=1, strategy="hybrid")`` here; the process group and Lightning's variables are undone."""
    environ = dict(os.environ)
    try:
        pl.seed_everything(0, verbose=False)
        trainer = pl.Trainer(strategy="hybrid", accelerator="cpu", devices=1, max_steps=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        with captured() as out:
            trainer.fit(TinyLM(), loader(token_data(4), 2))
        yield {**out, "strategy": trainer.strategy}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)


def test_one_device_warns_that_it_is_plain_ddp(one_process: dict[str, Any]) -> None:
    assert isinstance(one_process["strategy"], HybridParallelStrategy) and list(one_process["strategy"].plan) == []
    warning = _one(one_process["warnings"], "HybridParallelStrategy")
    assert "one process (Trainer devices=1, num_nodes=1)" in warning and "plain DDP on one process" in warning
    assert "trainer.devices=2" in warning
    plan_line = _one(one_process["info"], "HybridParallelStrategy plan")
    assert "empty plan: one process" in plan_line and "|" not in plan_line  # a reason, not an empty table


def test_blocks_under_min_shard_params_warn_with_the_setting_to_use(two_ranks: dict[str, Any]) -> None:
    result = two_ranks["fallbacks"]["small_blocks"]
    assert result["plan"] == []
    # TinyLM's blocks: fc1 32x128 + 128, fc2 128x32 + 32 = 8,352 parameters, under the default 65,536.
    warning = _one(result["warnings"], "min_shard_params")
    assert "no feed-forward block reaches min_shard_params=65536" in warning
    assert "(model.blocks.0.mlp.fc1, model.blocks.0.mlp.fc2) has 8,352 parameters" in warning
    assert "Set min_shard_params=8352 (lds-train: strategy.min_shard_params=8352) to shard it" in warning
    assert "plain DDP over 2 processes" in warning
    plan_line = _one(result["info"], "HybridParallelStrategy plan (tp=2, dp=1)")
    assert "empty plan: no feed-forward block reaches min_shard_params=65536" in plan_line


def test_model_without_feed_forward_block_warns_and_names_explicit_plan(two_ranks: dict[str, Any]) -> None:
    result = two_ranks["fallbacks"]["no_block"]
    assert result["plan"] == []
    warning = _one(result["warnings"], "HybridParallelStrategy")
    assert "plan='auto' found no feed-forward block" in warning and "explicit plan" in warning
    assert "empty plan: plan='auto' found no feed-forward block" in _one(result["info"], "HybridParallelStrategy plan")


def test_one_node_placement_line_says_there_is_nothing_to_choose(two_ranks: dict[str, Any]) -> None:
    line = _one(two_ranks["fallbacks"]["small_blocks"]["info"], "HybridParallelStrategy placement")
    assert "mesh (dp x tp) = [[0, 1]]" in line and "topology [[0, 1]]" in line
    assert "one island" in line and "nothing to choose" in line
    assert "Gbit/s" not in line and " ms" not in line  # no figures that nothing measured


def test_two_island_placement_line_quotes_only_figures_it_has() -> None:
    two_nodes = Topology(((0, 1), (2, 3)), "declared")
    fixed = describe_placement("dp_intra_node", "dp_intra_node", [[0, 2], [1, 3]], two_nodes, {}, None, "")
    assert "placement='dp_intra_node' as set; links not measured, no estimate made" in fixed
    assert "Gbit/s" not in fixed
    links = {"intra": LinkCost(100e9 / 8, 5e-6), "inter": LinkCost(1e9 / 8, 1e-4)}
    estimates = {"tp_intra_node": 0.0021, "dp_intra_node": 0.0305}
    chosen = describe_placement("auto", "tp_intra_node", [[0, 1], [2, 3]], two_nodes, estimates, links, "probed")
    assert "the lowest estimate; estimated communication per step: tp_intra_node=2.1 ms, dp_intra_node=30.5 ms" \
        in chosen
    assert "links probed: intra 100.00 Gbit/s 5 us, inter 1.00 Gbit/s 100 us" in chosen
