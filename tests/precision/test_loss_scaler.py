"""DynamicLossScaler: hysteresis, floor, growth, checkpoint state (the 2-rank decision: test_distributed.py)."""

from __future__ import annotations

import pytest
import torch

from lightning_deepseek.precision.loss_scaler import DynamicLossScaler, LossScalerConfigError


def test_hysteresis_backs_off_only_after_consecutive_overflows():
    scaler = DynamicLossScaler(init_scale=1024.0, hysteresis=3, growth_interval=100)
    scaler.update(found_inf=False)  # calibrated from here on
    for _ in range(2):
        scaler.update(found_inf=True)
    assert scaler.scale == 1024.0
    scaler.update(found_inf=True)  # third consecutive overflow
    assert scaler.scale == 512.0
    scaler.update(found_inf=True)  # every further consecutive one backs off too
    assert scaler.scale == 256.0
    scaler.update(found_inf=False)  # a finite step resets the count
    scaler.update(found_inf=True)
    scaler.update(found_inf=True)
    assert scaler.scale == 256.0


def test_calibration_backs_off_on_every_overflow_until_first_finite_step():
    scaler = DynamicLossScaler(init_scale=1024.0, hysteresis=4)
    for expected in (512.0, 256.0, 128.0):
        scaler.update(found_inf=True)
        assert scaler.scale == expected
    assert not scaler.calibrated
    scaler.update(found_inf=False)
    assert scaler.calibrated


def test_floor_and_growth_ceiling():
    scaler = DynamicLossScaler(init_scale=4.0, min_scale=2.0, max_scale=8.0, growth_interval=2, hysteresis=1)
    for _ in range(3):
        scaler.update(found_inf=True)
    assert scaler.scale == 2.0 and scaler.at_floor
    for _ in range(10):
        scaler.update(found_inf=False)
    assert scaler.scale == 8.0 and not scaler.at_floor


def test_unscale_finds_inf_and_divides_finite_gradients():
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2, dtype=torch.float64))]
    optimizer = torch.optim.SGD(params, lr=0.1)
    scaler = DynamicLossScaler(init_scale=8.0)
    params[0].grad = torch.full((3,), 8.0)
    params[1].grad = torch.full((2,), 16.0, dtype=torch.float64)
    assert scaler.unscale_(optimizer) is False
    assert torch.equal(params[0].grad, torch.ones(3)) and torch.equal(params[1].grad, torch.full((2,), 2.0).double())
    params[1].grad[0] = float("nan")
    assert scaler.unscale_(optimizer) is True


def test_state_dict_round_trip():
    scaler = DynamicLossScaler(init_scale=1024.0, hysteresis=2, growth_interval=5)
    for found in (True, False, False, True):
        scaler.update(found)
    restored = DynamicLossScaler(init_scale=7.0, min_scale=1.0, hysteresis=2, growth_interval=5)
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict()
    for found in (True, False, False, False, False, False):
        scaler.update(found)
        restored.update(found)
        assert restored.scale == scaler.scale


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"backoff_factor": 1.5}, "backoff_factor"), ({"growth_factor": 1.0}, "growth_factor"),
    ({"hysteresis": 0}, "hysteresis"), ({"min_scale": 0.0}, "min_scale"), ({"init_scale": 2.0, "min_scale": 4.0},
                                                                            "min_scale"),
])
def test_bad_arguments_name_the_setting(kwargs, name):
    with pytest.raises(LossScalerConfigError, match=name):
        DynamicLossScaler(**kwargs)
