"""Two real gloo processes, one spawn for several scenarios (each a Lightning ``Trainer`` run), checked one by one:

- parity: ``tp=2`` and ``dp=2`` training match one process on the global batch (loss of every step and final
  weights, fp32, same seed, 20 optimizer steps, 1e-5 relative);
- DCP reshard: save at ``dp=2, tp=1``, resume at ``tp=2``: exactly the saved weights and momenta, and the
  same continuation as a resume at ``tp=1``;
- full-file checkpoints: Lightning DDP's file resumed at ``tp=2``, and our gathered file at ``tp=1``;
- validation under ``inference_mode`` with ``sync_dist`` logging on a sharded model equals the global loss;
- mesh-aware gradient norm over mixed DTensor/plain gradients equals the single-process norm (2 and inf).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist

from lightning_deepseek import HybridParallelStrategy
from lightning_deepseek.parallel import clip_grad_norm_
from tests.parallel.common import (
    TinyLM,
    full_state,
    lm_loss,
    loader,
    make_trainer,
    max_relative_error,
    reference_run,
    relative_error,
    token_data,
)

STEPS, MICRO, TOL = 20, 2, 1e-5


def fit_parity(world_size: int, tp: int, steps: int, accumulate: int = 1, clip: float | None = None,
               **strategy_kwargs: Any) -> dict[str, Any]:
    """Train TinyLM with the strategy; every rank's losses, rank 0's full weights, the plan and the mesh."""
    dataset = token_data(steps * accumulate * world_size * MICRO)
    pl.seed_everything(0, verbose=False)
    module = TinyLM()
    strategy = HybridParallelStrategy(tensor_parallel_size=tp, min_shard_params=0, **strategy_kwargs)
    trainer = make_trainer(world_size, strategy, max_steps=steps, accumulate_grad_batches=accumulate,
                           gradient_clip_val=clip)
    trainer.fit(module, loader(dataset, MICRO))
    losses: list[Any] = [None] * world_size
    dist.all_gather_object(losses, module.losses)
    state = full_state(module)
    return {"losses": losses, "state": state if dist.get_rank() == 0 else None,
            "plan": [e.name for e in strategy.plan], "mesh": strategy.device_mesh.mesh.tolist()}


def check_parity(result: dict[str, Any], world_size: int, steps: int, accumulate: int = 1,
                 clip: float | None = None) -> list[float]:
    dataset = token_data(steps * accumulate * world_size * MICRO)
    ref_losses, ref_state = reference_run(steps, world_size * MICRO, dataset, clip=clip, accumulate=accumulate)
    per_rank = result["losses"]
    assert all(len(r) == steps * accumulate for r in per_rank)
    # Lightning's step output under accumulation is the loss divided by the number of micro-batches.
    losses = [accumulate * sum(r[i] for r in per_rank) / world_size for i in range(steps * accumulate)]
    for got, want in zip(losses, ref_losses):
        assert abs(got - want) <= TOL * abs(want), (losses, ref_losses)
    worst = max(ref_state, key=lambda k: max_relative_error({k: result["state"][k]}, {k: ref_state[k]}))
    assert relative_error(result["state"], ref_state) <= TOL, (worst, max_relative_error(result["state"], ref_state))
    return ref_losses


def _momenta(module: pl.LightningModule, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """SGD momentum buffers by parameter name, DTensor shards gathered (collective)."""
    out = {}
    for name, param in module.named_parameters():
        buf = optimizer.state[param]["momentum_buffer"]
        out[name] = (buf.full_tensor() if hasattr(buf, "full_tensor") else buf).detach().numpy().copy()
    return out


class _RecordLoaded(pl.Callback):
    """Weights and optimizer state as the resumed run starts (after the strategy loaded the checkpoint)."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.state = full_state(pl_module)
        self.momenta = _momenta(pl_module, trainer.optimizers[0])


def _reshard(world_size: int, ckpt: Path) -> dict[str, Any]:
    """3 steps at dp=2 tp=1 and a DCP save; models seeded differently resume from it at tp=2 and at tp=1."""
    dataset = token_data(3 * world_size * MICRO)
    pl.seed_everything(0, verbose=False)
    first = TinyLM()
    trainer = make_trainer(world_size, HybridParallelStrategy(tensor_parallel_size=1), max_steps=3)
    trainer.fit(first, loader(dataset, MICRO))
    trainer.save_checkpoint(ckpt)
    saved = {"state": full_state(first), "momenta": _momenta(first, trainer.optimizers[0])}
    resumed = {}
    for tp in (2, 1):
        torch.manual_seed(tp)  # not seed_everything: the global seed is also DistributedSampler's shuffling seed
        module, record = TinyLM(), _RecordLoaded()
        strategy = HybridParallelStrategy(tensor_parallel_size=tp, min_shard_params=0)
        trainer = make_trainer(world_size, strategy, max_steps=6, callbacks=[record])
        trainer.fit(module, loader(dataset, MICRO), ckpt_path=ckpt)
        losses: list[Any] = [None] * world_size
        dist.all_gather_object(losses, module.losses)
        resumed[tp] = {"losses": losses, "state": full_state(module), "loaded": record.state,
                       "loaded_momenta": record.momenta, "plan": [e.name for e in strategy.plan]}
    if dist.get_rank() != 0:
        return {}
    return {"saved": saved, "tp2": resumed[2], "tp1": resumed[1], "is_dcp_folder": ckpt.is_dir()}


def _full_files(world_size: int, folder: Path) -> dict[str, Any]:
    """A plain Lightning DDP checkpoint file resumed at tp=2, which saves a full file, resumed at tp=1."""
    from lightning.pytorch.strategies import DDPStrategy

    dataset = token_data(3 * world_size * MICRO)
    pl.seed_everything(0, verbose=False)
    module = TinyLM()
    trainer = make_trainer(world_size, DDPStrategy(), max_steps=3)
    trainer.fit(module, loader(dataset, MICRO))
    trainer.save_checkpoint(folder / "ddp.ckpt")
    saved = {"ddp": {"state": full_state(module), "momenta": _momenta(module, trainer.optimizers[0])}}
    loaded = {}
    for name, tp, source, target in (("tp2", 2, "ddp.ckpt", "hybrid.ckpt"), ("tp1", 1, "hybrid.ckpt", None)):
        torch.manual_seed(tp)
        module, record = TinyLM(), _RecordLoaded()
        strategy = HybridParallelStrategy(tensor_parallel_size=tp, min_shard_params=0,
                                          save_distributed_checkpoint=False)
        trainer = make_trainer(world_size, strategy, max_steps=6 if target else 7, callbacks=[record])
        trainer.fit(module, loader(dataset, MICRO), ckpt_path=folder / source)
        loaded[name] = {"state": record.state, "momenta": record.momenta}
        if target:
            trainer.save_checkpoint(folder / target)
            saved["hybrid"] = {"state": full_state(module), "momenta": _momenta(module, trainer.optimizers[0])}
    return {"saved": saved, "loaded": loaded, "file": str(folder / "hybrid.ckpt")} if dist.get_rank() == 0 else {}


def _validate(world_size: int) -> dict[str, Any]:
    """``trainer.validate`` on a tp=2 model, then a forward under ``torch.inference_mode`` against the unsharded
    model (Lightning itself validates under ``no_grad`` on gloo and under ``inference_mode`` on NCCL)."""
    pl.seed_everything(0, verbose=False)
    module = TinyLM()
    unsharded = copy.deepcopy(module.model)
    trainer = make_trainer(world_size, HybridParallelStrategy(tensor_parallel_size=2, min_shard_params=0))
    trainer.validate(module, loader(token_data(8, seed=3), MICRO), verbose=False)
    x, _ = token_data(4, seed=4)[2 * dist.get_rank():2 * dist.get_rank() + 2]
    with torch.inference_mode():
        error = (module.model(x) - unsharded(x)).abs().max().item()
    return {"val_loss": trainer.callback_metrics["val_loss"].item(), "inference_mode_error": error,
            "sharded": "model.blocks.0.mlp.fc1" in [e.name for e in trainer.strategy.plan]}


def _grad_norms(world_size: int) -> dict[str, Any]:
    """Norms of the same gradients, sharded (tp=2) and full, without clipping them (max_norm = inf)."""
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_deepseek.parallel.plan import auto_plan
    from lightning_deepseek.parallel.styles import apply_tensor_parallel

    torch.manual_seed(0)
    module = TinyLM()
    x, y = token_data(4, seed=5)[:]
    lm_loss(module.model, (x, y)).backward()
    full = {n: p.grad.clone() for n, p in module.named_parameters()}
    expected = {2.0: torch.nn.utils.get_total_norm(list(full.values()), 2.0).item(),
                float("inf"): torch.nn.utils.get_total_norm(list(full.values()), float("inf")).item()}
    module.zero_grad()
    entries, _ = auto_plan(module, 2, 0)
    apply_tensor_parallel(module, {e.name: e.style for e in entries}, DeviceMesh("cpu", torch.arange(world_size)))
    half = slice(dist.get_rank() * 2, dist.get_rank() * 2 + 2)
    # Shards hold the gradient summed over the tp group's halves, replicated parameters that of the local half;
    # reduce both as the strategy does, so that both sides see the full-batch gradients.
    lm_loss(module.model, (x[half], y[half])).backward()
    for p in module.parameters():
        grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        if not hasattr(p.grad, "to_local"):
            dist.all_reduce(grad)
        grad.div_(world_size)
    got = {norm: clip_grad_norm_(module.parameters(), float("inf"), norm).item() for norm in expected}
    return {"expected": expected, "got": got}


def _staged_precision(world_size: int) -> dict[str, Any]:
    """tp=2 under StagedPrecision (FP32 -> FP16 with loss scaling -> BF16) with clipping, against the FP32 run."""
    from lightning_deepseek.precision import StagedPrecision

    steps = 12
    dataset = token_data(steps * world_size * MICRO)
    pl.seed_everything(0, verbose=False)
    module = TinyLM()
    plugin = StagedPrecision(schedule=[("32-true", 3), ("16-mixed", 8), ("bf16-mixed", None)])
    strategy = HybridParallelStrategy(tensor_parallel_size=2, min_shard_params=0)
    trainer = make_trainer(world_size, strategy, max_steps=steps, plugins=[plugin], gradient_clip_val=1.0)
    trainer.fit(module, loader(dataset, MICRO))
    losses: list[Any] = [None] * world_size
    dist.all_gather_object(losses, module.losses)
    return {"losses": losses, "events": [e for _, e in plugin.events()], "sharded": bool(strategy.plan)}


def _foreign_models(world_size: int) -> dict[str, Any]:
    """Outputs and full gradients of a torch TransformerEncoderLayer and a Llama-style SwiGLU under the automatic
    plan at tp=2 (each rank its own half batch), against the unsharded modules on the whole batch."""
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_deepseek.parallel.plan import auto_plan
    from lightning_deepseek.parallel.styles import apply_tensor_parallel
    from tests.parallel.test_plan import SwiGLU

    rank, errors = dist.get_rank(), {}
    for name, make in (("encoder_layer", lambda: torch.nn.TransformerEncoderLayer(16, 2, 64, 0.0, batch_first=True)),
                       ("swiglu", lambda: SwiGLU(16, 64))):
        torch.manual_seed(0)
        reference, sharded = make(), make()
        sharded.load_state_dict(reference.state_dict())
        x = torch.randn(4, 5, 16, generator=torch.Generator().manual_seed(1))
        # Cubed, not squared: a post-norm output has a constant mean square, so that loss has no real gradient.
        reference(x).pow(3).mean().backward()
        entries, _ = auto_plan(sharded, 2, 0)
        apply_tensor_parallel(sharded, {e.name: e.style for e in entries}, DeviceMesh("cpu", torch.arange(world_size)))
        out = sharded(x[2 * rank:2 * rank + 2])
        out.pow(3).mean().backward()
        state = {}
        for pname, p in sharded.named_parameters():
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            if not hasattr(p.grad, "to_local"):
                dist.all_reduce(grad)
            grad.div_(world_size)  # the strategy's reduction at dp=1
            state[pname] = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        errors[name] = {
            "styles": sorted((e.name, e.style) for e in entries),
            "output": (out - reference(x)[2 * rank:2 * rank + 2]).abs().max().item(),
            "grad": max(((state[n] - p.grad).norm() / p.grad.norm()).item() for n, p in reference.named_parameters()),
        }
    return errors


def two_rank_scenarios(rank: int, world_size: int, ckpt: str) -> dict[str, Any]:
    """Every 2-process scenario of ``tests/parallel`` in one spawn (the ``two_ranks`` fixture of conftest.py)."""
    from tests.parallel.test_bad_input import setup_errors
    from tests.parallel.test_checkpoint_readers import write_gpt_folder
    from tests.parallel.test_fallbacks import fallback_scenarios
    from tests.parallel.test_optimizer_groups import optimizer_group_scenarios
    from tests.parallel.test_teardown import teardown_scenarios

    errors: list[Any] = [None] * world_size
    dist.all_gather_object(errors, setup_errors(world_size))
    return {
        "setup_errors": errors,
        "tp2": fit_parity(world_size, tp=2, steps=STEPS),
        "dp2": fit_parity(world_size, tp=1, steps=STEPS),
        "reshard": _reshard(world_size, Path(ckpt)),
        "full_files": _full_files(world_size, Path(ckpt).parent),
        "validate": _validate(world_size),
        "grad_norms": _grad_norms(world_size),
        "foreign_models": _foreign_models(world_size),
        "staged": _staged_precision(world_size),
        "optimizer_groups": optimizer_group_scenarios(world_size, Path(ckpt).parent),
        "fallbacks": fallback_scenarios(world_size),
        "gpt_folder": write_gpt_folder(world_size, Path(ckpt).parent / "gpt_dcp"),
        "teardown": teardown_scenarios(world_size),
    }


def test_tp2_matches_single_process(two_ranks: dict[str, Any]) -> None:
    result = two_ranks["tp2"]
    assert {"model.blocks.0.mlp.fc1", "model.blocks.0.mlp.fc2", "model.blocks.1.mlp.fc1"} <= set(result["plan"])
    ref_losses = check_parity(result, world_size=2, steps=STEPS)
    assert ref_losses[-1] < 0.8 * ref_losses[0]  # it trained: parity of two frozen models would prove nothing


def test_dp2_matches_single_process(two_ranks: dict[str, Any]) -> None:
    assert two_ranks["dp2"]["plan"] == []
    check_parity(two_ranks["dp2"], world_size=2, steps=STEPS)


def test_dcp_checkpoint_from_dp2_resumes_at_tp2(two_ranks: dict[str, Any]) -> None:
    result = two_ranks["reshard"]
    tp2, tp1 = result["tp2"], result["tp1"]
    assert result["is_dcp_folder"] and "model.blocks.0.mlp.fc1" in tp2["plan"] and tp1["plan"] == []
    # Exactly the saved weights and momenta, resharded onto tp=2 (the resumed models were seeded differently).
    assert max_relative_error(tp2["loaded"], result["saved"]["state"]) == 0.0
    assert max_relative_error(tp2["loaded_momenta"], result["saved"]["momenta"]) == 0.0
    # And training continues as the same resume at tp=1 does.
    assert all(len(r) == 3 for r in tp2["losses"])
    assert tp2["losses"] == [pytest.approx(r, rel=TOL) for r in tp1["losses"]]
    assert max_relative_error(tp2["state"], tp1["state"]) <= TOL


def test_full_checkpoint_files_load_across_strategies_and_tp(two_ranks: dict[str, Any]) -> None:
    result = two_ranks["full_files"]
    saved, loaded = result["saved"], result["loaded"]
    for name, source in (("tp2", "ddp"), ("tp1", "hybrid")):  # DDP's file into tp=2, our full file into tp=1
        assert max_relative_error(loaded[name]["state"], saved[source]["state"]) == 0.0
        assert max_relative_error(loaded[name]["momenta"], saved[source]["momenta"]) == 0.0
    # The full file is a plain Lightning checkpoint: load_state_dict on an unsharded module just works.
    module = TinyLM()
    module.load_state_dict(torch.load(result["file"], weights_only=False)["state_dict"])
    assert max_relative_error(full_state(module), saved["hybrid"]["state"]) == 0.0


def test_validation_syncs_the_global_loss_and_inference_mode_works(two_ranks: dict[str, Any]) -> None:
    pl.seed_everything(0, verbose=False)
    module = TinyLM()
    dataset = token_data(8, seed=3)
    with torch.no_grad():
        expected = sum(lm_loss(module.model, dataset[i:i + 2]).item() for i in range(0, 8, 2)) / 4
    assert two_ranks["validate"]["sharded"]
    assert two_ranks["validate"]["inference_mode_error"] < 1e-5
    assert two_ranks["validate"]["val_loss"] == pytest.approx(expected, rel=TOL)


def test_mesh_aware_grad_norm_matches_full_norm(two_ranks: dict[str, Any]) -> None:
    result = two_ranks["grad_norms"]
    for norm, expected in result["expected"].items():
        assert result["got"][norm] == pytest.approx(expected, rel=1e-5)


def test_staged_precision_trains_with_the_strategy(two_ranks: dict[str, Any]) -> None:
    result = two_ranks["staged"]
    assert result["sharded"]
    assert any("16-mixed" in e for e in result["events"]) and any("bf16-mixed" in e for e in result["events"])
    losses = [sum(r[i] for r in result["losses"]) / 2 for i in range(12)]
    ref_losses, _ = reference_run(12, 2 * MICRO, token_data(12 * 2 * MICRO), clip=1.0)
    # Half-precision stages round differently; the trajectory stays within a few percent of the FP32 one.
    assert losses == pytest.approx(ref_losses, rel=0.03) and losses[-1] < losses[0]


def test_automatic_plan_is_exact_on_torch_encoder_layer_and_swiglu(two_ranks: dict[str, Any]) -> None:
    result = two_ranks["foreign_models"]
    assert result["encoder_layer"]["styles"] == [("linear1", "colwise"), ("linear2", "rowwise")]
    assert result["swiglu"]["styles"] == [("w1", "colwise"), ("w2", "rowwise"), ("w3", "colwise")]
    for name in ("encoder_layer", "swiglu"):
        assert result[name]["output"] < 1e-5 and result[name]["grad"] < 1e-5, (name, result[name])
