"""``HybridParallelStrategy(expert_parallel_size=...)`` with Lightning on real gloo processes: one 2-process spawn
and one 4-process spawn, each running several scenarios (process start dominates their cost).

2 ranks:
- ep=2 with ``ExpertLoadBalancing``, gradient clipping (the mesh-aware norm over expert shards): losses and final
  weights of 20 SGD steps match one process on the global batch with the same bias updates (1e-5 relative);
- ep=2 with tp=2 (the dense feed-forward of the first layer tensor-parallel) and gradient accumulation: the same;
- a DCP checkpoint of the expert-parallel run reloads into an ep=2 run exactly, and into one process (what
  ``lds-sample`` reads) with the experts whole;
- ep=2 on a model with no MoE layer: a warning naming what was looked for, then plain training;
- ep=2 under ``StagedPrecision`` (FP32 -> FP16 with loss scaling -> BF16, clipping): every stage runs, the losses
  stay within 3% of the FP32 reference;
- ep=2 with ``GradientCompression`` (int8, error feedback) on the data-parallel exchange of the non-expert
  gradients: the hook runs every step, the losses stay within 3% of the uncompressed reference;
- ``ElasticTraining`` at ep=2 (``LightningGPT`` MoE with ``ExpertLoadBalancing``): a job stopped after its step-3
  checkpoint and resumed ends bitwise equal to an uninterrupted one (weights and balancing biases);
- ``lds-sample`` from the DCP checkpoint of an ep=2 ``LightningGPT`` run (``moe-tiny``): the experts come back
  whole (the weights as trained) and it prints text after the prompt.

4 ranks:
- the plain expert-parallel loop of ``test_expert.py`` at ep=2 x edp=2 and ep=4 against one process;
- resume at another EP size: the ep=2 checkpoint (2 ranks) loaded into one process (the strategy's DCP loader, no
  process group) is exactly as saved (weights, momenta, balancing biases) and its next 10 steps match one process
  running all 30 uninterrupted; the same checkpoint at ep=4 (4 ranks, the same global batch size) starts exactly
  as saved and its 10 steps match the one-process continuation on the batches the resumed run trained on (Lightning
  picks them: resumed on an epoch's last batch, 2.6 trains one batch of the next epoch, then goes on to the one
  after);
- node-limited routing: ``ExpertRouting(max_islands_per_token=1)`` on the declared topology ``"0,1;2,3"`` at ep=4
  (which makes ``dispatch="auto"`` dispatch per island): no token's experts span two islands, and losses and weights
  match one process routing with the same expert groups;
- the per-island dispatch in the plain loop, unrestricted and node-limited (``test_expert_dispatch.py``).
"""

from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

from lightning_deepseek import HybridParallelStrategy
from lightning_deepseek.moe import ExpertLoadBalancing, find_expert_layers
from lightning_deepseek.moe.balancing import LoadCounter, update_biases
from lightning_deepseek.parallel import Cluster, ExpertRouting
from lightning_deepseek.parallel.checkpoint import load_distributed
from tests.helpers import run_distributed
from tests.parallel.common import (
    TinyLM,
    full_state,
    global_indices,
    lm_loss,
    loader,
    make_trainer,
    reference_run,
    relative_error,
    token_data,
)
from tests.parallel.test_expert import _check as check_plain_loop
from tests.parallel.test_expert import expert_parallel_run
from tests.parallel.test_expert_dispatch import check_island_runs, island_scenarios

STEPS, MICRO, TOL, RATE = 20, 2, 1e-5, 1e-2
RESUMED, LIMITED_STEPS, STAGED_STEPS, TOPOLOGY = 30, 10, 10, "0,1;2,3"
MOE = dict(n_routed_experts=4, moe_top_k=2, n_shared_experts=1, moe_hidden=32, n_dense_layers=1, mlp_ratio=4)


class _RecordStart(pl.Callback):
    """Weights, momenta and balancing biases as a resumed run starts (after the checkpoint is loaded)."""

    start: dict[str, np.ndarray] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step:
            self.start = {**full_state(pl_module), **_optimizer_state(pl_module, trainer.optimizers[0])}


class _RecordBatches(pl.Callback):
    """The batches of every training step (numpy: they are pickled to the parent)."""

    def __init__(self) -> None:
        self.batches: list[tuple[np.ndarray, np.ndarray]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.batches.append((batch[0].numpy().copy(), batch[1].numpy().copy()))


class _RecordIslands(pl.Callback):
    """The most islands any token's routed experts spanned (experts 0..E/2-1 on one island, the rest on the other)."""

    most = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for layer in find_expert_layers(pl_module):
            layer.experts.register_forward_pre_hook(self._count(layer.num_experts // 2))

    def _count(self, per_island: int) -> Any:
        def count(module: torch.nn.Module, args: tuple) -> None:
            islands = args[1] // per_island
            self.most = max(self.most, 1 + int((islands.max(1).values != islands.min(1).values).any()))
        return count


def _optimizer_state(module: TinyLM, optimizer: torch.optim.Optimizer) -> dict[str, np.ndarray]:
    """Full momenta (``momentum/<name>``) and balancing biases (``bias/<layer>``); collective under EP."""
    out = {}
    for name, param in module.named_parameters():
        buf = optimizer.state[param]["momentum_buffer"]
        out[f"momentum/{name}"] = (buf.full_tensor() if hasattr(buf, "full_tensor") else buf).detach().numpy().copy()
    out.update({f"bias/{layer.name}": layer.bias.detach().numpy().copy() for layer in find_expert_layers(module)})
    return out


def fit(world_size: int, steps: int, tp: int, folder: str, accumulate: int = 1, clip: float | None = None,
        ckpt: str | None = None, resume: str | None = None, ep: int = 2, micro: int = MICRO,
        dataset: TensorDataset | None = None, callbacks: tuple[pl.Callback, ...] = (), **strategy_kwargs: Any
        ) -> dict[str, Any]:
    dataset = dataset or token_data(steps * accumulate * world_size * micro)
    pl.seed_everything(0, verbose=False)
    module = TinyLM(**MOE)
    strategy = HybridParallelStrategy(tensor_parallel_size=tp, expert_parallel_size=ep, min_shard_params=0,
                                      **strategy_kwargs)
    balancing, record = ExpertLoadBalancing(update_rate=RATE), _RecordStart()
    trainer = make_trainer(world_size, strategy, max_steps=steps, accumulate_grad_batches=accumulate,
                           gradient_clip_val=clip, callbacks=[balancing, record, *callbacks], default_root_dir=folder)
    trainer.fit(module, loader(dataset, micro), ckpt_path=resume)
    if ckpt is not None:
        trainer.save_checkpoint(ckpt)
    losses: list[Any] = [None] * world_size
    dist.all_gather_object(losses, module.losses)
    return {"losses": losses, "state": full_state(module), "summary": strategy.summary(),
            "tp_plan": [e.name for e in strategy.plan], "imbalance": balancing.history, "start": record.start,
            "end": _optimizer_state(module, trainer.optimizers[0])}


def no_moe(world_size: int) -> list[str]:
    pl.seed_everything(0, verbose=False)
    strategy = HybridParallelStrategy(tensor_parallel_size=1, expert_parallel_size=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(world_size, strategy, max_steps=2).fit(TinyLM(), loader(token_data(8), MICRO))
    return [str(w.message) for w in caught if "expert_parallel_size" in str(w.message)]


def staged_precision(world_size: int, folder: str) -> dict[str, Any]:
    from lightning_deepseek.precision import StagedPrecision

    pl.seed_everything(0, verbose=False)
    module = TinyLM(**MOE)
    plugin = StagedPrecision(schedule=[("32-true", 3), ("16-mixed", 6), ("bf16-mixed", None)])
    strategy = HybridParallelStrategy(tensor_parallel_size=1, expert_parallel_size=2)
    trainer = make_trainer(world_size, strategy, max_steps=STAGED_STEPS, plugins=[plugin], gradient_clip_val=0.5,
                           callbacks=[ExpertLoadBalancing(update_rate=RATE)], default_root_dir=folder)
    trainer.fit(module, loader(token_data(STAGED_STEPS * world_size * MICRO), MICRO))
    losses: list[Any] = [None] * world_size
    dist.all_gather_object(losses, module.losses)
    return {"losses": losses, "events": [e for _, e in plugin.events()]}


def compressed(world_size: int, folder: str) -> dict[str, Any]:
    from lightning_deepseek import GradientCompression

    pl.seed_everything(0, verbose=False)
    module = TinyLM(**MOE)
    compression = GradientCompression(bits=8, warmup_steps=0, min_bucket_numel=0)
    strategy = HybridParallelStrategy(tensor_parallel_size=1, expert_parallel_size=2)
    trainer = make_trainer(world_size, strategy, max_steps=STAGED_STEPS,
                           callbacks=[ExpertLoadBalancing(update_rate=RATE), compression], default_root_dir=folder)
    trainer.fit(module, loader(token_data(STAGED_STEPS * world_size * MICRO), MICRO))
    losses: list[Any] = [None] * world_size
    dist.all_gather_object(losses, module.losses)
    return {"losses": losses, "hook_steps": compression.hook_state.step if compression.hook_state else 0}


def sample_checkpoint(world_size: int, folder: str) -> dict[str, Any]:
    """2 steps of ``LightningGPT`` (``moe-tiny``, shortened) at ep=2, saved as a DCP folder: what lds-sample reads."""
    from lightning_deepseek.models import PRESETS, GPTConfig
    from lightning_deepseek.models.lightning_gpt import LightningGPT

    pl.seed_everything(0, verbose=False)
    module = LightningGPT(GPTConfig(**{**PRESETS["moe-tiny"], "block_size": 16, "n_layer": 1}))
    tokens = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(0))
    trainer = make_trainer(world_size, HybridParallelStrategy(tensor_parallel_size=1, expert_parallel_size=2),
                           max_steps=2)
    trainer.fit(module, loader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), MICRO))
    ckpt = str(Path(folder) / "gpt_ep.ckpt")
    trainer.save_checkpoint(ckpt)
    return {"ckpt": ckpt, "state": full_state(module)}


def elastic(world_size: int, folder: str) -> dict[str, Any]:
    """ElasticTraining at ep=2: 6 steps uninterrupted, and 3 steps then a resume to 6 (full weights and biases)."""
    from lightning_deepseek.data import TextDataModule
    from lightning_deepseek.elastic import ElasticTraining
    from lightning_deepseek.models import GPTConfig, LightningGPT
    from tests.elastic.audit import write_corpus

    def run(run_dir: Path, max_steps: int) -> dict[str, np.ndarray]:
        if dist.get_rank() == 0 and not (run_dir / "corpus.txt").exists():
            write_corpus(run_dir / "corpus.txt")
        dist.barrier()
        pl.seed_everything(0, verbose=False)
        data = TextDataModule(path=str(run_dir / "corpus.txt"), block_size=16, batch_size=2, cache_dir=run_dir)
        model = LightningGPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32, n_routed_experts=4,
                                       moe_top_k=2, moe_hidden=16), learning_rate=3e-3)
        callbacks = [ExpertLoadBalancing(update_rate=RATE), ElasticTraining(run_dir / "ckpt", 8,
                                                                            checkpoint_every_n_steps=3)]
        trainer = make_trainer(world_size, HybridParallelStrategy(tensor_parallel_size=1, expert_parallel_size=2),
                               max_steps=max_steps, callbacks=callbacks, limit_val_batches=0, default_root_dir=run_dir)
        trainer.fit(model, datamodule=data)
        state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
        return {k: v.detach().numpy().copy() for k, v in state.items()}

    reference = run(Path(folder) / "elastic-ref", 6)
    run(Path(folder) / "elastic", 3)
    resumed = run(Path(folder) / "elastic", 6)
    reports = (Path(folder) / "elastic" / "ckpt" / "reports.jsonl").read_text().splitlines()
    from_steps = [r["from_step"] for r in map(json.loads, reports) if r["event"] == "resumed"]
    return {"reference": reference, "resumed": resumed, "from_steps": from_steps}


def two_rank_scenarios(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    ckpt = str(Path(folder) / "ep.ckpt")
    ep = fit(world_size, STEPS, tp=1, folder=folder, clip=0.5, ckpt=ckpt)
    resumed = fit(world_size, STEPS, tp=1, folder=folder, clip=0.5, resume=ckpt)  # at max_steps: loads only
    plot = (Path(folder) / "expert_load.png").is_file()
    return {"ep": ep, "ep_tp": fit(world_size, STEPS // 2, tp=2, folder=folder, accumulate=2),
            "resumed": resumed["state"], "no_moe": no_moe(world_size), "ckpt": ckpt, "plot": plot,
            "staged": staged_precision(world_size, folder), "sample": sample_checkpoint(world_size, folder),
            "elastic": elastic(world_size, folder), "compressed": compressed(world_size, folder)}


def four_rank_scenarios(rank: int, world_size: int, folder: str, ckpt: str) -> dict[str, Any]:
    plain = {ep: expert_parallel_run(rank, world_size, ep) for ep in (2, 4)}
    # the 2-rank run's global batch (2 x 2) as 4 x 1, on its data: the continuation is the same computation
    batches = _RecordBatches()
    resumed = fit(world_size, RESUMED, tp=1, folder=folder, clip=0.5, resume=ckpt, ep=4, micro=1,
                  dataset=token_data(STEPS * 2 * MICRO), callbacks=(batches,))
    per_rank: list[Any] = [None] * world_size
    dist.all_gather_object(per_rank, batches.batches)
    resumed["batches"] = [tuple(np.concatenate(part) for part in zip(*step)) for step in zip(*per_rank)]
    islands = _RecordIslands()
    limited = fit(world_size, LIMITED_STEPS, tp=1, folder=folder, ep=4, micro=1, callbacks=(islands,),
                  cluster=Cluster(topology=TOPOLOGY),
                  expert_routing=ExpertRouting(max_islands_per_token=1))
    return {"plain": plain, "resumed": resumed, "limited": limited, "most_islands": islands.most,
            "per_island": island_scenarios(rank, world_size)}


def _balancing(module: TinyLM) -> Any:
    """``reference_run``'s ``after_step``: the balancing bias update, from this process's counts."""
    counter = LoadCounter(find_expert_layers(module))
    return lambda: update_biases(counter.layers, counter.take(), RATE)


def _node_limited_balancing(module: TinyLM) -> Any:
    for layer in find_expert_layers(module):
        layer.router.limit_groups([0, 0, 1, 1], 1)  # experts 0,1 on ranks 0,1 (one island), 2,3 on ranks 2,3
    return _balancing(module)


def reference(world_size: int, steps: int, accumulate: int = 1, clip: float | None = None
              ) -> tuple[list[float], dict[str, Any]]:
    dataset = token_data(steps * accumulate * world_size * MICRO)
    return reference_run(steps, world_size * MICRO, dataset, clip, accumulate, after_step=_balancing, **MOE)


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_distributed(two_rank_scenarios, 2, str(tmp_path_factory.mktemp("ep")), timeout=400)[0]


@pytest.fixture(scope="module")
def four_ranks(result: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_distributed(four_rank_scenarios, 4, str(tmp_path_factory.mktemp("ep4")), result["ckpt"],
                           timeout=500)[0]


def _check(run: dict[str, Any], steps: int, accumulate: int = 1, clip: float | None = None,
           reference_result: tuple[list[float], dict[str, Any]] | None = None) -> None:
    ref_losses, ref_state = reference_result or reference(2, steps, accumulate, clip)
    world_size = len(run["losses"])
    ours = [accumulate * sum(pair) / world_size for pair in zip(*run["losses"])]  # Lightning: loss / accumulate
    assert len(ours) == len(ref_losses)
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


def test_ep2_under_staged_precision_runs_every_stage(result: dict[str, Any]) -> None:
    events = result["staged"]["events"]
    assert any("16-mixed" in e for e in events) and any("bf16-mixed" in e for e in events)
    losses = [sum(r[i] for r in result["staged"]["losses"]) / 2 for i in range(STAGED_STEPS)]
    ref_losses, _ = reference(2, STAGED_STEPS, clip=0.5)
    # half-precision stages round differently; the trajectory stays within a few percent of the FP32 one
    assert losses == pytest.approx(ref_losses, rel=0.03) and losses[-1] < losses[0]


def test_ep2_with_gradient_compression_on_the_data_parallel_exchange(result: dict[str, Any]) -> None:
    assert result["compressed"]["hook_steps"] == STAGED_STEPS  # the int8 hook compressed every step's exchange
    losses = [sum(r[i] for r in result["compressed"]["losses"]) / 2 for i in range(STAGED_STEPS)]
    ref_losses, _ = reference(2, STAGED_STEPS)
    assert losses == pytest.approx(ref_losses, rel=0.03) and losses[-1] < losses[0]


def test_elastic_training_resumes_an_expert_parallel_job_bitwise(result: dict[str, Any]) -> None:
    reference, resumed = result["elastic"]["reference"], result["elastic"]["resumed"]
    assert result["elastic"]["from_steps"] == [3]  # so the equality below is not two runs from scratch
    assert any("expert_bias" in name for name in reference) and reference.keys() == resumed.keys()
    for name, expected in reference.items():
        np.testing.assert_array_equal(resumed[name], expected, err_msg=name)


def test_lds_sample_reads_an_expert_parallel_checkpoint(result: dict[str, Any]) -> None:
    from omegaconf import OmegaConf

    from lightning_deepseek.app.cli import run_sampling
    from lightning_deepseek.app.sampling import load_model

    ckpt = Path(result["sample"]["ckpt"])
    weights = {name: p.detach().numpy() for name, p in load_model(ckpt).named_parameters()}
    assert relative_error(weights, result["sample"]["state"]) == 0.0  # the expert shards come back whole
    cfg = OmegaConf.create(dict(ckpt=str(ckpt), prompt="Python", max_new_tokens=8, temperature=0.8, top_k=40, seed=0))
    text = run_sampling(cfg)
    assert text.startswith("Python") and len(text.encode()) >= len("Python") + 8


def _continue_in_one_process(ckpt: str, batches: list[tuple[Any, Any]]
                             ) -> tuple[dict[str, np.ndarray], list[float], dict[str, np.ndarray]]:
    """Load the DCP checkpoint into one process and train on ``batches``: the loaded state, losses, final weights."""
    pl.seed_everything(1, verbose=False)  # other initial weights: everything must come from the checkpoint
    module = TinyLM(**MOE)
    optimizer = module.configure_optimizers()
    load_distributed(module, [optimizer], Path(ckpt), strict=True, weights_only=False)
    loaded = {**full_state(module), **_optimizer_state(module, optimizer)}
    after_step, losses = _balancing(module), []
    for x, y in batches:
        loss = lm_loss(module.model, (torch.as_tensor(x), torch.as_tensor(y)))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        after_step()
        losses.append(loss.item())
    return loaded, losses, full_state(module)


def test_resume_in_one_process_loads_exactly_and_continues(result: dict[str, Any]) -> None:
    data = token_data(STEPS * 2 * MICRO)
    batches = [data[global_indices(step, 2 * MICRO, len(data))] for step in range(STEPS, RESUMED)]
    loaded, losses, state = _continue_in_one_process(result["ckpt"], batches)
    assert relative_error(loaded, {**result["ep"]["state"], **result["ep"]["end"]}) == 0.0
    ref_losses, ref_state = reference_run(RESUMED, 2 * MICRO, data, clip=0.5, after_step=_balancing, **MOE)
    np.testing.assert_allclose(losses, ref_losses[STEPS:], rtol=TOL)
    assert relative_error(state, ref_state) < TOL


@pytest.mark.parametrize("ep_size", [2, 4])
def test_four_ranks_ep_x_replicas_match_one_process(ep_size: int, four_ranks: dict[str, Any]) -> None:
    check_plain_loop(four_ranks["plain"][ep_size], 4)


def test_per_island_dispatch_matches_one_process_and_crosses_once_per_island(four_ranks: dict[str, Any]) -> None:
    check_island_runs(four_ranks["per_island"])


def test_resume_at_ep4_loads_exactly_and_continues_as_one_process(result: dict[str, Any],
                                                                    four_ranks: dict[str, Any]) -> None:
    saved, resumed = {**result["ep"]["state"], **result["ep"]["end"]}, four_ranks["resumed"]
    assert resumed["start"].keys() == saved.keys()
    assert relative_error(resumed["start"], saved) == 0.0  # weights, momenta and balancing biases as saved
    assert resumed["summary"]["expert_parallel"] == "ep=4 x edp=1, 1 MoE layers"
    assert len(resumed["batches"]) == RESUMED - STEPS
    _, losses, state = _continue_in_one_process(result["ckpt"], resumed["batches"])
    _check(resumed, RESUMED - STEPS, clip=0.5, reference_result=(losses, state))


def test_node_limited_routing_keeps_each_token_on_one_island(four_ranks: dict[str, Any]) -> None:
    assert four_ranks["most_islands"] == 1
    assert four_ranks["limited"]["summary"]["expert_dispatch"] == "per_island"  # auto: ep=4 spans both islands
    expected = reference_run(LIMITED_STEPS, 4, token_data(LIMITED_STEPS * 4), after_step=_node_limited_balancing,
                             **MOE)
    _check(four_ranks["limited"], LIMITED_STEPS, reference_result=expected)
