"""``HybridParallelStrategy(pipeline_parallel_size=2)`` in Lightning's loop, on real gloo processes, against one
process on the same global batch (``reference_run``: FP32, SGD with momentum, 8 optimizer steps, 1e-5).

One spawn per world size runs every scenario: on 2 ranks (``pp=2``) the schedules 1F1B and ZBVZeroBubble (with
gradient accumulation over two batches, clipping at 0.5 and full activation checkpointing), the MoE preset (its
auxiliary loss) and BF16 autocast on DualPipeV, HF Llama, a model built on the meta device (each rank materialises
its stages only), our ``LightningGPT``, and the bad settings that raise before training; on 4 ranks (``pp=2 x
dp=2``, each data-parallel replica reading its own shard) Interleaved1F1B (with selective activation checkpointing)
and DualPipeV, clipping at 1.0, FSDP2 over each stage's two replicas (1F1B; DualPipeV without resharding after the
forward; accumulation, clipping), and ``pp=4`` with 1F1B, and HF Llama at ``pp=4`` under every schedule; the
validation loss after each fit. Every rank of a pipeline reports the same loss; the mean over the ranks is the global
batch's loss.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from lightning_deepseek import HybridParallelStrategy
from lightning_deepseek.models import GPTConfig, LightningGPT
from lightning_deepseek.parallel.pipeline_split import SCHEDULES
from lightning_deepseek.parallel.zero import state_bytes
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
from tests.parallel.test_pipeline import make_model as make_hf_model

STEPS, MICRO, LAYERS, TOL = 8, 4, 4, 1e-5
MOE = dict(bias=False, n_routed_experts=4, moe_top_k=2, n_shared_experts=1, moe_hidden=16, n_dense_layers=1,
           moe_aux_loss_coef=1e-2)
# One spawn per world size fits several pipelines of 8 steps: a minute on a loaded 2-core machine.
pytestmark = pytest.mark.timeout(900)


class PipelinedLM(TinyLM):
    """TinyLM with the pipeline protocol: the loss of one micro-batch, and the losses logged."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    def on_pipeline_loss(self, loss: torch.Tensor, batch: Any, step: str) -> None:
        if step != "training":
            self.log(f"{step}_loss", loss, sync_dist=True)


def _fit(world_size: int, schedule: str, accumulate: int = 1, clip: float | None = None,
         activation_checkpointing: str = "none", pp: int = 2, shard: int = 1, reshard_after_forward: bool = True,
         precision: str = "32-true", tp: int = 1, ep: int = 1, callbacks: list[pl.Callback] | None = None,
         overlap: bool = False, zero: bool = False, steps: int = STEPS, max_steps: int | None = None,
         resume: str | None = None, loss_parallel: bool = False, **config: Any) -> dict[str, Any]:
    """Fit PipelinedLM for ``steps`` optimizer steps (one epoch; ``max_steps``: more epochs of it, from ``resume``);
    every rank's losses, the full weights (gathered from the stages), the validation loss after fitting, and what
    each rank's optimizer holds (``zero``: ZeRO-1)."""
    dp = world_size // (pp * tp)
    dataset = token_data(steps * accumulate * dp * MICRO)
    pl.seed_everything(0, verbose=False)
    module = PipelinedLM(n_layer=LAYERS, **config)
    strategy = HybridParallelStrategy(pipeline_parallel_size=pp, pipeline_schedule=schedule, pipeline_microbatches=4,
                                      activation_checkpointing=activation_checkpointing, data_parallel_shard_size=shard,
                                      reshard_after_forward=reshard_after_forward, tensor_parallel_size=tp,
                                      expert_parallel_size=ep, min_shard_params=0, pipeline_overlap=overlap,
                                      shard_optimizer_states=zero, loss_parallel=loss_parallel)
    trainer = make_trainer(world_size, strategy, max_steps=max_steps or steps, accumulate_grad_batches=accumulate,
                           gradient_clip_val=clip, precision=precision, callbacks=callbacks)
    trainer.fit(module, loader(dataset, MICRO), ckpt_path=resume)
    val = trainer.validate(module, loader(token_data(4 * dp * MICRO, seed=3), MICRO), verbose=False)
    losses: list[Any] = [None] * world_size
    dist.all_gather_object(losses, module.losses)
    optimizer = trainer.optimizers[0]
    optimized = sum(p.numel() for group in optimizer.param_groups for p in group["params"])
    return {"pp": pp, "dp": dp, "steps": max_steps or steps, "epoch_steps": steps, "losses": losses,
            "state": gathered_state(module),
            "val": val[0]["validation_loss"], "optimized": optimized,
            "local": sum(p.numel() for p in module.parameters()), "state_bytes": state_bytes(optimizer),
            "numel": {n: (p.to_local() if isinstance(p, DTensor) else p).numel() for n, p in module.named_parameters()},
            "with_state": sorted(n for n, p in module.named_parameters() if optimizer.state.get(p)),
            "sampler": strategy.distributed_sampler_kwargs, "table": strategy._pipeline.split.table(),
            "blocks": sorted({type(block).__name__ for block in module.model.blocks.values()}),
            "sharded": all(isinstance(p, DTensor) for p in module.parameters()),
            "shards": sorted(n for n, p in module.named_parameters() if isinstance(p, DTensor)),
            "meshes": {n: p.device_mesh.mesh_dim_names for n, p in module.named_parameters() if isinstance(p, DTensor)},
            "biases": {n: b.tolist() for n, b in module.named_buffers() if n.endswith("expert_bias")}}


def gathered_state(module: torch.nn.Module) -> dict[str, np.ndarray]:
    """The full weights of a pipelined module under the model's names: every rank's stages, tensor-parallel shards
    gathered (collective: every rank calls it)."""
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, full_state(module))
    return {k: v for s in states for k, v in s.items()}


def _meta(world_size: int, shard: int = 1) -> dict[str, Any]:
    """A model built on the meta device: each rank allocates and initialises only its stages (with ``shard``, its
    FSDP2 shard of them), then trains."""
    with torch.device("meta"):
        module = PipelinedLM(n_layer=LAYERS)
    strategy = HybridParallelStrategy(pipeline_parallel_size=2, data_parallel_shard_size=shard)
    trainer = make_trainer(world_size, strategy, max_steps=2)
    trainer.fit(module, loader(token_data(2 * MICRO * world_size // 2), MICRO))
    local = [p.to_local() if isinstance(p, DTensor) else p for p in module.parameters()]
    split = strategy._pipeline.split
    owned = split.stage_indices(strategy.world_mesh["pp"].get_local_rank())
    return {"meta": any(p.is_meta for p in local), "names": sorted(n for n, _ in module.named_parameters()),
            "losses": module.losses, "allocated": sum(p.numel() for p in local),
            "stages": sum(split.stages[i].num_parameters for i in owned)}


class _NoProtocol(TinyLM):
    pass


def _errors(world_size: int) -> dict[str, str]:
    """The message of each bad setting, raised on every rank before the first optimizer step."""
    cases = {
        "no_protocol": (_NoProtocol(n_layer=LAYERS), dict(pipeline_parallel_size=2), 8, 4),
        "not_dividing": (PipelinedLM(n_layer=LAYERS), dict(pipeline_parallel_size=3), 8, 4),
        "batch_not_splitting": (PipelinedLM(n_layer=LAYERS), dict(pipeline_parallel_size=2), 9, 3),
        "ragged_batches": (PipelinedLM(n_layer=LAYERS), dict(pipeline_parallel_size=2), 10, 4),
        "too_many_stages": (PipelinedLM(n_layer=2), dict(pipeline_parallel_size=2, pipeline_schedule="DualPipeV"),
                            8, 4),
    }
    messages = {}
    for name, (module, strategy_kwargs, samples, batch) in cases.items():
        trainer = make_trainer(world_size, HybridParallelStrategy(**strategy_kwargs), max_epochs=1)
        try:
            trainer.fit(module, loader(token_data(samples), batch))
            messages[name] = "no error"
        except ValueError as exc:
            messages[name] = str(exc)
    return messages


def _lightning_gpt(world_size: int) -> list[float]:
    """Our GPT LightningModule (AdamW, cosine schedule) through the pipeline: its logged training and validation
    losses and gradient norm (over both stages)."""
    pl.seed_everything(0, verbose=False)
    module = LightningGPT(GPTConfig(vocab_size=64, block_size=16, n_layer=LAYERS, n_head=2, n_embd=32))
    trainer = make_trainer(world_size, HybridParallelStrategy(pipeline_parallel_size=2), max_steps=3,
                           log_every_n_steps=1)
    trainer.fit(module, loader(token_data(3 * MICRO), MICRO), loader(token_data(MICRO, seed=3), MICRO))
    return [float(trainer.callback_metrics[name]) for name in ("train_loss", "val_loss", "grad_norm")]


class PipelinedLlama(pl.LightningModule):
    """HF Llama from a tiny config (untied embeddings) with the protocol's loss only: the model is found as the
    module's only child, the batch is an (inputs, targets) pair."""

    def __init__(self) -> None:
        super().__init__()
        self.model = make_hf_model("llama")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:  # Lightning wants one; not called
        return lm_loss(lambda x: self.model(x).logits, batch)

    def pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses = [*getattr(self, "losses", []), float(outputs["loss"])]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def _llama(world_size: int, schedule: str = "1F1B", pp: int = 2, steps: int = STEPS, batch: int = MICRO
           ) -> dict[str, Any]:
    """HF Llama through the strategy (one sample a micro-batch, ``batch`` per data-parallel replica): its losses and
    final weights."""
    module = PipelinedLlama()
    strategy = HybridParallelStrategy(pipeline_parallel_size=pp, pipeline_schedule=schedule,
                                      pipeline_microbatches=batch)
    dataset = token_data(STEPS * batch * world_size // pp)  # the one-process reference's, at the global batch
    make_trainer(world_size, strategy, max_steps=steps).fit(module, loader(dataset, batch))
    return {"losses": module.losses, "state": gathered_state(module)}


def hf_reference(model: torch.nn.Module, steps: int = STEPS, batch: int = MICRO) -> list[float]:
    """One process's losses of ``model`` (an HF causal LM, trained in place) over the first ``steps`` batches of
    ``batch`` samples of the pipelined runs."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    dataset, losses = token_data(STEPS * batch), []
    for step in range(steps):
        loss = lm_loss(lambda x: model(x).logits, dataset[global_indices(step, batch, len(dataset))])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@cache
def llama_reference(steps: int = STEPS, batch: int = MICRO) -> tuple[list[float], dict[str, np.ndarray]]:
    """One process's HF Llama: its losses and final weights (under ``PipelinedLlama``'s names; computed once per
    session for each ``steps`` and ``batch``: read only)."""
    model = make_hf_model("llama")
    losses = hf_reference(model, steps, batch)
    return losses, {f"model.{name}": value for name, value in full_state(model).items()}


def check_hf_parity(results: list[dict[str, Any]], steps: int = STEPS, batch: int = MICRO) -> None:
    """Every rank's losses and the gathered final weights of an HF Llama run against ``llama_reference``."""
    losses, state = llama_reference(steps, batch)
    for result in results:  # every rank of the pipeline reports the global batch's loss
        assert len(result["losses"]) == steps
        np.testing.assert_allclose(result["losses"], losses, rtol=TOL)
    assert relative_error(results[0]["state"], state) <= TOL


def _two_ranks(rank: int, world_size: int) -> dict[str, Any]:
    return {"1F1B": _fit(world_size, "1F1B"), "ZBV": _fit(world_size, "ZBVZeroBubble", accumulate=2, clip=0.5,
                                                                     activation_checkpointing="full"),
            "moe": _fit(world_size, "DualPipeV", **MOE), "bf16": _fit(world_size, "DualPipeV", precision="bf16-mixed"),
            "meta": _meta(world_size), "errors": _errors(world_size),
            "gpt": _lightning_gpt(world_size), "llama": _llama(world_size)}


# HF Llama at pp=4 (8 stages of its 8 layers on the two-stage schedules), one sample a micro-batch: each schedule's
# (steps, batch). 1F1B for 8 steps (the pp=2 run's reference), the others for 4; DualPipeV needs 8 micro-batches.
LLAMA_PP4 = {"1F1B": (STEPS, MICRO), "Interleaved1F1B": (4, MICRO), "ZBVZeroBubble": (4, MICRO), "DualPipeV": (4, 8)}


def _four_ranks(rank: int, world_size: int) -> dict[str, Any]:
    return {**{f"llama_{name}": _llama(world_size, name, pp=4, steps=steps, batch=batch)
               for name, (steps, batch) in LLAMA_PP4.items()},
            "Interleaved1F1B": _fit(world_size, "Interleaved1F1B", clip=1.0, activation_checkpointing="selective"),
            "DualPipeV": _fit(world_size, "DualPipeV", clip=1.0), "pp4": _fit(world_size, "1F1B", pp=4),
            "fsdp": _fit(world_size, "1F1B", accumulate=2, clip=0.5, shard=2),
            "fsdp_v": _fit(world_size, "DualPipeV", accumulate=2, clip=0.5, shard=2, reshard_after_forward=False),
            "meta_fsdp": _meta(world_size, shard=2),
            **{f"llama_dp_{name}": _llama(world_size, name, steps=4, batch=4) for name in SCHEDULES},
            **{f"moe_dp_{name}": _fit(world_size, name, steps=4, **MOE) for name in SCHEDULES}}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_distributed(_two_ranks, 2, timeout=840)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    return run_distributed(_four_ranks, 4, timeout=840)


def _reference_val(state: dict[str, np.ndarray], dp: int, **config: Any) -> float:
    """The mean loss of the validation batches under the reference's final weights."""
    module = PipelinedLM(n_layer=LAYERS, **config)
    loaded = module.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=False)
    assert not loaded.unexpected_keys and set(loaded.missing_keys) <= {n for n, _ in module.named_buffers()}
    x, y = token_data(4 * dp * MICRO, seed=3).tensors
    with torch.no_grad():
        return float(lm_loss(module.model, (x, y)))


def check_parity(results: list[dict[str, Any]], accumulate: int = 1, clip: float | None = None,
                 after_step: Any = None, **config: Any) -> None:
    """Losses, final weights and validation loss against one process on the global batch (``after_step``: as
    ``reference_run``'s, e.g. the balancing bias update)."""
    world_size, dp, steps = len(results), results[0]["dp"], results[0]["steps"]
    data = token_data(results[0]["epoch_steps"] * accumulate * dp * MICRO)
    ref_losses, ref_state = reference_run(steps, dp * MICRO, data, clip=clip,
                                          accumulate=accumulate, after_step=after_step, n_layer=LAYERS, **config)
    per_rank = results[0]["losses"]
    for rank in range(world_size):  # every rank of a pipeline (pp outermost) reports its loss
        assert per_rank[rank] == per_rank[(rank + world_size // results[0]["pp"]) % world_size]
    # Lightning's step output under accumulation is the loss divided by the number of batches accumulated.
    losses = [accumulate * sum(r[i] for r in per_rank) / world_size for i in range(steps * accumulate)]
    np.testing.assert_allclose(losses, ref_losses, rtol=TOL)
    assert relative_error(results[0]["state"], ref_state) <= TOL
    assert abs(results[0]["val"] - _reference_val(ref_state, dp, **config)) <= TOL * abs(results[0]["val"])
    for result in results:  # each optimizer holds its own stages only
        assert result["optimized"] == result["local"] < sum(v.size for v in ref_state.values())


def test_pp2_1f1b_matches_one_process_with_validation(two_ranks: list[dict[str, Any]]) -> None:
    check_parity([r["1F1B"] for r in two_ranks])
    assert [r["1F1B"]["sampler"] for r in two_ranks] == [{"num_replicas": 1, "rank": 0}] * 2


def test_pp2_zero_bubble_with_accumulation_clipping_and_checkpointing(two_ranks: list[dict[str, Any]]) -> None:
    check_parity([r["ZBV"] for r in two_ranks], accumulate=2, clip=0.5)
    assert two_ranks[0]["ZBV"]["blocks"] == ["CheckpointedBlock"]  # activation_checkpointing="full" composes
    assert "ZBVZeroBubble, pp=2" in two_ranks[0]["ZBV"]["table"]


def test_pp2_moe_preset_with_its_auxiliary_loss(two_ranks: list[dict[str, Any]]) -> None:
    check_parity([r["moe"] for r in two_ranks], **MOE)


def _bf16_reference() -> list[float]:
    """One process under BF16 autocast, each batch cut into the pipeline's 4 micro-batches, one backward each (BF16
    rounds differently for other matrix shapes, and sums the micro-batches' gradients of one backward in BF16)."""
    pl.seed_everything(0, verbose=False)
    module = PipelinedLM(n_layer=LAYERS)
    optimizer = module.configure_optimizers()
    dataset, losses = token_data(STEPS * MICRO), []
    for step in range(STEPS):
        x, y = dataset[global_indices(step, MICRO, len(dataset))]
        micro_losses = []
        for pair in zip(x.chunk(4), y.chunk(4)):
            with torch.autocast("cpu", torch.bfloat16):
                micro_losses.append(lm_loss(module.model, pair))
            (micro_losses[-1] / 4).backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(torch.stack(micro_losses).mean().item())
    return losses


def test_pp2_bf16_autocast_matches_one_process(two_ranks: list[dict[str, Any]]) -> None:
    """BF16 autocast (the precision a pipeline takes without a loss scaler) against one process in BF16."""
    np.testing.assert_allclose(two_ranks[0]["bf16"]["losses"][0], _bf16_reference(), rtol=TOL)


def test_pp2_hf_llama_matches_one_process(two_ranks: list[dict[str, Any]]) -> None:
    assert two_ranks[0]["llama"]["losses"] == two_ranks[1]["llama"]["losses"]
    check_hf_parity([r["llama"] for r in two_ranks])


def test_pp2_x_dp2_interleaved_matches_one_process(four_ranks: list[dict[str, Any]]) -> None:
    check_parity([r["Interleaved1F1B"] for r in four_ranks], clip=1.0)
    assert four_ranks[0]["Interleaved1F1B"]["blocks"] == ["CheckpointedBlock"]  # activation_checkpointing="selective"
    # pp outermost: ranks 0 and 2 hold stage 0..., ranks 0 and 1 are data-parallel replicas reading shards 0 and 1
    assert [r["Interleaved1F1B"]["sampler"]["rank"] for r in four_ranks] == [0, 1, 0, 1]


def test_pp2_x_fsdp2_with_accumulation_and_clipping(four_ranks: list[dict[str, Any]]) -> None:
    check_parity([r["fsdp"] for r in four_ranks], accumulate=2, clip=0.5)
    assert all(r["fsdp"]["sharded"] for r in four_ranks)  # FSDP2 over each stage's dp ranks


def test_pp2_x_fsdp2_under_dualpipev_without_resharding_after_forward(four_ranks: list[dict[str, Any]]) -> None:
    check_parity([r["fsdp_v"] for r in four_ranks], accumulate=2, clip=0.5)


def test_pp4_matches_one_process(four_ranks: list[dict[str, Any]]) -> None:
    check_parity([r["pp4"] for r in four_ranks])


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp4_hf_llama_matches_one_process_under_every_schedule(four_ranks: list[dict[str, Any]],
                                                               schedule: str) -> None:
    check_hf_parity([r[f"llama_{schedule}"] for r in four_ranks], *LLAMA_PP4[schedule])


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp2_x_dp2_hf_llama_and_moe_preset_match_one_process_under_every_schedule(four_ranks: list[dict[str, Any]],
                                                                                 schedule: str) -> None:
    results = [r[f"llama_dp_{schedule}"] for r in four_ranks]
    losses, state = llama_reference(4, 8)  # 4 samples a replica: 8 a step; each replica logs its own batch's loss
    np.testing.assert_allclose(np.mean([r["losses"] for r in results], axis=0), losses, rtol=TOL)
    assert relative_error(results[0]["state"], state) <= TOL
    check_parity([r[f"moe_dp_{schedule}"] for r in four_ranks], **MOE)


def test_pp2_x_dp2_dualpipev_matches_one_process(four_ranks: list[dict[str, Any]]) -> None:
    check_parity([r["DualPipeV"] for r in four_ranks], clip=1.0)


def test_meta_model_materialises_only_its_stages(two_ranks: list[dict[str, Any]]) -> None:
    first, last = (r["meta"] for r in two_ranks)
    assert not first["meta"] and not last["meta"]
    assert "model.tok_emb.weight" in first["names"] and "model.head.weight" not in first["names"]
    assert "model.head.weight" in last["names"] and "model.tok_emb.weight" not in last["names"]
    assert len(first["losses"]) == 2 and all(np.isfinite(first["losses"]))
    assert first["allocated"] == first["stages"] and last["allocated"] == last["stages"]


def test_meta_model_materialises_only_its_fsdp_shard_of_its_stages(four_ranks: list[dict[str, Any]]) -> None:
    for result in (r["meta_fsdp"] for r in four_ranks):
        assert not result["meta"] and result["allocated"] == result["stages"] // 2
        assert len(result["losses"]) == 2 and all(np.isfinite(result["losses"]))


def test_lightning_gpt_logs_its_losses_through_the_pipeline(two_ranks: list[dict[str, Any]]) -> None:
    assert two_ranks[0]["gpt"] == two_ranks[1]["gpt"] and all(np.isfinite(two_ranks[0]["gpt"]))


@pytest.mark.parametrize(("case", "message"), [
    ("no_protocol", "_NoProtocol has no pipeline_loss(output, target) method"),
    ("not_dividing", "pipeline_parallel_size=3 does not divide the world size 2"),
    ("batch_not_splitting", "the batch of 3 samples does not split into pipeline_microbatches=2"),
    ("ragged_batches", "a training batch of 2 samples follows batches of 4"),
    ("too_many_stages", "pipeline_parallel_size=2 with pipeline_schedule='DualPipeV' needs 4 stages"),
])
def test_bad_settings_raise_before_training_on_every_rank(two_ranks: list[dict[str, Any]], case: str,
                                                          message: str) -> None:
    for result in two_ranks:
        assert message in result["errors"][case]


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(pipeline_parallel_size=2, data_parallel_shard_size=2, pipeline_schedule="DualPipeV"),
     "data_parallel_shard_size=2 with pipeline_schedule='DualPipeV' needs reshard_after_forward=False"),
    (dict(pipeline_parallel_size=2, data_parallel_shard_size="auto"), "with data_parallel_shard_size='auto' is not"),
    (dict(pipeline_parallel_size=2, pipeline_schedule="GPipe"), "pipeline_schedule='GPipe' is not supported"),
    (dict(pipeline_parallel_size=2, pipeline_schedule="DualPipeV", pipeline_microbatches=2),
     "pipeline_microbatches=2 is too few for pipeline_schedule='DualPipeV' at pipeline_parallel_size=2"),
    (dict(pipeline_parallel_size=0), "pipeline_parallel_size=0 must be a positive integer"),
    (dict(pipeline_parallel_size=2, pipeline_schedule="DualPipeV", activation_checkpointing="selective"),
     "activation_checkpointing='selective' with pipeline_schedule='DualPipeV' is not supported"),
    (dict(pipeline_parallel_size=2, pipeline_overlap=True), "pipeline_overlap=True with pipeline_schedule='1F1B'"),
    (dict(pipeline_overlap=True), "pipeline_overlap=True with pipeline_parallel_size=1"),
    (dict(pipeline_parallel_size=2, pipeline_schedule="DualPipeV", pipeline_overlap="yes"),
     "pipeline_overlap='yes' must be True or False"),
])
def test_bad_pipeline_arguments_at_construction(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        HybridParallelStrategy(**kwargs)
