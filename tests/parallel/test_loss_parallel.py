"""``loss_parallel``'s checks before any rank starts: the settings it needs, and the embedding and head it finds in a
split model (the numerics run in ``test_pipeline_compose.py``'s 4-rank spawn: our GPT under DualPipeV and HF Llama
with sequence parallelism at pp=2 x tp=2 against one process, and predict's gathered logits)."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_deepseek import HybridParallelStrategy
from lightning_deepseek.parallel.loss_parallel import vocabulary_modules
from lightning_deepseek.parallel.pipeline_split import plan_pipeline_split
from tests.parallel.test_pipeline import VOCAB, make_model


@pytest.mark.parametrize("settings", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2},
                                      {"pipeline_parallel_size": 2, "tensor_parallel_size": "auto"}])
def test_needs_a_pipeline_and_tensor_parallelism(settings: dict) -> None:
    with pytest.raises(ValueError, match="loss_parallel=True .* needs pipeline_parallel_size > 1 and a "
                                         "tensor_parallel_size > 1.*or loss_parallel=False"):
        HybridParallelStrategy(loss_parallel=True, **settings)


@pytest.mark.parametrize(("name", "schedule", "embeddings", "head"), [
    ("gpt", "1F1B", ["tok_emb"], "head"),  # pos_emb's table is the block size, not the vocabulary
    ("gpt", "DualPipeV", ["tok_emb"], "head"),  # rank 0 holds both
    ("llama", "1F1B", ["model.embed_tokens"], "lm_head"),
])
def test_finds_the_embedding_and_the_head(name: str, schedule: str, embeddings: list[str], head: str) -> None:
    model = make_model(name)
    assert vocabulary_modules(model, plan_pipeline_split(model, 2, schedule), 2) == (embeddings, head)


def test_refuses_a_vocabulary_tp_does_not_divide() -> None:
    model = make_model("gpt")
    with pytest.raises(ValueError, match=f"vocabulary of {VOCAB}, which 3 does not divide.*loss_parallel=False"):
        vocabulary_modules(model, plan_pipeline_split(model, 2), 3)


def test_refuses_a_last_stage_without_a_head() -> None:
    chain = nn.Module()  # a chain: an embedding, a block list, a norm, and no output head
    chain.embed, chain.blocks, chain.norm = (nn.Embedding(VOCAB, 8), nn.ModuleList(nn.Linear(8, 8) for _ in range(4)),
                                             nn.LayerNorm(8))
    with pytest.raises(ValueError, match="holds no nn.Linear outside the block list"):
        vocabulary_modules(chain, plan_pipeline_split(chain, 2, split_points=["blocks.2"]), 2)
