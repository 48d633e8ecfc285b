"""The hook's CUDA path (NCCL, device futures, on-device residual reset): runs where a GPU is, skipped elsewhere.

One GPU is enough: a world of one process runs both exchanges through NCCL, with CUDA tensors, streams and
futures: the single all-gather of worlds up to two, and (forced) the two-phase one of larger worlds (quantize,
``all_to_all``, re-quantize on the phase-2 stream, ``all_gather``, dequantize). Run by ``benchmarks/gpu_checks.sh``
on the device machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lightning_deepseek.compression import fused
from lightning_deepseek.compression.hook import register_compression_hook
from lightning_deepseek.compression.quantize import dequantize, quantize

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_quantizer_on_cuda_matches_cpu_bitwise(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both CUDA paths, the eager ops and the fused kernels (``fused.py``, compiled by inductor into Triton)."""
    x = torch.randn(1 << 20) * torch.logspace(-6, 3, 1 << 20)
    for path in ("0", "1"):
        monkeypatch.setenv("LDS_FUSED_KERNELS", path)
        for bits, block_size in [(8, 128), (4, 64)]:
            cpu = quantize(x, bits, block_size)
            residual = x.cuda()
            gpu = quantize(residual, bits, block_size, residual=residual)
            codes_equal = int((cpu[0] == gpu[0].cpu()).sum()) / cpu[0].numel()
            print(f"LDS_FUSED_KERNELS={path} int{bits}: codes equal {codes_equal:.6f}, "
                  f"scales equal {torch.equal(cpu[1], gpu[1].cpu())}")
            assert torch.equal(cpu[1], gpu[1].cpu())
            # Bitwise on the eager path; the compiled one may round a division differently: stated tolerance.
            assert codes_equal == 1.0 if path == "0" else codes_equal >= 0.999
            values = dequantize(*gpu, bits, block_size)
            if path == "0":
                assert torch.equal(dequantize(*cpu, bits, block_size), values.cpu())
            assert torch.equal(residual, x.cuda() - values)  # the error feedback follows the bytes sent
    assert fused._failed is None


def _train_within_bound_and_reset_on_overflow(two_phase: bool) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 64)).cuda()
    reference = [p.detach().clone() for p in model.parameters()]
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.25)
    state = register_compression_hook(ddp, bits=8, block_size=128, warmup_steps=1, min_bucket_numel=1024,
                                      single_exchange_max_world=0 if two_phase else 2)
    ref_model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 64)).cuda()
    with torch.no_grad():
        for p, r in zip(ref_model.parameters(), reference):
            p.copy_(r)
    for step in range(4):
        x = torch.randn(32, 256, device="cuda")
        ddp(x).square().mean().backward()
        ref_model(x).square().mean().backward()
        got = torch.cat([p.grad.view(-1) for p in ddp.parameters()])
        exact = torch.cat([p.grad.view(-1) for p in ref_model.parameters()])
        rel = float((got - exact).norm() / exact.norm())
        assert rel < (1e-6 if step == 0 else 0.02), (two_phase, step, rel)
        for p in list(ddp.parameters()) + list(ref_model.parameters()):
            p.grad = None
    assert state.num_compressed_buckets >= 1 and state.residuals
    assert all(plan.single != two_phase for plan in state.plans.values())
    assert fused._failed is None and fused._compiled  # the fused kernels ran, compiled in backward's thread
    torch.cuda.synchronize()
    spans = state.take_gpu_spans()  # the last step's compression kernels, timed on their streams
    assert spans and all(start.elapsed_time(end) >= 0 for start, end in spans)
    assert state.last_bucket_event is not None and state.last_bucket_event.query()
    x = torch.randn(32, 256, device="cuda")
    x[0, 0] = float("inf")
    ddp(x).square().mean().backward()
    assert not all(torch.isfinite(p.grad).all() for p in ddp.parameters())
    for p in ddp.parameters():
        p.grad = None
    ddp(torch.randn(32, 256, device="cuda")).square().mean().backward()  # residuals reset on the device, no sync
    assert all(torch.isfinite(r).all() for r in state.residuals.values())
    assert all(torch.isfinite(p.grad).all() for p in ddp.parameters())


def test_hook_on_nccl_within_the_error_bound_and_resets_on_overflow(tmp_path: Path) -> None:
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        for two_phase in (False, True):
            _train_within_bound_and_reset_on_overflow(two_phase)
    finally:
        dist.destroy_process_group()


def test_callback_logs_gpu_timings_under_lightning_ddp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_deepseek import GradientCompression
    from lightning_deepseek.compression import callback as callback_module
    from lightning_deepseek.models import GPTConfig, LightningGPT

    # One GPU: Lightning's DDP over a world of one, which the callback leaves alone (nothing crosses a wire). Here
    # it installs its hook anyway, so that NCCL, the CUDA events and the metrics run under Lightning.
    monkeypatch.setattr(callback_module, "find_ddp_module", lambda strategy: strategy.model)
    tokens = torch.randint(0, 16, (64, 33), generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)
    callback = GradientCompression(bits=8, block_size=64, warmup_steps=2, min_bucket_numel=1024)
    trainer = pl.Trainer(strategy="ddp", accelerator="gpu", devices=1, max_steps=8, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, log_every_n_steps=1, default_root_dir=tmp_path, callbacks=[callback])
    torch.manual_seed(0)
    trainer.fit(LightningGPT(GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=32)), train_dataloaders=loader)
    metrics = trainer.callback_metrics
    # Read from CUDA events one step late: the exposed span is real device time, and compression ran kernels.
    assert float(metrics["compression/exposed_comm_ms"]) > 0
    assert float(metrics["compression/compress_ms"]) > 0
    assert callback.summary()["compression_exposed_comm_ms_median"] is not None
    assert callback.summary()["compression_kernels"] == "fused (torch.compile)"

