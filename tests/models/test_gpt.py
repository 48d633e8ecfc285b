import pytest
import torch

from lightning_deepseek.models import GPT, PRESETS, GPTConfig


def tiny_config(**overrides) -> GPTConfig:
    return GPTConfig(**{**PRESETS["tiny"], **overrides})


def test_forward_shape() -> None:
    model = GPT(tiny_config())
    logits = model(torch.randint(0, 256, (3, 17)))
    assert logits.shape == (3, 17, 256)


def test_attention_is_causal() -> None:
    torch.manual_seed(0)
    model = GPT(tiny_config()).eval()
    idx = torch.randint(0, 256, (1, 20))
    changed = idx.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 256
    assert torch.equal(model(idx)[:, :10], model(changed)[:, :10])
    assert not torch.allclose(model(idx)[:, 10:], model(changed)[:, 10:])


def test_feed_forward_is_a_linear_pair() -> None:
    mlp = GPT(tiny_config()).blocks[0].mlp
    assert isinstance(mlp.fc1, torch.nn.Linear) and isinstance(mlp.fc2, torch.nn.Linear)
    assert mlp.fc1.in_features == mlp.fc2.out_features == 64
    assert mlp.fc1.out_features == mlp.fc2.in_features == 256


def test_generate_appends_tokens() -> None:
    out = GPT(tiny_config()).generate(torch.zeros(2, 3, dtype=torch.long), max_new_tokens=5, top_k=10)
    assert out.shape == (2, 8)


def test_too_long_sequence_is_rejected() -> None:
    with pytest.raises(ValueError, match="block_size"):
        GPT(tiny_config())(torch.zeros(1, 65, dtype=torch.long))


@pytest.mark.parametrize("field, value, match", [("n_head", 3, "n_head"), ("n_layer", 0, "n_layer"),
                                                 ("dropout", 1.5, "dropout")])
def test_bad_config_names_the_field(field: str, value: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tiny_config(**{field: value})
