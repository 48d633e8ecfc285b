"""The CUDA path of expert parallelism: runs where a GPU is, skipped elsewhere (``benchmarks/gpu_checks.sh``).

One GPU is enough: a world of one NCCL process runs the dispatch of :mod:`lightning_deepseek.parallel.expert`
(count exchange, the autograd all-to-all of token rows and its reverse, on CUDA tensors through NCCL) at ``ep=1``,
against the same model without expert parallelism: loss and gradients within 1e-5 (fp32), the expert gradient
reduction and one SGD step. And torch's grouped GEMM on CUDA in BF16 against the per-expert loop.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_deepseek.models import GPT, GPTConfig
from lightning_deepseek.models import moe as moe_module
from lightning_deepseek.parallel.dims import ParallelDims
from lightning_deepseek.parallel.expert import (
    apply_expert_parallel,
    reduce_expert_gradients,
)
from lightning_deepseek.parallel.optimizers import disable_foreach_on_mixed_groups
from tests.parallel.common import CONFIG, lm_loss, token_data

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
MOE = dict(CONFIG, n_routed_experts=8, moe_top_k=2, n_shared_experts=1, moe_hidden=32)


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**MOE)).cuda()


def test_nccl_all_to_all_dispatch_matches_the_unsharded_model(tmp_path: Path) -> None:
    batch = tuple(t.cuda() for t in token_data(4)[:4])
    reference = _model()
    ref_loss = lm_loss(reference, batch)
    ref_loss.backward()
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = _model()
        mesh = ParallelDims(1).build_mesh("cuda")["edp", "ep"]
        assert len(apply_expert_parallel(model, mesh)) == 2
        loss = lm_loss(model, batch)
        loss.backward()
        reduce_expert_gradients(model.parameters(), mesh)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
            grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
            torch.testing.assert_close(grad, ref.grad, rtol=1e-4, atol=1e-6, msg=name)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        # Expert DTensors beside plain parameters: CUDA's default multi-tensor step refuses the mix; the strategy
        # steps such groups with foreach=False, as here.
        assert disable_foreach_on_mixed_groups([optimizer])
        optimizer.step()
        assert torch.isfinite(lm_loss(model, batch))
    finally:
        dist.destroy_process_group()


def test_grouped_gemm_on_cuda_in_bf16_matches_the_per_expert_loop() -> None:
    torch.manual_seed(0)
    counts = torch.tensor([5, 0, 17, 10], device="cuda")
    x = torch.randn(int(counts.sum()), 64, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(4, 64, 128, device="cuda", dtype=torch.bfloat16)
    out = moe_module.grouped_matmul(x, weight, counts)
    loop = torch.cat([rows @ weight[g] for g, rows in enumerate(torch.split(x, counts.tolist()))])
    torch.testing.assert_close(out, loop, rtol=2e-2, atol=2e-2)
    print("grouped GEMM kernel used on CUDA bf16:", ("cuda", torch.bfloat16) not in moe_module._GROUPED_MM_BROKEN)
