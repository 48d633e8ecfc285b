"""The tensors' peak of torchtitan's own step for its published Llama 3.1 H100 rows (what ``torchtitan_rows.py`` plans
in the strategy's layout): torchtitan's model and parallelisms at the benchmark's commit, on rank 0 of a fake world,
under torch's ``MemTracker`` as the planner measures (its ``LocalOpsOnly``: DTensor ops at local shapes).

torchtitan's memory figure is the caching allocator's peak reserved memory; this is the tensors' peak of the same
step, so their ratio is the allocator's reserve (``ALLOCATOR_RESERVE`` is calibrated on the two 8B rows) and its
difference from the plan's tensors is the layout's. The step: torchtitan's ``apply_tp`` (sequence and loss parallel,
Float8 styles with ``float8``), ``apply_ac``, ``apply_fsdp`` (BF16 parameters, FP32 reduction; the root kept
unsharded after forward, as the torch of that commit's date did), AdamW with its states, one eager step (no compile:
its peak is the loss's backward, outside the compiled blocks) of ``train.py``'s loss. The CPU's flash attention
stands in for the GPU's in the selective checkpointing's save list. Two and three blocks are stepped; the peak is
extrapolated linearly to the model's blocks (every block's saved activations are held at the peak).

Usage: ``git -C <torchtitan clone> archive 9dec370 torchtitan | tar -x -C DIR``, then
``python benchmarks/planning/torchtitan_own_step.py DIR [row name ...]`` (rows: ``ROWS``; about a minute of CPU).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import sys
import types
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel

from lightning_deepseek.planning.counting import LocalOpsOnly
from lightning_deepseek.planning.fake_world import fake_world

COMMIT = "9dec370"  # torchtitan's commit of benchmarks/llama3_h100_202412_torchtitan.md
ROWS = {  # name: (flavor, world, tp, local batch, activation checkpointing, float8, published GiB)
    "8B FSDP8 bs2 selective AC": ("8B", 8, 1, 2, "selective", False, 82.4),
    "8B FSDP128 bs2 selective AC": ("8B", 128, 1, 2, "selective", False, 67.0),
    "70B FSDP32xTP8 bs16 full AC": ("70B", 256, 8, 16, "full", False, 71.9),
    "70B FSDP32xTP8 bs16 full AC Float8": ("70B", 256, 8, 16, "full", True, 71.9),
}
SEQ_LEN, VOCAB = 8192, 128256


def load_torchtitan(path: str) -> types.ModuleType:
    """torchtitan of ``path`` (a namespace package then: the installed release would win an ordinary import)."""
    package = types.ModuleType("torchtitan")
    package.__path__ = [f"{path}/torchtitan"]
    sys.modules["torchtitan"] = package
    from torchtitan.models.llama import model as llama_model

    # the module: the package's attribute of that name is its function
    parallelize_llama = importlib.import_module("torchtitan.parallelisms.parallelize_llama")
    llama_model.Transformer.init_weights = lambda self, buffer_device=None: None  # fake tensors hold no values
    parallelize_llama._save_list.add(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)
    return parallelize_llama


def peak_bytes(flavor: str, world: int, tp: int, batch: int, ac: str, float8: bool, num_layers: int) -> int:
    """The tensors' peak of one step of rank 0 with ``num_layers`` blocks."""
    from torchtitan.models.llama import llama3_configs
    from torchtitan.models.llama.model import Transformer

    titan = importlib.import_module("torchtitan.parallelisms.parallelize_llama")

    args = dataclasses.replace(llama3_configs[flavor], n_layers=num_layers, vocab_size=VOCAB, max_seq_len=SEQ_LEN)
    with fake_world(world):
        mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp_shard", "tp"))
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            model = Transformer(args)
            if float8:
                from torchao.float8 import Float8LinearConfig, convert_to_float8_training

                convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True),
                                           module_filter_fn=lambda _, fqn: fqn != "output")
        if tp > 1:
            titan.apply_tp(model, mesh["tp"], loss_parallel=True, enable_float8=float8, enable_async_tp=False)
        titan.apply_ac(model, SimpleNamespace(mode=ac, selective_ac_option="op"))
        titan.apply_fsdp(model, mesh["dp_shard"], torch.bfloat16, torch.float32, pp_enabled=False)
        model.set_reshard_after_forward(False, recurse=False)
        params = list(model.parameters())
        optimizer = torch.optim.AdamW(params, lr=1e-4, foreach=True)
        with mode, LocalOpsOnly(mode):
            for param in params:
                param.grad = torch.zeros_like(param)
            optimizer.step()  # its states, as in every step after the first
            optimizer.zero_grad()
            tokens, labels = (torch.randint(0, VOCAB, (batch, SEQ_LEN)) for _ in range(2))
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
        with mode, tracker, LocalOpsOnly(mode):
            with loss_parallel() if tp > 1 else contextlib.nullcontext():
                pred = model(tokens)
                loss = F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))  # train.py's loss_fn
                del pred
                loss.backward()
            optimizer.step()
        return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


if __name__ == "__main__":
    load_torchtitan(sys.argv[1])
    from torchtitan.models.llama import llama3_configs

    for name in sys.argv[2:] or list(ROWS):
        flavor, world, tp, batch, ac, float8, published = ROWS[name]
        two, three = (peak_bytes(flavor, world, tp, batch, ac, float8, n) for n in (2, 3))
        peak = three + (llama3_configs[flavor].n_layers - 3) * (three - two)
        print(json.dumps({"row": name, "torchtitan": COMMIT, "tensors_gib": round(peak / 2**30, 2),
                          "published_reserved_gib": published,
                          "reserved_over_tensors": round(published * 2**30 / peak, 3)}), flush=True)
