"""ampinit.apex.optimizers (what ``apex.optimizers`` is under the alias): FusedLAMB, FusedNovoGrad
and FusedAdagrad against literal float64 references, their state, closures, checkpoints, bad
arguments, and training under ``ampinit.initialize`` at O2."""
import copy
import io
import itertools
import math

import pytest
import torch

import ampinit as amp
import ampinit.optim
from ampinit.apex import optimizers as apex_optimizers
from ampinit.apex.optimizers import FusedAdagrad, FusedLAMB, FusedMixedPrecisionLamb, FusedNovoGrad
from conftest import batch, train_step

# ---------------------------------------------------------------------------------------------
# References: plain Python loops over float64 tensors, each formula as the semantics state it.
# ---------------------------------------------------------------------------------------------


class _Reference:
    """``params[g][i]``: float64 copies; ``hyper[g]``: the group's hyper-parameters.  A param of
    ``dtype`` float16/bfloat16 is rounded to it after each update, as the param stores it."""

    def __init__(self, params, hyper, dtype):
        self.params = [[p.detach().double().clone() for p in group] for group in params]
        self.hyper = hyper
        self.dtype = dtype
        self.steps = [0] * len(params)
        self.state = {}  # (g, i) -> dict of float64 tensors

    def store(self, value):
        return value.to(self.dtype).double() if self.dtype != torch.float32 else value

    def step(self, grads):  # grads[g][i]: a float64 tensor or None
        raise NotImplementedError


class RefLAMB(_Reference):
    def __init__(self, params, hyper, dtype, max_grad_norm, adam_w_mode, use_nvlamb):
        super().__init__(params, hyper, dtype)
        self.max_grad_norm, self.adam_w_mode, self.use_nvlamb = max_grad_norm, adam_w_mode, use_nvlamb
        self.global_norms = []

    def step(self, grads):
        present = [g for group in grads for g in group if g is not None]
        if not present:
            return
        total = math.sqrt(sum(float((g * g).sum()) for g in present))
        self.global_norms.append(total)
        clip = total / self.max_grad_norm if (self.max_grad_norm > 0 and total > self.max_grad_norm) else 1.0
        for gi, h in enumerate(self.hyper):
            if all(g is None for g in grads[gi]):
                continue
            self.steps[gi] += 1
            t = self.steps[gi]
            beta1, beta2 = h["betas"]
            beta3 = 1 - beta1 if h["grad_averaging"] else 1.0
            bc1 = 1 - beta1 ** t if h["bias_correction"] else 1.0
            bc2 = 1 - beta2 ** t if h["bias_correction"] else 1.0
            lr, eps, wd = h["lr"], h["eps"], h["weight_decay"]
            for i, p in enumerate(self.params[gi]):
                g = grads[gi][i]
                if g is None:
                    continue
                st = self.state.setdefault((gi, i), {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)})
                g_hat = g / clip
                if not self.adam_w_mode:
                    g_hat = g_hat + wd * p
                st["exp_avg"] = beta1 * st["exp_avg"] + beta3 * g_hat
                st["exp_avg_sq"] = beta2 * st["exp_avg_sq"] + (1 - beta2) * g_hat ** 2
                u = (st["exp_avg"] / bc1) / (torch.sqrt(st["exp_avg_sq"] / bc2) + eps)
                if self.adam_w_mode:
                    u = u + wd * p
                pn, un = float(torch.sqrt((p * p).sum())), float(torch.sqrt((u * u).sum()))
                if self.use_nvlamb or wd != 0:
                    ratio = lr * pn / un if (pn != 0 and un != 0) else lr
                else:
                    ratio = lr
                self.params[gi][i] = self.store(p - ratio * u)


class RefNovoGrad(_Reference):
    def __init__(self, params, hyper, dtype, reg_inside_moment, norm_type, init_zero):
        super().__init__(params, hyper, dtype)
        self.mode, self.norm_type, self.init_zero = (0 if reg_inside_moment else 1), norm_type, init_zero

    def step(self, grads):
        for gi, h in enumerate(self.hyper):
            if all(g is None for g in grads[gi]):
                continue
            self.steps[gi] += 1
            t = self.steps[gi]
            beta1, beta2 = h["betas"]
            beta3 = 1 - beta1 if h["grad_averaging"] else 1.0
            bc1 = 1 - beta1 ** t if h["bias_correction"] else 1.0
            bc2 = math.sqrt(1 - beta2 ** t) if h["bias_correction"] else 1.0
            lr, eps, wd = h["lr"], h["eps"], h["weight_decay"]
            for i, p in enumerate(self.params[gi]):
                g = grads[gi][i]
                if g is None:
                    continue
                n = float(torch.sqrt((g * g).sum())) if self.norm_type == 2 else float(g.abs().max())
                if (gi, i) not in self.state:
                    self.state[(gi, i)] = {"exp_avg": torch.zeros_like(p), "exp_avg_sq": 0.0 if self.init_zero else n}
                st = self.state[(gi, i)]
                v = st["exp_avg_sq"]
                if self.norm_type == 2:
                    v = math.sqrt(beta2 * v * v + (1 - beta2) * n * n)
                else:
                    v = beta2 * v + (1 - beta2) * n
                st["exp_avg_sq"] = v
                if self.mode == 0:
                    g_hat = g / (v / bc2 + eps) + wd * p
                    st["exp_avg"] = beta1 * st["exp_avg"] + beta3 * g_hat
                    new = p - lr * st["exp_avg"] / bc1
                else:
                    st["exp_avg"] = beta1 * st["exp_avg"] + beta3 * g
                    new = p - lr * ((st["exp_avg"] / bc1) / (v / bc2 + eps) + wd * p)
                self.params[gi][i] = self.store(new)


class RefAdagrad(_Reference):
    def __init__(self, params, hyper, dtype, adagrad_w_mode):
        super().__init__(params, hyper, dtype)
        self.w_mode = adagrad_w_mode

    def step(self, grads):
        for gi, h in enumerate(self.hyper):
            lr, eps, wd = h["lr"], h["eps"], h["weight_decay"]
            for i, p in enumerate(self.params[gi]):
                g = grads[gi][i]
                if g is None:
                    continue
                st = self.state.setdefault((gi, i), {"sum": torch.zeros_like(p)})
                if not self.w_mode:
                    g = g + wd * p
                    st["sum"] = st["sum"] + g * g
                    new = p - lr * g / (torch.sqrt(st["sum"]) + eps)
                else:
                    st["sum"] = st["sum"] + g * g
                    new = p - lr * (g / (torch.sqrt(st["sum"]) + eps) + wd * p)
                self.params[gi][i] = self.store(new)


# ---------------------------------------------------------------------------------------------
# The harness: three groups, params of several shapes, some steps without some gradients.
# ---------------------------------------------------------------------------------------------

# Group 0: a matrix and a 0-dim tensor; group 1: a size-1 tensor (no gradient every third step),
# a 3-d tensor and a param of zeros (||p|| = 0 on its first step); group 2: one param with no
# gradient at steps 0, 1 and 5, so the whole group sits those steps out.
SHAPES = [[(5, 7), ()], [(1,), (3, 4, 2), (6,)], [(13,)]]
STEPS = 10


def _has_grad(group, index, step):
    if (group, index) == (1, 0):
        return step % 3 != 1
    if group == 2:
        return step not in (0, 1, 5)
    return True


def _initial_params(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = [[torch.randn(shape, generator=gen).to(dtype) for shape in group] for group in SHAPES]
    params[1][2].zero_()
    return params


def _grads(step, dtype, scale, seed=0):
    gen = torch.Generator().manual_seed(10_000 * seed + step)
    return [[(torch.randn(shape, generator=gen) * scale).to(dtype) if _has_grad(gi, i, step) else None
             for i, shape in enumerate(group)] for gi, group in enumerate(SHAPES)]


def _group_hyper(wd, defaults):
    """Per-group overrides: different lr, betas, eps and weight decay in each group."""
    overrides = [{}, dict(lr=5e-3, betas=(0.8, 0.99), eps=1e-5, weight_decay=wd * 0.5),
                 dict(lr=2e-2, betas=(0.95, 0.9), weight_decay=wd * 2)]
    return [{**defaults, **o} for o in overrides]


def _run(make_opt, ref, dtype, scale=1.0, steps=STEPS, check_skipped=True):
    """Step ``make_opt``'s optimizer and ``ref`` on the same gradients; return the optimizer and
    its params.  Checks on the way that ``p.grad`` is left alone and that a param without a
    gradient is not touched (value and state)."""
    params = [[p.clone().requires_grad_() for p in group] for group in _initial_params(dtype)]
    opt = make_opt(params)
    for step in range(steps):
        grads = _grads(step, dtype, scale)
        for group, group_grads in zip(params, grads):
            for p, g in zip(group, group_grads):
                p.grad = None if g is None else g.clone()
        before = {p: (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()})
                  for group in params for p in group if p.grad is None}
        opt.step()
        for group, group_grads in zip(params, grads):
            for p, g in zip(group, group_grads):
                if g is not None:
                    assert torch.equal(p.grad, g), "the optimizer modified p.grad"
        if check_skipped:
            for p, (value, state) in before.items():
                assert torch.equal(p.detach(), value)
                assert state.keys() == opt.state[p].keys()
                assert all(torch.equal(v, opt.state[p][k]) for k, v in state.items())
        ref.step([[None if g is None else g.double() for g in group] for group in grads])
        opt.zero_grad()
    return opt, params


def _close(actual, expected, rtol, atol_frac):
    """``assert_close`` with the absolute tolerance a fraction of the tensor's largest value:
    elements near zero (an ``exp_avg`` element where gradients cancelled) carry the rounding
    error of the tensor's large elements, not one proportional to their own size."""
    atol = atol_frac * float(expected.abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(actual.double(), expected, rtol=rtol, atol=atol)


def _compare(opt, params, ref, rtol, atol_frac, state_rtol, state_atol_frac):
    for gi, group in enumerate(params):
        assert opt.param_groups[gi].get("step", 0) == ref.steps[gi]
        for i, p in enumerate(group):
            assert p.dtype == ref.dtype
            _close(p.detach(), ref.params[gi][i], rtol, atol_frac)
            for key, expected in ref.state[(gi, i)].items():
                actual = opt.state[p][key]
                assert actual.dtype == torch.float32 and actual.device == p.device
                expected = torch.as_tensor(expected, dtype=torch.float64)
                assert actual.shape == expected.shape, key
                _close(actual, expected, state_rtol, state_atol_frac)


# FP32 params: float32 math against float64 over 10 steps.  The errors measured stay below 1e-6
# of each tensor's largest value; 1e-5 leaves room without hiding a wrong formula (a missing bias
# correction, clip or decay term is off by 1e-3 or more).
FP32_TOL = dict(rtol=1e-5, atol_frac=1e-5, state_rtol=1e-5, state_atol_frac=1e-5)


def _lamb_case(dtype, adam_w_mode, grad_averaging, bias_correction, use_nvlamb, wd, clip):
    max_grad_norm = {"clip": 1.0, "no-clip": 100.0, "off": 0.0}[clip]
    defaults = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=wd, bias_correction=bias_correction,
                    grad_averaging=grad_averaging)
    hyper = _group_hyper(wd, defaults)
    ref = RefLAMB(_initial_params(dtype), hyper, dtype, max_grad_norm, adam_w_mode, use_nvlamb)

    def make(params):
        groups = [{"params": ps, **{k: v for k, v in h.items() if k not in ("bias_correction", "grad_averaging")}}
                  for ps, h in zip(params, hyper)]
        return FusedLAMB(groups, max_grad_norm=max_grad_norm, adam_w_mode=adam_w_mode, use_nvlamb=use_nvlamb,
                         bias_correction=bias_correction, grad_averaging=grad_averaging)
    return make, ref


# Every combination of the flags, with the global norm above max_grad_norm ("clip") or below
# it ("no-clip"); clipping switched off (max_grad_norm=0) in two of them.
LAMB_FLAGS = [(*flags, wd, clip) for flags in itertools.product([True, False], repeat=4)
              for wd in (0.0, 0.1) for clip in ("clip", "no-clip")]
LAMB_FLAGS += [(True, True, True, False, 0.1, "off"), (False, False, False, True, 0.0, "off")]


@pytest.mark.parametrize("adam_w_mode,grad_averaging,bias_correction,use_nvlamb,wd,clip", LAMB_FLAGS)
def test_lamb_matches_reference(adam_w_mode, grad_averaging, bias_correction, use_nvlamb, wd, clip):
    make, ref = _lamb_case(torch.float32, adam_w_mode, grad_averaging, bias_correction, use_nvlamb, wd, clip)
    opt, params = _run(make, ref, torch.float32)
    _compare(opt, params, ref, **FP32_TOL)
    # The cases are what they say: the global norm is above 1.0 and below 100.0 at every step.
    assert min(ref.global_norms) > 1.0 and max(ref.global_norms) < 100.0


def _novograd_case(dtype, grad_averaging, bias_correction, reg_inside_moment, norm_type, init_zero, wd):
    defaults = dict(lr=1e-2, betas=(0.9, 0.98), eps=1e-8, weight_decay=wd, bias_correction=bias_correction,
                    grad_averaging=grad_averaging)
    hyper = _group_hyper(wd, defaults)
    ref = RefNovoGrad(_initial_params(dtype), hyper, dtype, reg_inside_moment, norm_type, init_zero)

    def make(params):
        groups = [{"params": ps, **h} for ps, h in zip(params, hyper)]
        return FusedNovoGrad(groups, reg_inside_moment=reg_inside_moment, norm_type=norm_type, init_zero=init_zero)
    return make, ref


@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("norm_type", [2, 0])
@pytest.mark.parametrize("grad_averaging,bias_correction,reg_inside_moment,init_zero",
                         list(itertools.product([True, False], repeat=4)))
def test_novograd_matches_reference(grad_averaging, bias_correction, reg_inside_moment, norm_type, init_zero, wd):
    make, ref = _novograd_case(torch.float32, grad_averaging, bias_correction, reg_inside_moment, norm_type,
                               init_zero, wd)
    opt, params = _run(make, ref, torch.float32)
    _compare(opt, params, ref, **FP32_TOL)


def _adagrad_case(dtype, adagrad_w_mode, wd):
    hyper = [dict(lr=1e-2, eps=1e-10, weight_decay=wd), dict(lr=5e-2, eps=1e-6, weight_decay=wd * 0.5),
             dict(lr=2e-2, eps=1e-3, weight_decay=wd * 2)]
    ref = RefAdagrad(_initial_params(dtype), hyper, dtype, adagrad_w_mode)

    def make(params):
        return FusedAdagrad([{"params": ps, **h} for ps, h in zip(params, hyper)], adagrad_w_mode=adagrad_w_mode)
    return make, ref


@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("adagrad_w_mode", [False, True])
def test_adagrad_matches_reference(adagrad_w_mode, wd):
    make, ref = _adagrad_case(torch.float32, adagrad_w_mode, wd)
    opt, params = _run(make, ref, torch.float32)
    _compare(opt, params, ref, **FP32_TOL)
    assert all("step" not in group for group in opt.param_groups)


LOW_CASES = {
    "lamb-adamw": lambda dt: _lamb_case(dt, True, True, True, False, 0.1, "clip"),
    "lamb-l2-nvlamb": lambda dt: _lamb_case(dt, False, False, True, True, 0.1, "no-clip"),
    "novograd-l2": lambda dt: _novograd_case(dt, True, True, False, 2, False, 0.1),
    "novograd-max-inside": lambda dt: _novograd_case(dt, False, True, True, 0, True, 0.1),
    "adagrad": lambda dt: _adagrad_case(dt, False, 0.1),
    "adagrad-w": lambda dt: _adagrad_case(dt, True, 0.1),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", sorted(LOW_CASES))
def test_low_precision_params_match_reference(case, dtype):
    """fp16/bf16 params against the reference rounding its float64 result to the param's dtype
    after each step.  Both round the same value, computed in float32 here and in float64 there, so
    a step's results can differ only where that value lies within float32 error of a rounding
    boundary, and then by one ulp (<= eps*|p|).  Such a difference feeds back into later steps only
    through ``wd*p`` and ``||p||``, smoothly: params are allowed 2 ulps (2*eps relative, and 2*eps
    of the tensor's largest value absolute).  The FP32 state sees the same gradients and the
    params only through ``wd*p`` (wd <= 0.2), so it is allowed eps.  (With these seeds the params
    come out bitwise equal; a wrong dtype path, e.g. state kept in fp16 or rounding before the
    decay term, misses by far more.)"""
    make, ref = LOW_CASES[case](dtype)
    opt, params = _run(make, ref, dtype)
    eps = torch.finfo(dtype).eps
    _compare(opt, params, ref, rtol=2 * eps, atol_frac=2 * eps, state_rtol=eps, state_atol_frac=eps)
    assert all(state[k].dtype == torch.float32 for state in opt.state.values() for k in state)


MIXED = (torch.float32, torch.float16, torch.bfloat16)


@pytest.mark.parametrize("kind", ["fp16", "bf16", "mixed"])
@pytest.mark.parametrize("case", sorted(LOW_CASES))
def test_low_precision_update_is_the_fp32_update_rounded_once(case, kind):
    """Each step on fp16/bf16 params gives exactly the float32 update of the same values,
    rounded once: an FP32 twin (same grads, reset to the low-precision values before each step)
    must agree bitwise, state included.  "mixed" puts fp32, fp16 and bf16 params in the same
    groups (several buckets per group); there LAMB's global norm adds the per-tensor norms in
    another order than the twin's, which may move it by a float32 ulp, so that case allows one
    ulp of each param's dtype (and 1e-6 relative on the state)."""
    make, _ = LOW_CASES[case](torch.float16)
    if kind == "mixed":
        dtypes = [[MIXED[(gi + i) % 3] for i in range(len(group))] for gi, group in enumerate(SHAPES)]
    else:
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[kind]
        dtypes = [[dtype] * len(group) for group in SHAPES]
    low = [[p.to(dt).requires_grad_() for p, dt in zip(group, group_dtypes)]
           for group, group_dtypes in zip(_initial_params(torch.float32), dtypes)]
    twin = [[p.detach().float().clone().requires_grad_() for p in group] for group in low]
    opt_low, opt_twin = make(low), make(twin)
    for step in range(6):
        grads = _grads(step, torch.float32, 1.0)
        for a_group, b_group, g_group in zip(low, twin, grads):
            for a, b, g in zip(a_group, b_group, g_group):
                a.grad = None if g is None else g.to(a.dtype)
                b.grad = None if g is None else a.grad.float().clone()
                with torch.no_grad():
                    b.copy_(a)
        opt_low.step()
        opt_twin.step()
        for a_group, b_group in zip(low, twin):
            for a, b in zip(a_group, b_group):
                if kind == "mixed":
                    eps = torch.finfo(a.dtype).eps
                    _close(a.detach(), b.detach().to(a.dtype).double(), eps, eps)
                    for key, value in opt_twin.state[b].items():
                        _close(opt_low.state[a][key], value.double(), 1e-6, 1e-6)
                else:
                    assert torch.equal(a.detach(), b.detach().to(a.dtype))
                    for key, value in opt_twin.state[b].items():
                        assert torch.equal(opt_low.state[a][key], value), key


# ---------------------------------------------------------------------------------------------
# Closures, zero_grad, checkpoints.
# ---------------------------------------------------------------------------------------------

MAKERS = {
    "lamb": lambda ps: FusedLAMB(ps, lr=1e-2, weight_decay=0.05),
    "lamb-l2-nvlamb": lambda ps: FusedLAMB(ps, lr=1e-2, adam_w_mode=False, use_nvlamb=True, max_grad_norm=0.5),
    "novograd": lambda ps: FusedNovoGrad(ps, lr=1e-2, weight_decay=0.01),
    "novograd-max-zero": lambda ps: FusedNovoGrad(ps, lr=1e-2, norm_type=0, init_zero=True, reg_inside_moment=True),
    "adagrad": lambda ps: FusedAdagrad(ps, lr=1e-2, weight_decay=0.01),
    "adagrad-w": lambda ps: FusedAdagrad(ps, lr=1e-2, weight_decay=0.01, adagrad_w_mode=True),
}


def _linear(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Linear(6, 3).to(dtype)


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_closure(name):
    data = torch.randn(8, 6, generator=torch.Generator().manual_seed(3))
    a, b = _linear(), _linear()
    opt_a, opt_b = MAKERS[name](a.parameters()), MAKERS[name](b.parameters())
    for _ in range(3):
        def closure():
            opt_a.zero_grad()
            loss = a(data).pow(2).mean()
            loss.backward()
            return loss
        loss_a = opt_a.step(closure)
        opt_b.zero_grad()
        loss_b = b(data).pow(2).mean()
        loss_b.backward()
        assert opt_b.step() is None
        assert torch.equal(loss_a.detach(), loss_b.detach())
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_zero_grad_follows_set_grad_none(name):
    model = _linear()
    opt = MAKERS[name](model.parameters())
    model(torch.ones(2, 6)).sum().backward()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    opt.set_grad_none = False
    model(torch.ones(2, 6)).sum().backward()
    opt.zero_grad()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    cls = type(opt)
    kept = cls(model.parameters(), set_grad_none=False)
    model(torch.ones(2, 6)).sum().backward()
    kept.zero_grad()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def _train(opt, model, steps, first_step=0):
    for step in range(first_step, first_step + steps):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(8, 6, generator=gen).to(next(model.parameters()).dtype)
        opt.zero_grad()
        model(x).float().pow(2).mean().backward()
        if step == 2:  # one param without a gradient at one step
            model.bias.grad = None
        opt.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("name", sorted(MAKERS))
def test_state_dict_round_trip_continues_exactly(name, dtype):
    whole = _linear(dtype=dtype)
    opt_whole = MAKERS[name](whole.parameters())
    _train(opt_whole, whole, 10)

    first = _linear(dtype=dtype)
    opt_first = MAKERS[name](first.parameters())
    _train(opt_first, first, 5)
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt_first.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)

    second = _linear(seed=99, dtype=dtype)
    second.load_state_dict(saved["model"])
    opt_second = MAKERS[name](second.parameters())
    opt_second.load_state_dict(saved["opt"])
    for p in second.parameters():  # the FP32 state stays FP32 for fp16 params (torch would cast it)
        assert all(v.dtype == torch.float32 for v in opt_second.state[p].values())
    _train(opt_second, second, 5, first_step=5)

    for p, q in zip(whole.parameters(), second.parameters()):
        assert torch.equal(p, q)
        assert opt_whole.state[p].keys() == opt_second.state[q].keys()
        for key, value in opt_whole.state[p].items():
            assert torch.equal(value, opt_second.state[q][key]), key
    assert [g.get("step") for g in opt_whole.param_groups] == [g.get("step") for g in opt_second.param_groups]


@pytest.mark.parametrize("name", ["novograd", "novograd-max-zero", "lamb"])
def test_load_state_dict_puts_state_on_the_params_device(name, device):
    """State saved from a CPU optimizer lands on the params' device, in FP32 (the NovoGrad
    norms are 0-dim tensors there)."""
    cpu = _linear()
    opt_cpu = MAKERS[name](cpu.parameters())
    _train(opt_cpu, cpu, 3)
    moved = copy.deepcopy(cpu).to(device).half()
    opt_moved = MAKERS[name](moved.parameters())
    opt_moved.load_state_dict(opt_cpu.state_dict())
    for p, q in zip(cpu.parameters(), moved.parameters()):
        for key, value in opt_cpu.state[p].items():
            loaded = opt_moved.state[q][key]
            assert loaded.device == q.device and loaded.dtype == torch.float32 and loaded.shape == value.shape
            assert torch.equal(loaded.cpu(), value)
    _train(opt_moved, moved, 1, first_step=3)


# ---------------------------------------------------------------------------------------------
# Arguments, sparse gradients, exports.
# ---------------------------------------------------------------------------------------------

BAD = [
    (FusedLAMB, dict(lr=-1.0)), (FusedLAMB, dict(lr=float("nan"))), (FusedLAMB, dict(eps=-1e-6)),
    (FusedLAMB, dict(weight_decay=-0.1)), (FusedLAMB, dict(betas=(1.0, 0.999))), (FusedLAMB, dict(betas=(0.9, -0.1))),
    (FusedLAMB, dict(betas=(0.9,))), (FusedLAMB, dict(betas=0.9)), (FusedLAMB, dict(amsgrad=True)),
    (FusedLAMB, dict(max_grad_norm=-1.0)), (FusedLAMB, dict(lr="0.1")),
    (FusedNovoGrad, dict(lr=-1.0)), (FusedNovoGrad, dict(eps=-1.0)), (FusedNovoGrad, dict(weight_decay=-1.0)),
    (FusedNovoGrad, dict(betas=(0.9, 1.0))), (FusedNovoGrad, dict(amsgrad=True)), (FusedNovoGrad, dict(norm_type=1)),
    (FusedNovoGrad, dict(norm_type=float("inf"))), (FusedNovoGrad, dict(norm_type=True)),
    (FusedAdagrad, dict(lr=-1.0)), (FusedAdagrad, dict(eps=-1.0)), (FusedAdagrad, dict(weight_decay=-0.5)),
]


@pytest.mark.parametrize("cls,kwargs", BAD, ids=[f"{c.__name__}-{sorted(k)[0]}-{i}" for i, (c, k) in enumerate(BAD)])
def test_bad_hyper_parameters_raise_value_error(cls, kwargs):
    with pytest.raises(ValueError):
        cls([torch.zeros(2, requires_grad=True)], **kwargs)


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_sparse_gradient_raises_and_updates_nothing(name):
    dense = torch.randn(4, 3, requires_grad=True)
    embedding = torch.nn.Embedding(10, 3, sparse=True)
    opt = MAKERS[name]([dense, embedding.weight])
    before = [dense.detach().clone(), embedding.weight.detach().clone()]
    dense.grad = torch.ones_like(dense)
    embedding(torch.tensor([1, 2])).sum().backward()
    assert embedding.weight.grad.is_sparse
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert torch.equal(dense.detach(), before[0]) and torch.equal(embedding.weight.detach(), before[1])
    assert not opt.state and all("step" not in g for g in opt.param_groups)


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_float64_params_are_refused(name):
    p = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    opt = MAKERS[name]([p])
    p.grad = torch.ones_like(p)
    with pytest.raises(TypeError, match="float64"):
        opt.step()


def test_exports_and_mixed_precision_lamb():
    assert issubclass(apex_optimizers.FusedAdam, ampinit.optim.FusedAdam)
    assert type(apex_optimizers.FusedAdam([torch.zeros(2, requires_grad=True)])) is apex_optimizers.FusedAdam
    assert apex_optimizers.FusedSGD is ampinit.optim.FusedSGD
    for name in ("FusedLAMB", "FusedNovoGrad", "FusedAdagrad"):
        cls = getattr(apex_optimizers, name)
        assert issubclass(cls, torch.optim.Optimizer) and name in apex_optimizers.__all__ and cls.__doc__
    with pytest.raises(NotImplementedError, match=r"FusedLAMB.*O2"):
        FusedMixedPrecisionLamb([torch.zeros(2, requires_grad=True)], lr=1e-3)


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_empty_and_non_contiguous_params(name):
    """An empty param is stepped without error; a non-contiguous one gets the update of a
    contiguous copy (to float32 rounding: a norm over other strides sums in another order)."""
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(6, 4, generator=gen)
    strided = base.t().contiguous().t().requires_grad_()  # (6, 4) with transposed strides
    dense = base.clone().requires_grad_()
    empty = torch.zeros(0, 3, requires_grad=True)
    assert not strided.is_contiguous()
    opt_strided, opt_dense = MAKERS[name]([strided, empty]), MAKERS[name]([dense])
    for _ in range(3):
        grad = torch.randn(6, 4, generator=gen)
        strided.grad, dense.grad, empty.grad = grad.t().contiguous().t(), grad.clone(), torch.zeros(0, 3)
        opt_strided.step()
        opt_dense.step()
    assert empty.shape == (0, 3) and not strided.is_contiguous()
    torch.testing.assert_close(strided.detach(), dense.detach(), rtol=1e-6, atol=1e-6)
    for key, value in opt_dense.state[dense].items():
        torch.testing.assert_close(opt_strided.state[strided][key], value, rtol=1e-6, atol=1e-6)


def test_step_without_gradients_changes_nothing():
    p = torch.ones(3, requires_grad=True)
    for make in MAKERS.values():
        opt = make([p])
        opt.step()
        assert torch.equal(p.detach(), torch.ones(3)) and not opt.state
        assert all("step" not in g for g in opt.param_groups)


# ---------------------------------------------------------------------------------------------
# Under ampinit at O2.
# ---------------------------------------------------------------------------------------------

O2_MAKERS = {
    "lamb": lambda ps: FusedLAMB(ps, lr=1e-2, weight_decay=0.01),
    "novograd": lambda ps: FusedNovoGrad(ps, lr=1e-1, weight_decay=0.01),
    "adagrad": lambda ps: FusedAdagrad(ps, lr=1e-2, weight_decay=0.01),
}


def _masters(opt):
    return [p for group in opt.param_groups for p in group["params"]]


def _o2_net():
    """Linear -> BatchNorm -> ReLU -> Linear.  The first Linear has no bias: a bias before a
    BatchNorm gets a gradient that is exactly zero but for rounding, which these normalising
    optimizers (and Adam) turn into full-size steps in arbitrary directions."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 4))


@pytest.mark.parametrize("name", sorted(O2_MAKERS))
def test_trains_under_o2(name):
    """At O2 the optimizer updates FP32 masters (fp16 Linear weights, FP32 BatchNorm) from the
    unscaled fp16 gradients.  Compared with the same optimizer on an FP32 copy of the model:
    the fp16 forward/backward perturbs each gradient by ~1e-3 relative, and each of these
    optimizers divides the gradient by a running magnitude, so the masters cannot match the
    FP32 run closely; what they must do is follow it.  Each tensor's displacement after 5 steps
    must match the FP32 run's to 1% (relative L2; measured ~5e-4), which a skipped or doubled
    update, a master not updated or not copied back, or a model rounded to fp16 between steps
    would miss.  (These optimizers are nearly invariant to the gradient's scale, so this does
    not check the unscaling; ampinit's own tests do.)"""
    fp32_model = _o2_net()
    model = copy.deepcopy(fp32_model)
    initial = [p.detach().clone() for p in fp32_model.parameters()]
    fp32_opt = O2_MAKERS[name](fp32_model.parameters())
    opt = O2_MAKERS[name](model.parameters())
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    assert isinstance(opt, type(fp32_opt)) and model[0].weight.dtype == torch.float16

    for step in range(5):
        train_step(model, opt, step)
        x, y = batch(step)
        fp32_opt.zero_grad()
        ((fp32_model(x) - y) ** 2).mean().backward()
        fp32_opt.step()

    masters = _masters(opt)
    assert len(masters) == len(initial) and all(m.dtype == torch.float32 for m in masters)
    for master, reference, start in zip(masters, fp32_model.parameters(), initial):
        expected = reference.detach() - start
        assert expected.norm() > 1e-3
        assert (master.detach() - reference.detach()).norm() / expected.norm() < 1e-2
    for master, param in zip(masters, model.parameters()):
        assert torch.equal(param.detach(), master.detach().to(param.dtype))
    assert opt.amp.skipped_steps == 0

    # An overflowing step is skipped: masters, model and optimizer state are unchanged by it.
    before_masters = [m.detach().clone() for m in masters]
    before_model = [p.detach().clone() for p in model.parameters()]
    before_state = {m: {k: v.clone() for k, v in opt.state[m].items()} for m in masters}
    before_steps = [g.get("step") for g in opt.param_groups]
    train_step(model, opt, 5, poison=True)
    assert opt.amp.skipped_steps == 1
    assert all(torch.equal(m.detach(), b) for m, b in zip(masters, before_masters))
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before_model))
    assert all(torch.equal(opt.state[m][k], v) for m, s in before_state.items() for k, v in s.items())
    assert [g.get("step") for g in opt.param_groups] == before_steps
    # ... and training goes on from there.
    train_step(model, opt, 6)
    assert opt.amp.skipped_steps == 1
    assert not any(torch.equal(m.detach(), b) for m, b in zip(masters, before_masters))


# ---------------------------------------------------------------------------------------------
# Checkpoints written by apex's own optimizers: apex counts steps per param group
# (``param_groups[i]['step']``), and FusedNovoGrad keeps its per-tensor norms in the group.
# ---------------------------------------------------------------------------------------------


def _two_layer(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _train_seq(opt, model, steps, first_step=0):
    for step in range(first_step, first_step + steps):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(8, 6, generator=gen)
        opt.zero_grad()
        model(x).float().pow(2).mean().backward()
        opt.step()


def _apex_adam_layout(torch_state_dict, step):
    """What apex's FusedAdam saves for the same moments: exp_avg/exp_avg_sq per param, the step
    count in each param group (an int, or apex's capturable int tensor)."""
    state = {k: {"exp_avg": v["exp_avg"].clone(), "exp_avg_sq": v["exp_avg_sq"].clone()}
             for k, v in torch_state_dict["state"].items()}
    groups = [{key: group[key] for key in ("lr", "betas", "eps", "weight_decay", "params")}
              for group in torch_state_dict["param_groups"]]
    for group in groups:
        group.update(bias_correction=True, step=step)
    return {"state": state, "param_groups": groups}


@pytest.mark.parametrize("step_type", ["int", "tensor"])
@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "adam"])
def test_fused_adam_resumes_an_apex_checkpoint_like_the_uninterrupted_run(adam_w_mode, step_type):
    """The reference is torch.optim.AdamW/Adam run 15 steps uninterrupted; ampinit's FusedAdam
    loads the moments and group step of step 10 in apex's layout and must end where it does."""
    torch_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    hyper = dict(lr=1e-2, weight_decay=0.01, eps=1e-8)
    reference = _two_layer()
    opt_ref = torch_cls(reference.parameters(), **hyper)
    _train_seq(opt_ref, reference, 10)
    apex_sd = _apex_adam_layout(opt_ref.state_dict(), 10 if step_type == "int" else torch.tensor([10]))
    resumed = _two_layer(seed=5)
    resumed.load_state_dict(reference.state_dict())
    opt = amp.optim.FusedAdam(resumed.parameters(), adam_w_mode=adam_w_mode, **hyper)
    opt.load_state_dict(apex_sd)
    _train_seq(opt_ref, reference, 5, first_step=10)
    _train_seq(opt, resumed, 5, first_step=10)
    for p, q in zip(reference.parameters(), resumed.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
    assert [float(s["step"]) for s in opt.state.values()] == [15.0] * 4
    assert all("step" not in group for group in opt.param_groups)  # no stale group count
    # What it saves now is torch's layout, and torch continues it.
    torch_again = torch_cls(resumed.parameters(), **hyper)
    torch_again.load_state_dict(opt.state_dict())
    assert [float(s["step"]) for s in torch_again.state.values()] == [15.0] * 4


def test_fused_adam_keeps_per_param_steps_over_a_group_step():
    """A per-param ``step`` (torch's layout) wins over a group's; a param without saved moments
    starts from 0, as in torch."""
    model = _two_layer()
    opt = amp.optim.FusedAdam(model.parameters(), lr=1e-2)
    _train_seq(opt, model, 3)
    saved = opt.state_dict()
    saved["param_groups"][0]["step"] = 99
    del saved["state"][3]
    fresh = amp.optim.FusedAdam(model.parameters(), lr=1e-2)
    fresh.load_state_dict(saved)
    params = list(model.parameters())
    assert [float(fresh.state[p]["step"]) for p in params[:3]] == [3.0] * 3
    assert params[3] not in fresh.state


def _novograd_to_apex_layout(state_dict, params):
    """Move FusedNovoGrad's per-param norms into the group, as apex keeps them: one tensor for
    the float16 params, one for the float32 params, each in the group's order."""
    state_dict = copy.deepcopy(state_dict)
    for group in state_dict["param_groups"]:
        norms = {torch.float16: [], torch.float32: []}
        for index in group["params"]:
            norms[params[index].dtype].append(state_dict["state"][index].pop("exp_avg_sq").reshape(()))
        group["exp_avg_sq"] = [torch.stack(norms[torch.float16]) if norms[torch.float16] else torch.zeros(0),
                               torch.stack(norms[torch.float32])]
    return state_dict


@pytest.mark.parametrize("name", ["lamb", "lamb-l2-nvlamb", "novograd", "novograd-max-zero", "adagrad"])
def test_apex_layout_checkpoints_continue_exactly(name):
    """apex's FusedLAMB/FusedNovoGrad/FusedAdagrad checkpoints (group step, NovoGrad's norms in the
    group, one param in float16 so that apex's two norm lists are both used) continue as the
    uninterrupted run does."""
    whole = _two_layer()
    whole[0].bias.data = whole[0].bias.data.half()
    opt_whole = MAKERS[name](whole.parameters())

    def run(opt, model, steps, first_step=0):
        for step in range(first_step, first_step + steps):
            gen = torch.Generator().manual_seed(step)
            opt.zero_grad()
            x = torch.randn(8, 6, generator=gen)
            out = torch.nn.functional.linear(x, model[0].weight, model[0].bias.float())
            model[2](torch.tanh(out)).pow(2).mean().backward()
            opt.step()

    run(opt_whole, whole, 6)
    params = list(whole.parameters())
    saved = opt_whole.state_dict()
    if name.startswith("novograd"):
        saved = _novograd_to_apex_layout(saved, params)
    resumed = copy.deepcopy(whole)
    opt_resumed = MAKERS[name](resumed.parameters())
    opt_resumed.load_state_dict(saved)
    run(opt_whole, whole, 4, first_step=6)
    run(opt_resumed, resumed, 4, first_step=6)
    for p, q in zip(whole.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
    assert [g.get("step") for g in opt_whole.param_groups] == [g.get("step") for g in opt_resumed.param_groups]
    assert all("exp_avg_sq" not in g for g in opt_resumed.param_groups)


def test_novograd_apex_norms_that_do_not_match_raise():
    model = _two_layer()
    opt = FusedNovoGrad(model.parameters())
    _train_seq(opt, model, 2)
    saved = _novograd_to_apex_layout(opt.state_dict(), list(model.parameters()))
    saved["param_groups"][0]["exp_avg_sq"][1] = saved["param_groups"][0]["exp_avg_sq"][1][:3]
    with pytest.raises(ValueError, match="same parameters"):
        FusedNovoGrad(model.parameters()).load_state_dict(saved)
