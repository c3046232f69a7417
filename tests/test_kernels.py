"""The compiled kernels against the torch fallback on the same data, and their argument checks.

Skipped where the extension is not built (or AMPINIT_DISABLE_EXT=1): test_ops.py covers the
facade whatever backend runs.
"""
import itertools
import os

import pytest
import torch

from ampinit import _ext, _fallback

pytestmark = pytest.mark.skipif(_ext.EXTENSION is None, reason=f"no compiled extension: {_ext.REASON}")
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
SIZES = [0, 1, 7, 31, 33, 4097, 65536 * 2 + 3, 555 * 555]


def _kernels_for(device):
    if device == "cuda" and not _ext.EXTENSION.with_cuda:
        pytest.skip("extension built without CUDA kernels")


def _data(dtype, device, seed, sizes=SIZES):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=g) * 1000).to(dtype).to(device) for n in sizes]


@pytest.mark.parametrize("in_dtype, out_dtype", list(itertools.product(DTYPES, DTYPES)))
def test_unscale_kernel_equals_single_rounding_reference(in_dtype, out_dtype, device):
    """The kernel rounds once (x * inv in float32, then to the output dtype): bitwise equal
    to that reference, including for values that overflow the output or underflow to 0."""
    _kernels_for(device)
    inputs = _data(in_dtype, device, 1)
    inputs[6][100] = float("nan")
    inputs[7][-1] = float("-inf")
    outputs = [torch.empty(x.shape, dtype=out_dtype, device=device) for x in inputs]
    found, per = torch.zeros(1, device=device), torch.zeros(len(inputs), device=device)
    inv = torch.full((1,), 3.0e-3, device=device)  # not a power of two: the rounding shows
    torch.ops.ampinit.unscale_(inputs, outputs, inv, found, per)
    for x, y in zip(inputs, outputs):
        assert torch.equal((x.float() * inv).to(out_dtype).isnan(), y.isnan())
        assert torch.equal(torch.nan_to_num((x.float() * inv).to(out_dtype)), torch.nan_to_num(y))
    assert found.item() == 1.0 and per.tolist() == [0] * 6 + [1, 1]


@pytest.mark.parametrize("out_weight", [0.9, 0.999, 3.0])
@pytest.mark.parametrize("in_dtype, out_dtype", [(torch.float16, torch.float32), (torch.float32, torch.float32),
                                                 (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)])
def test_accumulate_kernel_rounds_the_product_apart_like_the_fallback(in_dtype, out_dtype, out_weight, device):
    """From a review: ``acc * out_weight + contribution`` was contracted into one FMA (GCC with
    -mfma, nvcc), where the fallback rounds the product first: a quarter of the elements one ulp
    off for out_weight 0.9.  Weights of 0.5 and 1, the only ones tested before, are exact."""
    _kernels_for(device)
    inputs = _data(in_dtype, device, 11)
    inputs[5][7] = float("inf")
    outputs = [torch.randn(x.shape, generator=torch.Generator().manual_seed(12)).to(out_dtype).to(device)
               for x in inputs]
    reference = [o.clone() for o in outputs]
    found, expected_found = torch.zeros(1, device=device), torch.zeros(1, device=device)
    inv = torch.full((1,), 3.0e-3, device=device)
    torch.ops.ampinit.accumulate_(inputs, outputs, inv, found, out_weight)
    _fallback.accumulate_unscaled_(inputs, reference, inv, expected_found, out_weight)
    assert found.item() == expected_found.item() == 1.0
    for out, ref in zip(outputs, reference):
        assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(torch.nan_to_num(out), torch.nan_to_num(ref))


def test_in_place_and_mixed_dtypes_in_one_call(device):
    _kernels_for(device)
    inputs = _data(torch.float16, device, 2, [5, 70000]) + _data(torch.bfloat16, device, 3, [9]) + \
        _data(torch.float32, device, 4, [65537])
    expected = [(x.float() * 0.25).to(x.dtype) for x in inputs]
    found, inv = torch.zeros(1, device=device), torch.full((1,), 0.25, device=device)
    torch.ops.ampinit.unscale_(inputs, inputs, inv, found)
    assert found.item() == 0.0
    assert all(torch.equal(x, e) for x, e in zip(inputs, expected))


def test_more_tensors_than_one_launch_holds(device):
    """> 110 tensors and > 320 chunks: the launcher splits them over several launches, and a
    tensor may straddle two; an inf in the very last one is still seen."""
    _kernels_for(device)
    sizes = [1, 3] * 60 + [65536 * 3 + 1] * 120
    inputs = _data(torch.float16, device, 5, sizes)
    inputs[-1][-1] = float("inf")
    outputs = [torch.empty(x.shape, device=device) for x in inputs]
    found, inv = torch.zeros(1, device=device), torch.full((1,), 0.5, device=device)
    per = torch.zeros(len(inputs), device=device)
    torch.ops.ampinit.unscale_(inputs, outputs, inv, found, per)
    assert found.item() == 1.0 and per.nonzero().flatten().tolist() == [len(inputs) - 1]
    assert all(torch.equal(y[:-1], x[:-1].float() * 0.5) for x, y in zip(inputs, outputs))
    total, norms = torch.ops.ampinit.l2norm(inputs[:-1], True)
    ref = torch.stack([x.double().norm() for x in inputs[:-1]])
    torch.testing.assert_close(norms.double(), ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(total.double(), ref.norm().reshape(1), rtol=1e-6, atol=0)


@pytest.mark.parametrize("model_dtype", DTYPES)
def test_adopt_changes_kernel_takes_exactly_the_changed_elements(model_dtype, device):
    """The model's value wherever it differs from the master's rounding -- writes planted at
    random, NaN and inf included, in the vector body and the tail -- and the master's exact
    FP32 value everywhere else; equal to the torch fallback."""
    _kernels_for(device)
    g = torch.Generator().manual_seed(7)
    masters = [torch.randn(n, generator=g).to(device) * 10 for n in SIZES]
    models = [m.to(model_dtype) for m in masters]
    for i, model in enumerate(models):
        if model.numel():
            written = torch.rand(model.shape, generator=g).to(device) < 0.01
            written[-1] = True  # the tail
            model[written] = (torch.randn(int(written.sum()), generator=g) * 10).to(device, model_dtype)
            model[0] = [float("nan"), float("inf"), -2.0][i % 3]
    expected = [torch.where(mo.ne(ma.to(model_dtype)), mo.float(), ma) for ma, mo in zip(masters, models)]
    fallback = [m.clone() for m in masters]
    _fallback.adopt_changes_(fallback, models)
    torch.ops.ampinit.adopt_changes_(masters, models)
    for got, want, ref in zip(masters, expected, fallback):
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
        assert torch.equal(ref.nan_to_num(), want.nan_to_num())
    unchanged = [torch.randn(1000, generator=g).to(device)]
    before = unchanged[0].clone()
    torch.ops.ampinit.adopt_changes_(unchanged, [unchanged[0].to(model_dtype)])
    assert torch.equal(unchanged[0], before)  # nothing written: every FP32 digit kept


@pytest.mark.parametrize("model_dtype", DTYPES)
def test_adopt_changes_only_touches_flagged_tensors(model_dtype, device):
    _kernels_for(device)
    g = torch.Generator().manual_seed(8)
    masters = [torch.randn(n, generator=g).to(device) for n in (5, 4097, 70000)]
    models = [(m + 1).to(model_dtype) for m in masters]  # every element differs
    expected = [m.clone() for m in masters]
    expected[1] = models[1].float()
    only = torch.tensor([0.0, 1.0, 0.0], device=device)
    fallback = [m.clone() for m in masters]
    _fallback.adopt_changes_(fallback, models, only)
    torch.ops.ampinit.adopt_changes_(masters, models, only)
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(masters, expected, fallback))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fingerprint_equals_fallback_and_sees_every_single_change(dtype, device):
    """Bitwise the fallback's formula; one changed element anywhere (a vector, the tail, a chunk
    boundary of either backend), a sign flip or a swap of two elements changes it; dense
    non-contiguous inputs (transposed, channels_last) are read in memory order, inputs with
    gaps as their contiguous copy; many tensors in one call."""
    _kernels_for(device)
    g = torch.Generator().manual_seed(9)
    dense = [torch.randn(n, generator=g).to(dtype) for n in SIZES + [(1 << 20) + 5]]  # the fallback slices 2**20
    odd = [torch.randn(64, 48, generator=g).to(dtype).t(),
           torch.randn(2, 3, 5, 7, generator=g).to(dtype).to(memory_format=torch.channels_last),
           torch.randn(9, 10, generator=g).to(dtype)[:, 1::2],
           torch.randn(2 * 65536 + 9, generator=g).to(dtype)[3:]]   # misaligned start
    tensors = [t.to(device) for t in dense + odd] + [torch.randn(3, generator=g).to(dtype).to(device)] * 300
    base = torch.ops.ampinit.fingerprint(tensors)
    assert base.dtype == torch.int64 and base.device.type == device
    assert torch.equal(base, _fallback.fingerprint(tensors))
    assert torch.equal(base[len(dense)], _fallback.fingerprint([odd[0].t().contiguous().t()])[0])
    assert torch.equal(base[len(dense) + 1], _fallback.fingerprint([odd[1].permute(0, 2, 3, 1).contiguous()])[0])
    assert torch.equal(base[len(dense) + 2], _fallback.fingerprint([odd[2].contiguous()])[0])
    big = tensors[6]
    for index in (0, 3, 15, 32767, 32768, 65535, 65536, big.numel() - 1):
        changed = big.clone()
        changed[index] = changed[index] + 1
        assert torch.ops.ampinit.fingerprint([changed]) != base[6], index
    assert torch.ops.ampinit.fingerprint([-big]) != base[6]
    swapped = big.clone()
    swapped[[3, 4]] = big[[4, 3]]
    assert big[3] == big[4] or torch.ops.ampinit.fingerprint([swapped]) != base[6]


def test_update_scale_kernel_equals_fallback(device):
    _kernels_for(device)
    g = torch.Generator().manual_seed(9)
    states = []
    for impl in (torch.ops.ampinit.update_scale_, None):
        scale = torch.full((1,), 2.0 ** 15, device=device)
        tracker = torch.zeros(1, dtype=torch.int32, device=device)
        credits = torch.full((1,), 2, dtype=torch.int32, device=device)
        count = torch.zeros(1, dtype=torch.int64, device=device)
        found = torch.zeros(1, device=device)
        history = []
        for overflow in (torch.rand(300, generator=g) < 0.4).tolist():
            found.fill_(float(overflow))
            args = (scale, tracker, credits, count, found)
            if impl is None:
                _fallback.update_scale_(*args, growth_factor=3.0, backoff_factor=0.3, growth_interval=2,
                                        hysteresis=2, min_scale=0.7, max_scale=1e6)
            else:
                impl(*args, 3.0, 0.3, 2, 2, 0.7, 1e6)
            history.append((scale.item(), tracker.item(), credits.item(), count.item()))
        states.append(history)
        g = torch.Generator().manual_seed(9)
    assert states[0] == states[1]


@pytest.mark.parametrize("call, message", [
    (lambda d: torch.ops.ampinit.unscale_([torch.ones(3, device=d)], [], torch.ones(1, device=d),
                                          torch.zeros(1, device=d)), "same length"),
    (lambda d: torch.ops.ampinit.unscale_([torch.ones(3, device=d)], [torch.ones(4, device=d)],
                                          torch.ones(1, device=d), torch.zeros(1, device=d)), "different shapes"),
    (lambda d: torch.ops.ampinit.unscale_([torch.ones(3, device=d)], [torch.ones(3, device=d)],
                                          torch.ones(2, device=d), torch.zeros(1, device=d)), "1-element float32"),
    (lambda d: torch.ops.ampinit.unscale_([torch.ones(3, device=d, dtype=torch.float64)],
                                          [torch.ones(3, device=d)], torch.ones(1, device=d),
                                          torch.zeros(1, device=d)), "float32, float16 and bfloat16"),
    (lambda d: torch.ops.ampinit.check_finite_([torch.ones(3, device=d)], torch.zeros(1, device=d),
                                               torch.zeros(2, device=d)), "one element per input"),
    (lambda d: torch.ops.ampinit.fused_adam_([torch.ones(3, device=d, dtype=torch.float16)],
                                             [torch.ones(3, device=d)],
                                             [torch.zeros(3, device=d, dtype=torch.bfloat16)],
                                             [torch.zeros(3, device=d, dtype=torch.bfloat16)],
                                             [torch.zeros((), device=d)], [], [], [],
                                             1e-3, 0.9, 0.999, 1e-8, 0.0, False, True,
                                             torch.ones(1, device=d), torch.zeros(1, device=d)),
     "optimizer state 0 is BFloat16; the state of a Half param must be all of its dtype, all float32"),
    (lambda d: torch.ops.ampinit.fused_adam_([torch.ones(3, device=d, dtype=torch.float16)],
                                             [torch.ones(3, device=d)], [torch.zeros(3, device=d, dtype=torch.half)],
                                             [torch.zeros(3, device=d, dtype=torch.half)],
                                             [torch.zeros((), device=d)],
                                             [torch.zeros(3, device=d, dtype=torch.half)], [], [],
                                             1e-3, 0.9, 0.999, 1e-8, 0.0, False, True,
                                             torch.ones(1, device=d), torch.zeros(1, device=d)),
     "model copies are for float32"),
    (lambda d: torch.ops.ampinit.fused_adam_([torch.ones(3, device=d)], [torch.ones(3, device=d)],
                                             [torch.zeros(3, device=d)], [torch.zeros(3, device=d)],
                                             [torch.zeros((), device=d)], [], [], [], 1e-3, 0.9, 0.999, 1e-8, 0.0,
                                             False, True, torch.ones(1, device=d), torch.zeros(1, device=d),
                                             torch.zeros(5, device=d)), "hyper must be a contiguous float64"),
    (lambda d: torch.ops.ampinit.fused_sgd_([torch.ones(3, device=d)], [torch.ones(3, device=d)], [],
                                            [torch.zeros((), device=d)], [], [], [], 0.1, 0.9, 0.0, 0.0, False,
                                            torch.ones(1, device=d), torch.zeros(1, device=d), []),
     "momentum buffer"),
    (lambda d: torch.ops.ampinit.fused_sgd_([torch.ones(3, device=d)], [torch.ones(3, device=d)],
                                            [torch.zeros(3, device=d)], [torch.zeros((), device=d)], [], [], [], 0.1,
                                            0.9, 0.0, 0.0, False, torch.ones(1, device=d), torch.zeros(1, device=d),
                                            []),
     "new_buffer_flags must have the same length"),
    (lambda d: torch.ops.ampinit.adopt_changes_([torch.ones(3, device=d, dtype=torch.half)],
                                                [torch.ones(3, device=d, dtype=torch.half)]), "masters are float32"),
])
def test_bad_arguments_raise_clear_errors(call, message, device):
    _kernels_for(device)
    with pytest.raises(RuntimeError, match=message):
        call(device)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_tensor_over_2_31_elements():
    _kernels_for("cuda")
    if torch.cuda.get_device_properties(0).total_memory < 24 * 2 ** 30:
        pytest.skip("needs 24 GiB of GPU memory")
    n = 2 ** 31 + 7
    x = torch.ones(n, dtype=torch.float16, device="cuda")
    x[-1] = float("inf")
    found = torch.zeros(1, device="cuda")
    torch.ops.ampinit.check_finite_([x], found)
    assert found.item() == 1.0
    x[-1] = 2.0
    found.zero_()
    torch.ops.ampinit.unscale_([x], [x], torch.full((1,), 0.5, device="cuda"), found)
    assert found.item() == 0.0 and x[-1].item() == 1.0 and x[2 ** 31 + 1].item() == 0.5


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_ops_make_no_host_sync():
    _kernels_for("cuda")
    grads = _data(torch.float16, "cuda", 8, [1000, 70000])
    masters = [torch.empty(g.shape, device="cuda") for g in grads]
    found, inv = torch.zeros(1, device="cuda"), torch.full((1,), 0.5, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        torch.ops.ampinit.unscale_(grads, masters, inv, found)
        torch.ops.ampinit.check_finite_(grads, found)
        torch.ops.ampinit.copy_(grads, masters)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.skipif(os.environ.get("AMPINIT_RUN_SLOW", "0") == "0", reason="set AMPINIT_RUN_SLOW=1 (12 GiB)")
def test_cpu_tensor_over_2_31_elements():
    n = 2 ** 31 + 7
    x = torch.zeros(n, dtype=torch.float16)
    x[-1] = float("nan")
    found = torch.zeros(1)
    torch.ops.ampinit.check_finite_([x], found)
    assert found.item() == 1.0


# -- fused optimizers: kernels against the fallback --------------------------------------------

def _optimizer_rows(device, seed, param_dtypes, grad_dtypes, sizes=(1, 7, 33, 4097, 65536 + 5)):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i, n in enumerate(sizes):
        pd, gd = param_dtypes[i % len(param_dtypes)], grad_dtypes[i % len(grad_dtypes)]
        rows.append(dict(param=torch.randn(n, generator=g).to(pd).to(device),
                         grad=(torch.randn(n, generator=g) * 64).to(gd).to(device),
                         a=(torch.randn(n, generator=g) * 0.1).to(pd).to(device),
                         b=torch.rand(n, generator=g).to(pd).to(device)))
    return rows


def _clone_rows(rows):
    return [{k: v.clone() for k, v in row.items()} for row in rows]


def _assert_close_16bit(actual, expected):
    """float32 everywhere, so the two paths differ by FMA contraction and operation order only:
    one ulp of a 16-bit dtype, a few float32 ulps otherwise."""
    rtol = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7, torch.float32: 1e-5}[actual.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=1e-6)


@pytest.mark.parametrize("param_dtypes, grad_dtypes, with_model", [
    ([torch.float32], [torch.float16, torch.bfloat16, torch.float32], True),
    ([torch.float16, torch.bfloat16, torch.float32], [torch.float32, torch.float16], False),
    ([torch.bfloat16], [torch.bfloat16], False),
])
@pytest.mark.parametrize("capturable", [False, True])
@pytest.mark.parametrize("found", [0.0, 1.0])
def test_fused_adam_kernel_equals_fallback(param_dtypes, grad_dtypes, with_model, capturable, found, device):
    _kernels_for(device)
    hyper = dict(lr=3e-2, beta1=0.9, beta2=0.99, eps=1e-6, weight_decay=0.1)
    results = []
    for impl in ("kernel", "fallback"):
        rows = _clone_rows(_optimizer_rows(device, 11, param_dtypes, grad_dtypes))
        steps = [torch.full((), 3.0, device=device) for _ in rows]
        models = [torch.empty(r["param"].shape, dtype=torch.float16, device=device) for r in rows] if with_model else []
        vector = torch.tensor([hyper[k] for k in ("lr", "beta1", "beta2", "eps", "weight_decay")],
                              dtype=torch.float64, device=device) if capturable else None
        args = ([r["param"] for r in rows], [r["grad"] for r in rows], [r["a"] for r in rows],
                [r["b"] for r in rows], steps, models)
        flags = (torch.full((1,), 1 / 64.0, device=device), torch.full((1,), found, device=device))
        if impl == "kernel":
            torch.ops.ampinit.fused_adam_(*args, [], [], *(0.0 if capturable else v for v in hyper.values()), False,
                                          True, *flags, vector)
        else:
            _fallback.fused_adam_(*args, **hyper, decoupled_weight_decay=False, bias_correction=True,
                                  inv_scale=flags[0], found_inf=flags[1], hyper=vector)
        results.append((rows, steps, models))
    (rows_k, steps_k, models_k), (rows_f, steps_f, models_f) = results
    before = _optimizer_rows(device, 11, param_dtypes, grad_dtypes)
    for rk, rf, r0 in zip(rows_k, rows_f, before):
        for key in ("param", "a", "b"):
            assert rk[key].dtype == r0[key].dtype
            if found:
                assert torch.equal(rk[key], r0[key]) and torch.equal(rf[key], r0[key])
            else:
                _assert_close_16bit(rk[key], rf[key])
                assert not torch.equal(rk[key], r0[key])
    assert [float(s) for s in steps_k] == [float(s) for s in steps_f] == [3.0 + (not found)] * len(rows)
    for mk, rk in zip(models_k, rows_k):
        if not found:
            assert torch.equal(mk, rk["param"].half())


@pytest.mark.parametrize("param_dtypes", [[torch.float32], [torch.float16, torch.bfloat16, torch.float32]])
@pytest.mark.parametrize("nesterov, dampening", [(False, 0.3), (True, 0.0)])
@pytest.mark.parametrize("capturable", [False, True])
def test_fused_sgd_kernel_equals_fallback_and_new_buffer_rule(param_dtypes, nesterov, dampening, capturable,
                                                              device):
    """Rows 0 and 3 have new buffers (their contents are garbage and must not matter); the others
    are updated.  A skipped call leaves the new-buffer flags; an applied one clears them."""
    _kernels_for(device)
    hyper = dict(lr=0.05, momentum=0.9, dampening=dampening, weight_decay=1e-2)
    outs = []
    for impl in ("kernel", "fallback"):
        rows = _clone_rows(_optimizer_rows(device, 12, param_dtypes, [torch.float16, torch.float32]))
        flags = [torch.full((1,), float(i in (0, 3)), device=device) for i in range(len(rows))]
        for i in (0, 3):
            rows[i]["a"].fill_(float("nan"))
        steps = [torch.zeros((), device=device) for _ in rows]
        vector = torch.tensor(list(hyper.values()), dtype=torch.float64, device=device) if capturable else None
        for found in (1.0, 0.0):
            args = ([r["param"] for r in rows], [r["grad"] for r in rows], [r["a"] for r in rows], steps, [])
            scalars = (torch.full((1,), 1 / 64.0, device=device), torch.full((1,), found, device=device))
            if impl == "kernel":
                torch.ops.ampinit.fused_sgd_(*args, [], [], *hyper.values(), nesterov, *scalars, flags, vector)
            else:
                _fallback.fused_sgd_(*args, **hyper, nesterov=nesterov, inv_scale=scalars[0], found_inf=scalars[1],
                                     new_buffer_flags=flags, hyper=vector)
            if found:
                assert [f.item() for f in flags] == [float(i in (0, 3)) for i in range(len(rows))]
                assert all(s.item() == 0 for s in steps)
        assert all(f.item() == 0 for f in flags) and all(s.item() == 1 for s in steps)
        outs.append(rows)
    before = _optimizer_rows(device, 12, param_dtypes, [torch.float16, torch.float32])
    for i, (rk, rf, r0) in enumerate(zip(*outs, before)):
        for key in ("param", "a"):
            assert torch.isfinite(rk[key]).all()
            _assert_close_16bit(rk[key], rf[key])
        grad = r0["grad"].float() / 64 + 1e-2 * r0["param"].float()
        if i in (0, 3):  # torch's rule: the new buffer is the gradient
            _assert_close_16bit(rk["a"], grad.to(rk["a"].dtype))


def test_tensor_kinds_routes_in_one_pass():
    """The facade's one C pass over the tensors: what the kernels take, and where complex is."""
    kinds = _ext.EXTENSION.tensor_kinds
    dense = [torch.zeros(2), torch.zeros(2, dtype=torch.float16), torch.zeros(2, dtype=torch.bfloat16).t()]
    assert kinds(dense, (torch.zeros(3),)) == 1
    assert kinds([], []) == 1
    assert kinds(dense, [torch.zeros(2, dtype=torch.float64)]) == 0
    assert kinds(dense, [torch.zeros(2, dtype=torch.complex64)]) == 2
    assert kinds([torch.zeros(2).to_sparse()]) == 0
    with pytest.raises(TypeError, match="expected tensors"):
        kinds([torch.zeros(2), 3.0])
