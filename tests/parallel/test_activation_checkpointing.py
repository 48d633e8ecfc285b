"""Activation checkpointing per transformer block: which blocks are found, bitwise parity with no checkpointing
(losses and gradients, FP32, a few SGD steps, same seed) on our GPT, HF Llama and a user's ``nn.ModuleList``, the
activation bytes it keeps, and its composition with Lightning's DDP, tensor and expert parallelism and FSDP2 (2 gloo
processes each, and FSDP x TP on 4)."""

from __future__ import annotations

import copy
import math
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode  # no public dispatch-mode base class

from lightning_deepseek.models import GPT, GPTConfig
from lightning_deepseek.parallel.activation_checkpointing import (
    apply_activation_checkpointing,
    find_transformer_blocks,
    is_recomputing,
)
from tests.helpers import run_distributed

STEPS = 3
MODES = ("full", "selective")
_GPT = dict(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32)


class UserBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class UserModel(nn.Module):
    """A user's own model: an input projection, an ``nn.ModuleList`` of blocks, a head."""

    def __init__(self, dim: int = 32, num_blocks: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(8, dim)
        self.layers = nn.ModuleList(UserBlock(dim) for _ in range(num_blocks))
        self.head = nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _tokens(rows: int = 4, seq: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 64, (rows, seq), generator=torch.Generator().manual_seed(seed))


def _gpt_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), x.flatten())


def _llama() -> nn.Module:
    transformers = pytest.importorskip("transformers", reason="the HF case needs transformers (the test extra)")
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2))


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[nn.Module], torch.Tensor], list[str]]] = {
    # dropout on: the recompute must replay the forward's random masks
    "gpt": (lambda: GPT(GPTConfig(**_GPT, dropout=0.1)), lambda m: _gpt_loss(m, _tokens()),
            ["blocks.0", "blocks.1", "blocks.2"]),
    "gpt-moe": (lambda: GPT(GPTConfig(**_GPT, n_routed_experts=4, moe_top_k=2, moe_hidden=16, n_dense_layers=1,
                                      moe_aux_loss_coef=0.01)),
                lambda m: _gpt_loss(m, _tokens()), ["blocks.0", "blocks.1", "blocks.2"]),
    "llama": (_llama, lambda m: m(input_ids=_tokens(), labels=_tokens()).loss, ["model.layers.0", "model.layers.1"]),
    "user": (UserModel, lambda m: F.mse_loss(m(torch.ones(4, 5, 8).cumsum(1).sin()), torch.zeros(4, 5, 4)),
             ["layers.0", "layers.1", "layers.2"]),
}


def _train(case: str, mode: str) -> tuple[list[str], list[torch.Tensor], list[list[torch.Tensor]]]:
    build, loss_fn, _ = CASES[case]
    torch.manual_seed(0)
    model = build()
    model.train()
    names = apply_activation_checkpointing(model, mode)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, grads = [], []
    for _ in range(STEPS):
        loss = loss_fn(model)
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad()
    return names, losses, grads


@pytest.mark.parametrize("case", CASES)
def test_full_and_selective_are_bitwise_equal_to_none(case: str) -> None:
    _, reference_losses, reference_grads = _train(case, "none")
    for mode in MODES:
        names, losses, grads = _train(case, mode)
        assert names == CASES[case][2], mode
        assert all(torch.equal(a, b) for a, b in zip(losses, reference_losses)), (mode, losses, reference_losses)
        for step, (got, want) in enumerate(zip(grads, reference_grads)):
            assert all(torch.equal(a, b) for a, b in zip(got, want)), f"{mode}: gradients differ at step {step}"


def test_blocks_are_found_where_the_plan_looks() -> None:
    transformers = pytest.importorskip("transformers")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                                                n_positions=8, bos_token_id=0, eos_token_id=0))
    mixtral = transformers.MixtralForCausalLM(transformers.MixtralConfig(  # experts fused: no feed-forward pair
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2))
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), 2)
    assert find_transformer_blocks(gpt2) == ["transformer.h.0", "transformer.h.1"]
    assert find_transformer_blocks(mixtral) == ["model.layers.0", "model.layers.1"]
    apply_activation_checkpointing(mixtral, "selective")  # FSDP2's units and the pipeline split look after it
    assert find_transformer_blocks(mixtral) == ["model.layers.0", "model.layers.1"]
    assert find_transformer_blocks(encoder) == ["layers.0", "layers.1"]
    assert find_transformer_blocks(nn.ModuleList(UserBlock(16) for _ in range(2))) == ["0", "1"]


def test_names_state_dict_and_classes_are_kept() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**_GPT))
    keys, block_class = list(model.state_dict()), type(model.blocks[0])
    apply_activation_checkpointing(model, "selective")
    assert list(model.state_dict()) == keys
    assert isinstance(model.blocks[0], block_class) and type(model.blocks[0]) is not block_class
    assert apply_activation_checkpointing(model, "full") == ["blocks.0", "blocks.1", "blocks.2"]  # again: no nesting
    assert type(model.blocks[0]).__mro__[2] is block_class
    assert list(copy.deepcopy(model).state_dict()) == keys


def test_a_meta_model_is_checkpointed_before_it_is_materialised() -> None:
    with torch.device("meta"):
        model = GPT(GPTConfig(**_GPT))
    assert apply_activation_checkpointing(model, "full") == ["blocks.0", "blocks.1", "blocks.2"]
    model.to_empty(device="cpu")
    model.apply(GPT._init_weights)
    _gpt_loss(model, _tokens()).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_none_changes_nothing() -> None:
    model = UserModel()
    assert apply_activation_checkpointing(model, "none") == []
    assert type(model.layers[0]) is UserBlock


def test_no_blocks_warns_naming_what_was_looked_for() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    with pytest.warns(UserWarning, match=r"activation_checkpointing='full': no transformer block found in Sequential.*"
                      r"nn\.ModuleList.*feed-forward block.*_no_split_modules"):
        assert apply_activation_checkpointing(model, "full") == []


def test_bad_mode_names_the_setting_the_value_and_the_choices() -> None:
    with pytest.raises(ValueError, match=r"activation_checkpointing='partial'.*'none', 'full', 'selective'"):
        apply_activation_checkpointing(UserModel(), "partial")  # type: ignore[arg-type]


def test_a_counting_hook_can_skip_the_recompute() -> None:
    model = UserModel()
    apply_activation_checkpointing(model, "full")
    calls = {"all": 0, "once": 0}

    def count(module: nn.Module, args: Any) -> None:
        calls["all"] += 1
        calls["once"] += not is_recomputing()

    model.layers[1].up.register_forward_pre_hook(count)
    model(torch.ones(2, 3, 8)).sum().backward()
    assert calls == {"all": 2, "once": 1}
    with torch.no_grad():  # no gradients recorded: the block runs once, unwrapped
        model(torch.ones(2, 3, 8))
    assert calls == {"all": 3, "once": 2}


class ActivationBytes(TorchDispatchMode):
    """Counts, over one forward, the bytes of the distinct storages that autograd saves (``saved_tensors_hooks``:
    what the checkpoint does not drop), and the bytes of the storages the forward created that are still alive when
    it returns (``kept``: also what selective checkpointing caches, which no saved-tensor hook sees)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.ignored = {id(t.untyped_storage()) for t in (*model.parameters(), *model.buffers())}
        self.saved: dict[int, int] = {}
        self.created: weakref.WeakSet = weakref.WeakSet()
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if id(storage) not in self.ignored:
            self.saved[id(storage)] = storage.nbytes()
        return tensor

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and id(tensor.untyped_storage()) not in self.ignored:
                self.created.add(tensor.untyped_storage())
        return out

    def __enter__(self) -> ActivationBytes:
        self.hooks.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self.hooks.__exit__(*exc)

    @property
    def kept(self) -> int:
        return sum({storage.data_ptr(): storage.nbytes() for storage in self.created}.values())


class OpNames(TorchDispatchMode):
    """The names of the ops run while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
def test_selective_keeps_attention_and_full_recomputes_it(device: str) -> None:
    """Attention forwards run again in backward: one per block under full, none under selective (its output is
    kept), whichever kernel SDPA picks on ``device``; the losses stay those of none."""
    recomputed, losses = {}, {}
    for mode in ("none", *MODES):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**_GPT)).to(device)
        apply_activation_checkpointing(model, mode)
        loss = _gpt_loss(model, _tokens().to(device))
        with OpNames() as ops:
            loss.backward()
        recomputed[mode] = sum(name.startswith("aten._scaled_dot_product") and "backward" not in name
                               for name in ops.names)
        losses[mode] = loss.item()
    assert recomputed == {"none": 0, "full": _GPT["n_layer"], "selective": 0}
    assert losses["full"] == losses["selective"] == losses["none"]


def test_the_ops_selective_keeps_exist_in_this_torch() -> None:
    from lightning_deepseek.parallel.activation_checkpointing import _MATMUL_OPS, _SAVE_OPS

    aten = torch.ops.aten
    assert {aten.mm.default, aten.addmm.default, aten.bmm.default} <= _MATMUL_OPS
    assert {aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten._scaled_dot_product_cudnn_attention.default,
            torch.ops._c10d_functional.reduce_scatter_tensor.default} <= _SAVE_OPS


def _activation_bytes(mode: str, n_layer: int) -> tuple[int, int]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=64, n_layer=n_layer, n_head=2, n_embd=64))
    apply_activation_checkpointing(model, mode)
    x = _tokens(rows=2, seq=64)
    with ActivationBytes(model) as counter:
        loss = _gpt_loss(model, x)
    kept = counter.kept
    loss.backward()
    return sum(counter.saved.values()), kept


def test_checkpointing_keeps_one_block_input_per_block() -> None:
    blocks = 4
    none, fewer = _activation_bytes("none", blocks), _activation_bytes("none", blocks - 1)
    full, selective = _activation_bytes("full", blocks), _activation_bytes("selective", blocks)
    for i in (0, 1):  # 0: autograd's saved tensors, 1: what the forward leaves alive
        one_block = none[i] - fewer[i]
        assert full[i] <= none[i] / blocks + one_block, (i, full, none, one_block)
    # selective keeps the outputs of attention and half the matrix multiplies: between full and none
    assert full[1] < selective[1] < none[1], (full, selective, none)


def _train_on_rank(model: nn.Module, rank: int) -> dict[str, list]:
    """SGD steps on this rank's own tokens: every loss, and this rank's gradients (its shards) of the last step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses, grads = [], []
    for _ in range(STEPS):
        loss = _gpt_loss(model, _tokens(seed=rank + 1))
        loss.backward()
        losses.append(loss.item())
        grads = [(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).tolist() for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad()
    return dict(losses=losses, grads=grads)


LAYOUTS = {"tp": {"tp": 2}, "ep": {"edp": 1, "ep": 2}, "fsdp": {"dp": 2}, "fsdp x tp": {"dp": 2, "tp": 2}}
_MOE = dict(n_routed_experts=4, moe_top_k=2, moe_hidden=16, n_dense_layers=1)


def _sharded_runs(rank: int, world_size: int, layout: str) -> dict[str, Any]:
    """Each mode on GPT blocks sharded as ``layout`` says, in torchtitan's order: the plan's feed-forward layers as
    DTensors over ``tp`` or the routed experts over ``ep`` (a MoE GPT), then checkpointing, then FSDP2's
    ``fully_shard`` over ``dp`` on each block and the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_deepseek.parallel.expert import apply_expert_parallel
    from lightning_deepseek.parallel.plan import auto_plan
    from lightning_deepseek.parallel.styles import apply_tensor_parallel

    sizes = LAYOUTS[layout]
    mesh = init_device_mesh("cpu", tuple(sizes.values()), mesh_dim_names=tuple(sizes))
    results: dict[str, Any] = {}
    for mode in ("none", *MODES):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**_GPT, **(_MOE if "ep" in sizes else {})))
        entries = auto_plan(model, sizes["tp"], 0)[0] if "tp" in sizes else []
        if entries:
            apply_tensor_parallel(model, {e.name: e.style for e in entries}, mesh["tp"])
        if "ep" in sizes:
            entries = apply_expert_parallel(model, mesh)
        names = apply_activation_checkpointing(model, mode)
        if "dp" in sizes:
            for block in model.blocks:
                fully_shard(block, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
        results[mode] = dict(names=names, sharded=len(entries), block_class=type(model.blocks[0]).__name__,
                             **_train_on_rank(model, rank))
    return results


def _lightning_ddp_runs(world_size: int) -> dict[str, Any]:
    """Each mode applied in ``configure_model`` of a LightningModule trained by Lightning's own DDP: losses of every
    step and the final weights."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    from tests.parallel.common import TinyLM, full_state, loader, make_trainer, token_data

    class CheckpointedLM(TinyLM):
        def configure_model(self) -> None:
            self.checkpointed = apply_activation_checkpointing(self.model, self.mode)

    results: dict[str, Any] = {}
    for mode in ("none", *MODES):
        pl.seed_everything(0, verbose=False)
        module = CheckpointedLM()
        module.mode = mode
        make_trainer(world_size, DDPStrategy(), max_steps=STEPS).fit(module, loader(token_data(4 * STEPS), 2))
        results[mode] = dict(losses=module.losses, state=full_state(module), names=module.checkpointed)
    return results


def _distributed_scenarios(rank: int, world_size: int) -> dict[str, Any]:
    results = {layout: _sharded_runs(rank, world_size, layout) for layout, sizes in LAYOUTS.items()
               if math.prod(sizes.values()) == world_size}
    return {**results, "lightning ddp": _lightning_ddp_runs(world_size)} if world_size == 2 else results


@pytest.fixture(scope="module")
def two_rank_results() -> list[dict[str, Any]]:
    return run_distributed(_distributed_scenarios, 2, timeout=240)


@pytest.fixture(scope="module")
def four_rank_results() -> list[dict[str, Any]]:
    return run_distributed(_distributed_scenarios, 4, timeout=240)


def _check_bitwise(results: list[dict[str, Any]], layout: str) -> None:
    for rank, by_layout in enumerate(results):
        runs = by_layout[layout]
        for mode in MODES:
            assert runs[mode]["names"] == ["blocks.0", "blocks.1", "blocks.2"]
            assert runs[mode]["losses"] == runs["none"]["losses"], (rank, mode)
            assert runs[mode]["grads"] == runs["none"]["grads"], (rank, mode)


def test_tensor_parallel_blocks_checkpoint_bitwise(two_rank_results: list[dict[str, Any]]) -> None:
    assert two_rank_results[0]["tp"]["none"]["sharded"] > 0
    _check_bitwise(two_rank_results, "tp")


def test_expert_parallel_blocks_checkpoint_bitwise(two_rank_results: list[dict[str, Any]]) -> None:
    assert two_rank_results[0]["ep"]["none"]["sharded"] == 2  # the two MoE layers' experts, all-to-all inside
    _check_bitwise(two_rank_results, "ep")


def test_lightning_ddp_without_sharding_trains_bitwise(two_rank_results: list[dict[str, Any]]) -> None:
    for rank, results in enumerate(two_rank_results):
        runs = results["lightning ddp"]
        assert len(runs["none"]["losses"]) == STEPS
        for mode in MODES:
            assert runs[mode]["names"] == ["blocks.0", "blocks.1"], mode  # TinyLM: 2 blocks
            assert runs[mode]["losses"] == runs["none"]["losses"], (rank, mode)
            assert all((runs[mode]["state"][k] == v).all() for k, v in runs["none"]["state"].items()), (rank, mode)


def test_fully_shard_after_checkpointing_trains_bitwise(two_rank_results: list[dict[str, Any]]) -> None:
    assert two_rank_results[0]["fsdp"]["full"]["block_class"] == "FSDPCheckpointedBlock"
    _check_bitwise(two_rank_results, "fsdp")
    assert two_rank_results[0]["fsdp"]["none"]["losses"] != two_rank_results[1]["fsdp"]["none"]["losses"]


def test_tensor_parallel_then_checkpointing_then_fully_shard_on_four_ranks(
        four_rank_results: list[dict[str, Any]]) -> None:
    assert four_rank_results[0]["fsdp x tp"]["none"]["sharded"] > 0
    assert four_rank_results[0]["fsdp x tp"]["full"]["block_class"] == "FSDPCheckpointedBlock"
    _check_bitwise(four_rank_results, "fsdp x tp")
