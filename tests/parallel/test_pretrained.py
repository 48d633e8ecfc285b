"""Pretrained weights into sharded models, and the consolidated export (``lightning_deepseek.parallel.pretrained``).

A tiny HF Llama (random init, nothing downloaded) is written by ``save_pretrained`` as one file and as shards with
an index, and as a one-file Lightning checkpoint. On 2 real gloo processes, each LightningModule loads it in
``on_fit_start`` and trains 5 SGD steps (fp32):

- DDP (eager), FSDP-2 (built on the meta device), tp=2 and FSDP-2 from the Lightning file: the weights as training
  starts equal the saved ones exactly;
- the meta-initialised FSDP-2 run gives the losses and final weights of the eagerly built DDP run within 1e-5;
- resuming that FSDP-2 run's checkpoint with the same module (which loads the pretrained weights in
  ``on_fit_start`` again) starts from the checkpoint's weights;
- each rank asks the safetensors reader for its slices only (half of the elements under FSDP-2);
- the FSDP-2 and tp=2 runs' exports load with ``AutoModelForCausalLM.from_pretrained`` and equal their final
  weights.

In one process: names or shapes that do not match are one error listing them; ``strict=False``; a meta model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint import HuggingFaceStorageReader

from lightning_deepseek import HybridParallelStrategy
from lightning_deepseek.parallel.pretrained import export_safetensors, load_pretrained
from tests.helpers import run_distributed
from tests.parallel.common import full_state, loader, make_trainer, max_relative_error, relative_error, token_data

transformers = pytest.importorskip("transformers", reason="the pretrained-weights tests need transformers")

STEPS, MICRO, TOL = 5, 2, 1e-5
LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=16)


def llama(**overrides: Any) -> torch.nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**LLAMA, **overrides}))


class PretrainedLM(pl.LightningModule):
    """An HF Llama built in ``configure_model`` (on the meta device under ``empty_init=True``) that loads
    ``weights`` in ``on_fit_start``; next-token loss, SGD with momentum."""

    def __init__(self, weights: str, prefix: str = "") -> None:
        super().__init__()
        self.weights, self.prefix = weights, prefix
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if not hasattr(self, "model"):
            self.model = llama()

    def on_fit_start(self) -> None:
        load_pretrained(self.model, self.weights, prefix=self.prefix)

    def on_train_start(self) -> None:
        self.loaded = full_state(self.model)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(input_ids=x).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class CountingReader(HuggingFaceStorageReader):
    """Torch DCP's Hugging Face reader, counting the elements each rank asks it for (installed in the ranks)."""

    elements = 0

    def read_data(self, plan: Any, planner: Any) -> Any:
        CountingReader.elements += sum(int(np.prod(item.lengths)) for item in plan.items)
        return super().read_data(plan, planner)


def _fit(world_size: int, weights: Path, meta: bool = False, prefix: str = "", export: Path | None = None,
         save: Path | None = None, resume: Path | None = None, **strategy_kwargs: Any) -> dict[str, Any]:
    torch.manual_seed(1 + dist.get_rank())  # every weight must come from the file
    CountingReader.elements = 0
    module = PretrainedLM(str(weights), prefix)
    strategy = HybridParallelStrategy(min_shard_params=0, **{"tensor_parallel_size": 1, **strategy_kwargs})
    trainer = make_trainer(world_size, strategy, max_steps=2 * STEPS if resume else STEPS)
    if meta:
        with trainer.init_module(empty_init=True):
            module.configure_model()
        assert all(p.is_meta for p in module.parameters())
    trainer.fit(module, loader(token_data(STEPS * world_size * MICRO), MICRO), ckpt_path=resume)
    if save is not None:
        trainer.save_checkpoint(save)
    if export is not None:
        export_safetensors(module.model, export)
    losses: list[Any] = [None] * world_size
    dist.all_gather_object(losses, module.losses)
    return {"loaded": module.loaded, "losses": [sum(r[i] for r in losses) / world_size for i in range(STEPS)],
            "state": full_state(module.model), "read_fraction": CountingReader.elements / _numel(module.model)}


def _numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _two_ranks(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    import torch.distributed.checkpoint

    torch.distributed.checkpoint.HuggingFaceStorageReader = CountingReader  # this rank's process only
    root = Path(folder)
    runs = {
        "ddp": _fit(world_size, root / "single"),
        "fsdp_meta": _fit(world_size, root / "sharded", meta=True, data_parallel_shard_size=2,
                          export=root / "export", save=root / "fsdp_meta.ckpt"),
        "resumed": _fit(world_size, root / "sharded", meta=True, data_parallel_shard_size=2,
                        resume=root / "fsdp_meta.ckpt"),
        "tp2": _fit(world_size, root / "single", tensor_parallel_size=2, export=root / "export_tp2"),
        "fsdp_file": _fit(world_size, root / "lightning.ckpt", prefix="model.", data_parallel_shard_size=2),
    }
    return runs if rank == 0 else {}


def _numpy(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {name: p.detach().numpy().copy() for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    """A tiny Llama saved as HF does (one file; shards with an index) and as a Lightning checkpoint file."""
    root = tmp_path_factory.mktemp("pretrained")
    torch.manual_seed(0)
    model = llama()
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="20KB")
    torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}, "epoch": 3},
               root / "lightning.ckpt")
    return root, _numpy(model)


@pytest.fixture(scope="module")
def runs(saved: tuple[Path, dict[str, np.ndarray]]) -> dict[str, Any]:
    return run_distributed(_two_ranks, 2, str(saved[0]), timeout=400)[0]


def test_the_sharded_folder_has_an_index(saved: tuple[Path, dict[str, np.ndarray]]) -> None:
    root, _ = saved
    assert (root / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((root / "sharded").glob("*.safetensors"))) > 1


@pytest.mark.parametrize("run", ["ddp", "fsdp_meta", "tp2", "fsdp_file"])
def test_every_layout_starts_from_exactly_the_saved_weights(saved: tuple, runs: dict[str, Any], run: str) -> None:
    assert max_relative_error(runs[run]["loaded"], saved[1]) == 0.0


def test_each_rank_reads_only_its_slices(runs: dict[str, Any]) -> None:
    assert runs["ddp"]["read_fraction"] == 1.0  # replicated: every rank reads everything
    assert runs["fsdp_meta"]["read_fraction"] == pytest.approx(0.5, abs=0.01)  # FSDP-2: half of every tensor
    assert 0.5 < runs["tp2"]["read_fraction"] < 1.0  # tp=2: half of the feed-forward weights


def test_when_resuming_the_checkpoint_wins_over_the_pretrained_weights(runs: dict[str, Any]) -> None:
    assert max_relative_error(runs["resumed"]["loaded"], runs["fsdp_meta"]["state"]) == 0.0


def test_a_meta_initialised_fsdp_run_equals_the_eager_ddp_run(runs: dict[str, Any]) -> None:
    ddp, meta = runs["ddp"], runs["fsdp_meta"]
    assert meta["losses"] == [pytest.approx(want, rel=TOL) for want in ddp["losses"]]
    assert relative_error(meta["state"], ddp["state"]) <= TOL
    assert runs["tp2"]["losses"] == [pytest.approx(want, rel=TOL) for want in ddp["losses"]]
    assert ddp["losses"][-1] < ddp["losses"][0]  # it trained


@pytest.mark.parametrize(("run", "folder"), [("fsdp_meta", "export"), ("tp2", "export_tp2")])
def test_the_export_loads_with_from_pretrained(saved: tuple, runs: dict[str, Any], run: str, folder: str) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(saved[0] / folder)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert max_relative_error(_numpy(model), runs[run]["state"]) == 0.0


def test_names_and_shapes_that_do_not_match_are_listed(saved: tuple) -> None:
    root, _ = saved
    with pytest.raises(ValueError, match=r"shapes differ: model\.embed_tokens\.weight \(model \[64, 48\], file "
                                         r"\[64, 32\]\)"):
        load_pretrained(llama(hidden_size=48), root / "single")
    with pytest.raises(ValueError, match=r"in the model, not in the file: model\.layers\.2\.self_attn\.q_proj"):
        load_pretrained(llama(num_hidden_layers=3), root / "single")
    with pytest.raises(ValueError, match=r"in the file, not in the model: model\.model\.embed_tokens\.weight"):
        load_pretrained(llama(), root / "lightning.ckpt")  # the file names it model.model...: prefix= is missing


def test_strict_false_loads_the_names_both_have(saved: tuple) -> None:
    root, weights = saved
    deeper = llama(num_hidden_layers=3)
    load_pretrained(deeper, root / "sharded", strict=False)
    loaded = _numpy(deeper)
    assert all((loaded[k] == v).all() for k, v in weights.items())


def test_a_meta_model_is_refused(saved: tuple) -> None:
    with torch.device("meta"):
        model = llama()
    with pytest.raises(ValueError, match="still on the meta device"):
        load_pretrained(model, saved[0] / "single")
