"""The setup measurements leave the model as they found it, and say what to do when they cannot run."""

from __future__ import annotations

import pytest
import torch

from lightning_deepseek.autotune.decision import Candidate
from lightning_deepseek.autotune.measure import (
    CopyError,
    MicroBatch,
    first_optimizer,
    measure_activations,
    measure_copy_steps,
    micro_batch,
)
from tests.parallel.common import TinyLM, lm_loss, token_data


def test_measure_activations_restores_random_state_and_buffers() -> None:
    torch.manual_seed(0)
    module = TinyLM(dropout=0.1)
    module.register_buffer("running", torch.zeros(3))
    batch = token_data(4)[:4]
    before_rng = torch.get_rng_state()

    def step() -> torch.Tensor:
        module.running.add_(1.0)  # a buffer the forward updates, as batch norm does
        return lm_loss(module.model, batch)

    assert measure_activations(module, step) > 4 * 16 * 32 * 4  # at least one activation of the batch was saved
    assert torch.equal(torch.get_rng_state(), before_rng)  # dropout drew from a forked generator
    assert torch.equal(module.running, torch.zeros(3))
    assert all(p.grad is None for p in module.parameters())


def test_manual_optimization_without_example_input_names_the_fix() -> None:
    module = TinyLM()
    module.automatic_optimization = False
    with pytest.raises(ValueError, match="sets no example_input_array and training_step steps the optimizer itself "
                                         r"\(manual\): set the module's example_input_array"):
        micro_batch(module, object())


def test_first_optimizer_takes_lightnings_forms() -> None:
    module = TinyLM()
    optimizer = first_optimizer(module)
    assert isinstance(optimizer, torch.optim.Optimizer)
    module.configure_optimizers = lambda: {"optimizer": optimizer, "lr_scheduler": None}
    assert first_optimizer(module) is optimizer
    module.configure_optimizers = lambda: ([optimizer], [])
    assert first_optimizer(module) is optimizer
    module.configure_optimizers = lambda: None
    assert first_optimizer(module) is None


def test_a_model_that_cannot_be_copied_fails_before_any_collective() -> None:
    import threading

    module = TinyLM()
    module.lock = threading.Lock()  # not deep-copyable
    batch = MicroBatch(token_data(2)[:2], False, "2 sequences", 32)
    with pytest.raises(CopyError, match=r"TinyLM cannot be deep-copied \(TypeError: .*lock"):
        measure_copy_steps(module, batch, {Candidate(): lambda copy: lambda: None}, 25 << 20)
