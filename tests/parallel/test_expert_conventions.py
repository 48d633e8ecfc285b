"""Expert parallelism for MoE layers that are not transformers': the ``"grouped"`` convention, on 2 gloo processes.

In a plain DDP loop: torchtitan's MoE (found as it is: its ``GroupedExperts`` and its ``expert_bias_E``) and a
user's own FP32 layer (``register_experts``), each trained 8 SGD steps on one process over the global batch and
expert-sharded ``ep=2`` under DDP, the balancing bias updated after every step from the token counts (summed over
ranks under EP); losses and final weights within 1e-4. torchtitan's experts compute in BF16: on CPU a row's result
does not depend on the size of its group, so the sharded run matches as closely as the FP32 one (1.2e-7 on the
losses); docs/moe.md states the bound where a kernel's result does depend on it (GPU grouped GEMMs). The user's
layer also through the per-island dispatch (two islands of one rank each).
In the same spawn, with Lightning: torchtitan's MoE under ``HybridParallelStrategy(expert_parallel_size=2)`` and
``ExpertLoadBalancing`` against ``DDPStrategy`` with the same callback.
"""

from __future__ import annotations

import importlib.util
import tempfile
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_deepseek import HybridParallelStrategy
from lightning_deepseek.moe import ExpertLoadBalancing
from tests.helpers import run_distributed
from tests.moe import ep_runs
from tests.moe.grouped_models import VOCAB, build, loss
from tests.parallel.common import make_trainer, relative_error

STEPS, MICRO, SEQ, WORLD, TOL = 8, 2, 12, 2, 1e-4
KINDS = ["user", "titan"]
HAS_TITAN = importlib.util.find_spec("torchtitan") is not None  # a test dependency (see Makefile)


def _batches() -> list[torch.Tensor]:
    """The same global batch every step, so that the loss falls within a few steps."""
    tokens = torch.randint(0, VOCAB, (WORLD * MICRO, SEQ), generator=torch.Generator().manual_seed(3))
    return [tokens] * STEPS


class TitanModule(pl.LightningModule):
    """torchtitan's MoE LM as a user would train it with Lightning (SGD with momentum, its own loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = build("titan")
        self.losses: list[float] = []

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        value = loss(self.model, batch[0])
        self.losses.append(value.item())
        return value

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _fit(strategy: pl.strategies.Strategy) -> dict[str, Any]:
    module = TitanModule()
    with tempfile.TemporaryDirectory() as root:  # where rank 0 draws expert_load.png
        trainer = make_trainer(WORLD, strategy, max_steps=STEPS, callbacks=[ExpertLoadBalancing(update_rate=1e-2)],
                               default_root_dir=root)
        trainer.fit(module, DataLoader(TensorDataset(torch.cat(_batches())), batch_size=MICRO))
    losses = torch.tensor(module.losses)
    dist.all_reduce(losses)
    experts = [p for n, p in module.named_parameters() if "inner_experts" in n]
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in experts)
    return {"losses": (losses / WORLD).tolist(), "local_share": local / sum(p.numel() for p in experts),
            "bias": [m.expert_bias_E.abs().sum().item() for m in module.model.moes]}


def scenarios(rank: int, world_size: int) -> dict[str, Any]:
    runs = {kind: ep_runs.ep_run(build(kind), _batches(), loss, rank, world_size)
            for kind in KINDS if kind == "user" or HAS_TITAN}
    runs["user_per_island"] = ep_runs.ep_run(build("user"), _batches(), loss, rank, world_size, islands="0;1")
    if HAS_TITAN:
        hybrid = HybridParallelStrategy(tensor_parallel_size=1, expert_parallel_size=2)
        runs["lightning"] = {"ddp": _fit(DDPStrategy()), "hybrid": _fit(hybrid)}
    return runs


@pytest.fixture(scope="module")
def runs() -> dict[str, Any]:
    return run_distributed(scenarios, WORLD, timeout=240)[0]


@pytest.mark.parametrize("kind", KINDS)
def test_grouped_experts_sharded_match_one_process(kind: str, runs: dict[str, Any]) -> None:
    if kind not in runs:
        pytest.skip("torchtitan 0.3 is not installed (a test dependency, see Makefile)")
    run = runs[kind]
    experts = "moes.{}.experts" if kind == "user" else "moes.{}.routed_experts.inner_experts"
    assert run["layers"] == [(experts.format(i), "grouped", 2) for i in range(2)]  # 4 experts, 2 per rank
    assert len(run["ignored"]) == (4 if kind == "user" else 6)  # every stacked expert weight left out of DDP
    ref_losses, ref_state = ep_runs.reference(build(kind), _batches(), loss)
    for step, (ours, ref) in enumerate(zip(run["losses"], ref_losses)):
        assert abs(ours - ref) <= TOL * abs(ref), f"{kind} step {step}: {ours} vs {ref}"
    assert relative_error(run["state"], ref_state) < TOL
    assert ref_losses[-1] < ref_losses[0]  # it trained
    assert len(run["bias"]) == 2 and all(b > 0 for b in run["bias"])  # expert_bias / expert_bias_E balanced


def test_hybrid_strategy_shards_torchtitan_experts_at_ddp_parity(runs: dict[str, Any]) -> None:
    """The user's path: ``HybridParallelStrategy(expert_parallel_size=2)`` and ``ExpertLoadBalancing`` on
    torchtitan's MoE with no adapter: half the expert weights per rank, the bias balanced, DDP's losses."""
    if "lightning" not in runs:
        pytest.skip("torchtitan 0.3 is not installed (a test dependency, see Makefile)")
    ddp, hybrid = runs["lightning"]["ddp"], runs["lightning"]["hybrid"]
    assert hybrid["local_share"] == 0.5 and ddp["local_share"] == 1.0
    assert len(hybrid["losses"]) == STEPS and hybrid["losses"][-1] < hybrid["losses"][0]
    for step, (ours, ref) in enumerate(zip(hybrid["losses"], ddp["losses"])):
        assert abs(ours - ref) <= TOL * abs(ref), f"step {step}: {ours} vs {ref}"
    assert all(b > 0 for b in hybrid["bias"]) and hybrid["bias"] == pytest.approx(ddp["bias"], rel=TOL)


def test_grouped_experts_dispatched_per_island_match_one_process(runs: dict[str, Any]) -> None:
    """The per-island dispatch (each rank an island of its own) takes a grouped layer's rows as the flat one does."""
    run = runs["user_per_island"]
    ref_losses, ref_state = ep_runs.reference(build("user"), _batches(), loss)
    for step, (ours, ref) in enumerate(zip(run["losses"], ref_losses)):
        assert abs(ours - ref) <= TOL * abs(ref), f"step {step}: {ours} vs {ref}"
    assert relative_error(run["state"], ref_state) < TOL
