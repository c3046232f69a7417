"""The ops facade against a plain elementwise reference, with planted inf/NaN."""
import itertools

import pytest
import torch

from ampinit import ops

SIZES = [0, 1, 7, 4097, 65536 * 2 + 3]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
TOL = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-6}


def _grads(dtype, sizes, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=g) * 100).to(dtype).to(device) for n in sizes]


def _reference(inputs, inv_scale, out_dtype):
    outs = [(x.double() * inv_scale).to(out_dtype) for x in inputs]
    bad = any(not torch.isfinite(x.double()).all() for x in inputs)
    return outs, bad


def _flags(device):
    return torch.zeros(1, device=device), torch.full((1,), 1 / 256.0, device=device)


@pytest.mark.parametrize("in_dtype, out_dtype", list(itertools.product(DTYPES, DTYPES)))
@pytest.mark.parametrize("plant", [None, "inf", "-inf", "nan"])
def test_unscale_out_of_place(in_dtype, out_dtype, plant, device):
    inputs = _grads(in_dtype, SIZES, device)
    if plant:
        inputs[3][1234] = float(plant)
    outputs = [torch.empty(x.shape, dtype=out_dtype, device=device) for x in inputs]
    found_inf, inv = _flags(device)
    expected, bad = _reference(inputs, 1 / 256.0, out_dtype)
    ops.unscale_(inputs, outputs, inv, found_inf)
    assert found_inf.item() == float(bad) == float(plant is not None)
    for out, ref in zip(outputs, expected):
        torch.testing.assert_close(out, ref, rtol=TOL[out_dtype], atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("plant_at", [None, (0, 0), (4, -1)])
def test_unscale_in_place_many_tensors_noncontiguous(dtype, plant_at, device):
    inputs = _grads(dtype, [3, 7, 1] + [33] * 120, device, seed=1)
    inputs.append(torch.randn(24, 17, device=device).to(dtype).t())  # non-contiguous
    if plant_at:
        inputs[plant_at[0]][plant_at[1]] = float("nan")
    expected, bad = _reference(inputs, 1 / 256.0, dtype)
    found_inf, inv = _flags(device)
    ops.unscale_(inputs, inputs, inv, found_inf)
    assert found_inf.item() == float(bad)
    for out, ref in zip(inputs, expected):
        torch.testing.assert_close(out, ref, rtol=TOL[dtype], atol=0, equal_nan=True)


def test_empty_lists_and_flag_is_sticky(device):
    found_inf, inv = _flags(device)
    ops.unscale_([], [], inv, found_inf)
    ops.accumulate_unscaled_([], [], inv, found_inf)
    assert found_inf.item() == 0.0
    found_inf.fill_(1.0)
    ops.unscale_(_grads(torch.float16, [5], device), [torch.empty(5, device=device)], inv, found_inf)
    assert found_inf.item() == 1.0  # the caller zeroes it, ops never clear it


@pytest.mark.parametrize("in_dtype", DTYPES)
@pytest.mark.parametrize("plant", [False, True])
def test_accumulate_unscaled(in_dtype, plant, device):
    inputs = _grads(in_dtype, SIZES, device, seed=2)
    if plant:
        inputs[-1][-1] = float("inf")
    outputs = [torch.randn(x.shape, device=device) for x in inputs]
    expected = [o.double() + x.double() / 256.0 for o, x in zip(outputs, inputs)]
    found_inf, inv = _flags(device)
    ops.accumulate_unscaled_(inputs, outputs, inv, found_inf)
    assert found_inf.item() == float(plant)
    for out, ref in zip(outputs, expected):
        torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
def test_copy_masters_to_model_rounds_like_torch(out_dtype, device):
    masters = [torch.randn(n, device=device) for n in SIZES]
    models = [torch.empty(n, dtype=out_dtype, device=device) for n in SIZES]
    ops.copy_(models, masters)
    for model, master in zip(models, masters):
        assert torch.equal(model, master.to(out_dtype))


def test_unscale_sparse(device):
    i = torch.tensor([[0, 2, 2]])
    grad = torch.sparse_coo_tensor(i, torch.tensor([2.0, 4.0, 8.0]), (4,)).to(device)
    found_inf, inv = _flags(device)
    out = ops.unscale_sparse(grad, inv, found_inf, torch.float32)
    assert found_inf.item() == 0.0
    assert torch.equal(out.to_dense().cpu(), torch.tensor([2.0, 0.0, 12.0, 0.0]) / 256.0)
    bad = torch.sparse_coo_tensor(i, torch.tensor([1.0, float("nan"), 1.0]), (4,)).to(device)
    ops.unscale_sparse(bad, inv, found_inf, torch.float32)
    assert found_inf.item() == 1.0


def test_update_scale_matches_python_model(device):
    """Random overflow sequences against a plain-Python model of the state machine."""
    g = torch.Generator().manual_seed(3)
    for trial in range(20):
        hysteresis = 1 + trial % 3
        scale = torch.full((1,), 2.0 ** 10, device=device)
        tracker = torch.zeros(1, dtype=torch.int32, device=device)
        credits = torch.full((1,), hysteresis, dtype=torch.int32, device=device)
        count = torch.zeros(1, dtype=torch.int64, device=device)
        found = torch.zeros(1, device=device)
        py = dict(scale=2.0 ** 10, tracker=0, credits=hysteresis, count=0)
        for overflow in (torch.rand(200, generator=g) < 0.3).tolist():
            found.fill_(float(overflow))
            ops.update_scale_(scale, tracker, credits, count, found, growth_factor=2.0,
                              backoff_factor=0.5, growth_interval=3, hysteresis=hysteresis,
                              min_scale=1.0, max_scale=2.0 ** 12)
            if overflow:
                py["count"] += 1
                py["tracker"] = 0
                py["credits"] -= 1
                if py["credits"] <= 0:
                    py["scale"] = max(py["scale"] / 2, 1.0)
                py["credits"] = max(py["credits"], 0)
            else:
                py["tracker"] += 1
                if py["tracker"] == 3:
                    py["scale"] = min(py["scale"] * 2, 2.0 ** 12)
                    py["tracker"] = 0
                    py["credits"] = hysteresis
            assert (scale.item(), tracker.item(), credits.item(), count.item()) == \
                (py["scale"], py["tracker"], py["credits"], py["count"])


def test_backend_reports_fallback():
    name, reason = ops.backend()
    assert name == "torch" and reason
