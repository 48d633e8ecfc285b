"""The setup measurements leave the model as they found it, and say what to do when they cannot run."""

from __future__ import annotations

import time

import pytest
import torch

from lightning_deepseek.autotune.cost_model import ComputeProfile
from lightning_deepseek.autotune.measure import (
    CopyError,
    MicroBatch,
    agree_compute,
    first_optimizer,
    measure_compute,
    measure_quantize,
    measure_sharded,
    micro_batch_step,
)
from tests.parallel.common import TinyLM, lm_loss, token_data


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread, as the distributed tests' ranks use: two threads on the 2 shared cores made each tiny
    backward take up to seconds, waiting on a descheduled worker thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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


def test_agree_compute_keeps_every_figure_of_the_sharded_copies() -> None:
    profile = ComputeProfile(0.1, 0.2, 3, 4, "src", 0.05, {("tp", 2): (0.3, 0.01), ("ep", 2): (0.02, -0.001)})
    assert agree_compute(profile) == profile  # no process group: every figure back in its place


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


def test_measure_sharded_times_copies_and_leaves_the_model_alone() -> None:
    torch.manual_seed(0)
    module = TinyLM(dropout=0.1)
    before = [p.detach().clone() for p in module.parameters()]
    before_rng = torch.get_rng_state()
    batch = MicroBatch(token_data(2)[:2], False, "2 sequences", 32)

    def widen(copy: torch.nn.Module) -> None:  # a "sharding" whose step waits 0.1 s more (a collective, say)
        forward = copy.training_step

        def slower(data, i):
            time.sleep(0.1)  # a fixed wait, not more arithmetic: other jobs on the cores cannot hide it
            return forward(data, i)
        copy.training_step = slower

    optimizer, sharded = measure_sharded(module, batch, {("tp", 2): widen}, repeats=3)
    assert optimizer > 0 and set(sharded) == {("tp", 2)}
    extra_pass, extra_optimizer = sharded[("tp", 2)]
    assert extra_pass > 0.05  # the wait, measured on the copy's pass and not on the replicated one
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters()))  # the optimizer stepped copies
    assert all(p.grad is None for p in module.parameters())
    assert torch.equal(torch.get_rng_state(), before_rng)


def test_a_model_that_cannot_be_copied_fails_before_any_collective() -> None:
    import threading

    module = TinyLM()
    module.lock = threading.Lock()  # not deep-copyable
    batch = MicroBatch(token_data(2)[:2], False, "2 sequences", 32)
    with pytest.raises(CopyError, match=r"TinyLM cannot be deep-copied \(TypeError: .*lock"):
        measure_sharded(module, batch, {("tp", 2): lambda copy: None})
