"""Lightning's contract for model-parallel strategies, as its own ``ModelParallelStrategy`` tests pin it
(``tests/tests_pytorch/strategies/test_model_parallel.py`` and ``test_model_parallel_integration.py``, Lightning
2.6.5), adapted to ``HybridParallelStrategy`` on 2 real gloo processes (one spawn runs every scenario; each test
checks one):

- mesh dimensions ``dp``/``tp`` for Lightning's ``data_parallel``/``tensor_parallel``; ``tensor_parallel_size=
  "per_node"`` for Lightning's ``"auto"``; Lightning's 2 x 2 FSDP x TP model on 4 GPUs becomes, on 2 ranks, a
  user's TP over ``tp=2`` and a user's FSDP2 over ``dp=2`` (each checked against one process), and its 2-GPU
  FSDP2 model TP over ``tp=2`` with ``fully_shard`` over ``dp=1``, as there;
- single-file checkpoints go both ways between us and Lightning's ``DDPStrategy`` and ``ModelParallelStrategy``,
  DCP folders between us and ``ModelParallelStrategy``; optimizer states keyed as Lightning keys them;
- where we differ on purpose (docs/large_models.md, "Differences from Lightning's ModelParallelStrategy") the test
  pins our behaviour: our own plan gives every rank of a tp group its own micro-batch, ``configure_model`` is not
  required, a meta module that cannot be initialised is an error rather than a warning.

Not adapted: the PyTorch 2.4 gate (``lightning_deepseek.versions`` checks ours), Lightning's private
``_align_compiled_param_names_with_module`` (its behaviour is checked through a compiled model's one-file
checkpoint), torchmetrics moved to CUDA (CPU only here).
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_deepseek import HybridParallelStrategy
from tests.helpers import free_port, run_distributed

DIM, HIDDEN, SAMPLES, BATCH, LR, TOL = 32, 64, 8, 2, 0.01, 1e-5


class FeedForward(nn.Module):
    """Lightning's test model: a SwiGLU feed-forward block."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN)
        self.w2 = nn.Linear(DIM, HIDDEN)
        self.w3 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w3(F.silu(self.w1(x)) * self.w2(x))


def _view(mesh: DeviceMesh, kind: str) -> DeviceMesh:
    """The data- or tensor-parallel view by position: ours is ``("dp", "tp")``, Lightning's
    ``("data_parallel", "tensor_parallel")``; one model runs under both strategies."""
    return mesh[mesh.mesh_dim_names[("dp", "tp").index(kind)]]


def parallelize_tp(model: FeedForward, mesh: DeviceMesh) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(model, _view(mesh, "tp"), {"w1": ColwiseParallel(), "w2": ColwiseParallel(),
                                                  "w3": RowwiseParallel()})


def parallelize_fsdp(model: FeedForward, mesh: DeviceMesh) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in (model.w1, model.w2, model.w3):
        fully_shard(layer, mesh=_view(mesh, "dp"))


def compile_eager(model: FeedForward, mesh: DeviceMesh) -> nn.Module:
    return torch.compile(model, backend="eager")  # an OptimizedModule (``_orig_mod`` names) without inductor


class Rows(Dataset):
    """The same fixed rows on every rank (Lightning's ``RandomDataset`` seeded alike)."""

    def __init__(self) -> None:
        self.data = torch.randn(SAMPLES, DIM, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.data[index]


def _full(module: nn.Module) -> dict[str, np.ndarray]:
    """Full parameter values by name (DTensor shards gathered: collective)."""
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().numpy().copy()
            for n, p in module.named_parameters()}


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


class TemplateModel(pl.LightningModule):
    """Lightning's ``TemplateModel``; ``configure_model`` applies ``parallelize`` (the user's own parallelisation)
    to ``self.model`` with ``self.device_mesh``. Records the batches every rank saw, the full weights at the start
    and the end, and the layout facts Lightning's tests assert in ``on_train_start``."""

    def __init__(self, parallelize: tuple[Callable, ...] = (), sgd: bool = False) -> None:
        super().__init__()
        self.model = FeedForward()
        self.parallelize, self.sgd = parallelize, sgd
        self.batches: list[np.ndarray] = []
        self.facts: dict[str, Any] = {}

    def configure_model(self) -> None:
        if any(isinstance(p, DTensor) for p in self.model.parameters()):
            return
        for fn in self.parallelize:
            wrapped = fn(self.model, self.device_mesh)
            self.model = self.model if wrapped is None else wrapped

    def training_step(self, batch: torch.Tensor, batch_idx: int = 0) -> torch.Tensor:
        self.batches.append(self.all_gather(batch).detach().float().numpy().copy())
        return self.model(batch).sum()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Rows(), batch_size=BATCH)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.sgd:
            return torch.optim.SGD(self.model.parameters(), lr=LR, momentum=0.9)
        return torch.optim.AdamW(self.model.parameters())

    def on_train_start(self) -> None:
        params = list(self.model.parameters())
        optimizer_params = self.optimizers(use_pl_optimizer=False).param_groups[0]["params"]
        loader = self.trainer.train_dataloader
        self.facts = {
            "all_dtensor": all(isinstance(p, DTensor) for p in params),
            "meshes": sorted({str(p.device_mesh.mesh.tolist()) for p in params if isinstance(p, DTensor)}),
            "optimizer_on_param_meshes": all(not isinstance(p, DTensor) or p.device_mesh == params[0].device_mesh
                                             for p in optimizer_params),
            "w1_placements": str(getattr(self.model.w1.weight, "placements", None)),
            "w1_local_shape": tuple(_local(self.model.w1.weight).shape),
            "any_meta": any(p.is_meta for p in params) or any(p.is_meta for p in optimizer_params),
            "device": str(self.model.w1.weight.device), "dtype": str(self.model.w1.weight.dtype),
            "optimizer_device": str(optimizer_params[0].device),
            "loader_len": len(loader), "distributed_sampler": isinstance(loader.sampler, DistributedSampler),
        }
        self.initial = _full(self)

    def on_train_end(self) -> None:
        self.final = _full(self)


def _trainer(strategy: Any, **kwargs: Any) -> pl.Trainer:
    defaults = dict(accelerator="cpu", devices=2, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, max_epochs=1)
    return pl.Trainer(strategy=strategy, **{**defaults, **kwargs})


def _fit(make: Callable[[], pl.LightningModule], strategy: Any, empty_init: bool | None = None,
         ckpt_path: Path | None = None, **kwargs: Any) -> tuple[pl.Trainer, pl.LightningModule]:
    pl.seed_everything(0, verbose=False)
    trainer = _trainer(strategy, **kwargs)
    with trainer.init_module(empty_init=empty_init) if empty_init is not None else nullcontext():
        module = make()
    module.meta_before_fit = all(p.is_meta for p in module.parameters())
    module.before_fit = (str(module.model.w1.weight.device), str(module.model.w1.weight.dtype)) \
        if hasattr(module, "model") else None
    trainer.fit(module, ckpt_path=None if ckpt_path is None else str(ckpt_path))
    return trainer, module


def _plain(obj: Any) -> Any:
    """Tensors as numpy, recursively (picklable by value across processes)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().float().numpy().copy()
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


def _states(trainer: pl.Trainer) -> dict[str, Any]:
    """The strategy's full model and optimizer states (collective for sharding strategies), as Lightning's tests
    read them: sizes on every rank, the states themselves on rank 0 with optimizer states keyed by parameter name
    (Lightning's files key them by index)."""
    strategy = trainer.strategy
    model_state = strategy.lightning_module_state_dict()
    optimizer_state = strategy.optimizer_state(trainer.optimizers[0])
    out = {"model_len": len(model_state), "optimizer_len": len(optimizer_state)}
    if trainer.global_rank == 0:
        names = [n for n, _ in strategy.lightning_module.named_parameters()]
        out["model"] = _plain(dict(model_state))
        out["optimizer_keys"] = sorted(map(str, optimizer_state["state"]))
        out["optimizer"] = _plain({names[k] if isinstance(k, int) else k: v
                                   for k, v in optimizer_state["state"].items()})
    return out


def _guarded(fn: Callable[[], Any]) -> Any:
    """``fn()``, or the exception it raised (a failing scenario must not hide the others' results)."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - reported by the test that reads this scenario
        return {"error": type(exc).__name__, "mro": [c.__name__ for c in type(exc).__mro__], "message": str(exc),
                "traceback": traceback.format_exc(limit=-6)}


# --- scenarios (each runs on both ranks) ---


class MeshProbe(BoringModel):
    def configure_model(self) -> None:
        mesh = self.device_mesh
        self.seen = None if mesh is None else {
            "is_device_mesh": isinstance(mesh, DeviceMesh), "device_type": mesh.device_type,
            "names": mesh.mesh_dim_names, "shape": tuple(mesh.shape), "ndim": mesh.ndim}


def _mesh_in_configure_model() -> dict[str, Any]:
    seen = {}
    for tp in (1, 2, "per_node"):
        module = MeshProbe()
        _trainer(HybridParallelStrategy(tensor_parallel_size=tp), max_steps=1).fit(module)
        seen[str(tp)] = module.seen
    return seen


def _facts(trainer: pl.Trainer, module: TemplateModel) -> dict[str, Any]:
    return {**module.facts, "batches": module.batches, "initial": module.initial, "final": module.final,
            "meta_before_fit": module.meta_before_fit, "plan": [e.name for e in trainer.strategy.plan],
            "tp_mesh": trainer.strategy.device_mesh["tp"].mesh.tolist(),
            "dp_mesh": trainer.strategy.device_mesh["dp"].mesh.tolist(),
            "ddp_module": trainer.strategy.ddp_module is not None}


def _user_tensor_parallel() -> dict[str, Any]:
    """Lightning's ``test_tensor_parallel``: the user's TP over ``tp=2``, built under ``empty_init=True``; the
    strategy's own plan would shard the same block (``min_shard_params=0``)."""
    strategy = HybridParallelStrategy(tensor_parallel_size=2, min_shard_params=0)
    trainer, module = _fit(lambda: TemplateModel((parallelize_tp,), sgd=True), strategy, empty_init=True)
    return _facts(trainer, module)


def _user_fsdp() -> dict[str, Any]:
    """Lightning's ``test_fsdp2_tensor_parallel``, its data-parallel half: the user's ``fully_shard`` over
    ``dp=2``."""
    strategy = HybridParallelStrategy(tensor_parallel_size=1)
    trainer, module = _fit(lambda: TemplateModel((parallelize_fsdp,), sgd=True), strategy, empty_init=True)
    return _facts(trainer, module)


def _our_plan() -> dict[str, Any]:
    """The same block sharded by the strategy's own plan at ``tp=2``, no ``configure_model``: every rank its own
    micro-batch (our difference from Lightning)."""
    strategy = HybridParallelStrategy(tensor_parallel_size=2, min_shard_params=0)
    trainer, module = _fit(lambda: PlanOnly(sgd=True), strategy)
    return _facts(trainer, module)


class PlanOnly(TemplateModel):
    """No ``configure_model`` of its own (Lightning's ``ModelParallelStrategy`` refuses such a module)."""

    configure_model = pl.LightningModule.configure_model


class NoResetParameters(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4, 4))


class ResetParameters(NoResetParameters):
    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class MetaModel(pl.LightningModule):
    """Lightning's ``test_meta_device_materialization`` model (built on the meta device)."""

    def __init__(self, layer: type[nn.Module]) -> None:
        super().__init__()
        self.layer1 = nn.Sequential(layer(), layer())
        self.layer2 = nn.Linear(4, 4)
        self.register_buffer("buffer", torch.rand(2))

    def reset_parameters(self) -> None:
        self.buffer.fill_(1.0)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.layer2(batch @ self.layer1[0].weight @ self.layer1[1].weight).sum()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(torch.ones(4, 4), batch_size=2)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _meta_materialization() -> dict[str, Any]:
    out = {}
    for layer in (NoResetParameters, ResetParameters):
        with torch.device("meta"):
            module = MetaModel(layer)

        def fit(module: MetaModel = module) -> dict[str, Any]:
            _trainer(HybridParallelStrategy(tensor_parallel_size=1), max_steps=1).fit(module)
            return {"no_meta": all(not t.is_meta for t in [*module.parameters(), *module.buffers()]),
                    "buffer": module.buffer.tolist()}

        out[layer.__name__] = _guarded(fit)
    return out


def _init_context() -> dict[str, Any]:
    """Lightning's ``test_module_init_context``: device and dtype before the fit and at its start."""
    out = {}
    for precision, empty_init in (("32-true", False), ("32-true", True), ("16-true", True), ("bf16-true", True)):
        def run(precision: str = precision, empty_init: bool = empty_init) -> dict[str, Any]:
            strategy = HybridParallelStrategy(tensor_parallel_size=2)
            trainer, module = _fit(lambda: TemplateModel((parallelize_tp, parallelize_fsdp)), strategy,
                                   empty_init=empty_init, precision=precision, max_steps=1, barebones=True)
            return {"before": module.before_fit, "device": module.facts["device"], "dtype": module.facts["dtype"],
                    "optimizer_device": module.facts["optimizer_device"]}

        out[f"{precision}-{empty_init}"] = _guarded(run)
    return out


def _state_dicts_and_saving(folder: Path) -> dict[str, Any]:
    """Lightning's ``test_strategy_state_dict`` for both checkpoint kinds, then its ``test_save_checkpoint_path_exists``
    with the same trainers."""
    out: dict[str, Any] = {}
    for distributed in (True, False):
        correct = list(TemplateModel().state_dict())
        strategy = HybridParallelStrategy(tensor_parallel_size=2, save_distributed_checkpoint=distributed)
        trainer, _ = _fit(lambda: TemplateModel((parallelize_tp, parallelize_fsdp)), strategy, barebones=True)
        keys = list(trainer.strategy.lightning_module_state_dict())
        out[f"keys-{distributed}"] = {"keys": keys, "correct": correct}
        out[f"save-{distributed}"] = _save_over_existing(trainer, folder / f"save-{distributed}", distributed)
    return out


def _save_over_existing(trainer: pl.Trainer, folder: Path, distributed: bool) -> dict[str, Any]:
    cases = {"folder": ("file",), "dcp_folder": ("meta.pt",), "file": None}
    if trainer.global_rank == 0:
        for name, contents in cases.items():
            path = folder / name
            if contents is None:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.touch()
            else:
                path.mkdir(parents=True)
                for entry in contents:
                    (path / entry).touch()
    trainer.strategy.barrier()
    out = {}
    for name in cases:
        path = folder / name
        result = _guarded(lambda path=path: trainer.save_checkpoint(path))
        trainer.strategy.barrier()
        out[name] = {"error": (result or {}).get("error"), "is_file": path.is_file(), "is_dir": path.is_dir(),
                     "entries": sorted(os.listdir(path)) if path.is_dir() else None}
    return out


def _interchange(folder: Path) -> dict[str, Any]:
    """Lightning's ``test_load_full_state_checkpoint_into_regular_model`` and
    ``test_load_standard_checkpoint_into_distributed_model``, and the same both ways with Lightning's
    ``ModelParallelStrategy``: each run resumes the previous one's file at the end of its epoch, so its states are
    exactly the loaded ones."""
    def ours(**kwargs: Any) -> HybridParallelStrategy:
        return HybridParallelStrategy(tensor_parallel_size=2, save_distributed_checkpoint=False, **kwargs)

    def lightning() -> ModelParallelStrategy:
        return ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2, save_distributed_checkpoint=False)

    sharded = (parallelize_tp, parallelize_fsdp)
    steps = [  # name, strategy, the user's parallelisation, the file it resumes
        ("ours", ours, sharded, None),
        ("ddp_from_ours", DDPStrategy, (), "ours"),
        ("ours_from_ddp", ours, sharded, "ddp_from_ours"),
        ("lightning_from_ours", lightning, sharded, "ours"),
        ("ours_from_lightning", ours, sharded, "lightning_from_ours"),
    ]
    out: dict[str, Any] = {}
    for name, make_strategy, parallelize, source in steps:
        def run(make_strategy: Callable = make_strategy, parallelize: tuple = parallelize,
                source: str | None = source, name: str = name) -> dict[str, Any]:
            trainer, _ = _fit(lambda: TemplateModel(parallelize), make_strategy(), barebones=True,
                              ckpt_path=None if source is None else folder / f"{source}.ckpt")
            states = _states(trainer)
            trainer.save_checkpoint(folder / f"{name}.ckpt")
            if trainer.global_rank == 0:
                saved = torch.load(folder / f"{name}.ckpt", weights_only=False)["optimizer_states"][0]
                states["file_optimizer_keys"] = sorted(map(str, saved["state"]))
                states["file_param_groups"] = [list(map(str, g["params"])) for g in saved["param_groups"]]
            return states

        out[name] = _guarded(run)
    return out


def _distributed_checkpoints(folder: Path) -> dict[str, Any]:
    """Lightning's ``test_save_load_sharded_state_dict``: our DCP folder from the checkpoint callback, resumed by us
    and by Lightning's ``ModelParallelStrategy``, whose folder we resume in turn."""
    sharded = (parallelize_tp, parallelize_fsdp)
    out: dict[str, Any] = {}
    trainer, module = _fit(lambda: TemplateModel(sharded), HybridParallelStrategy(tensor_parallel_size=2),
                           enable_checkpointing=True, default_root_dir=str(folder / "ours"))
    path = Path(trainer.strategy.broadcast(trainer.checkpoint_callback.best_model_path))
    out["listing"] = sorted(os.listdir(path))
    meta = torch.load(path / "meta.pt", weights_only=True)
    out["meta"] = {"version": "pytorch-lightning_version" in meta, "callbacks": len(meta["callbacks"]),
                   "state_dict": "state_dict" in meta, "optimizer_states": "optimizer_states" in meta}
    saved = module.final

    def resume(strategy: Any, ckpt: Path, epochs: int, root: str) -> dict[str, Any]:
        trainer, module = _fit(lambda: TemplateModel(sharded), strategy, ckpt_path=ckpt, max_epochs=epochs,
                               enable_checkpointing=True, default_root_dir=str(folder / root))
        return {"trainer": trainer, "initial": module.initial, "final": module.final}

    ours = _guarded(lambda: resume(HybridParallelStrategy(tensor_parallel_size=2), path, 2, "ours_resumed"))
    out["ours_resumed"] = {"error": ours.get("error"), "initial": ours.get("initial"), "saved": saved}
    theirs = _guarded(lambda: resume(ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2), path, 2,
                                     "lightning"))
    out["lightning_resumed"] = {"error": theirs.get("error"), "initial": theirs.get("initial"), "saved": saved}
    if "trainer" in theirs:
        their_path = Path(theirs["trainer"].strategy.broadcast(theirs["trainer"].checkpoint_callback.best_model_path))
        back = _guarded(lambda: resume(HybridParallelStrategy(tensor_parallel_size=2), their_path, 3, "back"))
        out["ours_from_lightning"] = {"error": back.get("error"), "initial": back.get("initial"),
                                      "saved": theirs["final"]}
    return out


def _invalid_sizes() -> dict[str, Any]:
    """Lightning's ``test_validate_device_mesh_dimensions``: sizes the world size (2) cannot be cut into."""
    out = {}
    for kwargs in (dict(tensor_parallel_size=3), dict(tensor_parallel_size=4), dict(expert_parallel_size=3),
                   dict(data_parallel_shard_size=3)):
        def fit(kwargs: dict[str, Any] = kwargs) -> None:
            _trainer(HybridParallelStrategy(**kwargs), max_steps=1).fit(BoringModel())

        out[str(kwargs)] = _guarded(fit)
    return out


def _unknown_checkpoint(folder: Path) -> Any:
    """Lightning's ``test_load_unknown_checkpoint_type``: a folder that is neither a file nor a DCP checkpoint."""
    path = folder / "empty_dir"
    path.mkdir(parents=True, exist_ok=True)
    return _guarded(lambda: _fit(TemplateModel, HybridParallelStrategy(tensor_parallel_size=1), ckpt_path=path)
                    and "no error")


def _compiled_single_file(folder: Path) -> Any:
    """Lightning's ``test_model_parallel_single_file_checkpoint_with_compile``: a compiled submodule, one file."""
    def run() -> dict[str, Any]:
        strategy = HybridParallelStrategy(tensor_parallel_size=1, save_distributed_checkpoint=False)
        trainer, module = _fit(lambda: TemplateModel((compile_eager,)), strategy, max_steps=2)
        path = folder / "compiled.ckpt"
        trainer.save_checkpoint(path)
        saved = torch.load(path, weights_only=False)
        resumed, record = _fit(lambda: TemplateModel((compile_eager,)), HybridParallelStrategy(tensor_parallel_size=1),
                               ckpt_path=path, max_steps=3, max_epochs=2)
        return {"model_keys": sorted(saved["state_dict"]), "plain_keys": sorted(TemplateModel().state_dict()),
                "optimizer_keys": sorted(map(str, saved["optimizer_states"][0]["state"])),
                "saved": module.final, "loaded": record.initial}

    return _guarded(run)


def _fsdp1_module() -> Any:
    """Lightning's ``test_fsdp_v1_modules_unsupported``: a module wrapped by the legacy FSDP API."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    def wrap(model: FeedForward, mesh: DeviceMesh) -> nn.Module:
        return FullyShardedDataParallel(model, device_id=torch.device("cpu"))

    return _guarded(lambda: _fit(lambda: TemplateModel((wrap,)), HybridParallelStrategy(tensor_parallel_size=1),
                                 max_steps=1) and "no error")


def contract_scenarios(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """Every scenario of this module on 2 ranks; the results of rank ``rank``."""
    root = Path(folder)
    results = {
        "mesh": _guarded(_mesh_in_configure_model),
        "user_tp": _guarded(_user_tensor_parallel),
        "user_fsdp": _guarded(_user_fsdp),
        "our_plan": _guarded(_our_plan),
        "meta": _meta_materialization(),
        "init_context": _init_context(),
        "state_dicts": _guarded(lambda: _state_dicts_and_saving(root)),
        "interchange": _interchange(root / "interchange"),
        "dcp": _guarded(lambda: _distributed_checkpoints(root / "dcp")),
        "invalid_sizes": _invalid_sizes(),
        "unknown_checkpoint": _unknown_checkpoint(root),
        "compiled": _compiled_single_file(root),
        "fsdp1": _fsdp1_module(),  # last: a legacy-FSDP run that goes wrong may leave the ranks out of step
    }
    return results


def _timeout_scenario(rank: int, world_size: int) -> Any:
    """Lightning's ``test_set_timeout``: the strategy's ``timeout`` reaches ``init_process_group`` (the helper's own
    group is closed first, so that the strategy opens the world itself)."""
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(free_port())
    with mock.patch("torch.distributed.init_process_group", wraps=dist.init_process_group) as spy:
        strategy = HybridParallelStrategy(tensor_parallel_size=1, timeout=timedelta(seconds=30))
        _trainer(strategy, devices=1, max_steps=1).fit(BoringModel())
    return [call.kwargs.get("timeout") for call in spy.call_args_list]


@pytest.fixture(scope="module")
def contract(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(contract_scenarios, 2, str(tmp_path_factory.mktemp("contract")), timeout=280)


def _ok(result: Any) -> Any:
    failed = isinstance(result, dict) and "mro" in result
    assert not failed, f"{result['error']}: {result['message']}\n{result['traceback']}" if failed else ""
    return result


def _reference(initial: dict[str, np.ndarray], batches: list[list[np.ndarray]]) -> tuple[list[float], dict]:
    """One process: SGD on ``mean over the data-parallel groups of sum(model(batch))`` for each step's batches
    (one per group); the losses and the final weights, keyed as the LightningModule's."""
    model = FeedForward()
    model.load_state_dict({k.removeprefix("model."): torch.from_numpy(v) for k, v in initial.items()})
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for groups in batches:
        loss = sum(model(torch.from_numpy(b)).sum() for b in groups) / len(groups)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {f"model.{k}": v.detach().numpy() for k, v in model.named_parameters()}


def _relative_error(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert a.keys() == b.keys()
    diff = np.sqrt(sum(float(np.sum((a[k] - b[k]) ** 2)) for k in a))
    return diff / np.sqrt(sum(float(np.sum(b[k] ** 2)) for k in b))


# --- the device mesh and the user's own parallelisation ---


def test_device_mesh_access_before_setup_is_a_runtime_error() -> None:
    with pytest.raises(RuntimeError):
        _ = HybridParallelStrategy().device_mesh


@pytest.mark.parametrize(("tp", "shape"), [("1", (2, 1)), ("2", (1, 2)), ("per_node", (1, 2))])
def test_device_mesh_is_set_in_configure_model(contract: list[dict], tp: str, shape: tuple[int, int]) -> None:
    for rank in contract:
        seen = _ok(rank["mesh"])[tp]
        assert seen == {"is_device_mesh": True, "device_type": "cpu", "names": ("dp", "tp"), "shape": shape,
                        "ndim": 2}


def test_users_tensor_parallelism_is_kept_and_not_sharded_twice(contract: list[dict]) -> None:
    for rank in contract:
        run = _ok(rank["user_tp"])
        assert run["meta_before_fit"] and not run["any_meta"]  # init_module(empty_init=True): the meta device
        assert run["all_dtensor"] and run["optimizer_on_param_meshes"] and run["meshes"] == [str(run["tp_mesh"])]
        assert run["plan"] == [] and run["w1_placements"] == "(Shard(dim=0),)" and run["w1_local_shape"] == (32, 32)
        assert not run["ddp_module"]


def test_users_tensor_parallel_group_shares_one_batch(contract: list[dict]) -> None:
    for rank in contract:
        run = _ok(rank["user_tp"])
        assert run["distributed_sampler"] and run["loader_len"] == SAMPLES // BATCH  # dp=1: every sample
        assert all(np.array_equal(step[0], step[1]) for step in run["batches"])


def test_users_tensor_parallelism_trains_as_one_process(contract: list[dict]) -> None:
    run = _ok(contract[0]["user_tp"])
    losses, final = _reference(run["initial"], [[step[0]] for step in run["batches"]])
    assert _relative_error(run["final"], final) <= TOL


def test_users_fsdp_over_dp_trains_as_one_process(contract: list[dict]) -> None:
    for rank in contract:
        run = _ok(rank["user_fsdp"])
        assert run["meta_before_fit"] and not run["any_meta"] and run["all_dtensor"] and not run["ddp_module"]
        assert run["meshes"] == [str(run["dp_mesh"])] and run["plan"] == []
        assert run["w1_placements"] == "(Shard(dim=0),)"
        assert run["distributed_sampler"] and run["loader_len"] == SAMPLES // BATCH // 2
        assert all(not np.array_equal(step[0], step[1]) for step in run["batches"])  # dp ranks: different data
    run = contract[0]["user_fsdp"]
    _, final = _reference(run["initial"], [[step[0], step[1]] for step in run["batches"]])
    assert _relative_error(run["final"], final) <= TOL  # FSDP reduces; the strategy reduces nothing again


def test_our_plan_gives_every_rank_of_a_tp_group_its_own_micro_batch(contract: list[dict]) -> None:
    """Our difference: data-parallel attention needs every rank's own micro-batch; the plan's layers gather them."""
    for rank in contract:
        run = _ok(rank["our_plan"])
        assert run["plan"] == ["model"] or {"model.w1", "model.w2", "model.w3"} <= set(run["plan"]), run["plan"]
        assert run["loader_len"] == SAMPLES // BATCH // 2
        assert all(not np.array_equal(step[0], step[1]) for step in run["batches"])
    run = contract[0]["our_plan"]
    _, final = _reference(run["initial"], [[step[0], step[1]] for step in run["batches"]])
    assert _relative_error(run["final"], final) <= TOL


# --- initialisation ---


@pytest.mark.parametrize(("case", "before", "dtype"), [
    ("32-true-False", "cpu", "torch.float32"), ("32-true-True", "meta", "torch.float32"),
    ("16-true-True", "meta", "torch.float16"), ("bf16-true-True", "meta", "torch.bfloat16"),
])
def test_module_init_context_gives_device_and_dtype(contract: list[dict], case: str, before: str, dtype: str) -> None:
    for rank in contract:
        run = _ok(rank["init_context"][case])
        assert run == {"before": (before, dtype), "device": "cpu", "dtype": dtype, "optimizer_device": "cpu"}


def test_meta_module_without_reset_parameters_is_an_error_naming_it(contract: list[dict]) -> None:
    """Our difference: Lightning warns and leaves such a module's memory uninitialised."""
    for rank in contract:
        error = rank["meta"]["NoResetParameters"]
        assert error["error"] == "ValueError" and "layer1.0 (NoResetParameters)" in error["message"], error


def test_meta_module_is_materialised_with_its_reset_parameters(contract: list[dict]) -> None:
    for rank in contract:
        assert _ok(rank["meta"]["ResetParameters"]) == {"no_meta": True, "buffer": [1.0, 1.0]}


def test_configure_model_is_not_required(contract: list[dict]) -> None:
    """Our difference: Lightning raises a TypeError without ``configure_model``; our plan shards the model itself."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    assert not is_overridden("configure_model", PlanOnly(), pl.LightningModule)
    for rank in contract:
        assert _ok(rank["our_plan"])["all_dtensor"]


# --- checkpoints ---


@pytest.mark.parametrize("distributed", [True, False])
def test_state_dict_has_the_unwrapped_models_keys(contract: list[dict], distributed: bool) -> None:
    for i, rank in enumerate(contract):
        run = _ok(rank["state_dicts"])[f"keys-{distributed}"]
        if distributed or i == 0:
            assert run["keys"] == run["correct"]
        else:
            assert run["keys"] == []  # the full state dict exists on rank 0 only


def _loaded_equal(result: dict[str, Any], source: dict[str, Any]) -> None:
    assert result["model_len"] == source["model_len"] and result["optimizer_len"] == source["optimizer_len"]
    assert result["model"].keys() == source["model"].keys()
    for key, value in result["model"].items():
        np.testing.assert_array_equal(value, source["model"][key], err_msg=key)
    assert result["optimizer"].keys() == source["optimizer"].keys()
    for name, state in result["optimizer"].items():
        for key, value in state.items():
            np.testing.assert_array_equal(value, source["optimizer"][name][key], err_msg=f"{name}.{key}")


@pytest.mark.parametrize(("target", "source"), [
    ("ddp_from_ours", "ours"), ("ours_from_ddp", "ddp_from_ours"),
    ("lightning_from_ours", "ours"), ("ours_from_lightning", "lightning_from_ours"),
])
def test_single_file_checkpoints_load_across_strategies(contract: list[dict], target: str, source: str) -> None:
    runs = contract[0]["interchange"]
    _loaded_equal(_ok(runs[target]), _ok(runs[source]))
    for rank in contract[1:]:  # a full file is assembled on rank 0; the other ranks return empty states
        if target.startswith("ours"):
            assert _ok(rank["interchange"][target]) == {"model_len": 0, "optimizer_len": 0}


def test_single_file_optimizer_states_are_keyed_by_index_as_lightnings(contract: list[dict]) -> None:
    runs = contract[0]["interchange"]
    indices = [str(i) for i in range(6)]
    for name in ("ours", "ddp_from_ours", "lightning_from_ours", "ours_from_ddp", "ours_from_lightning"):
        run = _ok(runs[name])
        assert run["file_optimizer_keys"] == indices and run["file_param_groups"] == [indices], name
        assert run["optimizer_keys"] == indices, name


def test_distributed_checkpoint_folder_is_lightnings_layout(contract: list[dict]) -> None:
    run = _ok(contract[0]["dcp"])
    assert run["listing"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    assert run["meta"] == {"version": True, "callbacks": 1, "state_dict": False, "optimizer_states": False}


@pytest.mark.parametrize("resumed", ["ours_resumed", "lightning_resumed", "ours_from_lightning"])
def test_distributed_checkpoints_resume_across_strategies(contract: list[dict], resumed: str) -> None:
    for rank in contract:
        run = _ok(rank["dcp"])[resumed]
        assert run["error"] is None, run["error"]
        assert run["initial"].keys() == run["saved"].keys()
        for key, value in run["initial"].items():
            np.testing.assert_array_equal(value, run["saved"][key], err_msg=key)


def test_saving_a_distributed_checkpoint_over_a_folder_or_a_file(contract: list[dict]) -> None:
    for rank in contract:
        run = _ok(rank["state_dicts"])["save-True"]
        assert run["folder"]["error"] is None and {"file", "meta.pt"} <= set(run["folder"]["entries"])
        assert run["dcp_folder"]["error"] is None and "meta.pt" in run["dcp_folder"]["entries"]
        assert run["file"]["error"] is None and run["file"]["is_dir"] and "meta.pt" in run["file"]["entries"]


def test_saving_a_file_over_a_folder_that_is_no_checkpoint_is_an_error(contract: list[dict]) -> None:
    for rank in contract:
        run = _ok(rank["state_dicts"])["save-False"]
        assert run["folder"]["error"] == "IsADirectoryError" and run["folder"]["entries"] == ["file"]
        assert run["file"]["error"] is None and run["file"]["is_file"]


def test_saving_a_file_over_a_distributed_checkpoint_replaces_it(contract: list[dict]) -> None:
    for rank in contract:
        run = _ok(rank["state_dicts"])["save-False"]["dcp_folder"]
        assert run["error"] is None and run["is_file"], run


def test_save_checkpoint_refuses_storage_options(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="storage_options"):
        HybridParallelStrategy().save_checkpoint({}, tmp_path / "x.ckpt", storage_options=object())


def test_loading_a_folder_that_is_no_checkpoint_is_a_value_error(contract: list[dict]) -> None:
    for rank in contract:
        assert rank["unknown_checkpoint"]["error"] == "ValueError", rank["unknown_checkpoint"]


def test_compiled_submodule_single_file_checkpoint(contract: list[dict]) -> None:
    run = _ok(contract[0]["compiled"])
    assert run["model_keys"] == run["plain_keys"]  # no ``_orig_mod``: loads into the uncompiled model
    assert run["loaded"].keys() == run["saved"].keys()
    for key, value in run["loaded"].items():
        np.testing.assert_array_equal(value, run["saved"][key], err_msg=key)


def test_compiled_submodule_optimizer_states_are_keyed_by_index(contract: list[dict]) -> None:
    assert _ok(contract[0]["compiled"])["optimizer_keys"] == [str(i) for i in range(6)]


# --- bad input ---


@pytest.mark.parametrize("case", ["{'tensor_parallel_size': 3}", "{'tensor_parallel_size': 4}",
                                  "{'expert_parallel_size': 3}", "{'data_parallel_shard_size': 3}"])
def test_invalid_sizes_are_runtime_errors(contract: list[dict], case: str) -> None:
    for rank in contract:
        error = rank["invalid_sizes"][case]
        assert "RuntimeError" in error["mro"], error


@pytest.mark.parametrize("case", ["{'tensor_parallel_size': 3}", "{'tensor_parallel_size': 4}",
                                  "{'expert_parallel_size': 3}", "{'data_parallel_shard_size': 3}"])
def test_invalid_sizes_name_the_argument(contract: list[dict], case: str) -> None:
    name = case.split("'")[1]
    for rank in contract:
        error = rank["invalid_sizes"][case]
        assert name in error["message"] and "does not divide the world size 2" in error["message"], error


def test_legacy_fsdp_module_is_a_type_error(contract: list[dict]) -> None:
    for rank in contract:
        assert rank["fsdp1"]["error"] == "TypeError" and "FSDP2" in rank["fsdp1"]["message"], rank["fsdp1"]


def test_timeout_reaches_init_process_group() -> None:
    (timeouts,) = run_distributed(_timeout_scenario, 1, timeout=120)
    assert timeouts == [timedelta(seconds=30)]
