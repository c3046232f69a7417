import math

import pytest
import torch

from ampinit import LossScaler


def _run(scaler, overflow_pattern):
    scales = []
    for overflow in overflow_pattern:
        scaler.found_inf.fill_(1.0 if overflow else 0.0)
        scaler.update()
        scales.append(scaler.loss_scale())
    return scales


def test_torch_recipe_exact_scale():
    # torch's _run_scaling_case: init 128, growth every clean step, one planted inf.
    s = LossScaler("dynamic", init_scale=128.0, growth_interval=1)
    scales = _run(s, [False, False, True, False, False])
    assert scales == [256.0, 512.0, 256.0, 512.0, 1024.0]
    assert s.state_dict() == {"loss_scale": 1024.0, "unskipped": 0, "hysteresis_left": 1, "overflows": 1}


def test_apex_defaults_growth_after_2000_clean_steps():
    s = LossScaler("dynamic")
    assert s.loss_scale() == 2.0 ** 16
    _run(s, [False] * 1999)
    assert s.loss_scale() == 2.0 ** 16 and s.state_dict()["unskipped"] == 1999
    _run(s, [False])
    assert s.loss_scale() == 2.0 ** 17 and s.state_dict()["unskipped"] == 0
    _run(s, [True])
    assert s.loss_scale() == 2.0 ** 16


def test_floor_and_ceiling():
    s = LossScaler("dynamic", init_scale=4.0, min_loss_scale=1.0, max_loss_scale=16.0, growth_interval=1)
    assert _run(s, [True, True, True]) == [2.0, 1.0, 1.0]
    assert _run(s, [False] * 6) == [2.0, 4.0, 8.0, 16.0, 16.0, 16.0]
    default = LossScaler("dynamic", init_scale=2.0 ** -23)
    assert _run(default, [True, True, True])[-1] == 2.0 ** -24  # never collapses to 0


def test_hysteresis_backs_off_after_n_overflows():
    s = LossScaler("dynamic", init_scale=64.0, hysteresis=2, growth_interval=3)
    assert _run(s, [True, True, True, False, False, False, True]) == [64.0, 32.0, 16.0, 16.0, 16.0, 32.0, 32.0]


def test_static_scale_never_changes_but_counts_overflows():
    s = LossScaler(128.0)
    assert _run(s, [True, False, True] + [False] * 3000)[-1] == 128.0
    assert s.state_dict()["overflows"] == 2


def test_scale_and_inverse_stay_on_device_and_exact():
    s = LossScaler("dynamic", init_scale=1024.0)
    loss = torch.tensor(3.0, dtype=torch.float16)
    scaled = s.scale(loss)
    assert scaled.dtype == torch.float32 and scaled.shape == () and scaled.item() == 3072.0
    assert s.inv_scale().item() == 1 / 1024.0


def test_state_dict_round_trip_and_apex_format():
    s = LossScaler("dynamic", init_scale=256.0, growth_interval=5)
    _run(s, [False, True, False, False])
    fresh = LossScaler("dynamic", growth_interval=5)
    fresh.load_state_dict(s.state_dict())
    assert fresh.state_dict() == s.state_dict()
    apex_state = {"loss_scale": 512.0, "unskipped": 7}
    fresh.load_state_dict(apex_state)
    assert fresh.loss_scale() == 512.0 and fresh.state_dict()["unskipped"] == 7


@pytest.mark.parametrize("bad", [None, {}, {"loss_scale": 2.0}, {"loss_scale": -1.0, "unskipped": 0},
                                 {"loss_scale": math.nan, "unskipped": 0},
                                 {"loss_scale": 2.0, "unskipped": -3}, {"loss_scale": "2", "unskipped": 0}])
def test_bad_state_leaves_scaler_untouched(bad):
    s = LossScaler("dynamic", init_scale=64.0)
    before = s.state_dict()
    with pytest.raises(ValueError):
        s.load_state_dict(bad)
    assert s.state_dict() == before


@pytest.mark.parametrize("kwargs", [dict(loss_scale=0.0), dict(loss_scale="auto"), dict(growth_interval=0),
                                    dict(hysteresis=0), dict(backoff_factor=2.0),
                                    dict(min_loss_scale=4.0, max_loss_scale=2.0)])
def test_bad_construction(kwargs):
    with pytest.raises(ValueError):
        LossScaler(**{"loss_scale": "dynamic", **kwargs})


def test_hysteresis_follows_apex_update_scale_hysteresis():
    """Within the floor and ceiling, ampinit's scaler and apex's update_scale_hysteresis rule
    (amp_C's emulation, checked bitwise against apex's rule in test_apex_multi_tensor.py) give the
    same scale after every backward, on random overflow sequences."""
    from ampinit.apex import amp_C
    g = torch.Generator().manual_seed(5)
    for hysteresis in (1, 2, 4):
        ours = LossScaler("dynamic", init_scale=2.0 ** 20, hysteresis=hysteresis, growth_interval=5,
                          min_loss_scale=2.0 ** -120, max_loss_scale=2.0 ** 120)
        scale = torch.full((1,), 2.0 ** 20)
        growth = torch.zeros(1, dtype=torch.int32)
        credits = torch.full((1,), hysteresis, dtype=torch.int32)
        seen = set()
        for overflow in (torch.rand(400, generator=g) < 0.2).tolist():
            found = torch.full((1,), float(overflow))
            ours.found_inf.copy_(found)
            ours.update()
            amp_C.update_scale_hysteresis(scale, growth, credits, found, 2.0, 0.5, 5, hysteresis)
            assert ours.loss_scale() == scale.item()
            seen.add(scale.item())
        assert len(seen) > 4 and 2.0 ** -120 < min(seen) and max(seen) < 2.0 ** 120  # moved both ways, in range
