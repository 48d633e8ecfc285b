"""The GPU side of topology discovery and the link probe: runs where a GPU is, skipped elsewhere.

One GPU is enough: a world of one NCCL process checks that the probe's device follows the backend, and NVML's view
of every visible GPU is checked against torch's UUIDs. Run by ``benchmarks/gpu_checks.sh`` on the device machine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_deepseek.parallel.placement import probe_device
from lightning_deepseek.parallel.topology import _nvml_index

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_probe_sends_gpu_tensors_under_nccl(tmp_path: Path) -> None:
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        device = probe_device(dist.get_backend_config())
        assert device == torch.device("cuda", torch.cuda.current_device())
        measured = torch.ones(3, dtype=torch.float64, device=device)  # what probe_links reduces
        dist.all_reduce(measured)
        assert measured.tolist() == [1.0, 1.0, 1.0]
    finally:
        dist.destroy_process_group()


def test_nvml_finds_every_visible_gpu_by_uuid() -> None:
    pynvml = pytest.importorskip("pynvml")
    pynvml.nvmlInit()
    for i in range(torch.cuda.device_count()):
        uuid = str(torch.cuda.get_device_properties(i).uuid)
        index = _nvml_index(pynvml, i, uuid)
        found = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(index))
        assert (found.decode() if isinstance(found, bytes) else found).endswith(uuid), (i, index, found, uuid)
