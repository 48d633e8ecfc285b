"""The data-parallel exchange of a pipeline's stage gradients: once per optimizer step (after the last accumulated
batch, before clipping) each rank averages its stages' gradients with the ranks holding the same stages (the mesh's
``dp`` group), where DDP would without a pipeline.

Plain: one flat fp32 all-reduce of every gradient (a missing gradient counts as zeros, so every replica sends the
same layout). Compressed (``GradientCompression`` under a pipeline installs a :class:`CompressionState` with
:func:`compress_exchange`): the DDP hook's own exchange (:func:`lightning_deepseek.compression.hook.compressed_average`:
the same block quantisation, error feedback, byte counts and non-finite handling, every replica dequantising the same
bytes) on one bucket holding the matrices (parameters of 2 or more dimensions) in model order, and one fp32
all-reduce of the rest (biases, norms: what the hook leaves uncompressed too). The warm-up steps, and matrices of
fewer than ``min_bucket_numel`` values in all, go fp32.

Costs: compressed, the hook's bytes for the matrices (~0.25x those of fp32 for int8, ~0.13x for int4), one fp32
residual per matrix element, message buffers of about ``N * bits / 2`` bytes. Nothing overlaps with the backward:
the exchange starts once the schedule's last backward is done (the plain all-reduce as well). Residuals are keyed by
the LightningModule's parameter names, so the callback's checkpoints hold them as under DDP.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:  # parallel imports compression inside functions (the layering note in pyproject.toml)
    from lightning_deepseek.compression.config import CompressionConfig
    from lightning_deepseek.compression.state import CompressionState

__all__ = ["average_gradients", "compress_exchange"]


def compress_exchange(group: dist.ProcessGroup, named_parameters: Iterable[tuple[str, nn.Parameter]],
                      config: CompressionConfig) -> CompressionState:
    """The state of a compressed exchange over ``group`` for this rank's stage parameters (residuals under their
    names); collective over the world (it makes the phase-2 communicator)."""
    from lightning_deepseek.compression.hook import compression_state

    config.check_decided("GradientCompression under a pipeline")
    return compression_state(group, named_parameters, config)


@torch.no_grad()
def average_gradients(params: Sequence[nn.Parameter], group: dist.ProcessGroup,
                      compression: CompressionState | None = None) -> None:
    """Average the gradients of ``params`` (those requiring one) over ``group`` in place; compressed when
    ``compression`` is given. Collective over ``group``: every replica passes the same parameters."""
    params = [p for p in params if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if compression is None:
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat, group=group)
        flat.div_(dist.get_world_size(group))
        _copy_back(flat, params)
        return
    _compressed_average(params, compression)


def _copy_back(flat: torch.Tensor, params: Sequence[nn.Parameter]) -> None:
    for p, piece in zip(params, flat.split([p.numel() for p in params])):
        p.grad.copy_(piece.view_as(p.grad))


def _compressed_average(params: Sequence[nn.Parameter], state: CompressionState) -> None:
    """One step of the compressed exchange: the matrices through the hook's exchange, the rest in fp32."""
    from lightning_deepseek.compression.hook import allreduce_average, compressed_average

    state.last_bucket_time = time.perf_counter()  # what follows is exposed: the backward is done
    state.begin_step()
    matrices = sorted((p for p in params if p.dim() > 1), key=lambda p: state.param_order[id(p)])
    if not state.compressing or sum(p.numel() for p in matrices) < state.config.min_bucket_numel:
        matrices = []
    compressed = {id(p) for p in matrices}
    rest = [p for p in params if id(p) not in compressed]
    pending = []
    if matrices:
        for p in matrices:
            if not p.grad.is_contiguous():
                p.grad = p.grad.contiguous()
        pending.append(compressed_average(state, [p.grad for p in matrices],
                                          [state.param_names[id(p)] for p in matrices], matrices[0].grad))
    if rest:
        flat = torch.cat([p.grad.reshape(-1) for p in rest])
        pending.append(allreduce_average(state, flat))
    for future in pending:
        future.wait()
    if rest:
        _copy_back(flat, rest)
    state.end_step()
    state.release()
