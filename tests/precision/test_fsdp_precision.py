"""StagedPrecision with sharded parameters (FSDP2) on real gloo processes (2 and 4): FSDP's mixed-precision policy
follows the stage.

- ``set_mixed_precision`` on a live FSDP2 model (FP32 -> BF16 -> FP32 -> FP16 between steps) gives bitwise the
  outputs and gradients of a model given each policy by ``fully_shard`` itself;
- FP32 -> BF16 under ``data_parallel_shard_size=2``: each block's forward sees FP32 weights in the FP32 stage and
  BF16 all-gathered weights in the BF16 stage; the gradients are reduce-scattered in FP32 (the default
  ``fsdp_reduce_dtype``), in BF16 with ``fsdp_reduce_dtype=None``; after ``fit`` the model gathers FP32 again;
- FP32 -> FP16 -> BF16 under FSDP against the same schedule under DDP (autocast on FP32 weights): the FP32 stage
  within 1e-5 (relative, each step's mean loss over the ranks); the half-precision stages differ by design (FSDP
  runs the embeddings, norms and residual stream on FP16/BF16 copies, DDP's autocast keeps them FP32): within 1e-3
  (measured on CPU: FP16 steps 1e-6, BF16 steps 9e-5);
- on 4 ranks, FP32 -> BF16 under HSDP (2 shards x 2 replicas), FSDP x tensor parallelism (tp=2) and FSDP x expert
  parallelism (ep=2, MoE): the same gathered and reduced dtypes, and the losses against DDP within the same
  tolerances (measured: BF16 steps up to 3e-5);
- FP32 -> BF16 -> FP8 under FSDP (float8 layers converted before sharding, FP8 GEMMs emulated on CPU) trains
  through the FP8 stage; before it, its losses equal bitwise those of FP32 -> BF16 under FSDP (the converted layers
  compute as nn.Linear), then differ from them (the FP8 GEMMs run), and match the same schedule under DDP within
  1e-3 (relative; measured on CPU with torchao 0.18: BF16 steps 1e-5, FP8 steps 1.3e-5);
- the same FP8 schedule under FSDP x TP (4 ranks, tp=2) against DDP: FP8 steps within 1e-3 (measured 5e-5);
- an FP8 stage with a model sharded before the plugin sees it (``fully_shard`` in ``configure_model``) is refused
  at setup with an error naming the fix.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter  # the protocol set_custom_reduce_scatter takes

from lightning_deepseek import HybridParallelStrategy, StagedPrecision
from lightning_deepseek.precision.fsdp_policy import fsdp_units, set_mixed_precision, stage_policy
from tests.helpers import run_distributed
from tests.parallel.common import TinyLM, loader, make_trainer, token_data

STEPS, MICRO = 9, 2
SCHEDULE = [("32-true", 3), ("16-mixed", 6), ("bf16-mixed",)]
FP32_TOL, HALF_TOL, FP8_TOL = 1e-5, 1e-3, 1e-3
FP8_STEPS, FP8_SCHEDULE, BF16_SCHEDULE = 6, [("32-true", 2), ("bf16-mixed", 4), ("fp8",)], [("32-true", 2), ("bf16",)]
MOE = dict(n_routed_experts=4, moe_top_k=2, n_shared_experts=1, moe_hidden=32, n_dense_layers=1, mlp_ratio=4)


class _RecordingReduceScatter(ReduceScatter):
    """FSDP's reduce-scatter (the same collective it runs by default), noting the dtype it reduces in per step."""

    def __init__(self, trainer: pl.Trainer, record: dict[int, set[str]]) -> None:
        self.trainer, self.record = trainer, record

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, op: Any,
                 async_op: bool = False) -> Any:
        self.record.setdefault(self.trainer.global_step, set()).add(str(input_tensor.dtype))
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


class RecordDtypes(pl.Callback):
    """Per optimizer step: the dtype of the first block's ``fc1`` weight its forward sees, and the reduce dtypes."""

    def __init__(self) -> None:
        self.gathered: dict[int, str] = {}
        self.reduced: dict[int, set[str]] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        def note(fc1: torch.nn.Module, args: Any) -> None:
            self.gathered.setdefault(trainer.global_step, str(fc1.weight.dtype))

        self.hook = pl_module.model.blocks[0].mlp.fc1.register_forward_pre_hook(note)
        for unit in fsdp_units(pl_module):
            unit.set_custom_reduce_scatter(_RecordingReduceScatter(trainer, self.reduced))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.hook.remove()


def _fit(world_size: int, schedule: list[tuple], shard: int, steps: int = STEPS, tp: int = 1, ep: int = 1,
         model: dict[str, Any] | None = None, **plugin_kwargs: Any) -> dict:
    pl.seed_everything(0, verbose=False)
    module, record = TinyLM(**(model or {})), RecordDtypes()
    plugin = StagedPrecision(schedule, init_scale=1024.0, **plugin_kwargs)
    strategy = HybridParallelStrategy(tensor_parallel_size=tp, expert_parallel_size=ep, min_shard_params=0,
                                      data_parallel_shard_size=shard)
    trainer = make_trainer(world_size, strategy, max_steps=steps, plugins=[plugin], callbacks=[record])
    trainer.fit(module, loader(token_data(steps * world_size * MICRO), MICRO))
    after: list[str] = []
    fc1 = module.model.blocks[0].mlp.fc1
    fc1.register_forward_pre_hook(lambda m, args: after.append(str(m.weight.dtype)) and None)
    with torch.no_grad():
        module.model(token_data(2)[:][0])
    losses: list[Any] = [None] * world_size
    dist.all_gather_object(losses, module.losses)
    return {"losses": [sum(r[i] for r in losses) / world_size for i in range(steps)], "events": plugin.events(),
            "skipped": plugin.num_skipped_steps, "gathered": record.gathered,
            "reduced": {k: sorted(v) for k, v in record.reduced.items()}, "after_fit": after,
            "fp8_layers": plugin.float8_layers, "fc1": type(fc1).__name__}


def _fp8_runs(world_size: int) -> dict[str, Any]:
    if importlib.util.find_spec("torchao") is None:
        return {}
    return {"fsdp": _fit(world_size, FP8_SCHEDULE, shard=2, steps=FP8_STEPS),
            "ddp": _fit(world_size, FP8_SCHEDULE, shard=1, steps=FP8_STEPS),
            "bf16": _fit(world_size, BF16_SCHEDULE, shard=2, steps=FP8_STEPS), "error": _fp8_error(world_size)}


class _ShardedInConfigureModel(TinyLM):
    def configure_model(self) -> None:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for module in (*self.model.blocks, self.model):
            fully_shard(module, mesh=mesh)


def _fp8_error(world_size: int) -> str:
    plugin = StagedPrecision([("bf16-mixed", 1), ("fp8",)])
    trainer = make_trainer(world_size, HybridParallelStrategy(tensor_parallel_size=1), max_steps=2, plugins=[plugin])
    try:
        trainer.fit(_ShardedInConfigureModel(), loader(token_data(8), MICRO))
    except ValueError as exc:
        return str(exc)
    return "no error"


def _sharded_mlp(policy: MixedPrecisionPolicy) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for module in (model[0], model[2], model):
        fully_shard(module, mesh=mesh, mp_policy=policy)
    return model


def _step(model: torch.nn.Module) -> list[np.ndarray]:
    """Output and the gathered gradients of one forward and backward on a fixed batch."""
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(dist.get_rank()))
    out = model(x)
    out.float().square().sum().backward()
    grads = [p.grad.full_tensor().numpy().copy() for p in model.parameters()]
    model.zero_grad()
    return [out.detach().float().numpy().copy(), *grads]


def _live_switch_against_fully_shard() -> dict[str, bool]:
    """One model switched FP32 -> BF16 -> FP32 -> FP16 (FP32 reduce) between steps, against models given each
    policy by ``fully_shard`` itself: bitwise equal outputs and gradients."""
    live, equal = _sharded_mlp(MixedPrecisionPolicy()), {}
    _step(live)
    for precision in ("bf16-mixed", "32-true", "16-mixed"):
        policy = stage_policy(precision)
        set_mixed_precision(fsdp_units(live), policy)
        got, want = _step(live), _step(_sharded_mlp(policy))
        equal[precision] = all(np.array_equal(a, b) for a, b in zip(got, want))
    return equal


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    return {"live_switch": _live_switch_against_fully_shard(),
            "fsdp": _fit(world_size, SCHEDULE, shard=2), "ddp": _fit(world_size, SCHEDULE, shard=1),
            "bf16_reduce": _fit(world_size, [("32-true", 1), ("bf16-mixed",)], shard=2, steps=2,
                                fsdp_reduce_dtype=None),
            "fp8": _fp8_runs(world_size)}


def _four_ranks(rank: int, world_size: int) -> dict[str, Any]:
    short = dict(schedule=[("32-true", 2), ("bf16-mixed",)], steps=5)
    fp8 = dict(schedule=FP8_SCHEDULE, steps=FP8_STEPS)
    return {"ddp": _fit(world_size, shard=1, **short), "hsdp": _fit(world_size, shard=2, **short),
            "tp": _fit(world_size, shard=2, tp=2, **short), "ddp_moe": _fit(world_size, shard=1, model=MOE, **short),
            "ep": _fit(world_size, shard=2, ep=2, model=MOE, **short),
            **({"ddp_fp8": _fit(world_size, shard=1, **fp8), "tp_fp8": _fit(world_size, shard=2, tp=2, **fp8)}
               if importlib.util.find_spec("torchao") is not None else {})}


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_distributed(_worker, 2, timeout=280)


def test_live_policy_switch_equals_fully_shard_given_that_policy(ranks: list[dict]) -> None:
    for result in ranks:
        assert result["live_switch"] == {"bf16-mixed": True, "32-true": True, "16-mixed": True}


def test_fsdp_gathers_parameters_in_the_stage_dtype_and_reduces_in_fp32(ranks: list[dict]) -> None:
    for result in (r["fsdp"] for r in ranks):
        assert result["events"] == [(3, "32-true -> 16-mixed"), (6, "16-mixed -> bf16-mixed")]
        assert [result["gathered"][s] for s in range(STEPS)] == (
            ["torch.float32"] * 3 + ["torch.float16"] * 3 + ["torch.bfloat16"] * 3)
        assert all(result["reduced"][s] == ["torch.float32"] for s in range(STEPS))
        assert result["after_fit"] == ["torch.float32"]  # the model leaves the run with FSDP's FP32 gathers
    for result in (r["ddp"] for r in ranks):  # no FSDP unit: autocast alone, FP32 weights in every stage
        assert set(result["gathered"].values()) == {"torch.float32"} and not result["reduced"]


def test_fsdp_reduce_dtype_none_reduces_in_the_stage_dtype(ranks: list[dict]) -> None:
    for result in (r["bf16_reduce"] for r in ranks):
        assert result["gathered"] == {0: "torch.float32", 1: "torch.bfloat16"}
        assert result["reduced"] == {0: ["torch.float32"], 1: ["torch.bfloat16"]}


def test_staged_run_under_fsdp_matches_ddp(ranks: list[dict]) -> None:
    fsdp, ddp = ranks[0]["fsdp"], ranks[0]["ddp"]
    assert fsdp["skipped"] == ddp["skipped"] == 0
    errors = [abs(a - b) / abs(b) for a, b in zip(fsdp["losses"], ddp["losses"])]
    assert max(errors[:3]) <= FP32_TOL, errors
    assert max(errors[3:]) <= HALF_TOL, errors
    assert fsdp["losses"][-1] < fsdp["losses"][0] - 0.1  # and it trains


def test_fp8_stage_under_fsdp_matches_ddp_and_costs_nothing_before_it(ranks: list[dict]) -> None:
    if not ranks[0]["fp8"]:
        pytest.skip("torchao is not installed (the fp8 extra)")
    fsdp, ddp, bf16 = (ranks[0]["fp8"][name] for name in ("fsdp", "ddp", "bf16"))
    assert fsdp["events"] == [(2, "32-true -> bf16-mixed"), (4, "bf16-mixed -> fp8-mixed")]
    assert (fsdp["fc1"], ddp["fc1"]) == ("ToggledFloat8Linear", "Linear")  # converted at setup; DDP's swapped back
    assert fsdp["fp8_layers"] and fsdp["fp8_layers"] == ddp["fp8_layers"]
    assert fsdp["losses"][:4] == bf16["losses"][:4]  # bitwise: the converted layers compute as nn.Linear until FP8
    assert all(a != b for a, b in zip(fsdp["losses"][4:], bf16["losses"][4:]))  # then FP8 GEMMs
    assert all(np.isfinite(fsdp["losses"])) and fsdp["losses"][-1] < fsdp["losses"][0]
    errors = [abs(a - b) / abs(b) for a, b in zip(fsdp["losses"], ddp["losses"])]
    assert max(errors[:2]) <= FP32_TOL and max(errors[2:4]) <= HALF_TOL and max(errors[4:]) <= FP8_TOL, errors
    for result in (r["fp8"]["fsdp"] for r in ranks):  # BF16 gathers in the FP8 stage; FP32 again after fit
        assert [result["gathered"][s] for s in range(FP8_STEPS)] == ["torch.float32"] * 2 + ["torch.bfloat16"] * 4
        assert result["after_fit"] == ["torch.float32"]


def test_fp8_stage_with_a_model_sharded_before_conversion_is_a_clear_error(ranks: list[dict]) -> None:
    if not ranks[0]["fp8"]:
        pytest.skip("torchao is not installed (the fp8 extra)")
    message = ranks[0]["fp8"]["error"]
    assert "Stage('fp8') with sharded parameters needs its float8 layers before sharding" in message, message
    assert "data_parallel_shard_size to a size" in message


def test_policy_follows_the_stage_under_hsdp_tensor_and_expert_parallelism() -> None:
    runs = run_distributed(_four_ranks, 4, timeout=280)
    for name, reference in (("hsdp", "ddp"), ("tp", "ddp"), ("ep", "ddp_moe")):
        for result in (r[name] for r in runs):
            assert [result["gathered"][s] for s in range(5)] == ["torch.float32"] * 2 + ["torch.bfloat16"] * 3, name
            assert all(result["reduced"][s] == ["torch.float32"] for s in range(5)), name
        got, want = runs[0][name]["losses"], runs[0][reference]["losses"]
        errors = [abs(a - b) / abs(b) for a, b in zip(got, want)]
        assert max(errors[:2]) <= FP32_TOL and max(errors[2:]) <= HALF_TOL, (name, errors)
    if "tp_fp8" in runs[0]:  # FP32 -> BF16 -> FP8 under FSDP x TP: the float8 layers converted before both
        errors = [abs(a - b) / abs(b) for a, b in zip(runs[0]["tp_fp8"]["losses"], runs[0]["ddp_fp8"]["losses"])]
        assert max(errors[:2]) <= FP32_TOL and max(errors[2:4]) <= HALF_TOL and max(errors[4:]) <= FP8_TOL, errors


@pytest.mark.parametrize(("value", "dtype"), [(torch.float32, torch.float32), ("bf16", torch.bfloat16),
                                              ("float16", torch.float16), (None, None)])
def test_fsdp_reduce_dtype_takes_dtypes_and_their_names(value: Any, dtype: torch.dtype | None) -> None:
    assert StagedPrecision(fsdp_reduce_dtype=value).fsdp_reduce_dtype == dtype


@pytest.mark.parametrize("value", ["fp8", torch.int8])
def test_a_bad_fsdp_reduce_dtype_is_a_clear_error(value: Any) -> None:
    with pytest.raises(ValueError, match=r"fsdp_reduce_dtype=.* is not a gradient reduce dtype\. Use torch\.float32"):
        StagedPrecision(fsdp_reduce_dtype=value)
