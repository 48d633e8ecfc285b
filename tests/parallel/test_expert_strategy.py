"""``HybridParallelStrategy(expert_parallel_size=2)`` with Lightning on 2 real gloo processes (one spawn):

- ep=2 with ``ExpertLoadBalancing``, gradient clipping (the mesh-aware norm over expert shards): losses and final
  weights of 20 SGD steps match one process on the global batch with the same bias updates (1e-5 relative);
- ep=2 with tp=2 (the dense feed-forward of the first layer tensor-parallel) and gradient accumulation: the same;
- a DCP checkpoint of the expert-parallel run reloads into an ep=2 run exactly, and into one process (what
  ``lds-sample`` reads) with the experts whole;
- ep=2 on a model with no MoE layer: a warning naming what was looked for, then plain training.
"""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist

from lightning_deepseek import HybridParallelStrategy
from lightning_deepseek.moe import ExpertLoadBalancing, find_expert_layers
from lightning_deepseek.moe.balancing import LoadCounter, update_biases
from tests.helpers import run_distributed
from tests.parallel.common import (
    TinyLM,
    full_state,
    global_indices,
    lm_loss,
    loader,
    make_trainer,
    relative_error,
    token_data,
)

STEPS, MICRO, TOL, RATE = 20, 2, 1e-5, 1e-2
MOE = dict(n_routed_experts=4, moe_top_k=2, n_shared_experts=1, moe_hidden=32, n_dense_layers=1, mlp_ratio=4)


def fit(world_size: int, steps: int, tp: int, folder: str, accumulate: int = 1, clip: float | None = None,
        ckpt: str | None = None, resume: str | None = None) -> dict[str, Any]:
    dataset = token_data(steps * accumulate * world_size * MICRO)
    pl.seed_everything(0, verbose=False)
    module = TinyLM(**MOE)
    strategy = HybridParallelStrategy(tensor_parallel_size=tp, expert_parallel_size=2, min_shard_params=0)
    balancing = ExpertLoadBalancing(update_rate=RATE)
    trainer = make_trainer(world_size, strategy, max_steps=steps, accumulate_grad_batches=accumulate,
                           gradient_clip_val=clip, callbacks=[balancing], default_root_dir=folder)
    trainer.fit(module, loader(dataset, MICRO), ckpt_path=resume)
    if ckpt is not None:
        trainer.save_checkpoint(ckpt)
    losses: list[Any] = [None] * world_size
    dist.all_gather_object(losses, module.losses)
    return {"losses": losses, "state": full_state(module), "summary": strategy.summary(),
            "tp_plan": [e.name for e in strategy.plan], "imbalance": balancing.history}


def no_moe(world_size: int) -> list[str]:
    pl.seed_everything(0, verbose=False)
    strategy = HybridParallelStrategy(tensor_parallel_size=1, expert_parallel_size=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(world_size, strategy, max_steps=2).fit(TinyLM(), loader(token_data(8), MICRO))
    return [str(w.message) for w in caught if "expert_parallel_size" in str(w.message)]


def scenarios(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    ckpt = str(Path(folder) / "ep.ckpt")
    ep = fit(world_size, STEPS, tp=1, folder=folder, clip=0.5, ckpt=ckpt)
    resumed = fit(world_size, STEPS, tp=1, folder=folder, clip=0.5, resume=ckpt)  # at max_steps: loads only
    plot = (Path(folder) / "expert_load.png").is_file()
    return {"ep": ep, "ep_tp": fit(world_size, STEPS // 2, tp=2, folder=folder, accumulate=2),
            "resumed": resumed["state"], "no_moe": no_moe(world_size), "ckpt": ckpt, "plot": plot}


def reference(world_size: int, steps: int, accumulate: int = 1, clip: float | None = None
              ) -> tuple[list[float], dict[str, Any]]:
    dataset = token_data(steps * accumulate * world_size * MICRO)
    pl.seed_everything(0, verbose=False)
    module = TinyLM(**MOE)
    optimizer = module.configure_optimizers()
    counter = LoadCounter(find_expert_layers(module))
    losses = []
    for step in range(steps):
        for k in range(accumulate):
            batch = dataset[global_indices(step * accumulate + k, world_size * MICRO, len(dataset))]
            loss = lm_loss(module.model, batch)
            (loss / accumulate).backward()
            losses.append(loss.item())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        update_biases(counter.layers, counter.take(), RATE)
    return losses, full_state(module)


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_distributed(scenarios, 2, str(tmp_path_factory.mktemp("ep")), timeout=400)[0]


def _check(run: dict[str, Any], steps: int, accumulate: int = 1, clip: float | None = None) -> None:
    ref_losses, ref_state = reference(2, steps, accumulate, clip)
    ours = [accumulate * sum(pair) / 2 for pair in zip(*run["losses"])]  # Lightning reports loss / accumulate
    for step, (a, b) in enumerate(zip(ours, ref_losses)):
        assert abs(a - b) <= TOL * abs(b), f"micro-batch {step}: {a} vs {b}"
    assert relative_error(run["state"], ref_state) < TOL


def test_ep2_with_balancing_and_clipping_matches_one_process(result: dict[str, Any]) -> None:
    _check(result["ep"], STEPS, clip=0.5)
    assert result["ep"]["summary"]["expert_parallel"] == "ep=2 x edp=1, 1 MoE layers"
    assert result["ep"]["summary"]["expert_param_bytes_vs_ddp"] < 1.0
    assert len(result["ep"]["imbalance"]) == STEPS and all(row[1] >= 1.0 for row in result["ep"]["imbalance"])
    assert result["plot"] or importlib.util.find_spec("matplotlib") is None  # rank 0 drew expert_load.png


def test_ep2_with_tp2_and_accumulation_matches_one_process(result: dict[str, Any]) -> None:
    assert result["ep_tp"]["tp_plan"]  # the dense first layer and the shared expert are tensor-parallel
    _check(result["ep_tp"], STEPS // 2, accumulate=2)


def test_dcp_checkpoint_with_expert_shards_reloads_exactly(result: dict[str, Any]) -> None:
    assert relative_error(result["resumed"], result["ep"]["state"]) == 0.0


def test_dcp_checkpoint_with_expert_shards_loads_into_one_process(result: dict[str, Any]) -> None:
    from lightning.fabric.utilities.load import _load_distributed_checkpoint  # what lds-sample reads with

    state = _load_distributed_checkpoint(Path(result["ckpt"]))["state_dict"]
    full = {name: state[name].numpy() for name in result["ep"]["state"]}
    assert relative_error(full, result["ep"]["state"]) == 0.0  # the experts come back whole at ep=1


def test_ep_on_a_model_without_moe_warns_and_trains(result: dict[str, Any]) -> None:
    assert len(result["no_moe"]) == 1
    assert "has no MoE layer: looked for modules marked `is_moe_experts`" in result["no_moe"][0]
    assert "set expert_parallel_size=1" in result["no_moe"][0]
