"""The ops facade against a plain elementwise reference, with planted inf/NaN.

These run whatever backend is live (the compiled kernels when built, else the torch
fallback); CI runs them both ways.  test_kernels.py compares the two paths directly.
"""
import itertools
import os

import numpy as np
import pytest
import torch

from ampinit import _ext, ops

SIZES = [0, 1, 7, 4097, 65536 * 2 + 3, 555 * 555]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
TOL = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-6}
# The fallback casts before it scales, rounding twice: one fp16 subnormal step apart at most.
ATOL = {torch.float16: 2.0 ** -24, torch.bfloat16: 0.0, torch.float32: 0.0}


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
        torch.testing.assert_close(out, ref, rtol=TOL[out_dtype], atol=ATOL[out_dtype], equal_nan=True)


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
        torch.testing.assert_close(out, ref, rtol=TOL[dtype], atol=ATOL[dtype], equal_nan=True)


def test_empty_lists_and_flag_is_sticky(device):
    found_inf, inv = _flags(device)
    ops.unscale_([], [], inv, found_inf)
    ops.accumulate_unscaled_([], [], inv, found_inf)
    ops.check_finite_([], found_inf, torch.zeros(0, device=device))  # the CUDA kernels read row 0 of no rows
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
                py["credits"] = hysteresis  # apex: a clean backward refills the credits
                py["tracker"] += 1
                if py["tracker"] == 3:
                    py["scale"] = min(py["scale"] * 2, 2.0 ** 12)
                    py["tracker"] = 0
            assert (scale.item(), tracker.item(), credits.item(), count.item()) == \
                (py["scale"], py["tracker"], py["credits"], py["count"])


def test_backend_is_the_expected_one():
    """CI sets AMPINIT_EXPECT_BACKEND, so a build that silently fell back fails here."""
    name, reason = ops.backend(torch.device("cpu"))
    assert reason
    if os.environ.get("AMPINIT_DISABLE_EXT", "0") not in ("", "0"):
        assert name == "torch" and "AMPINIT_DISABLE_EXT" in reason and _ext.EXTENSION is None
    elif _ext.EXTENSION is not None:
        assert name == "cpu" and _ext.EXTENSION.cpu_kernels() in reason
    expected = os.environ.get("AMPINIT_EXPECT_BACKEND")
    if expected:
        assert name == expected, reason


@pytest.mark.parametrize("in_dtype, out_dtype", list(itertools.product(DTYPES, [torch.float32, torch.float16])))
def test_accumulate_every_dtype_pair_and_weight(in_dtype, out_dtype, device):
    inputs = _grads(in_dtype, SIZES, device, seed=5)
    inputs[4][65536] = float("-inf")  # the first element of the second chunk
    outputs = [torch.randn(x.shape, device=device).to(out_dtype) for x in inputs]
    expected = [(0.5 * o.double() + x.double() / 256.0).to(out_dtype) for o, x in zip(outputs, inputs)]
    found_inf, inv = _flags(device)
    ops.accumulate_unscaled_(inputs, outputs, inv, found_inf, out_weight=0.5)
    assert found_inf.item() == 1.0
    # Both terms are O(1) and may cancel: the error bound is absolute, a few fp16 ulps of 1.
    atol = 4e-3 if out_dtype == torch.float16 else 1e-6
    for out, ref in zip(outputs, expected):
        torch.testing.assert_close(out, ref, rtol=TOL[out_dtype], atol=atol, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("plant", [None, float("inf"), float("-inf"), float("nan")])
def test_check_finite_and_per_tensor_flags(dtype, plant, device):
    inputs = _grads(dtype, SIZES, device, seed=6)
    before = [x.clone() for x in inputs]
    if plant is not None:
        inputs[1][0] = plant
        inputs[5][555 * 555 - 1] = plant  # the scalar tail of the last chunk
    found_inf, inv = _flags(device)
    per_tensor = torch.zeros(len(inputs), device=device)
    ops.check_finite_(inputs, found_inf, per_tensor)
    bad = plant is not None
    assert found_inf.item() == float(bad)
    assert per_tensor.tolist() == [0.0, float(bad), 0.0, 0.0, 0.0, float(bad)]
    for x, b in zip(inputs[2:5], before[2:5]):
        assert torch.equal(x, b)  # read-only
    found_inf.zero_()
    per_tensor.zero_()
    outputs = [torch.empty(x.shape, device=device) for x in inputs]
    ops.unscale_(inputs, outputs, inv, found_inf, per_tensor)
    assert found_inf.item() == float(bad)
    assert per_tensor.tolist() == [0.0, float(bad), 0.0, 0.0, 0.0, float(bad)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_l2norm_matches_double_reference(dtype, device):
    inputs = _grads(dtype, SIZES, device, seed=7)
    total, per = ops.l2norm(inputs, per_tensor=True)
    ref = [x.double().norm() for x in inputs]
    assert total.shape == (1,) and total.dtype == torch.float32 and total.device == inputs[0].device
    torch.testing.assert_close(total.double().cpu(), torch.stack(ref).norm().reshape(1).cpu(), rtol=1e-6, atol=0)
    torch.testing.assert_close(per.double().cpu(), torch.stack(ref).cpu(), rtol=1e-6, atol=0)
    _, none = ops.l2norm(inputs)
    assert none.numel() == 0
    inputs[3][17] = float("inf")
    assert ops.l2norm(inputs)[0].item() == float("inf")
    inputs[3][17] = float("nan")
    assert ops.l2norm(inputs)[0].isnan().item()


def test_copy_noncontiguous_and_channels_last(device):
    master = torch.randn(6, 5, 4, 3, device=device)
    model = torch.empty(6, 5, 4, 3, device=device, dtype=torch.float16).to(memory_format=torch.channels_last)
    strided_master = torch.randn(9, 10, device=device)[:, ::2]
    strided_model = torch.empty(9, 5, device=device, dtype=torch.bfloat16)
    ops.copy_([model, strided_model], [master, strided_master])
    assert torch.equal(model, master.half()) and torch.equal(strided_model, strided_master.bfloat16())


# -- what is flagged is what is written ---------------------------------------------------------

@pytest.mark.parametrize("out_dtype, fits, overflows", [
    (torch.float16, 65519.0, 65520.0),                  # 65520 rounds (ties to even) to 65536 = inf
    (torch.bfloat16, 3.3961773e38, 3.3961776e38),       # half an ulp above the largest bfloat16
])
def test_unscale_into_a_narrower_dtype_flags_values_that_overflow_it(out_dtype, fits, overflows, device):
    """A finite float32 value whose product overflows the output dtype is written as inf: the
    op must flag it (the tensor is not the only one, and the flag is per tensor)."""
    inputs = [torch.tensor([1.0, fits], device=device), torch.tensor([overflows, 2.0], device=device),
              torch.tensor([1e5, -3.0], device=device)]
    outputs = [torch.empty(2, dtype=out_dtype, device=device) for _ in inputs]
    found_inf, per = torch.zeros(1, device=device), torch.zeros(2, device=device)
    one = torch.ones(1, device=device)
    ops.unscale_(inputs[:2], outputs[:2], one, found_inf, per)
    assert found_inf.item() == 1.0 and per.tolist() == [0.0, 1.0]
    assert torch.isfinite(outputs[0]).all() and outputs[1][0].item() == float("inf")
    # 1e5 overflows float16 before the scaling, not after: not flagged, and rounded once
    found_inf.zero_()
    ops.unscale_([inputs[2]], [outputs[2]], torch.full((1,), 1 / 256.0, device=device), found_inf)
    assert found_inf.item() == 0.0 and outputs[2][0].item() == (torch.tensor(1e5) / 256).to(out_dtype).item()


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32])
def test_accumulate_flags_what_its_contribution_brings(out_dtype, device):
    """A finite value pushed past the output dtype is flagged; an inf/NaN an earlier loss left
    in the output is not flagged again (that loss's scaler backed off for it, not this one's)."""
    big = 60000.0 if out_dtype == torch.float16 else 3e38
    one = torch.ones(1, device=device)
    outputs = [torch.tensor([big, 1.0], dtype=out_dtype, device=device)]
    found_inf = torch.zeros(1, device=device)
    ops.accumulate_unscaled_([torch.tensor([big, 1.0], device=device)], outputs, one, found_inf)
    assert found_inf.item() == 1.0 and outputs[0][0].item() == float("inf")

    found_inf.zero_()
    left_over = [torch.tensor([float("nan"), float("inf"), 1.0], dtype=out_dtype, device=device)]
    ops.accumulate_unscaled_([torch.tensor([1.0, 2.0, 3.0], device=device)], left_over, one, found_inf)
    assert found_inf.item() == 0.0 and left_over[0][2].item() == 4.0

    ops.accumulate_unscaled_([torch.tensor([1.0, 2.0, float("-inf")], device=device)], left_over, one, found_inf)
    assert found_inf.item() == 1.0


def test_unscale_with_inv_scale_above_one_flags_the_product(device):
    """A loss scale below 1 (inv_scale 4): the product overflows float16 in place."""
    grads = [torch.tensor([20000.0, 1.0], dtype=torch.float16, device=device)]
    found_inf = torch.zeros(1, device=device)
    ops.unscale_(grads, grads, torch.full((1,), 4.0, device=device), found_inf)
    assert found_inf.item() == 1.0


# -- complex tensors ------------------------------------------------------------------------------

COMPLEX = [torch.complex64, torch.complex128]


def _complex_grads(dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    sizes = [1, 7, 4097, 70000]
    return [torch.complex(torch.randn(n, generator=g), torch.randn(n, generator=g)).to(dtype).to(device) * 100
            for n in sizes]


@pytest.mark.parametrize("dtype", COMPLEX)
@pytest.mark.parametrize("part, value", [(None, None), ("real", float("inf")), ("imag", float("nan")),
                                         ("imag", float("-inf")), ("real", float("nan"))])
def test_complex_gradients(dtype, part, value, device):
    """unscale_, accumulate_unscaled_, check_finite_ and copy_ take complex tensors (as their
    real views): values scaled exactly like the real and imaginary parts, an inf/NaN in either
    part flagged for the tensor holding it."""
    grads = _complex_grads(dtype, device)
    if part is not None:
        getattr(grads[2], part)[123] = value
    bad = part is not None
    expected_flags = [0.0, 0.0, float(bad), 0.0]
    reference = [torch.view_as_real(x).double() / 256.0 for x in grads]

    found_inf, per = torch.zeros(1, device=device), torch.zeros(4, device=device)
    inv = torch.full((1,), 1 / 256.0, device=device)
    ops.check_finite_(grads, found_inf, per)
    assert found_inf.item() == float(bad) and per.tolist() == expected_flags

    found_inf.zero_()
    per.zero_()
    outputs = [torch.empty_like(x) for x in grads]
    ops.unscale_(grads, outputs, inv, found_inf, per)
    assert found_inf.item() == float(bad) and per.tolist() == expected_flags
    for out, ref in zip(outputs, reference):
        assert out.dtype == dtype
        torch.testing.assert_close(torch.view_as_real(out).double(), ref, rtol=1e-6, atol=0, equal_nan=True)

    found_inf.zero_()
    in_place = [x.clone() for x in grads]
    ops.unscale_(in_place, in_place, inv, found_inf)
    assert found_inf.item() == float(bad)
    assert all(torch.equal(torch.view_as_real(a).nan_to_num(), torch.view_as_real(b).nan_to_num())
               for a, b in zip(in_place, outputs))

    found_inf.zero_()
    base = [torch.ones_like(x) for x in grads]
    ops.accumulate_unscaled_(grads, base, inv, found_inf, out_weight=0.5)
    assert found_inf.item() == float(bad)
    for out, ref in zip(base, reference):
        ones = torch.view_as_real(torch.ones_like(out)).double()
        torch.testing.assert_close(torch.view_as_real(out).double(), ref + 0.5 * ones, rtol=1e-6, atol=1e-6,
                                   equal_nan=True)

    narrow = [torch.empty(x.shape, dtype=torch.complex64, device=device) for x in grads]
    ops.copy_(narrow, grads)
    assert all(torch.equal(torch.view_as_real(n).nan_to_num(), torch.view_as_real(x.to(torch.complex64)).nan_to_num())
               for n, x in zip(narrow, grads))


def test_complex_partner_must_be_complex(device):
    with pytest.raises(ValueError, match="partner must be complex"):
        ops.unscale_([torch.ones(2, dtype=torch.complex64, device=device)], [torch.ones(4, device=device)],
                     torch.ones(1, device=device), torch.zeros(1, device=device))
    conj = torch.ones(2, dtype=torch.complex64, device=device).conj()
    with pytest.raises(ValueError, match="conjugate bit"):
        ops.unscale_([torch.ones(2, dtype=torch.complex64, device=device)], [conj],
                     torch.ones(1, device=device), torch.zeros(1, device=device))
    found = torch.zeros(1, device=device)
    ops.check_finite_([torch.tensor([complex(1, float("inf"))], device=device).conj()], found)  # read: fine
    assert found.item() == 1.0


class _ComplexNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 4, dtype=torch.complex64))
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        z = x.to(torch.complex64) @ self.w
        return self.fc(z.abs().to(self.fc.weight.dtype))


@pytest.mark.parametrize("loss_scale", [128.0, "dynamic"])
def test_complex_parameters_train_and_skip_overflows(loss_scale, device):
    """A complex parameter at O0 with a static and a dynamic scale: every step equals plain
    training (the scales are powers of two, so unscaling is exact), except the two steps whose
    gradient got an inf in the imaginary and a NaN in the real part: those are skipped."""
    import ampinit as amp

    def run(use_amp):
        torch.manual_seed(0)
        model = _ComplexNet().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        if use_amp:
            model, opt = amp.initialize(model, opt, opt_level="O0", loss_scale=loss_scale, verbosity=0)
        for step in range(6):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(16, 8, generator=g).to(device)
            opt.zero_grad()
            loss = model(x).float().pow(2).mean()
            poison = {2: complex(0, float("inf")), 4: complex(float("nan"), 0)}.get(step)
            if use_amp:
                with amp.scale_loss(loss, opt) as scaled:
                    scaled.backward()
                    if poison is not None:
                        model.w.grad[1, 1] = poison
                opt.step()
            else:
                loss.backward()
                if poison is None:
                    opt.step()
        return model, opt

    amp_model, amp_opt = run(True)
    plain_model, _ = run(False)
    assert amp_opt.amp.skipped_steps == 2
    assert amp_model.w.dtype == torch.complex64
    for a, b in zip(amp_model.parameters(), plain_model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype, value", [(torch.float32, 1e20), (torch.float32, 3e38), (torch.float32, 1e-25),
                                          (torch.bfloat16, 1e30), (torch.float16, 6e4)])
def test_l2norm_squares_in_double(dtype, value, device):
    """|x| > ~1.8e19 overflows a float square and |x| < ~1e-23 underflows it: the norms must
    still be the float64 reference rounded to float32 (inf only where that is)."""
    x = torch.full((1000,), value).to(dtype).to(device)
    total, per = ops.l2norm([x, x[:10]], per_tensor=True)
    reference = torch.stack([x.double().norm(), x[:10].double().norm()])
    torch.testing.assert_close(per.cpu(), reference.float().cpu(), rtol=1e-6, atol=0)
    torch.testing.assert_close(total.cpu(), reference.norm().float().reshape(1).cpu(), rtol=1e-6, atol=0)


def _fingerprint_reference(tensor):
    """``ops.fingerprint``'s formula in numpy's wrapping uint32 arithmetic, on the elements in
    memory order: read from the storage for a dense tensor, from the contiguous copy for one with
    gaps."""
    strides_sorted = sorted(zip(tensor.stride(), tensor.shape), reverse=True)
    expected_stride, dense = 1, True
    for stride, size in reversed(strides_sorted):
        if size != 1:
            dense = dense and stride == expected_stride
            expected_stride *= size
    flat = (torch.as_strided(tensor, (tensor.numel(),), (1,)) if dense else tensor.contiguous().reshape(-1))
    unsigned = {2: np.uint16, 4: np.uint32}[tensor.element_size()]
    bits = flat.cpu().contiguous().view({2: torch.int16, 4: torch.int32}[tensor.element_size()]).numpy()
    keys = (np.arange(bits.size, dtype=np.uint64) * np.uint64(0x9E3779B9)).astype(np.uint32)  # mod 2**32
    x = bits.view(unsigned).astype(np.uint32) ^ keys
    with np.errstate(over="ignore"):  # lowbias32, in wrapping uint32
        x ^= x >> np.uint32(16)
        x *= np.uint32(0x7FEB352D)
        x ^= x >> np.uint32(15)
        x *= np.uint32(0x846CA68B)
        x ^= x >> np.uint32(16)
    return int(x.sum(dtype=np.uint64) & np.uint64(0xFFFFFFFF))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fingerprint_follows_its_formula_in_memory_order(dtype, device):
    """The facade (kernels or fallback) against an independent numpy reference: dense tensors in
    memory order whatever their strides (transposed, channels_last, a view at an offset),
    others (gaps) as their contiguous copy; more than 2**20 elements (the fallback's slice)."""
    g = torch.Generator().manual_seed(12)
    base = (torch.randn((1 << 20) + 9, generator=g) * 100).to(dtype).to(device)
    tensors = [base, base[3:], base[:12].reshape(3, 4).t(), base[:210].reshape(2, 3, 5, 7).to(
        memory_format=torch.channels_last), base[:90].reshape(9, 10)[:, 1::2], base[:0], base[:1]]
    prints = ops.fingerprint(tensors)
    assert prints.dtype == torch.int64 and prints.device == base.device
    assert prints.tolist() == [_fingerprint_reference(t) for t in tensors]
    assert prints[2] != ops.fingerprint([tensors[2].contiguous()])[0]  # memory order, not logical


# -- from a fuzzing review of the ops (G12) ----------------------------------------------------

def test_unscale_sparse_flags_a_product_that_overflows_the_output_dtype(device):
    """The dense ops flag a finite product that overflows the output dtype; the sparse path
    flagged the float32 product before its cast, so an O3 step with a sparse embedding and a
    loss scale below 1 stepped inf into the weights."""
    grad = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([40000.0, 1.0]), (4,)).to(device)
    found_inf = torch.zeros(1, device=device)
    out = ops.unscale_sparse(grad.to(torch.float16), torch.full((1,), 2.0, device=device), found_inf,
                             torch.float16)
    assert out.dtype == torch.float16 and out.to_dense()[0].item() == float("inf")
    assert found_inf.item() == 1.0
    found_inf.zero_()
    ops.unscale_sparse(grad, torch.full((1,), 0.5, device=device), found_inf, torch.float16)
    assert found_inf.item() == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_accumulate_a_zero_dim_row(dtype, device):
    """A scalar parameter (a temperature) with two losses before one step: the fallback
    broadcast the 0-dim row against the 1-element scale and raised."""
    out = torch.tensor(2.0, dtype=dtype, device=device)
    found_inf = torch.zeros(1, device=device)
    ops.accumulate_unscaled_([torch.tensor(1.0, dtype=dtype, device=device)], [out],
                             torch.full((1,), 0.5, device=device), found_inf)
    assert out.shape == () and out.item() == 2.5 and found_inf.item() == 0.0


def test_l2norm_of_complex_tensors_counts_both_parts(device):
    """The norm reached the fallback's ``t.double()``, which drops the imaginary part: a
    gradient with a zero real part read as zero (grads.py tells zeroed gradients by their norm)."""
    tensors = [torch.tensor([3 + 4j], device=device), torch.tensor([2j, -1j], device=device),
               torch.tensor([1 + 1j], device=device).conj()]
    total, each = ops.l2norm(tensors, per_tensor=True)
    assert each.tolist() == pytest.approx([5.0, 5 ** 0.5, 2 ** 0.5])
    assert total.item() == pytest.approx((25 + 5 + 2) ** 0.5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64, torch.complex128])
def test_fingerprint_of_8_byte_elements_sees_every_bit(dtype, device):
    """An 8-byte element is read as two 32-bit words: the fallback kept only the low 48 bits, so
    a sign flip, a doubling or ``w.mul_(-1)`` of a float64 tensor changed nothing."""
    base = torch.randn(64, dtype=dtype, device=device)
    before = ops.fingerprint([base])[0]
    changes = (lambda t: t[0].neg_(), lambda t: t[1].mul_(2), lambda t: t.mul_(-1), lambda t: t[5].add_(2.0 ** -10))
    for change in changes:
        written = base.clone()
        change(written)
        assert ops.fingerprint([written])[0] != before
    assert ops.fingerprint([base.clone()])[0] == before


def _bad_calls(device):
    """(name, call, the tensors it must leave untouched): each call is refused by every backend."""
    y0, y1, found = torch.zeros(4, device=device), torch.zeros(4, device=device), torch.zeros(1, device=device)
    half = torch.full((1,), 0.5, device=device)
    ones, inf4 = torch.ones(4, device=device), torch.full((4,), float("inf"), device=device)
    d0 = torch.zeros(4, dtype=torch.float64, device=device)  # float64: the fallback takes the call everywhere
    ints = torch.zeros(4, dtype=torch.int32, device=device)
    shared = torch.arange(20.0, device=device)
    return [
        ("lengths", lambda: ops.unscale_([ones, ones], [y0], half, found), [y0, found]),
        ("numel", lambda: ops.unscale_([inf4, torch.ones(5, device=device)], [y0, y1], half, found), [y0, y1, found]),
        ("broadcast row", lambda: ops.accumulate_unscaled_([ones.double(), torch.ones(1, device=device)], [d0, y1],
                                                           half, found), [d0, y1, found]),
        ("same numel, other shape", lambda: ops.unscale_([inf4.double(), torch.ones(1, 4, device=device)], [d0, y1],
                                                         half, found), [d0, y1, found]),
        ("per-tensor flags", lambda: ops.unscale_([inf4, ones], [y0, y1], half, found, torch.zeros(3, device=device)),
         [y0, y1, found]),
        ("found_inf dtype", lambda: ops.unscale_([ones], [y0], half, d0[:2]), [y0]),
        ("integer row", lambda: ops.unscale_([inf4, ones], [y0, ints], half, found), [y0, found]),
        ("copy lengths", lambda: ops.copy_([y0], [inf4, ones]), [y0]),
        ("float16 master", lambda: ops.adopt_changes_([y0.half()], [ones.half()]), []),
        ("integer check", lambda: ops.check_finite_([inf4, torch.ones(3, dtype=torch.int64, device=device)], found),
         [found]),
        ("kernels: same numel, other shape", lambda: ops.unscale_([inf4, torch.ones(1, 4, device=device)], [y0, y1],
                                                                  half, found), [y0, y1, found]),
        ("output shifted over its input", lambda: ops.unscale_([shared[:16]], [shared[1:17]], half, found),
         [shared, found]),
        ("expanded output", lambda: ops.copy_([torch.zeros(1, device=device).expand(4)], [ones]), []),
        # two rows writing one output (a tied parameter listed twice): the fallback applied the
        # op twice, the kernels raced
        ("one output twice", lambda: ops.unscale_([ones, inf4], [y0, y0], half, found), [y0, found]),
        ("one output twice in place", lambda: ops.unscale_([y1, y1], [y1, y1], half, found), [y1, found]),
        ("a row reads what another writes", lambda: ops.copy_([y0, y1], [y1, ones]), [y0, y1]),
        ("overlapping outputs", lambda: ops.accumulate_unscaled_([ones, ones], [shared[:4], shared[2:6]], half,
                                                                 found), [shared, found]),
        ("one strided view twice", lambda: ops.copy_([shared[::2], shared[::2]], [shared[1::2], shared[1::2]]),
         [shared]),
        ("one master twice", lambda: ops.adopt_changes_([y0, y0], [ones.half(), inf4.half()]), [y0]),
        ("one param twice, adam", lambda: ops.fused_adam_(
            [y0, y0], [ones, ones], [y1, torch.zeros(4, device=device)], [d0.float(), torch.zeros(4, device=device)],
            [torch.zeros(1, device=device), torch.zeros(1, device=device)], [], lr=0.1, beta1=0.9, beta2=0.99,
            eps=1e-8, weight_decay=0.0, decoupled_weight_decay=False, bias_correction=True,
            inv_scale=half, found_inf=found), [y0, y1]),
        ("one param twice, sgd", lambda: ops.fused_sgd_(
            [y1, y1], [ones, inf4], [], [torch.zeros(1, device=device), torch.zeros(1, device=device)], [], lr=0.1,
            momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, inv_scale=half, found_inf=found),
         [y1]),
    ]


@pytest.mark.parametrize("case", range(21))
def test_bad_rows_are_refused_before_anything_is_written(case, device):
    """From a fuzzing review: the fallback (no extension, or any call holding a float64 or complex
    row) checked nothing: ``zip`` dropped a row, a (1,) row broadcast into a (4,) one, an integer
    row failed after row 0 was written with ``found_inf`` left 0.  The kernels checked numels
    only (a (1, 4) row failed in the write-back, after the other rows were written, found_inf
    left 0) and took an output shifted one element over its input (every 16th value wrong)."""
    name, call, untouched = _bad_calls(device)[case]
    before = [t.clone() for t in untouched]
    with pytest.raises((RuntimeError, ValueError, TypeError)) as raised:
        call()
    for was, now in zip(before, untouched):
        assert torch.equal(was, now), name
    if "twice" in name or "another writes" in name or "overlapping" in name:
        assert "share memory" in str(raised.value), (name, raised.value)


def test_bad_calls_are_all_run():
    assert len(_bad_calls(torch.device("cpu"))) == 21


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rows_that_share_memory_only_to_read_or_apart_are_accepted(dtype, device):
    """What the check for rows sharing memory must let through: one input read by two rows,
    adjacent views of one buffer (DDP's gradient bucket), interleaved strided views (float64:
    the fallback's check)."""
    bucket = torch.arange(1.0, 13.0, dtype=dtype, device=device)
    found, inv = torch.zeros(1, device=device), torch.full((1,), 0.5, device=device)
    ops.check_finite_([bucket, bucket], found)
    views = [bucket[0:4], bucket[4:8], bucket[8:12]]
    ops.unscale_(views, views, inv, found)
    torch.testing.assert_close(bucket, torch.arange(1.0, 13.0, dtype=dtype, device=device) * 0.5)
    grid = torch.zeros(4, 6, dtype=dtype, device=device)
    source = torch.ones(4, 3, dtype=dtype, device=device)
    ops.copy_([grid[:, 0::2], grid[:, 1::2]], [source, 2 * source])
    assert grid[:, 0::2].eq(1).all() and grid[:, 1::2].eq(2).all()
    same = torch.ones(4, dtype=dtype, device=device)
    out = torch.zeros(2, 4, dtype=dtype, device=device)
    ops.accumulate_unscaled_([same, same], [out[0], out[1]], inv, found)
    assert out.eq(0.5).all() and found.item() == 0.0


@pytest.mark.parametrize("n", [1, 17, 16])
def test_accumulate_flags_no_padding_lane(n, device):
    """An inf ``out_weight`` over an inf previous value brings nothing new (the inf was flagged
    when written); the CPU kernels' zero-padded tail lanes computed 0 * inf = NaN and flagged it
    for n = 1 and 17, not 16."""
    out = torch.full((n,), float("inf"), device=device)
    found = torch.zeros(1, device=device)
    ops.accumulate_unscaled_([torch.zeros(n, device=device)], [out], torch.ones(1, device=device), found,
                             out_weight=float("inf"))
    assert found.item() == 0.0
