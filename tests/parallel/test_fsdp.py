"""Parameter sharding (``data_parallel_shard_size``, FSDP2) and meta-device initialisation, on real gloo processes:

- FSDP over 2 ranks and HSDP (2 shards x 2 replicas) over 4 train as one process on the global batch (losses and
  final weights, fp32, 1e-5), with gradient clipping; each rank holds half of every parameter;
- full activation checkpointing under FSDP is bitwise equal to none; so are full and selective checkpointing of MoE
  blocks whose experts are an FSDP unit of their own (FSDP x EP, 4 ranks); staged precision runs each stage under FSDP;
- a model built under ``trainer.init_module(empty_init=True)`` (meta device) trains with sharding: no rank holds a
  full parameter, and loading the same weights gives the eager run's losses;
- FSDP x tensor parallelism (the feed-forward shards over ``tp=2``, sharded over their ``dp=2`` replicas; the rest
  over all 4 ranks), with clipping, equals one process;
- FSDP x expert parallelism on the MoE model (experts over ``ep=2``, replicated over their ``edp=2`` replicas as
  the rest is across its 2 x 2 HSDP groups) equals one process;
- HSDP x tensor parallelism and HSDP x expert parallelism against DDP over 20 steps, on 4 ranks (shard 2: the tp
  and ep shards replicated across the two shard groups, FSDP's (2, 1) mesh) and 8 (shard 4: each tp or ep shard
  sharded over 2 of its replicas and replicated across the groups, 2 x 2); each rank holds exactly the parameter,
  gradient and momentum bytes the layout says; their DCP checkpoints resume under DDP with the same weights;
- GradientCompression trains under FSDP (its numerics: tests/compression/test_fsdp_compression.py);
- bad settings: clear errors before training.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_deepseek import GradientCompression, HybridParallelStrategy, StagedPrecision
from lightning_deepseek.models import GPT, GPTConfig
from tests.helpers import run_distributed
from tests.parallel.common import (
    CONFIG,
    TinyLM,
    full_state,
    loader,
    make_trainer,
    reference_run,
    relative_error,
    token_data,
)

STEPS, MICRO, TOL = 8, 2, 1e-5
HSDP_STEPS = 20
MOE = dict(n_routed_experts=4, moe_top_k=2, n_shared_experts=1, moe_hidden=32, n_dense_layers=1, mlp_ratio=4)


class MetaLM(TinyLM):
    """TinyLM whose model is built in ``configure_model`` (on the meta device under ``empty_init=True``)."""

    def __init__(self, **config: Any) -> None:
        pl.LightningModule.__init__(self)
        self.config, self.lr, self.adam, self.losses = {**CONFIG, **config}, 0.05, False, []

    def configure_model(self) -> None:
        if not hasattr(self, "model"):
            self.model = GPT(GPTConfig(**self.config))


def _fit(world_size: int, module: pl.LightningModule, meta: bool = False, clip: float | None = None, tp: int = 1,
         steps: int = STEPS, save: str | None = None, **strategy_kwargs: Any) -> dict[str, Any]:
    dataset = token_data(steps * world_size * MICRO)
    strategy = HybridParallelStrategy(tensor_parallel_size=tp, min_shard_params=0, **strategy_kwargs)
    trainer = make_trainer(world_size, strategy, max_steps=steps, gradient_clip_val=clip)
    if meta:
        with trainer.init_module(empty_init=True):
            module.configure_model()
        meta_built = all(p.is_meta for p in module.parameters())
    trainer.fit(module, loader(dataset, MICRO))
    if save is not None:
        trainer.save_checkpoint(save)
    losses: list[Any] = [None] * world_size
    dist.all_gather_object(losses, module.losses)
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in module.parameters())
    full = sum(p.numel() for p in module.parameters())
    return {"losses": losses, "state": full_state(module), "local_fraction": local / full,
            "layout_bytes": 4 * _layout_numel(module, strategy),
            "model_state_bytes": strategy.summary().get("hybrid_model_state_bytes"),
            "all_dtensor": all(isinstance(p, DTensor) for p in module.parameters()),
            "meta_built": meta_built if meta else None, "ddp_module": strategy.ddp_module is not None}


def _two_ranks(rank: int, world_size: int) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    fsdp = _fit(world_size, TinyLM(), data_parallel_shard_size=2, clip=0.5)
    pl.seed_everything(0, verbose=False)
    checkpointed = _fit(world_size, TinyLM(), data_parallel_shard_size=2, clip=0.5, activation_checkpointing="full")
    pl.seed_everything(0, verbose=False)
    meta = _fit(world_size, MetaLM(), meta=True, data_parallel_shard_size=2)
    strategy = HybridParallelStrategy(tensor_parallel_size=1, data_parallel_shard_size=2)
    trainer = make_trainer(world_size, strategy, max_steps=1, callbacks=[GradientCompression(bits=8)])
    try:
        trainer.fit(TinyLM(), loader(token_data(8), MICRO))
        compression = "no error"
    except ValueError as exc:
        compression = str(exc)
    pl.seed_everything(0, verbose=False)
    staged, plugin = TinyLM(), StagedPrecision(schedule=[("32-true", 2), ("16-mixed", 3), ("bf16-mixed", None)])
    make_trainer(world_size, HybridParallelStrategy(tensor_parallel_size=1, data_parallel_shard_size=2),
                 max_steps=STEPS, plugins=[plugin], gradient_clip_val=0.5).fit(staged, loader(token_data(64), MICRO))
    return {"fsdp": fsdp, "checkpointed": checkpointed, "meta": meta, "compression": compression,
            "staged": {"losses": staged.losses, **plugin.summary()}}


def _four_ranks(rank: int, world_size: int) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    hsdp = _fit(world_size, TinyLM(), data_parallel_shard_size=2)
    pl.seed_everything(0, verbose=False)
    no_reshard = _fit(world_size, TinyLM(), data_parallel_shard_size=4, reshard_after_forward=False)
    pl.seed_everything(0, verbose=False)
    moe = _fit(world_size, TinyLM(**MOE), data_parallel_shard_size=2, expert_parallel_size=2)
    pl.seed_everything(0, verbose=False)
    tp = _fit(world_size, TinyLM(), tp=2, data_parallel_shard_size=4, clip=0.5)
    return {"hsdp": hsdp, "no_reshard": no_reshard, "moe": moe, "tp": tp}


def _expert_units_checkpointed(rank: int, world_size: int) -> dict[str, Any]:
    runs = {}
    for mode in ("none", "selective", "full"):
        pl.seed_everything(0, verbose=False)
        runs[mode] = _fit(world_size, TinyLM(**MOE), steps=3, data_parallel_shard_size=2, expert_parallel_size=2,
                          activation_checkpointing=mode)
    return runs


def _layout_numel(module: pl.LightningModule, strategy: HybridParallelStrategy) -> int:
    """The parameter elements one rank holds by the layout: a tp shard (a rowwise bias is replicated over tp) and an
    expert slice split over their FSDP shard ranks (``ParallelDims.shard_split``), the rest over ``dp_shard``."""
    dims, styles = strategy.parallel_dims, {e.name: e.style for e in strategy.plan}
    total = 0
    for name, param in module.named_parameters():
        owner, _, kind = name.rpartition(".")
        if ".experts." in name:
            divisor = dims.ep * dims.shard_split(dims.ep)[1]
        elif owner in styles:
            divisor = (dims.tp if styles[owner] == "colwise" or kind == "weight" else 1) * dims.shard_split(dims.tp)[1]
        else:
            divisor = dims.dp_shard
        total += param.numel() // divisor
    return total


class LoadedWeights(pl.Callback):
    """The full weights as the resumed run starts (after the strategy loaded the checkpoint)."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.state = full_state(pl_module)


def _hsdp_model_parallel(rank: int, world_size: int, shard: int, folder: str) -> dict[str, Any]:
    runs: dict[str, Any] = {}
    for name, config, kwargs in (("ddp", {}, {}), ("ddp_moe", MOE, {}),
                                 ("tp", {}, dict(tp=2, data_parallel_shard_size=shard)),
                                 ("ep", MOE, dict(expert_parallel_size=2, data_parallel_shard_size=shard))):
        pl.seed_everything(0, verbose=False)
        save = f"{folder}/{name}.ckpt" if name in ("tp", "ep") else None
        runs[name] = _fit(world_size, TinyLM(**config), steps=HSDP_STEPS, save=save, **kwargs)
        if save is not None:  # the DCP folder resumes under plain DDP with the same weights
            loaded = LoadedWeights()
            trainer = make_trainer(world_size, HybridParallelStrategy(tensor_parallel_size=1),
                                   max_steps=HSDP_STEPS + 1, callbacks=[loaded])
            trainer.fit(TinyLM(**config), loader(token_data(world_size * MICRO), MICRO), ckpt_path=save)
            runs[name]["loaded"] = loaded.state
    return runs


@pytest.fixture(scope="module")
def two_rank_runs() -> list[dict[str, Any]]:
    return run_distributed(_two_ranks, 2, timeout=240)


def _check(run: dict[str, Any], world_size: int, clip: float | None = None, **config: Any) -> None:
    dataset = token_data(STEPS * world_size * MICRO)
    ref_losses, ref_state = reference_run(STEPS, world_size * MICRO, dataset, clip=clip, **config)
    losses = [sum(r[i] for r in run["losses"]) / world_size for i in range(STEPS)]
    for got, want in zip(losses, ref_losses):
        assert abs(got - want) <= TOL * abs(want), (losses, ref_losses)
    assert relative_error(run["state"], ref_state) <= TOL


def test_fsdp_over_two_ranks_trains_as_one_process_with_half_the_parameters(two_rank_runs: list[dict]) -> None:
    for rank in two_rank_runs:
        assert rank["fsdp"]["all_dtensor"] and not rank["fsdp"]["ddp_module"]
        assert rank["fsdp"]["local_fraction"] == pytest.approx(0.5, abs=0.01)
    _check(two_rank_runs[0]["fsdp"], 2, clip=0.5)


def test_activation_checkpointing_under_fsdp_is_bitwise_equal(two_rank_runs: list[dict]) -> None:
    for rank in two_rank_runs:
        assert rank["checkpointed"]["losses"] == rank["fsdp"]["losses"]
        assert all((rank["checkpointed"]["state"][k] == v).all() for k, v in rank["fsdp"]["state"].items())


def test_a_meta_model_is_sharded_then_materialised_per_rank(two_rank_runs: list[dict]) -> None:
    for rank in two_rank_runs:
        assert rank["meta"]["meta_built"] and rank["meta"]["local_fraction"] == pytest.approx(0.5, abs=0.01)
        assert all(torch.isfinite(torch.tensor(r)).all() for r in rank["meta"]["losses"])
    first = two_rank_runs[0]["meta"]["losses"]
    assert first[0][-1] < first[0][0]  # it learns


def test_hsdp_and_no_reshard_over_four_ranks_train_as_one_process() -> None:
    runs = run_distributed(_four_ranks, 4, timeout=300)
    for rank in runs:
        assert rank["hsdp"]["local_fraction"] == pytest.approx(0.5, abs=0.01)
        assert rank["no_reshard"]["local_fraction"] == pytest.approx(0.25, abs=0.01)
    _check(runs[0]["hsdp"], 4)
    _check(runs[0]["no_reshard"], 4)
    _check(runs[0]["moe"], 4, **MOE)  # experts: ep=2, FSDP over their edp=2 replicas; the rest HSDP 2 x 2
    _check(runs[0]["tp"], 4, clip=0.5)  # feed-forward tp=2, FSDP over its dp=2 replicas; the rest over all 4


def test_checkpointed_moe_blocks_with_their_experts_sharded_apart_train_bitwise_as_none() -> None:
    # The experts are an FSDP unit inside each checkpointed block: its hooks (all-gather, reshard) run inside the
    # checkpointed region; selective checkpointing's recompute once failed on them (torch 2.13).
    runs = run_distributed(_expert_units_checkpointed, 4, timeout=300)
    for rank in runs:
        for mode in ("selective", "full"):
            assert rank[mode]["losses"] == rank["none"]["losses"], mode
            assert all((rank[mode]["state"][k] == v).all() for k, v in rank["none"]["state"].items()), mode


class HFMoE(pl.LightningModule):
    """A tiny transformers Mixtral (experts fused: its blocks are found by the class it declares unsplittable)."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        self.model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            vocab_size=CONFIG["vocab_size"], hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2))
        self.losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        tokens = batch[0]
        loss = self.model(input_ids=tokens, labels=tokens).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _hf_moe_units(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.fsdp import FSDPModule

    runs = {}
    for mode in ("none", "selective"):
        pl.seed_everything(0, verbose=False)
        module = HFMoE()
        trainer = make_trainer(world_size, HybridParallelStrategy(data_parallel_shard_size=2,
                                                                  activation_checkpointing=mode), max_steps=3)
        trainer.fit(module, loader(token_data(3 * world_size * MICRO), MICRO))
        runs[mode] = {"units": [name for name, m in module.named_modules() if isinstance(m, FSDPModule)],
                      "losses": module.losses}
    return runs


def test_checkpointed_hf_moe_blocks_stay_fsdp_units() -> None:
    """A checkpointed block's class is a subclass of its own: FSDP2's units (chosen after checkpointing) once missed
    the blocks of models found by their declared class (transformers' MoE families), gathering the whole model at
    once."""
    pytest.importorskip("transformers")
    for rank in run_distributed(_hf_moe_units, 2, timeout=200):
        assert rank["selective"]["units"] == rank["none"]["units"]
        assert {"model.model.layers.0", "model.model.layers.1"} <= set(rank["none"]["units"])
        assert rank["selective"]["losses"] == rank["none"]["losses"]


@pytest.mark.parametrize(("world_size", "shard"), [(4, 2), (8, 4)])
def test_hsdp_of_tensor_and_expert_shards_trains_as_ddp_with_the_bytes_the_layout_says(
        world_size: int, shard: int, tmp_path: Any) -> None:
    # 4 ranks, shard 2: the tp and ep shards replicated over their 2 replicas (FSDP's (2, 1) mesh); 8 ranks, shard
    # 4: each sharded over 2 of its 4 replicas inside a shard group and replicated across the two groups (2 x 2).
    runs = run_distributed(_hsdp_model_parallel, world_size, shard, str(tmp_path), timeout=300)
    for run, ddp in (("tp", "ddp"), ("ep", "ddp_moe")):
        got, want = runs[0][run], runs[0][ddp]
        mean = [[sum(r[i] for r in losses) / world_size for i in range(HSDP_STEPS)]
                for losses in (got["losses"], want["losses"])]
        assert all(abs(a - b) <= TOL * abs(b) for a, b in zip(*mean)), (run, mean)
        assert relative_error(got["state"], want["state"]) <= TOL, run
        assert relative_error(got["loaded"], got["state"]) == 0.0, run  # its checkpoint, resumed under DDP
        for rank in runs:  # parameters, gradients and SGD momentum, exactly; about 1/shard of the model
            assert rank[run]["all_dtensor"] and rank[run]["local_fraction"] == pytest.approx(1 / shard, abs=0.01)
            assert rank[run]["model_state_bytes"] == 3 * rank[run]["layout_bytes"], run


def test_staged_precision_runs_every_stage_on_sharded_parameters(two_rank_runs: list[dict]) -> None:
    # Autocast over FSDP's FP32 parameters (FSDP's own mixed-precision policy is not set by the stage).
    for rank in two_rank_runs:
        run = rank["staged"]
        assert run["precision_final"] == "bf16-mixed" and run["precision_fallbacks"] == "none"
        assert all(map(math.isfinite, run["losses"])) and run["losses"][-1] < run["losses"][0]


def test_compression_with_parameter_sharding_trains(two_rank_runs: list[dict]) -> None:
    # its numerics: tests/compression/test_fsdp_compression.py
    for rank in two_rank_runs:
        assert rank["compression"] == "no error"


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(data_parallel_shard_size=0), "data_parallel_shard_size=0 must be a positive integer"),
    (dict(data_parallel_shard_size=2, shard_optimizer_states=True),
     "parameter sharding already shards the optimizer states"),
])
def test_bad_sharding_settings_fail_at_construction(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HybridParallelStrategy(**kwargs)
