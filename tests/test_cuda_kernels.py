"""The CUDA kernels on a GPU: what no CPU run can catch.

Views at odd offsets (input and output misaligned differently), many tensors of interleaved
dtypes over several launches with both kernel-parameter spaces (4 KiB and 32 KiB), CUDA-graph
capture and replay of every op (the model-write detection included), no host sync, flags on the
wrong device, and l2norm's range.
Each test compares against the torch fallback or a float64 reference computed independently.
Collected everywhere; skipped without a GPU or without the compiled CUDA kernels.
"""
import time

import pytest
import torch

from ampinit import _ext, _fallback, ops

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
    pytest.mark.skipif(_ext.EXTENSION is None or not getattr(_ext.EXTENSION, "with_cuda", False),
                       reason="needs the compiled CUDA kernels"),
]

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
N = 65536 * 2 + 7  # three chunks, the last one short: vectors, then a scalar tail


@pytest.fixture(params=[4096, 32764], ids=["params-4KiB", "params-32KiB"])
def param_space(request):
    """Runs the test with each kernel-parameter space the build, driver and GPU allow."""
    module = _ext.EXTENSION
    try:
        module._set_cuda_kernel_param_bytes(request.param)
    except ValueError as error:
        pytest.skip(str(error))
    yield request.param
    module._set_cuda_kernel_param_bytes(0)


def _random(n, dtype, seed, scale=100.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * scale).to(dtype).cuda()


def _view_at(values, offset):
    """A view of a copy of ``values`` starting ``offset`` elements into a larger buffer, so its
    address is not 16-byte aligned (offset % 4 != 0): what DDP bucket views look like."""
    base = torch.empty(values.numel() + offset + 5, dtype=values.dtype, device=values.device)
    view = base[offset:offset + values.numel()]
    view.copy_(values)
    return view


# -- misaligned views ---------------------------------------------------------------------------

OFFSETS = [(0, 0), (1, 3), (2, 0), (3, 1), (0, 2)]  # (input offset, output offset), in elements


@pytest.mark.parametrize("in_dtype, out_dtype", [(torch.float16, torch.float32), (torch.bfloat16, torch.float32),
                                                 (torch.float32, torch.float16), (torch.float32, torch.float32)])
@pytest.mark.parametrize("offsets", OFFSETS)
def test_misaligned_unscale_copy_accumulate_check(in_dtype, out_dtype, offsets, param_space):
    x = _random(N, in_dtype, 1)
    x[N - 2] = float("inf")  # in the scalar tail
    inputs = _view_at(x, offsets[0])
    inv = torch.full((1,), 1 / 256.0, device="cuda")

    out = _view_at(torch.zeros(N, dtype=out_dtype, device="cuda"), offsets[1])
    found, per = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    ops.unscale_([inputs], [out], inv, found, per)
    expected = (x.float() * inv).to(out_dtype)
    assert torch.equal(out.nan_to_num(), expected.nan_to_num()) and found.item() == 1.0 and per.item() == 1.0

    acc = _view_at(_random(N, out_dtype, 2, scale=1.0), offsets[1])
    start = acc.clone()
    found.zero_()
    ops.accumulate_unscaled_([inputs], [acc], inv, found, out_weight=0.5)
    reference = (start.float() * 0.5 + x.float() * inv)
    torch.testing.assert_close(acc.float().nan_to_num(), reference.to(out_dtype).float().nan_to_num(),
                               rtol={torch.float16: 1e-3, torch.float32: 1e-6}[out_dtype], atol=1e-6)
    assert found.item() == 1.0

    copied = _view_at(torch.zeros(N, dtype=out_dtype, device="cuda"), offsets[1])
    ops.copy_([copied], [inputs])
    assert torch.equal(copied.nan_to_num(), x.to(out_dtype).nan_to_num())

    found.zero_()
    x[N - 2] = 1.0
    clean = _view_at(x, offsets[0])
    ops.check_finite_([clean], found)
    assert found.item() == 0.0
    clean[0] = float("nan")  # in the scalar head
    ops.check_finite_([clean], found)
    assert found.item() == 1.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0, 1, 2, 3])
def test_misaligned_l2norm(dtype, offset, param_space):
    x = _random(N, dtype, 3)
    view = _view_at(x, offset)
    total, per = ops.l2norm([view, x[5:17]], per_tensor=True)
    reference = torch.stack([x.double().norm(), x[5:17].double().norm()])
    torch.testing.assert_close(per.double(), reference, rtol=1e-6, atol=0)
    torch.testing.assert_close(total.double(), reference.norm().reshape(1), rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offsets", OFFSETS)
def test_misaligned_fingerprint_and_adopt(dtype, offsets, param_space):
    """The model at one offset, its FP32 master at another: the fingerprint and the adopted
    masters equal the fallback's, and a single changed element changes the fingerprint."""
    masters_values = _random(N, torch.float32, 5)
    model = _view_at(masters_values.to(dtype), offsets[0])
    changed = torch.tensor([0, 1, 2, 3, 4, 5, 8191, 65535, 65536, N - 1], device="cuda")
    model[changed] = model[changed] * 2 + 1
    master = _view_at(masters_values, offsets[1])
    expected = master.clone()
    _fallback.adopt_changes_([expected], [model])
    ops.adopt_changes_([master], [model])
    assert torch.equal(master, expected)
    assert torch.equal(master[changed], model[changed].float())
    fingerprint = ops.fingerprint([model, model[1:], master])
    assert torch.equal(fingerprint, _fallback.fingerprint([model, model[1:], master]))
    assert ops.fingerprint([_view_at(model, offsets[1])])[0] == fingerprint[0]  # the address does not count
    for index in (0, 3, 65535, N - 1):
        edited = _view_at(model, offsets[1])
        edited[index] = 8.0 if edited[index].item() == 7.0 else 7.0
        assert ops.fingerprint([edited])[0] != fingerprint[0], index


@pytest.mark.parametrize("param_dtype, grad_dtype", [(torch.float32, torch.float16), (torch.float16, torch.float32),
                                                     (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("offsets", OFFSETS)
def test_misaligned_fused_optimizers(param_dtype, grad_dtype, offsets, param_space):
    """Param and state at one offset, gradient (and model copy) at another; compared with the
    torch fallback on aligned copies (float32 math both: one ulp of a 16-bit dtype apart)."""
    rtol = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7, torch.float32: 1e-5}[param_dtype]
    for kind in ("adam", "sgd"):
        values = [_random(N, param_dtype, 4, 1.0), _random(N, grad_dtype, 5, 1.0), _random(N, param_dtype, 6, 0.1),
                  _random(N, param_dtype, 7, 0.1).abs()]
        aligned = [v.clone() for v in values]
        views = [_view_at(values[0], offsets[0]), _view_at(values[1], offsets[1]),
                 _view_at(values[2], offsets[0]), _view_at(values[3], offsets[0])]
        with_model = param_dtype == torch.float32
        models = [_view_at(torch.zeros(N, dtype=torch.bfloat16, device="cuda"), offsets[1])] if with_model else []
        ref_models = [torch.zeros(N, dtype=torch.bfloat16, device="cuda")] if with_model else []
        flags = torch.full((1,), 0.5, device="cuda"), torch.zeros(1, device="cuda")
        steps, ref_steps = [torch.full((), 2.0, device="cuda")], [torch.full((), 2.0, device="cuda")]
        if kind == "adam":
            hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled_weight_decay=True,
                         bias_correction=True)
            ops.fused_adam_([views[0]], [views[1]], [views[2]], [views[3]], steps, models, **hyper,
                            inv_scale=flags[0], found_inf=flags[1])
            _fallback.fused_adam_([aligned[0]], [aligned[1]], [aligned[2]], [aligned[3]], ref_steps, ref_models,
                                  **hyper, inv_scale=flags[0], found_inf=flags[1])
            pairs = [(views[0], aligned[0]), (views[2], aligned[2]), (views[3], aligned[3])]
        else:
            hyper = dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01, nesterov=False)
            new = [torch.zeros(1, device="cuda")]
            ops.fused_sgd_([views[0]], [views[1]], [views[2]], steps, models, **hyper, inv_scale=flags[0],
                           found_inf=flags[1], new_buffer_flags=new)
            _fallback.fused_sgd_([aligned[0]], [aligned[1]], [aligned[2]], ref_steps, ref_models, **hyper,
                                 inv_scale=flags[0], found_inf=flags[1],
                                 new_buffer_flags=[torch.zeros(1, device="cuda")])
            pairs = [(views[0], aligned[0]), (views[2], aligned[2])]
        for got, want in pairs:
            torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=1e-6)
        if with_model:
            assert torch.equal(models[0], views[0].bfloat16())
        assert steps[0].item() == ref_steps[0].item() == 3.0


# -- many tensors, interleaved dtypes, several launches -------------------------------------------

def _interleaved(count, seed):
    g = torch.Generator().manual_seed(seed)
    sizes = [int(s) for s in torch.randint(1, 5000, (count,), generator=g)]
    sizes[7] = 65536 * 3 + 1  # straddles launches
    return [(torch.randn(n, generator=g) * 10).to(DTYPES[i % 3]).cuda() for i, n in enumerate(sizes)]


@pytest.mark.parametrize("offsets", [(0, 0, 0), (1, 3, 2), (3, 0, 1), (2, 2, 3)])
def test_misaligned_split_and_join_of_remainder_masters(offsets, param_space):
    """ops.split_masters_ then join_masters with the weight, the remainders and the masters each
    at its own offset (vector path for some, scalar for others), planted ties of both kinds:
    bit for bit the fallback's, every master back exactly."""
    weight_at, remainder_at, master_at = offsets
    g = torch.Generator().manual_seed(7)
    bits = (torch.randn(N, generator=g) * 100).view(torch.int32).clone()
    bits[::5] = ((bits[::5] >> 16) | 2) << 16 | 0x8000  # ties: half lower, half upper
    bits[1::10] = (((bits[1::10] >> 16) & ~1) | 2) << 16 | 0x8000
    values = _view_at(bits.view(torch.float32).cuda(), master_at)
    weight = _view_at(torch.zeros(N, dtype=torch.bfloat16, device="cuda"), weight_at)
    remainder = _view_at(torch.zeros(N, dtype=torch.int16, device="cuda"), remainder_at)
    ties = torch.zeros((N + 31) // 32, dtype=torch.int32, device="cuda")
    ops.split_masters_([weight], [remainder], [ties], [values])
    ref_weight = torch.zeros(N, dtype=torch.bfloat16, device="cuda")
    ref_remainder, ref_ties = ops.new_remainders(ref_weight)
    _fallback.split_master_(ref_weight, ref_remainder, ref_ties, values)
    assert torch.equal(weight.view(torch.int16), ref_weight.view(torch.int16))
    assert torch.equal(remainder, ref_remainder)
    assert int((remainder == -32768).sum()) > 1000
    joined = ops.join_masters([weight], [remainder], [ties])[0]
    assert torch.equal(joined.view(torch.int32), values.view(torch.int32))
    assert torch.equal(joined.view(torch.int32), _fallback.join_master(weight, remainder, ties).view(torch.int32))


@pytest.mark.parametrize("count", [700, 2500])
def test_interleaved_dtypes_many_launches(count, param_space):
    """More tensors than one launch holds in either space, three dtypes interleaved (one
    launch sequence per dtype group): per-tensor flags and norms land at the right index."""
    inputs = _interleaved(count, 8)
    bad = {3, 7, count // 2, count - 1}
    for i in bad:
        inputs[i][-1] = float("nan") if i % 2 else float("inf")
    outputs = [torch.empty(x.shape, device="cuda") for x in inputs]
    found, per = torch.zeros(1, device="cuda"), torch.zeros(count, device="cuda")
    inv = torch.full((1,), 0.5, device="cuda")
    ops.unscale_(inputs, outputs, inv, found, per)
    assert found.item() == 1.0 and set(per.nonzero().flatten().tolist()) == bad
    for x, y in zip(inputs, outputs):
        assert torch.equal((x.float() * 0.5).nan_to_num(), y.nan_to_num())
    per.zero_()
    ops.check_finite_(inputs, found, per)
    assert set(per.nonzero().flatten().tolist()) == bad
    assert torch.equal(ops.fingerprint(inputs), _fallback.fingerprint(inputs))
    clean = [x for i, x in enumerate(inputs) if i not in bad]
    total, norms = ops.l2norm(clean, per_tensor=True)
    reference = torch.stack([x.double().norm() for x in clean])
    torch.testing.assert_close(norms.double(), reference, rtol=1e-6, atol=0)
    torch.testing.assert_close(total.double(), reference.norm().reshape(1), rtol=1e-6, atol=0)


def test_interleaved_dtypes_fused_adam(param_space):
    params = _interleaved(600, 9)
    grads = [(torch.randn(p.shape, device="cuda") * 64).to(DTYPES[(i + 1) % 3]) for i, p in enumerate(params)]
    state = [[torch.zeros_like(p) for p in params] for _ in range(2)]
    steps = [torch.zeros((), device="cuda") for _ in params]
    ref_params = [p.clone() for p in params]
    ref_state = [[torch.zeros_like(p) for p in params] for _ in range(2)]
    ref_steps = [torch.zeros((), device="cuda") for _ in params]
    flags = torch.full((1,), 1 / 64.0, device="cuda"), torch.zeros(1, device="cuda")
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled_weight_decay=True,
                 bias_correction=True)
    for _ in range(2):
        ops.fused_adam_(params, grads, *state, steps, [], **hyper, inv_scale=flags[0], found_inf=flags[1])
        _fallback.fused_adam_(ref_params, grads, *ref_state, ref_steps, [], **hyper, inv_scale=flags[0],
                              found_inf=flags[1])
    for p, r in zip(params, ref_params):
        rtol = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7, torch.float32: 1e-5}[p.dtype]
        torch.testing.assert_close(p.float(), r.float(), rtol=rtol, atol=1e-6)
    assert all(s.item() == 2.0 for s in steps)


# -- CUDA graphs ------------------------------------------------------------------------------------

def _capture(fn):
    """Warm ``fn`` up on a side stream, then capture one call of it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result


def test_graph_replay_of_the_elementwise_ops():
    """Every elementwise op captured once, replayed on new data and a new scale: the results
    are the eager ones (the scale and the flags are read from device memory at replay)."""
    grads = [_random(n, dtype, 10 + i) for i, (n, dtype) in enumerate([(N, torch.float16), (33, torch.bfloat16),
                                                                        (4097, torch.float32)])]
    masters = [torch.zeros(g.shape, device="cuda") for g in grads]
    accum = [torch.ones(g.shape, device="cuda") for g in grads]
    models = [torch.zeros(g.shape, dtype=torch.float16, device="cuda") for g in grads]
    inv, found = torch.full((1,), 0.5, device="cuda"), torch.zeros(1, device="cuda")
    per = torch.zeros(len(grads), device="cuda")

    def step():
        ops.unscale_(grads, masters, inv, found, per)
        ops.check_finite_(grads, found, per)
        ops.accumulate_unscaled_(grads, accum, inv, found, out_weight=0.5)
        ops.copy_(models, masters)
        return ops.l2norm(masters, per_tensor=True)

    graph, (total, norms) = _capture(step)
    for trial in range(3):
        new = [_random(g.numel(), g.dtype, 100 + trial * 10 + i) for i, g in enumerate(grads)]
        if trial == 1:
            new[1][5] = float("inf")
        for g, v in zip(grads, new):
            g.copy_(v)
        inv.fill_(2.0 ** -(trial + 1))
        found.zero_()
        per.zero_()
        for a in accum:
            a.fill_(1.0)
        graph.replay()
        torch.cuda.synchronize()
        scale = 2.0 ** -(trial + 1)
        for g, m, a, model in zip(new, masters, accum, models):
            assert torch.equal(m.nan_to_num(), (g.float() * scale).nan_to_num())
            torch.testing.assert_close(a.nan_to_num(), (0.5 + g.float() * scale).nan_to_num(), rtol=1e-6, atol=1e-6)
            assert torch.equal(model.nan_to_num(), m.half().nan_to_num())
        assert found.item() == float(trial == 1) and per.tolist() == [0.0, float(trial == 1), 0.0]
        if trial != 1:
            reference = torch.stack([(g.double() * scale).norm() for g in new])
            torch.testing.assert_close(norms.double(), reference, rtol=1e-6, atol=0)
            torch.testing.assert_close(total.double(), reference.norm().reshape(1), rtol=1e-6, atol=0)


def test_graph_replay_of_fingerprint_and_adopt():
    """The model-write detection captured once (fingerprint, compare with the last marks, adopt
    the flagged tensors), replayed after writes to different tensors: the eager fallback's result."""
    values = [_random(n, torch.float32, 50 + i) for i, n in enumerate((N, 33, 4097))]
    masters = [v.clone() for v in values]
    models = [v.to(dtype) for v, dtype in zip(values, DTYPES)]
    marks = ops.fingerprint(models).clone()

    def detect():
        now = ops.fingerprint(models)
        ops.adopt_changes_(masters, models, only=now.ne(marks).float())
        return now

    graph, now = _capture(detect)
    for trial, written in enumerate([[], [1], [0, 2]]):
        for m, v in zip(masters, values):
            m.copy_(v)
        for i, model in enumerate(models):
            model.copy_(values[i])
            if i in written:
                model[trial::7] = -model[trial::7] - 1
        expected_marks = _fallback.fingerprint(models)
        expected = [v.clone() for v in values]
        _fallback.adopt_changes_(expected, models, only=expected_marks.ne(marks).float())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(now, expected_marks)
        assert now.ne(marks).nonzero().flatten().tolist() == written
        assert all(torch.equal(m, e) for m, e in zip(masters, expected))


def test_graph_replay_of_split_and_join():
    """split_masters_ then join_masters captured once, replayed on new masters: the eager
    fallback's weights and every master back bit for bit; no host sync on the way."""
    sizes = (N, 33, 4097)
    masters = [_random(n, torch.float32, 60 + i) for i, n in enumerate(sizes)]
    weights = [torch.zeros(n, dtype=torch.bfloat16, device="cuda") for n in sizes]
    rests = [ops.new_remainders(w) for w in weights]
    remainders, ties = [r for r, _ in rests], [t for _, t in rests]

    def split_join():
        ops.split_masters_(weights, remainders, ties, masters)
        return ops.join_masters(weights, remainders, ties)

    graph, joined = _capture(split_join)
    for trial in range(2):
        for i, m in enumerate(masters):
            m.copy_(_random(m.numel(), torch.float32, 70 + 10 * trial + i))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            graph.replay()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        for m, w, j in zip(masters, weights, joined):
            assert torch.equal(w.view(torch.int16), m.to(torch.bfloat16).view(torch.int16))
            assert torch.equal(j.view(torch.int32), m.view(torch.int32))


def test_graph_replay_of_update_scale():
    scale = torch.full((1,), 1024.0, device="cuda")
    tracker = torch.zeros(1, dtype=torch.int32, device="cuda")
    credits = torch.ones(1, dtype=torch.int32, device="cuda")
    count = torch.zeros(1, dtype=torch.int64, device="cuda")
    found = torch.zeros(1, device="cuda")
    graph, _ = _capture(lambda: ops.update_scale_(scale, tracker, credits, count, found, growth_factor=2.0,
                                                  backoff_factor=0.5, growth_interval=2, hysteresis=1,
                                                  min_scale=1.0, max_scale=2.0 ** 20))
    scale.fill_(1024.0)
    tracker.zero_()
    count.zero_()
    history = []
    for overflow in (0, 0, 1, 0, 1):
        found.fill_(float(overflow))
        graph.replay()
        history.append((scale.item(), count.item()))
    assert history == [(1024.0, 0), (2048.0, 0), (1024.0, 1), (1024.0, 1), (512.0, 2)]


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_graph_replay_of_the_capturable_optimizers_follows_lr_changes(kind):
    """A captured fused step (capturable=True: hyper-parameters read from device tensors)
    replayed with new gradients, an LR changed in place by a scheduler and a skipped step,
    against the same optimizer stepping eagerly."""
    from ampinit.optim import FusedAdam, FusedSGD

    def make(params):
        if kind == "adam":
            return FusedAdam(params, lr=1e-2, weight_decay=0.1, capturable=True)
        return FusedSGD(params, lr=0.1, momentum=0.9, dampening=0.1, capturable=True)

    values = [_random(n, torch.float32, 20 + i, 1.0) for i, n in enumerate((N, 7, 4097))]
    captured = [torch.nn.Parameter(v.clone()) for v in values]
    eager = [torch.nn.Parameter(v.clone()) for v in values]
    opt_c, opt_e = make(captured), make(eager)
    sched_c = torch.optim.lr_scheduler.StepLR(opt_c, step_size=1, gamma=0.7)
    sched_e = torch.optim.lr_scheduler.StepLR(opt_e, step_size=1, gamma=0.7)
    found = torch.zeros(1, device="cuda")
    inv = torch.ones(1, device="cuda")
    grads = [torch.zeros_like(v) for v in values]
    scaled_c = dict(zip(captured, grads))

    def step():
        opt_c._amp_update(found, inv, scaled_c)

    graph, _ = _capture(step)  # the warm-up is one (eager) step of opt_c
    opt_e._amp_update(found, inv, dict(zip(eager, [g.clone() for g in grads])))
    for trial in range(4):
        new = [_random(v.numel(), torch.float32, 200 + trial * 7 + i, 1.0) for i, v in enumerate(values)]
        for g, n in zip(grads, new):
            g.copy_(n)
        found.fill_(float(trial == 2))
        graph.replay()
        opt_e._amp_update(found.clone(), inv, dict(zip(eager, [n.clone() for n in new])))
        sched_c.step()
        sched_e.step()
    torch.cuda.synchronize()
    for a, b in zip(captured, eager):
        assert torch.equal(a, b)


# -- no host sync, and no host-to-device copy ----------------------------------------------------

def test_l2norm_does_not_wait_for_the_gpu():
    """l2norm must not copy from pageable host memory (that waits for the stream): queued
    behind a sleep kernel of a quarter second, it returns on the host at once."""
    grads = [_random(n, torch.float16, 30 + i) for i, n in enumerate((N, 100, 7))] * 50
    ops.l2norm(grads, per_tensor=True)  # warm-up
    torch.cuda.synchronize()
    torch.cuda._sleep(500_000_000)  # ~0.25-0.3 s at H100/H200 clocks
    start = time.perf_counter()
    total, _ = ops.l2norm(grads, per_tensor=True)
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    assert elapsed < 0.05, f"l2norm blocked the host for {elapsed * 1e3:.1f} ms"
    assert torch.isfinite(total).all()


def test_ops_make_no_host_sync():
    grads = [_random(n, torch.float16, 40 + i) for i, n in enumerate((N, 1000))]
    masters = [torch.empty(g.shape, device="cuda") for g in grads]
    params = [torch.randn(g.shape, device="cuda") for g in grads]
    state = [[torch.zeros_like(p) for p in params] for _ in range(2)]
    steps = [torch.zeros((), device="cuda") for _ in params]
    found, inv = torch.zeros(1, device="cuda"), torch.full((1,), 0.5, device="cuda")
    hyper = torch.tensor([1e-3, 0.9, 0.999, 1e-8, 0.0], dtype=torch.float64, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.unscale_(grads, masters, inv, found)
        ops.accumulate_unscaled_(grads, masters, inv, found)
        ops.check_finite_(grads, found)
        ops.copy_(grads, masters)
        ops.l2norm(grads, per_tensor=True)
        ops.fingerprint(grads)
        ops.adopt_changes_(masters, grads, only=torch.ones(len(grads), device="cuda"))
        ops.fused_adam_(params, grads, *state, steps, [], lr=0.0, beta1=0.0, beta2=0.0, eps=0.0, weight_decay=0.0,
                        decoupled_weight_decay=True, bias_correction=True, inv_scale=inv, found_inf=found,
                        hyper=hyper)
        ops.fused_sgd_(params, grads, state[0], steps, [], lr=1e-3, momentum=0.9, dampening=0.0, weight_decay=0.0,
                       nesterov=False, inv_scale=inv, found_inf=found,
                       new_buffer_flags=[torch.zeros(1, device="cuda") for _ in params])
    finally:
        torch.cuda.set_sync_debug_mode(0)


# -- bad input -----------------------------------------------------------------------------------

def test_flags_on_the_cpu_with_cuda_tensors_say_what_to_do():
    grads = [torch.ones(3, device="cuda")]
    with pytest.raises(ValueError, match="must be on the tensors' device"):
        ops.unscale_(grads, grads, torch.ones(1), torch.zeros(1))
    with pytest.raises(RuntimeError, match="found_inf must be a 1-element float32 tensor on cuda"):
        torch.ops.ampinit.unscale_(grads, grads, torch.ones(1, device="cuda"), torch.zeros(1))
    with pytest.raises(RuntimeError, match="inv_scale must be a 1-element float32 tensor on cuda"):
        torch.ops.ampinit.unscale_(grads, grads, torch.ones(1), torch.zeros(1, device="cuda"))
    with pytest.raises(RuntimeError, match="keep inv_scale, found_inf and step counters on the device"):
        torch.ops.ampinit.check_finite_(grads, torch.zeros(1), None)


def test_failed_copy_leaves_steps_alone():
    """A row that needs a contiguous copy that cannot be made (1 TiB: out of memory) raises
    before anything is launched: the step counters are not advanced."""
    n = 2 ** 38
    huge = [torch.zeros(1, device="cuda").expand(n) for _ in range(4)]  # stride 0: copied to be dense
    steps = [torch.zeros((), device="cuda")]
    with pytest.raises(RuntimeError):
        torch.ops.ampinit.fused_adam_([huge[0]], [huge[1]], [huge[2]], [huge[3]], steps, [], [], [], 1e-3, 0.9,
                                      0.999, 1e-8, 0.0, True, True, torch.ones(1, device="cuda"),
                                      torch.zeros(1, device="cuda"), None)
    torch.cuda.synchronize()
    assert steps[0].item() == 0.0
