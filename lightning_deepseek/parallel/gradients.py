"""The gradient reduction of shards that DDP does not see (tensor-parallel and expert-parallel ``DTensor``s).

A shard's gradient after backward is already summed over the ranks that share its slice's computation (its
``tp`` or ``ep`` group: the collectives' backward brings each rank's contribution); what is left is the sum over
the ranks that hold *replicas* of the same slice (``dp`` for tensor-parallel shards, ``edp`` for expert slices),
then the division by the world size, which makes it DDP's mean over all ranks. One flat all-reduce per call, once
per optimizer step (accumulated micro-batches add up locally first).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


@torch.no_grad()
def reduce_shard_gradients(grads: list[torch.Tensor], group: dist.ProcessGroup | None, world_size: int) -> None:
    """Sum ``grads`` (local tensors) over ``group`` (None: nothing to sum, one replica) and divide by
    ``world_size``, in place."""
    if not grads:
        return
    flat = torch._utils._flatten_dense_tensors(grads)  # no public flatten with an unflatten pair (as DDP uses)
    if group is not None:
        dist.all_reduce(flat, group=group)
    flat.div_(world_size)
    for grad, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        grad.copy_(reduced)
