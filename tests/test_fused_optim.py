"""ampinit.optim's fused optimizers: against torch.optim on their own, and under initialize."""
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
    half = torch.zeros(2, dtype=torch.float16, requires_grad=True)
    opt = FusedAdam([half])
    half.grad = torch.ones_like(half)
    with pytest.raises(TypeError, match="float32 params"):
        opt.step()
    assert torch.equal(half, torch.zeros(2, dtype=torch.float16)) and not opt.state[half]


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
    for (name, a), b in zip(m1.state_dict().items(), m2.state_dict().values()):
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
