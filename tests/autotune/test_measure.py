"""The setup measurements leave the model as they found it, and say what to do when they cannot run."""

from __future__ import annotations

import pytest
import torch

from lightning_deepseek.autotune.measure import measure_compute, measure_quantize, micro_batch_step
from tests.parallel.common import TinyLM, lm_loss, token_data


def test_measure_compute_restores_random_state_buffers_and_gradients() -> None:
    torch.manual_seed(0)
    module = TinyLM(dropout=0.1)
    module.register_buffer("running", torch.zeros(3))
    batch = token_data(4)[:4]
    before_rng = torch.get_rng_state()

    def step() -> torch.Tensor:
        module.running.add_(1.0)  # a buffer the forward updates, as batch norm does
        return lm_loss(module.model, batch)

    profile = measure_compute(module, step, "4 sequences", repeats=2)
    assert profile.forward_seconds > 0 and profile.backward_seconds > 0
    assert profile.activation_bytes > 4 * 16 * 32 * 4  # at least one activation of the batch was saved
    assert torch.equal(torch.get_rng_state(), before_rng)  # dropout drew from a forked generator
    assert torch.equal(module.running, torch.zeros(3))
    assert all(p.grad is None for p in module.parameters())
    assert "2 forward/backward passes of 4 sequences" in profile.source


def test_manual_optimization_without_example_input_names_the_fix() -> None:
    module = TinyLM()
    module.automatic_optimization = False
    with pytest.raises(ValueError, match="sets no example_input_array and training_step steps the optimizer itself "
                                         r"\(manual\): set the module's example_input_array"):
        micro_batch_step(module, object())


def test_quantize_cost_is_per_fp32_byte_for_each_width() -> None:
    costs = measure_quantize(1 << 20, (8, 4))
    assert set(costs) == {8, 4} and all(0 < q < 1e-6 and 0 < dq < 1e-6 for q, dq in costs.values())
