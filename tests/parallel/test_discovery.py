"""Topology discovery under ``CUDA_VISIBLE_DEVICES`` and the link probe, on real gloo processes.

A fake NVML stands in for the GPU driver: an 8-GPU host of NVLink pairs ``{0, 1}, {2, 3}, {4, 5}, {6, 7}``, each
GPU known by its UUID. ``torch.cuda.get_device_properties`` is replaced so that CUDA index ``i`` is the ``i``-th
GPU of a visible list, as ``CUDA_VISIBLE_DEVICES`` makes it.
"""

from __future__ import annotations

import math
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_deepseek.parallel.placement import probe_device, probe_links
from lightning_deepseek.parallel.topology import Topology, _nvlink_island, discover_topology
from tests.helpers import run_distributed

NUM_GPUS = 8


class FakeNVML:
    """The few ``pynvml`` calls that NVLink discovery makes; handles are NVML (physical) indices."""

    NVML_P2P_CAPS_INDEX_NVLINK = 2
    NVML_P2P_STATUS_OK = 0
    NVML_P2P_STATUS_NOT_SUPPORTED = 5

    class NVMLError(Exception):
        pass

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return NUM_GPUS

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> int:
        for index in range(NUM_GPUS):
            if uuid == f"GPU-{gpu_uuid(index)}":
                return index
        raise self.NVMLError(f"NVML_ERROR_NOT_FOUND: {uuid}")

    def nvmlDeviceGetIndex(self, handle: int) -> int:
        return handle

    def nvmlDeviceGetP2PStatus(self, a: int, b: int, caps: int) -> int:
        assert caps == self.NVML_P2P_CAPS_INDEX_NVLINK
        return self.NVML_P2P_STATUS_OK if a // 2 == b // 2 else self.NVML_P2P_STATUS_NOT_SUPPORTED


def gpu_uuid(index: int) -> str:
    """``torch.cuda``'s spelling of a UUID: NVML's without the ``GPU-`` prefix."""
    return f"{index:08x}-aaaa-bbbb-cccc-{index:012x}"


def fake_gpus(monkeypatch: pytest.MonkeyPatch, visible: list[int]) -> None:
    """Install the fake NVML and make CUDA index ``i`` the physical GPU ``visible[i]``."""
    monkeypatch.setitem(sys.modules, "pynvml", FakeNVML())
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=gpu_uuid(visible[i])))


@pytest.mark.parametrize(("visible", "islands"), [
    ([1, 2], [0, 2]),  # CUDA_VISIBLE_DEVICES=1,2: two NVLink pairs, though CUDA numbers them 0 and 1
    ([5, 4], [4, 4]),  # one pair listed in reverse
    ([6, 7, 0, 1], [6, 6, 0, 0]),  # a SLURM-like allocation in another order
])
def test_nvlink_islands_follow_the_physical_gpu(monkeypatch: pytest.MonkeyPatch, visible: list[int],
                                                islands: list[int]) -> None:
    fake_gpus(monkeypatch, visible)
    assert [_nvlink_island(torch.device("cuda", i)) for i in range(len(visible))] == islands


def test_unknown_uuid_falls_back_to_the_cuda_index(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, [0, 1, 2, 3])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid="not-an-nvml-gpu"))
    assert [_nvlink_island(torch.device("cuda", i)) for i in range(4)] == [0, 0, 2, 2]


def discovery_and_probe(rank: int, world_size: int, store_path: str) -> dict[str, Any]:
    """Every scenario of one 2-process spawn (process start dominates the cost); rank 0's results."""
    results: dict[str, Any] = {}
    # One process per GPU, each seeing only its own (CUDA_VISIBLE_DEVICES=1 and =2): both are cuda:0.
    with pytest.MonkeyPatch.context() as monkeypatch:
        fake_gpus(monkeypatch, [1 + rank])
        topology = discover_topology(torch.device("cuda", 0), local_rank=rank)
        results["per_process_gpus"] = (topology.islands, topology.source)

    results["device"] = str(probe_device(dist.get_backend_config()))
    for name, islands in {"two_islands": ((0,), (1,)), "one_island": ((0, 1),)}.items():
        links = probe_links(Topology(islands))
        results[name] = {k: (c.bandwidth, c.latency) for k, c in links.items()}
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, results[name])
        results[f"{name}_same_on_all_ranks"] = gathered[0] == gathered[1]

    # A group whose only backend carries CUDA tensors (like NCCL on GPUs) rejects CPU tensors; here no CUDA exists.
    dist.destroy_process_group()
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("cuda:gloo", store=store, rank=rank, world_size=world_size)
    try:
        probe_links(Topology(((0,), (1,))))
        results["cuda_only_group"] = "no error"
    except Exception as exc:  # noqa: BLE001 - the test checks which error it was
        results["cuda_only_group"] = f"{type(exc).__name__}: {exc}"
    # The probe fails before any collective, so a fast rank would tear its group down while the other is still
    # connecting to it ("Connection closed by peer"): meet on the store first. This group has no CPU barrier.
    store.set(f"done{rank}", "1")
    store.wait([f"done{r}" for r in range(world_size)])
    return results


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_distributed(discovery_and_probe, 2, str(tmp_path_factory.mktemp("probe") / "store"), timeout=120)[0]


def test_ranks_seeing_one_gpu_each_are_split_by_nvlink(two_processes: dict[str, Any]) -> None:
    # Both ranks hold cuda:0, but on GPUs 1 and 2, which share no NVLink: two islands on one host.
    assert two_processes["per_process_gpus"] == (((0,), (1,)), "nvml")


def test_gloo_probe_sends_cpu_tensors_and_measures_each_link(two_processes: dict[str, Any]) -> None:
    assert two_processes["device"] == "cpu"
    for name in ("two_islands", "one_island"):
        links = two_processes[name]
        assert two_processes[f"{name}_same_on_all_ranks"]
        for bandwidth, latency in links.values():
            assert 0 < latency < 1 and 1e6 < bandwidth < math.inf  # 4 MiB within seconds
        assert links["intra"] == links["inter"]  # the missing link class takes the measured one's figures


def test_probe_on_a_group_without_cpu_backend_asks_for_link_costs(two_processes: dict[str, Any]) -> None:
    assert two_processes["cuda_only_group"].startswith("ValueError: placement='auto' probes the links")
    assert "Set link_costs" in two_processes["cuda_only_group"]
