"""ampinit.optim's fused optimizers: against torch.optim on their own, and under initialize."""
import copy

import pytest
import torch

import ampinit as amp
from ampinit.optim import FusedAdam, FusedAdamW, FusedSGD
from conftest import SmallNet, batch

CASES = {
    "adam": (lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1),
             lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.1, adam_w_mode=False)),
    "adam-no-decay": (lambda p: torch.optim.Adam(p, lr=3e-3, betas=(0.8, 0.99), eps=1e-6),
                      lambda p: FusedAdam(p, lr=3e-3, betas=(0.8, 0.99), eps=1e-6)),
    "adamw": (lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
              lambda p: FusedAdamW(p, lr=1e-2, weight_decay=0.1)),
    "apex-default-is-adamw": (lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.05),
                              lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.05)),
    "sgd": (lambda p: torch.optim.SGD(p, lr=0.05), lambda p: FusedSGD(p, lr=0.05)),
    "sgd-momentum-decay": (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-2),
                           lambda p: FusedSGD(p, lr=0.05, momentum=0.9, weight_decay=1e-2)),
    "sgd-dampening": (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.8, dampening=0.3),
                      lambda p: FusedSGD(p, lr=0.05, momentum=0.8, dampening=0.3)),
    "sgd-nesterov": (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
                     lambda p: FusedSGD(p, lr=0.05, momentum=0.9, nesterov=True)),
}


def _params(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g).to(device) for n in (1, 7, 4097, 555 * 555)] + \
        [torch.randn(30, 20, generator=g).to(device).t()]  # non-contiguous


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_torch_optim_over_many_steps(case, device):
    make_ref, make_fused = CASES[case]
    ref = [p.clone().requires_grad_() for p in _params(device)]
    fused = [p.clone().requires_grad_() for p in _params(device)]
    ref_opt, fused_opt = make_ref(ref), make_fused(fused)
    g = torch.Generator().manual_seed(1)
    for step in range(60):
        for a, b in zip(ref, fused):
            grad = torch.randn(a.shape, generator=g).to(device)
            if step == 30 and a.numel() == 7:
                continue  # a param without a gradient this step is left alone, step count included
            a.grad, b.grad = grad.clone(), grad.clone()
        ref_opt.step()
        fused_opt.step()
        for p in ref + fused:
            p.grad = None
    for a, b in zip(ref, fused):
        torch.testing.assert_close(b, a, rtol=2e-6, atol=2e-6)
    for a, b in zip(ref, fused):
        for key, value in ref_opt.state[a].items():
            if key != "step":
                torch.testing.assert_close(fused_opt.state[b][key], value, rtol=2e-6, atol=2e-6)
    assert [float(fused_opt.state[b]["step"]) for b in fused] == [60, 59, 60, 60, 60]


@pytest.mark.parametrize("make", [lambda p: FusedAdam(p, lr=0.1, weight_decay=0.1),
                                  lambda p: FusedSGD(p, lr=0.1, momentum=0.9)])
def test_found_inf_skips_inside_and_model_copy_is_written(make, device):
    from ampinit import ops
    params = _params(device)[:3]
    opt = make(params)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()  # state exists
    before = [p.clone() for p in params]
    state_before = {k: v.clone() for k, v in opt.state[params[2]].items()}
    models = [torch.empty(p.shape, dtype=torch.float16, device=device) for p in params]
    grads = [torch.full(p.shape, 512.0, dtype=torch.float16, device=device) for p in params]
    found, inv = torch.ones(1, device=device), torch.full((1,), 1 / 512.0, device=device)
    opt._amp_update(found, inv, dict(zip(params, grads)), dict(zip(params, models)))
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert all(torch.equal(v, state_before[k]) for k, v in opt.state[params[2]].items())
    found.zero_()
    opt._amp_update(found, inv, dict(zip(params, grads)), dict(zip(params, models)))
    assert not any(torch.equal(p, b) for p, b in zip(params, before))
    assert all(torch.equal(m, p.half()) for m, p in zip(models, params))
    assert float(opt.state[params[2]]["step"]) == 2
    assert ops.backend(torch.device(device))[0] in ("cpu", "cuda", "torch")


def test_bad_input():
    with pytest.raises(ValueError, match="AMSGrad"):
        FusedAdam([torch.zeros(2, requires_grad=True)], amsgrad=True)
    with pytest.raises(ValueError, match="betas"):
        FusedAdam([torch.zeros(2, requires_grad=True)], betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="Nesterov"):
        FusedSGD([torch.zeros(2, requires_grad=True)], lr=0.1, nesterov=True)
    double = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    opt = FusedAdam([double])
    double.grad = torch.ones_like(double)
    with pytest.raises(TypeError, match="float32, float16 and bfloat16 params"):
        opt.step()
    assert torch.equal(double, torch.zeros(2, dtype=torch.float64)) and not opt.state[double]


def _train(opt_level, make_opt, steps, device="cpu", poison_at=(), accumulate=False):
    torch.manual_seed(0)
    model = SmallNet().to(device)
    opt = make_opt(model.parameters())
    model, opt = amp.initialize(model, opt, opt_level=opt_level, verbosity=0, loss_scale="dynamic",
                                min_loss_scale=1.0)
    losses = []
    for step in range(steps):
        x, y = batch(step, device)
        opt.zero_grad()
        parts = [(x[:16], y[:16]), (x[16:], y[16:])] if accumulate else [(x, y)]
        for xs, ys in parts:
            loss = ((model(xs).float() - ys) ** 2).mean() / len(parts)
            if step in poison_at:
                loss = loss * float("inf")
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
        opt.step()
        losses.append(loss.item())
    return model, opt, losses


@pytest.mark.parametrize("opt_level", ["O2", "O5"])
@pytest.mark.parametrize("fused, plain", [
    (lambda p: FusedAdam(p, lr=1e-2, eps=1e-4, adam_w_mode=False), lambda p: torch.optim.Adam(p, lr=1e-2, eps=1e-4)),
    (lambda p: FusedSGD(p, lr=0.05, momentum=0.9), lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)),
])
@pytest.mark.parametrize("accumulate", [False, True])
def test_under_initialize_matches_the_plain_optimizer(opt_level, fused, plain, accumulate, device):
    """Same model, same data, an overflow at step 3: the fused optimizer reading fp16/bf16
    gradients ends where torch's optimizer on ampinit's unscaled masters ends."""
    m1, o1, l1 = _train(opt_level, fused, 12, device, poison_at=(3,), accumulate=accumulate)
    m2, o2, l2 = _train(opt_level, plain, 12, device, poison_at=(3,), accumulate=accumulate)
    assert o1.amp.skipped_steps == o2.amp.skipped_steps == 1
    assert o1.amp.last_overflow_step == 3
    # The FP32 masters agree closely: both optimizers compute in float32, in a different order.
    for a, b in zip(amp.master_params(o1), amp.master_params(o2)):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # The 16-bit model copies are those masters rounded: one flip of a rounding decision moves
    # a value by a whole ulp of its dtype, so allow one (not a relative 1e-4).
    for (name, a), b in zip(m1.named_parameters(), m2.parameters()):
        ulp = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}.get(a.dtype, 1e-4)
        torch.testing.assert_close(a.float(), b.float(), rtol=ulp, atol=1e-5, msg=name)
    for (name, a), b in zip(m1.named_buffers(), m2.buffers()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
    masters = {id(m) for g in o1.param_groups for m in g["params"]}
    for param in m1.parameters():  # the model holds its master's rounding, written by the kernel
        master = o1.amp._master_of(param)
        if param.dtype != torch.float32:
            assert id(master) in masters and torch.equal(param, master.to(param.dtype))


def test_overflow_names_and_persistent_nan_raise_without_per_step_sync():
    model, opt, _ = _train("O2", lambda p: FusedAdam(p, lr=1e-3), 3)
    opt.amp.max_skips_at_floor = 3
    x, y = batch(0)
    with pytest.raises(RuntimeError, match="Non-finite gradients in: fc1.weight"):
        for _ in range(40):
            opt.zero_grad()
            with amp.scale_loss(((model(x).float() - y) ** 2).mean(), opt) as scaled:
                scaled.backward()
                model.fc1.weight.grad[0, 0] = float("nan")
            opt.step()
    assert opt.amp.last_overflow_params == ["fc1.weight"]


@pytest.mark.skipif(amp.ops.backend(torch.device("cpu"))[0] == "torch",
                    reason="the torch fallback of the fused optimizers reads found_inf on the host")
def test_o2_step_with_fused_optimizer_makes_no_host_read(monkeypatch):
    """No .item()/bool()/float() on a tensor anywhere in scale_loss + step (on CUDA that is
    no sync; the flags reach the host by a non-blocking copy, read a step later)."""
    model, opt, _ = _train("O2", lambda p: FusedAdam(p, lr=1e-3), 2)
    assert opt.amp.skipped_steps == 0  # settles the earlier steps' flags
    calls = []
    for name in ("item", "__bool__", "__float__", "__int__", "tolist"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, *a, _real=real, _name=name: calls.append(_name) or _real(self, *a))
    x, y = batch(0)
    opt.zero_grad()
    with amp.scale_loss(((model(x).float() - y) ** 2).mean(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert calls == []
    assert opt.amp.skipped_steps == 0  # settling the counters reads the flags: here, and only here
    assert calls == ["tolist"]


@pytest.mark.parametrize("set_to_none", [True, False])
def test_o2_fused_step_takes_the_scaled_gradients_without_fp32_buffers(set_to_none):
    """A fused O2 step unscales the model's gradients inside its kernel: between the backward and
    the step no FP32 master gradient exists, whichever zero_grad the loop uses.  zero_grad(
    set_to_none=False) after a fused step once gave every master a zero buffer, which took the
    slower path (one more FP32 pass, 4 bytes per parameter): 25.0 against 17.7 ms a step."""
    model, opt, _ = _train("O2", lambda p: FusedAdamW(p, lr=1e-3, weight_decay=0.1), 2)
    model_params = {id(p) for p in model.parameters()}  # BatchNorm's stay FP32: no master of their own
    masters = [p for group in opt.param_groups for p in group["params"] if id(p) not in model_params]
    assert masters
    x, y = batch(0)
    for _ in range(2):
        opt.zero_grad(set_to_none=set_to_none)
        with amp.scale_loss(((model(x).float() - y) ** 2).mean(), opt) as scaled:
            scaled.backward()
        assert [m.grad for m in masters] == [None] * len(masters)
        assert all(p.grad is not None for p in model.parameters())
        opt.step()


def test_checkpoint_round_trip_with_fused_optimizer(tmp_path):
    model, opt, _ = _train("O2", lambda p: FusedAdam(p, lr=1e-2), 5, poison_at=(2,))
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "amp": amp.state_dict()}, tmp_path / "c.pt")
    torch.manual_seed(0)
    fresh = SmallNet()
    fresh_opt = FusedAdam(fresh.parameters(), lr=1e-2)
    fresh, fresh_opt = amp.initialize(fresh, fresh_opt, opt_level="O2", verbosity=0)
    saved = torch.load(tmp_path / "c.pt")
    fresh.load_state_dict(saved["model"])
    fresh_opt.load_state_dict(saved["opt"])
    amp.load_state_dict(saved["amp"])
    for a, b in zip(opt.param_groups[0]["params"], fresh_opt.param_groups[0]["params"]):
        assert torch.equal(a, b)
        assert float(opt.state[a]["step"]) == float(fresh_opt.state[b]["step"]) == 4  # one step skipped
    assert fresh_opt.amp.skipped_steps == 1


# -- 16-bit params, updated directly ---------------------------------------------------------------

LOW = [torch.float16, torch.bfloat16]
ULP = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}  # relative spacing at the top of a binade


def _low_params(dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g).to(dtype).to(device) for n in (1, 7, 33, 4097, 70001)] + \
        [torch.randn(30, 20, generator=g).to(dtype).to(device).t()]  # non-contiguous


def _assert_within_one_ulp(actual, expected, min_exact=0.99, what=""):
    """16-bit results computed in float32 with another order of operations (or FMA contraction)
    than the reference: they may land one ulp of the dtype apart (the atol covers values near 0
    from cancellations, g + w * wd, where one ulp of the operands is far larger), and almost
    all must be bitwise equal: a kernel that rounded intermediates to 16 bits would not be."""
    torch.testing.assert_close(actual.float(), expected.float(), rtol=ULP[actual.dtype], atol=1e-6, msg=what)
    exact = (actual == expected).float().mean().item() if actual.numel() else 1.0
    assert exact >= min_exact, f"{what}: only {exact:.4%} bitwise equal"


ADAM_LOW = {
    "adam": (lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1, fused=True),
             lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.1, adam_w_mode=False)),
    "adamw": (lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
              lambda p: FusedAdamW(p, lr=1e-2, weight_decay=0.1)),
    "adam-no-decay": (lambda p: torch.optim.Adam(p, lr=3e-3, betas=(0.8, 0.99), eps=1e-6, fused=True),
                      lambda p: FusedAdam(p, lr=3e-3, betas=(0.8, 0.99), eps=1e-6)),
    "adamw-beta1-over-half": (lambda p: torch.optim.AdamW(p, lr=1e-2, betas=(0.3, 0.9), fused=True),
                              lambda p: FusedAdam(p, lr=1e-2, betas=(0.3, 0.9), weight_decay=1e-2)),
}


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("case", sorted(ADAM_LOW))
def test_low_precision_adam_matches_torch_fused(case, dtype, device):
    """torch.optim.Adam/AdamW(fused=True) on the same 16-bit params is the reference: state in
    the param's dtype, float32 arithmetic, one rounding per stored value.  Each step starts both
    from the reference's params and state, so every step is compared on its own."""
    make_ref, make_fused = ADAM_LOW[case]
    ref = [p.clone().requires_grad_() for p in _low_params(dtype, device)]
    fused = [p.clone().requires_grad_() for p in _low_params(dtype, device)]
    ref_opt, fused_opt = make_ref(ref), make_fused(fused)
    g = torch.Generator().manual_seed(1)
    for step in range(8):
        for a, b in zip(ref, fused):
            # The gradient in its param's layout: torch 2.13's CPU fused Adam pairs a
            # non-contiguous param with a differently laid out gradient by memory order.
            a.grad = torch.empty_like(a).copy_(torch.randn(a.shape, generator=g) * 3)
            b.grad = a.grad.clone(memory_format=torch.preserve_format)
        ref_opt.step()
        fused_opt.step()
        for index, (a, b) in enumerate(zip(ref, fused)):
            _assert_within_one_ulp(b.detach(), a.detach(), what=f"param {index} at step {step}")
            for key in ("exp_avg", "exp_avg_sq"):
                value = fused_opt.state[b][key]
                assert value.dtype == dtype
                _assert_within_one_ulp(value, ref_opt.state[a][key], what=f"{key} {index} at step {step}")
            assert float(fused_opt.state[b]["step"]) == step + 1
            with torch.no_grad():  # the next step starts from the reference's values
                b.copy_(a)
                for key in ("exp_avg", "exp_avg_sq"):
                    fused_opt.state[b][key].copy_(ref_opt.state[a][key])


def _sgd_reference_step(params, grads, buffers, *, lr, momentum, dampening, weight_decay, nesterov):
    """torch.optim.SGD (single-tensor) on float32 copies of 16-bit params and buffers, each
    result rounded once into the 16-bit tensors: float32 arithmetic, state in the param's dtype."""
    ups = [torch.nn.Parameter(p.detach().float()) for p in params]
    opt = torch.optim.SGD(ups, lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                          nesterov=nesterov, foreach=False)
    for up, grad, buffer in zip(ups, grads, buffers):
        up.grad = grad.float()
        if buffer is not None:
            opt.state[up]["momentum_buffer"] = buffer.float()
    opt.step()
    new_buffers = []
    with torch.no_grad():
        for p, up in zip(params, ups):
            p.copy_(up)
            buffer = opt.state[up].get("momentum_buffer")
            new_buffers.append(None if buffer is None else buffer.to(p.dtype))
    return new_buffers


SGD_LOW = {
    "plain": dict(lr=0.1, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False),
    "momentum-decay": dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.1, nesterov=False),
    "dampening": dict(lr=0.05, momentum=0.8, dampening=0.3, weight_decay=0.0, nesterov=False),
    "nesterov": dict(lr=0.05, momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=True),
}


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("case", sorted(SGD_LOW))
def test_low_precision_sgd_matches_float32_math_rounded_once(case, dtype, device):
    """The reference is torch.optim.SGD in float32 on the upcast 16-bit state, rounded once per
    step (what SGD(fused=True) specifies).  torch 2.13's CPU SGD(fused=True) itself is no
    reference for 16-bit params: its vectorized loop leaves them unchanged."""
    hyper = SGD_LOW[case]
    ref = _low_params(dtype, device)
    fused = [p.clone().requires_grad_() for p in ref]
    opt = FusedSGD(fused, **hyper)
    buffers = [None] * len(ref)
    g = torch.Generator().manual_seed(2)
    for step in range(6):
        grads = [(torch.randn(p.shape, generator=g) * 3).to(dtype).to(device) for p in ref]
        buffers = _sgd_reference_step(ref, grads, buffers, **hyper)
        for b, grad in zip(fused, grads):
            b.grad = grad
        opt.step()
        for index, (a, b) in enumerate(zip(ref, fused)):
            _assert_within_one_ulp(b.detach(), a, what=f"param {index} at step {step}")
            if hyper["momentum"]:
                assert opt.state[b]["momentum_buffer"].dtype == dtype
                _assert_within_one_ulp(opt.state[b]["momentum_buffer"], buffers[index],
                                       what=f"buffer {index} at step {step}")
            with torch.no_grad():
                b.copy_(a)
                if hyper["momentum"]:
                    opt.state[b]["momentum_buffer"].copy_(buffers[index])


def test_mixed_param_and_grad_dtypes_in_one_call(device):
    """fp32, fp16 and bf16 params in one group, with grads of other dtypes: one call, grouped by
    dtypes inside, each param as it would be updated alone."""
    g = torch.Generator().manual_seed(3)
    rows = [(torch.float32, torch.float16), (torch.float16, torch.float32), (torch.bfloat16, torch.bfloat16),
            (torch.float16, torch.bfloat16), (torch.float32, torch.float32), (torch.bfloat16, torch.float16)]
    values = [(torch.randn(5000, generator=g), torch.randn(5000, generator=g)) for _ in rows]
    for make in (lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.1),
                 lambda p: FusedSGD(p, lr=0.1, momentum=0.9, weight_decay=0.1)):
        together = [v.to(pd, copy=True).to(device).requires_grad_() for (pd, _), (v, _) in zip(rows, values)]
        alone = [v.to(pd, copy=True).to(device).requires_grad_() for (pd, _), (v, _) in zip(rows, values)]
        opt = make(together)
        singles = [make([p]) for p in alone]
        flags = torch.zeros(1, device=device), torch.ones(1, device=device)
        for _ in range(3):  # other-dtype grads come in as ampinit passes them: scaled_grads
            grads = [grad.to(gd).to(device) for (_, gd), (_, grad) in zip(rows, values)]
            opt._amp_update(*flags, dict(zip(together, grads)))
            for single, q, grad in zip(singles, alone, grads):
                single._amp_update(*flags, {q: grad.clone()})
        for p, q, single in zip(together, alone, singles):
            assert p.dtype == q.dtype and torch.equal(p, q)
            for key, value in single.state[q].items():
                assert torch.equal(opt.state[p][key], value), key


@pytest.mark.parametrize("make", [lambda p: FusedAdam(p, lr=0.1, weight_decay=0.1),
                                  lambda p: FusedSGD(p, lr=0.1, momentum=0.9, dampening=0.2)])
@pytest.mark.parametrize("dtype", LOW)
def test_low_precision_found_inf_skips_everything(make, dtype, device):
    params = [p.requires_grad_() for p in _low_params(dtype, device)[:4]]
    opt = make(params)
    found, inv = torch.ones(1, device=device), torch.full((1,), 0.5, device=device)
    grads = [torch.ones_like(p) for p in params]
    opt._amp_update(found, inv, dict(zip(params, grads)))  # first step skipped: state made, nothing applied
    before = [p.detach().clone() for p in params]
    state = {k: v.clone() for k, v in opt.state[params[3]].items()}
    opt._amp_update(found, inv, dict(zip(params, grads)))
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert all(torch.equal(v, state[k]) for k, v in opt.state[params[3]].items())
    assert float(opt.state[params[3]]["step"]) == 0
    found.zero_()
    opt._amp_update(found, inv, dict(zip(params, grads)))
    assert not torch.equal(params[3], before[3]) and float(opt.state[params[3]]["step"]) == 1


def test_o3_fused_adam_matches_torch_fused_adam():
    """The apex pattern (s_fusedadam_o3): FusedAdam on a pure-fp16 model at O3 ends where
    torch.optim.Adam(fused=True) ends on the same model (same kernel semantics: bitwise with the
    compiled kernels, one fp16 ulp with the fallback)."""
    def train(make_opt):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4)
        opt = make_opt(model.parameters())
        model, opt = amp.initialize(model, opt, opt_level="O3", verbosity=0, loss_scale=128.0)
        for step in range(6):
            x, y = batch(step)
            opt.zero_grad()
            with amp.scale_loss(((model(x.half()).float() - y) ** 2).mean(), opt) as scaled:
                scaled.backward()
            opt.step()
        return model
    fused = train(lambda p: FusedAdam(p, lr=1e-2, adam_w_mode=False, bias_correction=True))
    ref = train(lambda p: torch.optim.Adam(p, lr=1e-2, fused=True))
    for a, b in zip(fused.parameters(), ref.parameters()):
        assert a.dtype == torch.float16
        _assert_within_one_ulp(a.detach(), b.detach(), min_exact=0.9)


# -- loading torch.optim checkpoints, and ours into torch.optim -------------------------------------

RESUME = {
    "adam": (lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1),
             lambda p: FusedAdam(p, lr=5e-1, weight_decay=0.0, adam_w_mode=False)),
    "adamw": (lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
              lambda p: FusedAdamW(p, lr=5e-1)),
    "adamw-as-fusedadam-default": (lambda p: torch.optim.AdamW(p, lr=1e-2, betas=(0.8, 0.9), weight_decay=0.05),
                                   lambda p: FusedAdam(p)),
    "sgd-momentum-decay": (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-2),
                           lambda p: FusedSGD(p, lr=1.0, momentum=0.1)),
    "sgd-nesterov": (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
                     lambda p: FusedSGD(p, lr=1.0, momentum=0.5, nesterov=True)),
    "sgd-dampening": (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.8, dampening=0.3),
                      lambda p: FusedSGD(p, lr=1.0, momentum=0.5)),
    "sgd-plain": (lambda p: torch.optim.SGD(p, lr=0.05), lambda p: FusedSGD(p, lr=1.0)),
}
# The fused kernels and torch.optim's default (foreach/single-tensor) paths order the float32
# operations differently: a few float32 ulps apart after ten steps.
RESUME_TOL = dict(rtol=1e-5, atol=1e-6)


def _grads_for(params, step, device):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g).to(device) for p in params]


def _run(opt, params, steps, first, device):
    for step in range(first, first + steps):
        for p, grad in zip(params, _grads_for(params, step, device)):
            p.grad = grad
        opt.step()


@pytest.mark.parametrize("case", sorted(RESUME))
def test_torch_checkpoint_continues_exactly_in_fused(case, device):
    """r08/r15: train with torch.optim, save, load into the fused optimizer (built with other
    hyper-parameters: the checkpoint's win), and continue: both end in the same place."""
    make_torch, make_fused = RESUME[case]
    params = _params(device)
    torch_params = [p.clone().requires_grad_() for p in params]
    torch_opt = make_torch(torch_params)
    _run(torch_opt, torch_params, 5, 0, device)
    saved = copy.deepcopy(torch_opt.state_dict())
    fused_params = [p.detach().clone().requires_grad_() for p in torch_params]
    fused_opt = make_fused(fused_params)
    fused_opt.load_state_dict(saved)
    _run(torch_opt, torch_params, 10, 5, device)
    _run(fused_opt, fused_params, 10, 5, device)
    for a, b in zip(torch_params, fused_params):
        torch.testing.assert_close(b, a, **RESUME_TOL)
        for key, value in torch_opt.state[a].items():
            if key == "step":
                assert float(fused_opt.state[b]["step"]) == float(value) == 15
            else:
                torch.testing.assert_close(fused_opt.state[b][key], value, **RESUME_TOL)


@pytest.mark.parametrize("case", sorted(RESUME))
def test_fused_checkpoint_continues_exactly_in_torch(case, device):
    make_torch, make_fused = RESUME[case]
    params = _params(device)
    fused_params = [p.clone().requires_grad_() for p in params]
    # the fused optimizer with the torch one's hyper-parameters: train the torch one's groups
    reference = make_torch([torch.zeros(1, requires_grad=True)])
    fused_opt = make_fused(fused_params)
    group = reference.param_groups[0]
    for key in ("lr", "weight_decay", "momentum", "dampening", "nesterov", "betas", "eps"):
        if key in group and key in fused_opt.param_groups[0]:
            fused_opt.param_groups[0][key] = group[key]
    if isinstance(fused_opt, FusedAdam):  # the mode is fixed at construction: the cases agree
        assert reference.param_groups[0]["decoupled_weight_decay"] == fused_opt.adam_w_mode
    _run(fused_opt, fused_params, 5, 0, device)
    saved = copy.deepcopy(fused_opt.state_dict())
    for param_state in saved["state"].values():
        assert "momentum_buffer_is_new" not in param_state
        step = param_state.get("step")
        assert step is None or (step.device.type == "cpu" and step.dtype == torch.float32 and step.dim() == 0)
    torch_params = [p.detach().clone().requires_grad_() for p in fused_params]
    torch_opt = make_torch(torch_params)
    torch_opt.load_state_dict(saved)
    _run(torch_opt, torch_params, 10, 5, device)
    _run(fused_opt, fused_params, 10, 5, device)
    for a, b in zip(torch_params, fused_params):
        torch.testing.assert_close(a, b, **RESUME_TOL)


def test_sgd_buffer_first_applied_on_a_skipped_step_stays_new(device):
    """The first application of a new momentum buffer is skipped (found_inf): the buffer stays
    new on the device, the next applied step makes it the gradient (torch's rule), and a
    checkpoint taken in between saves it as None, which torch.optim.SGD reads the same way."""
    params = [p.requires_grad_() for p in _params(device)[:3]]
    opt = FusedSGD(params, lr=0.1, momentum=0.9, dampening=0.5)
    found, inv = torch.ones(1, device=device), torch.ones(1, device=device)
    grads = [torch.full_like(p, 2.0) for p in params]
    opt._amp_update(found, inv, dict(zip(params, grads)))
    saved = copy.deepcopy(opt.state_dict())
    assert all(s["momentum_buffer"] is None for s in saved["state"].values())
    found.zero_()
    before = [p.detach().clone() for p in params]
    opt._amp_update(found, inv, dict(zip(params, grads)))
    for p, b in zip(params, before):
        assert torch.equal(opt.state[p]["momentum_buffer"], torch.full_like(p, 2.0))  # not 0.5 * 2
        torch.testing.assert_close(p.detach(), b - 0.2)
    twins = [b.clone().requires_grad_() for b in before]
    torch_opt = torch.optim.SGD(twins, lr=0.1, momentum=0.9, dampening=0.5)
    torch_opt.load_state_dict(saved)
    for t in twins:
        t.grad = torch.full_like(t, 2.0)
    torch_opt.step()
    for t, p in zip(twins, params):
        torch.testing.assert_close(t, p, rtol=0, atol=0)


@pytest.mark.parametrize("group, message", [
    (dict(amsgrad=True), "amsgrad=True"),
    (dict(maximize=True), "maximize=True"),
    (dict(decoupled_weight_decay=False, weight_decay=0.1), "adam_w_mode=False"),
])
def test_loading_what_the_kernels_cannot_do_is_refused(group, message):
    """Refused before anything changes (from a review: torch had swapped the groups and the
    state in first, so the refused optimizer went on at the checkpoint's lr, without AMSGrad,
    stepping the other optimizer's live moments)."""
    p = torch.zeros(3, requires_grad=True)
    torch_opt = torch.optim.Adam([p], lr=5.0, **group)
    p.grad = torch.ones(3)
    torch_opt.step()
    torch_opt.step()
    fused = FusedAdam([p], lr=1e-2)  # adam_w_mode=True
    p.grad = torch.full((3,), 0.5)
    fused.step()
    before = copy.deepcopy(fused.state_dict())
    with pytest.raises(ValueError, match=message):
        fused.load_state_dict(torch_opt.state_dict())
    after = fused.state_dict()
    assert after["param_groups"] == before["param_groups"]
    assert all(torch.equal(after["state"][0][key], before["state"][0][key]) for key in before["state"][0])
    assert fused.state[p]["exp_avg"].data_ptr() != torch_opt.state[p]["exp_avg"].data_ptr()
    sgd = torch.optim.SGD([p], lr=0.1, maximize=True)
    with pytest.raises(ValueError, match="maximize=True"):
        FusedSGD([p], lr=0.1).load_state_dict(sgd.state_dict())
    # Adam without weight decay runs the same in either mode: accepted
    plain = torch.optim.Adam([p], lr=1e-3)
    FusedAdam([p]).load_state_dict(plain.state_dict())


def test_loaded_groups_get_the_fused_defaults():
    """r15: torch's groups lack bias_correction (KeyError before): filled from the defaults."""
    p = torch.nn.Parameter(torch.randn(3))
    adam = torch.optim.Adam([p], lr=1e-3)
    p.grad = torch.ones(3)
    adam.step()
    fused = FusedAdam([p], lr=1e-3, adam_w_mode=False)
    fused.load_state_dict(adam.state_dict())
    assert fused.param_groups[0]["bias_correction"] is True
    p.grad = torch.ones(3)
    fused.step()
    assert float(fused.state[p]["step"]) == 2


# -- capturable: hyper-parameters on the device -----------------------------------------------------

@pytest.mark.parametrize("make", [
    lambda p, c: FusedAdam(p, lr=1e-2, weight_decay=0.1, adam_w_mode=False, capturable=c),
    lambda p, c: FusedAdamW(p, lr=1e-2, betas=(0.8, 0.95), capturable=c),
    lambda p, c: FusedSGD(p, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=1e-2, capturable=c),
    lambda p, c: FusedSGD(p, lr=0.1, capturable=c),
])
def test_capturable_matches_eager_and_follows_the_scheduler(make, device):
    """capturable=True reads lr/betas/eps/weight decay from float64 device tensors: the same
    update bit for bit, and an LR scheduler's in-place fill_ reaches the kernel."""
    params = _params(device)
    eager = [p.clone().requires_grad_() for p in params]
    capt = [p.clone().requires_grad_() for p in params]
    opt_e, opt_c = make(eager, False), make(capt, True)
    schedulers = [torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) for opt in (opt_e, opt_c)]
    g = torch.Generator().manual_seed(4)
    lr_tensor = None
    for _ in range(6):
        for a, b in zip(eager, capt):
            a.grad = torch.randn(a.shape, generator=g).to(device)
            b.grad = a.grad.clone()
        opt_e.step()
        opt_c.step()
        lr_tensor = lr_tensor if lr_tensor is not None else opt_c.param_groups[0]["lr"]
        for scheduler in schedulers:
            scheduler.step()
        assert opt_c.param_groups[0]["lr"] is lr_tensor  # filled in place, never replaced
    assert isinstance(lr_tensor, torch.Tensor) and lr_tensor.dtype == torch.float64
    assert lr_tensor.device.type == torch.device(device).type and float(lr_tensor) == opt_e.param_groups[0]["lr"]
    for a, b in zip(eager, capt):
        assert torch.equal(a, b)


@pytest.mark.parametrize("make", [lambda groups: FusedAdamW(groups, lr=0.1), lambda groups: FusedSGD(groups, lr=0.1)],
                         ids=["adamw", "sgd"])
@pytest.mark.parametrize("where", ["same group", "after construction"])
def test_a_parameter_listed_twice_is_refused_before_any_update(make, where):
    """torch.optim warns and updates such a parameter once per listing; the fused kernels would
    update it once: a clear error naming both places, with every group and state untouched (a
    group before the duplicate included), and no other check may fire after an update either."""
    first, shared = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(4))
    if where == "same group":
        with pytest.warns(UserWarning, match="duplicate"):
            opt = make([{"params": [first]}, {"params": [shared, shared]}])
    else:
        opt = make([{"params": [first]}, {"params": [shared]}])
        opt.param_groups[1]["params"].append(shared)
    first.grad, shared.grad = torch.ones(3), torch.ones(4)
    with pytest.raises(RuntimeError, match=r"param_groups\[1\]\['params'\]\[1\] is the same parameter as "
                                           r"param_groups\[1\]\['params'\]\[0\]"):
        opt.step()
    assert torch.equal(first, torch.ones(3)) and torch.equal(shared, torch.ones(4))
    assert not opt.state[first] and not opt.state[shared]


def test_a_later_groups_sparse_gradient_is_refused_before_any_update():
    first, embedding = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(5, 2))
    opt = FusedAdamW([{"params": [first]}, {"params": [embedding]}], lr=0.1)
    first.grad = torch.ones(3)
    embedding.grad = torch.sparse_coo_tensor([[1]], torch.ones(1, 2), (5, 2))
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert torch.equal(first, torch.ones(3)) and not opt.state[first]


def test_state_of_another_shape_is_refused_before_any_update():
    """torch's load_state_dict matches state to params by position only: a later group's state
    of another shape is named before any group is stepped."""
    source = FusedAdamW([{"params": [torch.nn.Parameter(torch.randn(4))]},
                         {"params": [torch.nn.Parameter(torch.randn(5))]}], lr=0.1)
    for group in source.param_groups:
        for p in group["params"]:
            p.grad = torch.ones_like(p)
    source.step()
    first, second = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(6))
    opt = FusedAdamW([{"params": [first]}, {"params": [second]}], lr=0.1)
    opt.load_state_dict(source.state_dict())
    first.grad, second.grad = torch.ones(4), torch.ones(6)
    step_before = opt.state[first]["step"].clone()
    with pytest.raises(RuntimeError, match=r"state 'exp_avg' of param_groups\[1\]\['params'\]\[0\] has shape \(5,\)"):
        opt.step()
    assert torch.equal(first, torch.ones(4)) and torch.equal(opt.state[first]["step"], step_before)


@pytest.mark.parametrize("make", [lambda groups: FusedAdamW(groups, lr=0.01), lambda groups: FusedSGD(groups, lr=0.01)],
                         ids=["adamw", "sgd"])
def test_a_model_parameter_appended_beside_its_master_is_refused(make):
    """Appending the 16-bit model parameter itself to param_groups (not add_param_group) would
    update it twice, through its master and directly: a clear error, on every backend (at the
    scale_loss that finds it, before the backward)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    opt = make([{"params": model[0].parameters()}, {"params": model[1].parameters()}])
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    opt.param_groups[1]["params"].append(model[0].weight)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    groups = [list(group["params"]) for group in opt.param_groups]
    with pytest.raises(RuntimeError, match="lists 0.weight twice: as the 16-bit model parameter"):
        with amp.scale_loss(model(torch.randn(4, 8)).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
    with pytest.raises(RuntimeError, match="lists 0.weight twice"):
        opt.step()
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())
    assert [list(group["params"]) for group in opt.param_groups] == groups  # nothing was changed


def test_a_bare_import_ampinit_reaches_the_fused_optimizers():
    """README's ``ampinit.optim.FusedAdamW(...)`` after ``import ampinit`` alone (it raised
    AttributeError unless ``ampinit.optim`` was imported too); a fresh process, so no other test
    has imported it."""
    import subprocess
    import sys
    code = "import ampinit; print(ampinit.optim.FusedAdamW.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "FusedAdamW"


@pytest.mark.parametrize("make", [
    lambda p: FusedAdam(p, lr=0.05, adam_w_mode=False, weight_decay=0.1, set_grad_none=False),
    lambda p: FusedAdam(p, lr=0.05, weight_decay=0.1, state_dtype=torch.bfloat16),
    lambda p: FusedSGD(p, lr=0.05, momentum=0.9, weight_decay=0.1, set_grad_none=True),
], ids=["adam_l2", "adamw_bf16_state", "sgd"])
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_optimizer_continues_as_the_original(make, how):
    """copy.deepcopy / pickling keeps the settings that live outside the param groups
    (``adam_w_mode``, ``set_grad_none``, ``state_dtype``): torch's ``__getstate__`` leaves them
    out, and a copied FusedAdam raised AttributeError.  Reference: the original, stepped alike."""
    import pickle
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    opt = make(params)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    copied = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
    twins = [p for group in copied.param_groups for p in group["params"]]
    for name in type(opt)._SETTINGS:
        assert getattr(copied, name) == getattr(opt, name)
    for _ in range(3):
        grads = [torch.randn_like(p) for p in params]
        for p, twin, g in zip(params, twins, grads):
            p.grad, twin.grad = g.clone(), g.clone()
        opt.step()
        copied.step()
    assert all(torch.equal(p, twin) for p, twin in zip(params, twins))
    opt.zero_grad()
    copied.zero_grad()
    assert [p.grad is None for p in params] == [t.grad is None for t in twins]


@pytest.mark.parametrize("state_dtype", [None, torch.bfloat16])
def test_a_fused_adam_pickled_before_its_settings_were_kept_loads_them_back(state_dtype):
    """Pickles made before ``__getstate__`` kept ``adam_w_mode``/``state_dtype`` raised
    AttributeError on load; ``adam_w_mode`` comes from the groups, and bfloat16 moments of FP32
    params give ``state_dtype`` back (else the next steps would hold them in FP32)."""
    params = [torch.nn.Parameter(torch.randn(3))]
    opt = FusedAdam(params, lr=0.1, adam_w_mode=False, state_dtype=state_dtype)
    params[0].grad = torch.ones(3)
    opt.step()
    old = {k: v for k, v in opt.__getstate__().items() if k not in FusedAdam._SETTINGS}
    loaded = FusedAdam.__new__(FusedAdam)
    loaded.__setstate__(old)
    assert (loaded.adam_w_mode, loaded.state_dtype) == (False, state_dtype)


@pytest.mark.parametrize("make, group, message", [
    (lambda p: FusedAdamW(p, lr=1e-2), dict(maximize=True), "maximize=True"),
    (lambda p: FusedAdam(p, lr=1e-2), dict(amsgrad=True), "amsgrad=True"),
    (lambda p: FusedAdamW(p, lr=1e-2), dict(decoupled_weight_decay=False, weight_decay=0.5), "adam_w_mode=False"),
    (lambda p: FusedSGD(p, lr=0.1), dict(maximize=True), "maximize=True"),
])
def test_add_param_group_refuses_what_the_kernels_would_not_follow(make, group, message):
    """From a review: these were accepted and then stepped as if absent (maximize descended:
    -0.1 where torch gives +0.1; AMSGrad was left out; an Adam group was stepped as AdamW).
    (Nesterov with dampening in a group is stepped as torch steps it: see below.)"""
    first, second = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
    opt = make([first])
    with pytest.raises(ValueError, match=message):
        opt.add_param_group({"params": [second], **group})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [second]})  # the same parameter without the setting is fine
    assert len(opt.param_groups) == 2


@pytest.mark.parametrize("group", [dict(momentum=0.0), dict(dampening=0.5)])
def test_a_group_without_momentum_in_a_nesterov_fused_sgd_steps_like_torch(group):
    """From a review: torch.optim.SGD checks nesterov against its own arguments only, and steps a
    group with momentum 0 as plain SGD, one with dampening with both; the group check refused the
    first at construction.  Both are stepped as torch steps them, also when added later."""
    def run(make):
        torch.manual_seed(0)
        a, b, c = (torch.nn.Parameter(torch.randn(5)) for _ in range(3))
        opt = make([{"params": [a]}, {"params": [b], **group}])
        opt.add_param_group({"params": [c], **group})
        for step in range(4):
            a.grad, b.grad = torch.full((5,), 0.1 * step + 0.3), torch.full((5,), 0.1 * step - 0.2)
            c.grad = torch.full((5,), 0.05 * step)
            opt.step()
        return [a.detach().clone(), b.detach().clone(), c.detach().clone()]

    for got, want in zip(run(lambda g: FusedSGD(g, lr=0.1, momentum=0.9, nesterov=True)),
                         run(lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9, nesterov=True))):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
