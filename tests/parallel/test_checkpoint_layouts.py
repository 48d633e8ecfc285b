"""DCP checkpoints of every sharded layout resume at other layouts, on real gloo processes.

Each run trains 3 steps (SGD with momentum, fp32) and saves; a model seeded differently resumes from it at another
layout and trains 3 more. Every step sees the whole data set (one global batch per epoch), so the continuation does
not depend on how the resumed sampler deals samples to ranks. Checked: the weights and momenta as the resumed run
starts equal the saved ones exactly (resharded), and the continuation (its 3 losses and the final weights) equals
6 uninterrupted steps of one process on the global batch within 1e-5 relative (the tolerance of every parity test
here: fp32 sums in another order); each run's share of the parameters shows its layout.

- 2 ranks, GPT: FSDP-2 -> DDP, FSDP-2 -> tp=2, DDP -> FSDP-2, tp=2 -> FSDP-2 (which saves one full file);
- 4 ranks, the MoE preset: FSDP x EP (experts ep=2 sharded over edp=2, the rest HSDP 2 x 2) -> DDP, -> ep=4 and
  -> FSDP x TP (tp=2, FSDP over all 4), DDP -> FSDP x EP (whose ``export_safetensors`` holds its full weights);
- one process: the FSDP-2 folder through the strategy on one device, and the full file written under FSDP by a
  plain Lightning Trainer (no strategy of ours).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from lightning_deepseek import HybridParallelStrategy
from lightning_deepseek.parallel.pretrained import export_safetensors
from tests.helpers import run_distributed
from tests.parallel.common import (
    TinyLM,
    full_state,
    loader,
    make_trainer,
    max_relative_error,
    reference_run,
    relative_error,
    token_data,
)

STEPS, MICRO, TOL = 3, 2, 1e-5
MOE = dict(n_routed_experts=4, moe_top_k=2, n_shared_experts=1, moe_hidden=32, n_dense_layers=1, mlp_ratio=4)
LAYOUTS = {
    "fsdp": dict(data_parallel_shard_size=2),
    "ddp": {},
    "tp2": dict(tensor_parallel_size=2),
    "fsdp_ep": dict(data_parallel_shard_size=2, expert_parallel_size=2),
    "ep4": dict(expert_parallel_size=4),
    "fsdp_tp": dict(tensor_parallel_size=2, data_parallel_shard_size=4),
}
LOCAL_FRACTION = {"fsdp": 0.5, "ddp": 1.0}  # of the parameters held by one rank (the others: below 1)


def momenta(module: pl.LightningModule, optimizer: torch.optim.Optimizer) -> dict[str, np.ndarray]:
    """SGD momentum buffers by parameter name, shards gathered (collective where sharded)."""
    out = {}
    for name, param in module.named_parameters():
        buf = optimizer.state[param]["momentum_buffer"]
        out[name] = (buf.full_tensor() if isinstance(buf, DTensor) else buf).detach().numpy().copy()
    return out


class RecordLoaded(pl.Callback):
    """Weights and momenta as the resumed run starts (after the strategy loaded the checkpoint)."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.loaded = {"state": full_state(pl_module), "momenta": momenta(pl_module, trainer.optimizers[0])}


def _strategy(layout: str, full_file: bool = False) -> HybridParallelStrategy:
    kwargs = {"tensor_parallel_size": 1, **LAYOUTS[layout]}
    return HybridParallelStrategy(min_shard_params=0, save_distributed_checkpoint=not full_file, **kwargs)


def save_run(world_size: int, layout: str, path: Path, config: dict[str, Any]) -> dict[str, Any]:
    """3 steps at ``layout``, saved as a DCP folder at ``path``: the saved weights and momenta."""
    pl.seed_everything(0, verbose=False)
    module = TinyLM(**config)
    trainer = make_trainer(world_size, _strategy(layout), max_steps=STEPS)
    trainer.fit(module, loader(token_data(world_size * MICRO), MICRO))
    trainer.save_checkpoint(path)
    return {"state": full_state(module), "momenta": momenta(module, trainer.optimizers[0]),
            "local_fraction": local_fraction(module)}


def resume_run(world_size: int, layout: str, path: Path, config: dict[str, Any], save_file: Path | None = None,
               micro: int = MICRO, export: Path | None = None) -> dict[str, Any]:
    """Resume ``path`` at ``layout`` for 3 more steps: what was loaded, every rank's losses, the final weights."""
    torch.manual_seed(1 + dist.get_rank())  # not seed_everything: its seed is also the sampler's shuffling seed
    module, record = TinyLM(**config), RecordLoaded()
    trainer = make_trainer(world_size, _strategy(layout, full_file=save_file is not None), max_steps=2 * STEPS,
                           callbacks=[record])
    trainer.fit(module, loader(token_data(world_size * micro), micro), ckpt_path=path)
    if save_file is not None:
        trainer.save_checkpoint(save_file)
    if export is not None:
        export_safetensors(module, export)
    losses: list[Any] = [None] * world_size
    dist.all_gather_object(losses, module.losses)
    return {"loaded": record.loaded, "losses": losses, "state": full_state(module),
            "momenta": momenta(module, trainer.optimizers[0]), "local_fraction": local_fraction(module)}


def _two_ranks(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    root = Path(folder)
    saved = {layout: save_run(world_size, layout, root / f"{layout}.ckpt", {}) for layout in ("fsdp", "ddp", "tp2")}
    resumed = {
        "fsdp->ddp": resume_run(world_size, "ddp", root / "fsdp.ckpt", {}),
        "fsdp->tp2": resume_run(world_size, "tp2", root / "fsdp.ckpt", {}),
        "ddp->fsdp": resume_run(world_size, "fsdp", root / "ddp.ckpt", {}),
        "tp2->fsdp": resume_run(world_size, "fsdp", root / "tp2.ckpt", {}, save_file=root / "fsdp_full.ckpt"),
    }
    return {"saved": saved, "resumed": resumed} if rank == 0 else {}


def local_fraction(module: torch.nn.Module) -> float:
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in module.parameters())
    return local / sum(p.numel() for p in module.parameters())


def _four_ranks(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    root = Path(folder)
    saved = {layout: save_run(world_size, layout, root / f"moe_{layout}.ckpt", MOE) for layout in ("fsdp_ep", "ddp")}
    resumed = {
        "fsdp_ep->ddp": resume_run(world_size, "ddp", root / "moe_fsdp_ep.ckpt", MOE),
        "fsdp_ep->ep4": resume_run(world_size, "ep4", root / "moe_fsdp_ep.ckpt", MOE),
        "fsdp_ep->fsdp_tp": resume_run(world_size, "fsdp_tp", root / "moe_fsdp_ep.ckpt", MOE),
        "ddp->fsdp_ep": resume_run(world_size, "fsdp_ep", root / "moe_ddp.ckpt", MOE, export=root / "moe_export"),
    }
    return {"saved": saved, "resumed": resumed} if rank == 0 else {}


def _one_process(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """The FSDP-2 folder resumed by the strategy on one device (global batch as at 2 ranks); the full file written
    under FSDP-2 loaded by a plain Lightning Trainer."""
    root = Path(folder)
    dcp = resume_run(1, "ddp", root / "fsdp.ckpt", {}, micro=2 * MICRO)
    module, record = TinyLM(), RecordLoaded()
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, max_steps=2 * STEPS + 1,
                         callbacks=[record])
    trainer.fit(module, loader(token_data(8), MICRO), ckpt_path=root / "fsdp_full.ckpt")
    return {"dcp": dcp, "file": record.loaded}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("layouts")


@pytest.fixture(scope="module")
def two_rank_runs(folder: Path) -> dict[str, Any]:
    return run_distributed(_two_ranks, 2, str(folder), timeout=400)[0]


def _check_resume(saved: dict[str, Any], resumed: dict[str, Any], world_size: int, layouts: tuple[str, str],
                  **config: Any) -> None:
    for layout, run in zip(layouts, (saved, resumed)):  # the layouts are what they say
        if layout in LOCAL_FRACTION:
            assert run["local_fraction"] == pytest.approx(LOCAL_FRACTION[layout], abs=0.01)
        else:
            assert run["local_fraction"] < 0.9
    assert max_relative_error(resumed["loaded"]["state"], saved["state"]) == 0.0
    assert max_relative_error(resumed["loaded"]["momenta"], saved["momenta"]) == 0.0
    dataset = token_data(world_size * MICRO)
    ref_losses, ref_state = reference_run(2 * STEPS, world_size * MICRO, dataset, **config)
    ranks = resumed["losses"]
    losses = [sum(r[i] for r in ranks) / len(ranks) for i in range(STEPS)]
    assert losses == [pytest.approx(want, rel=TOL) for want in ref_losses[STEPS:]]
    assert relative_error(resumed["state"], ref_state) <= TOL


@pytest.mark.parametrize(("source", "target"), [("fsdp", "ddp"), ("fsdp", "tp2"), ("ddp", "fsdp"), ("tp2", "fsdp")])
def test_two_rank_layouts_resume_each_other(two_rank_runs: dict[str, Any], source: str, target: str) -> None:
    _check_resume(two_rank_runs["saved"][source], two_rank_runs["resumed"][f"{source}->{target}"], 2,
                  (source, target))


def test_moe_layouts_resume_each_other_on_four_ranks(folder: Path) -> None:
    result = run_distributed(_four_ranks, 4, str(folder), timeout=500)[0]
    for source, target in (("fsdp_ep", "ddp"), ("fsdp_ep", "ep4"), ("fsdp_ep", "fsdp_tp"), ("ddp", "fsdp_ep")):
        _check_resume(result["saved"][source], result["resumed"][f"{source}->{target}"], 4, (source, target), **MOE)
    final = result["resumed"]["ddp->fsdp_ep"]["state"]
    exported = load_file(folder / "moe_export" / "model.safetensors")  # that run's weights, consolidated
    assert max_relative_error({name: exported[name].numpy() for name in final}, final) == 0.0


def test_sharded_checkpoints_load_on_one_process(two_rank_runs: dict[str, Any], folder: Path) -> None:
    result = run_distributed(_one_process, 1, str(folder), timeout=200)[0]
    _check_resume(two_rank_runs["saved"]["fsdp"], result["dcp"], 2, ("fsdp", "ddp"))
    written = two_rank_runs["resumed"]["tp2->fsdp"]  # the final state of the FSDP-2 run that wrote the file
    assert max_relative_error(result["file"]["state"], written["state"]) == 0.0
    assert max_relative_error(result["file"]["momenta"], written["momenta"]) == 0.0
