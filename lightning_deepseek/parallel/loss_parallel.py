"""The vocabulary over ``tp`` inside tensor-parallel pipeline stages (``loss_parallel=True`` with
``pipeline_parallel_size`` and ``tensor_parallel_size``): torchtitan's and Megatron's layout of the embedding, the
output head and the loss.

- The output head is sharded column-wise by vocabulary: each ``tp`` rank computes the logits of its ``1 / tp`` of the
  vocabulary, and the whole ``(batch, sequence, vocabulary)`` tensor is never built. The module's ``pipeline_loss``
  receives them as a DTensor sharded on its last dimension and runs under torch's ``loss_parallel()``, where
  ``F.cross_entropy`` (or ``F.nll_loss`` of ``F.log_softmax``) reduces over the shards.
- The token embedding is sharded row-wise by vocabulary: each rank looks up the ids in its range, and the partial
  embeddings are all-reduced over ``tp``. torch computes its gradient whole on each rank (a replicated DTensor);
  a hook keeps this rank's rows of it.

Why: with a large vocabulary (Llama 3: 128,256) the head, the embedding and the logits of a micro-batch are the last
and first stages' largest tensors, whole on every ``tp`` rank otherwise. torch's ``ColwiseParallel`` /
``RowwiseParallel`` and ``loss_parallel`` do the work; this module finds the two modules in a split model, keeps the
stage's output a plain tensor (what the schedule handles) and wraps the loss.

Which modules: the head is the last ``nn.Linear`` outside the block list among the last stage's modules; the
embeddings are the ``nn.Embedding`` modules outside it among the first stage's whose table has the head's vocabulary
(our GPT: ``tok_emb``, ``head``; HF decoders: ``model.embed_tokens``, ``lm_head``).

Requires: a vocabulary that ``tp`` divides; a ``pipeline_loss`` that computes the cross-entropy of the logits
(other operations on the sharded logits follow DTensor's rules, redistributing where they need the whole vocabulary).
Costs per micro-batch over ``tp``: one all-reduce of the embedded batch (forward), one of the head's input gradient
(backward), and the loss's three all-reduces of one number per token. Saves ``(tp - 1) / tp`` of the head's and the
embedding's parameters, gradients, optimizer states, and of the logits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

from lightning_deepseek.parallel.pipeline_split import PipelineSplit

__all__ = ["apply_loss_parallel", "gather_vocabulary", "loss_parallel", "parallel_loss", "vocabulary_modules"]


def _outside_blocks(split: PipelineSplit, stage_index: int) -> list[str]:
    return [name for name in split.stages[stage_index].modules if not name.rpartition(".")[2].isdigit()]


def vocabulary_modules(model: nn.Module, split: PipelineSplit, tp_size: int) -> tuple[list[str], str]:
    """The embeddings and the head of ``model`` (names relative to it) that ``loss_parallel`` shards.

    Raises:
        ValueError: the last stage holds no ``nn.Linear`` outside the block list, or ``tp_size`` does not divide the
            vocabulary.
    """
    def found(stage_index: int, kind: type) -> list[tuple[str, nn.Module]]:
        return [(name, sub) for owned in _outside_blocks(split, stage_index)
                for name, sub in model.get_submodule(owned).named_modules(prefix=owned) if isinstance(sub, kind)]

    heads = found(split.num_stages - 1, nn.Linear)
    if not heads:
        raise ValueError(f"loss_parallel=True: the last pipeline stage holds no nn.Linear outside the block list "
                         f"({_outside_blocks(split, split.num_stages - 1)}), so there is no output head to shard "
                         "by vocabulary. Set loss_parallel=False.")
    head, layer = heads[-1]
    vocab = layer.out_features
    if vocab % tp_size:
        raise ValueError(f"loss_parallel=True with tensor_parallel_size={tp_size}: the head {head!r} has a vocabulary "
                         f"of {vocab}, which {tp_size} does not divide. Pad the vocabulary to a multiple of {tp_size} "
                         "or set loss_parallel=False.")
    embeddings = [name for name, sub in found(0, nn.Embedding) if sub.num_embeddings == vocab]
    return embeddings, head


def apply_loss_parallel(module: nn.Module, names: list[str], head: str, tp_mesh: DeviceMesh) -> None:
    """Shard the embeddings ``names`` and the ``head`` that this rank's stages hold (in ``module``, with their
    names there) over ``tp_mesh``: the embeddings row-wise to a replicated output, the head column-wise to the
    local shard of the logits."""
    held = dict(module.named_modules())
    styles: dict[str, ColwiseParallel | RowwiseParallel] = {
        name: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()) for name in names if name in held}
    if head in held:
        styles[head] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=True)
    if styles:
        parallelize_module(module, tp_mesh, styles)
    for name in names:
        if name in held:
            held[name].register_forward_pre_hook(_keep_gradient_rows)


def _keep_gradient_rows(embedding: nn.Module, args: tuple) -> None:
    """torch's row-wise embedding computes a replicated (whole) gradient for its row-sharded weight: a hook on the
    weight the forward uses keeps only this rank's rows, copied, so the whole gradient is freed as soon as it is made.
    Registered at the forward: materialising a meta model, or FSDP2, replaces the parameter."""
    weight = embedding.weight
    if not isinstance(weight, DTensor) or getattr(weight, "_keeps_gradient_rows", False):
        return

    def keep_rows(grad: torch.Tensor) -> torch.Tensor:
        if not isinstance(grad, DTensor) or grad.placements == weight.placements:
            return grad
        rows = grad.redistribute(grad.device_mesh, weight.placements).to_local().clone()
        return DTensor.from_local(rows, grad.device_mesh, weight.placements, run_check=False, shape=grad.shape,
                                  stride=grad.stride())
    weight.register_hook(keep_rows)
    weight._keeps_gradient_rows = True


def parallel_loss(loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], tp_mesh: DeviceMesh
                  ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``loss_fn(output, target)`` on the vocabulary-sharded logits: the last stage's local shard is handed to it as
    a DTensor sharded on the last dimension, and a DTensor loss comes back as its (replicated) local value. Run the
    forward and backward under :func:`loss_parallel`."""
    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        value = loss_fn(_vocabulary_shard(output, tp_mesh), target)
        # a copy, not DTensor's view of its local value: the split backward detaches the loss in place
        return value.full_tensor().clone() if isinstance(value, DTensor) else value
    return loss


def gather_vocabulary(output: torch.Tensor, tp_mesh: DeviceMesh) -> torch.Tensor:
    """The whole logits from this rank's vocabulary shard (one all-gather over ``tp``), for ``trainer.predict``."""
    return _vocabulary_shard(output, tp_mesh).full_tensor()


def _vocabulary_shard(output: torch.Tensor, tp_mesh: DeviceMesh) -> DTensor:
    """This rank's logits (its vocabulary shard, the last dimension) as the DTensor of the whole logits."""
    return DTensor.from_local(output, tp_mesh, [Shard(output.dim() - 1)], run_check=False)
