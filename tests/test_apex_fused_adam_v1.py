"""apex 0.1's ``FusedAdam(..., max_grad_norm=...)`` and ``apex.optimizers.FP16_Optimizer``, the
pair of pytorch-pretrained-BERT's fp16 examples, against apex's behaviour written out below:
an fp16 model, flat FP32 masters per param group, the group's norm of the fp16 gradients for
the overflow check and the clipping, and the 0.1 kernel's update."""
import io
import math

import pytest
import torch
from torch import nn

from ampinit.apex import optimizers as apex_optimizers
from ampinit.apex.fused_adam_v1 import FusedAdamV1

INF = float("inf")


class ApexV1Reference:
    """apex 0.1's ``FP16_Optimizer(FusedAdam(groups, ...), dynamic_loss_scale=...)``, by hand."""

    def __init__(self, groups, *, bias_correction, betas=(0.9, 0.999), eps=1e-8, eps_inside_sqrt=False,
                 max_grad_norm=0.0, dynamic=True, static_scale=1.0):
        self.groups = groups  # dicts: params (the fp16 model's), lr, weight_decay
        self.masters = [torch.cat([p.detach().float().flatten() for p in g["params"]]) for g in groups]
        self.exp_avg = [torch.zeros_like(m) for m in self.masters]
        self.exp_avg_sq = [torch.zeros_like(m) for m in self.masters]
        self.steps = [0 for _ in groups]
        self.bias_correction, self.betas, self.eps = bias_correction, betas, eps
        self.eps_inside_sqrt, self.max_grad_norm = eps_inside_sqrt, max_grad_norm
        self.dynamic = dynamic
        self.cur_scale = 2.0 ** 16 if dynamic else static_scale
        self.cur_iter, self.last_overflow_iter = 0, -1
        self.clipped = 0  # how many group updates the clipping changed

    def zero_grad(self):
        for g in self.groups:
            for p in g["params"]:
                p.grad = None

    def backward(self, loss):
        (loss.float() * self.cur_scale).backward()

    def step(self):
        flats = [torch.cat([p.grad.flatten() for p in g["params"]]) for g in self.groups]
        norms = [float(torch.norm(f, 2.0, dtype=torch.float32)) for f in flats]
        if not all(math.isfinite(n) for n in norms):
            self._update_scale(True)
            return
        beta1, beta2 = self.betas
        for i, (group, flat, norm) in enumerate(zip(self.groups, flats, norms)):
            combined = self.cur_scale
            if self.max_grad_norm > 0:
                clip = (norm / self.cur_scale + 1e-6) / self.max_grad_norm
                if clip > 1:
                    combined = clip * self.cur_scale
                    self.clipped += 1
            self.steps[i] += 1
            t = self.steps[i]
            step_size = group["lr"]
            if self.bias_correction:
                step_size = group["lr"] * math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t)
            g = flat.float() / combined
            p, m, v = self.masters[i], self.exp_avg[i], self.exp_avg_sq[i]
            m.mul_(beta1).add_((1 - beta1) * g)
            v.mul_(beta2).add_((1 - beta2) * g * g)
            denom = (v + self.eps).sqrt() if self.eps_inside_sqrt else v.sqrt() + self.eps
            p.sub_(step_size * (m / denom + group["weight_decay"] * p))
            with torch.no_grad():
                for param, value in zip(group["params"], p.split([q.numel() for q in group["params"]])):
                    param.copy_(value.view_as(param))
        self._update_scale(False)

    def _update_scale(self, skip):
        if self.dynamic:
            if skip:
                self.cur_scale = max(self.cur_scale / 2, 1)
                self.last_overflow_iter = self.cur_iter
            elif (self.cur_iter - self.last_overflow_iter) % 1000 == 0:
                self.cur_scale *= 2
        self.cur_iter += 1

    def state_dict(self):
        """What apex's wrapper saved: flat masters and one flat state entry per group."""
        state = {i: {"step": self.steps[i], "exp_avg": self.exp_avg[i].clone(),
                     "exp_avg_sq": self.exp_avg_sq[i].clone()} for i in range(len(self.groups)) if self.steps[i]}
        groups = [{"lr": g["lr"], "bias_correction": self.bias_correction, "betas": self.betas, "eps": self.eps,
                   "weight_decay": g["weight_decay"], "max_grad_norm": self.max_grad_norm, "params": [i]}
                  for i, g in enumerate(self.groups)]
        out = {"dynamic_loss_scale": self.dynamic, "cur_scale": self.cur_scale, "cur_iter": self.cur_iter,
               "optimizer_state_dict": {"state": state, "param_groups": groups},
               "fp32_groups_flat": [m.clone() for m in self.masters]}
        if self.dynamic:
            out.update(last_overflow_iter=self.last_overflow_iter, scale_factor=2, scale_window=1000)
        return out


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).half()


def _bert_groups(model):
    """pytorch-pretrained-BERT's two groups: weight decay except on biases."""
    return [{"params": [p for n, p in model.named_parameters() if "bias" not in n], "weight_decay": 0.01},
            {"params": [p for n, p in model.named_parameters() if "bias" in n], "weight_decay": 0.0}]


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 6, generator=g).half(), 3 * torch.randn(8, 3, generator=g)


def _lr(step, base=5e-2, total=16):
    """BERT's warmup_linear, set by hand in param_groups every step."""
    progress = step / total
    return base * (progress / 0.1 if progress < 0.1 else 1.0 - progress)


def _train(model, opt, steps, planted=(), first=0):
    for step in range(first, first + steps):
        x, y = _batch(step)
        loss = ((model(x).float() - y) ** 2).mean()
        opt.backward(loss * (INF if step in planted else 1.0))
        for group in opt.groups if isinstance(opt, ApexV1Reference) else opt.param_groups:
            group["lr"] = _lr(step)
        opt.step()
        opt.zero_grad()


def _ampinit_pair(model, **kwargs):
    dynamic = kwargs.pop("dynamic", True)
    inner = apex_optimizers.FusedAdam(_bert_groups(model), lr=_lr(0), **kwargs)
    return apex_optimizers.FP16_Optimizer(inner, dynamic_loss_scale=dynamic, verbose=False)


def _reference(model, **kwargs):
    return ApexV1Reference(_bert_groups(model), **kwargs)


def _assert_same(model, reference_model, opt, reference):
    masters = torch.cat([p.detach().flatten() for g in opt.param_groups for p in g["params"]])
    torch.testing.assert_close(masters, torch.cat(reference.masters), rtol=2e-5, atol=1e-6)
    for p, q in zip(model.parameters(), reference_model.parameters()):
        torch.testing.assert_close(p, q, rtol=2e-3, atol=1e-5)  # one fp16 rounding apart at most
    assert opt.loss_scale == reference.cur_scale


CONFIGS = {
    "bert": dict(bias_correction=False, max_grad_norm=1.0),
    "bias_correction": dict(bias_correction=True, max_grad_norm=1.0),
    "eps_inside_sqrt": dict(bias_correction=True, eps=1e-6, eps_inside_sqrt=True, max_grad_norm=0.5),
    "no_clipping": dict(bias_correction=False, max_grad_norm=0.0),
    "static": dict(bias_correction=False, max_grad_norm=1.0, dynamic=False),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fp16_optimizer_with_fused_adam_v1_trains_like_apex(name):
    kwargs = dict(CONFIGS[name])
    planted = {3, 4, 9} if kwargs.get("dynamic", True) else ()
    model, reference_model = _model(), _model()
    opt = _ampinit_pair(model, **kwargs)
    assert isinstance(opt.optimizer, FusedAdamV1)
    reference = _reference(reference_model, **kwargs)
    _train(model, opt, 14, planted)
    _train(reference_model, reference, 14, planted)
    _assert_same(model, reference_model, opt, reference)
    if kwargs["max_grad_norm"] > 0:
        assert reference.clipped > 0  # the test reaches the clipping
    assert reference.cur_scale <= (2.0 ** 13 if planted else 1.0)  # the planted overflows, and natural ones


@pytest.mark.parametrize("changed", ["max_grad_norm", "bias_correction", "eps_inside_sqrt", "per_group_norm"])
def test_the_reference_tells_the_settings_apart(changed):
    """The comparison above has the power to see each setting: changing it moves the weights
    beyond its tolerance."""
    kwargs = dict(bias_correction=False, eps=1e-6, max_grad_norm=1.0)
    model, other_model = _model(), _model()
    reference = _reference(model, **kwargs)
    if changed == "max_grad_norm":
        kwargs["max_grad_norm"] = 0.0
    elif changed == "per_group_norm":  # one group: the biases are clipped with the weights
        kwargs["max_grad_norm"] = 1.0
    else:
        kwargs[changed] = True
    other = _reference(other_model, **kwargs)
    if changed == "per_group_norm":
        other.groups = [{"params": list(other_model.parameters()), "lr": _lr(0), "weight_decay": 0.01}]
        other.masters = [torch.cat([p.detach().float().flatten() for p in other_model.parameters()])]
        other.exp_avg, other.exp_avg_sq, other.steps = [torch.zeros_like(other.masters[0])], \
            [torch.zeros_like(other.masters[0])], [0]
    _train(model, reference, 8)
    _train(other_model, other, 8)
    assert not all(torch.allclose(p, q, rtol=2e-3, atol=1e-5) for p, q in zip(model.parameters(),
                                                                              other_model.parameters()))


def test_an_apex_checkpoint_of_the_pair_resumes_like_apex():
    """apex's flat checkpoint (fp32_groups_flat, one flat state entry per group) loads into
    per-parameter masters and state, and training continues as apex's would."""
    kwargs = dict(bias_correction=True, max_grad_norm=1.0)
    reference_model = _model()
    reference = _reference(reference_model, **kwargs)
    _train(reference_model, reference, 6, planted={2})
    checkpoint = {"model": reference_model.state_dict(), "optimizer": reference.state_dict()}
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=False)

    model = _model(seed=7)  # other weights: all of them must come from the checkpoint
    opt = _ampinit_pair(model, **kwargs)
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["optimizer"])
    _assert_same(model, reference_model, opt, reference)
    first = opt.param_groups[0]["params"][0]
    assert opt.state[first]["step"] == reference.steps[0] > 0 and opt.state[first]["exp_avg"].shape == first.shape

    assert (opt.loss_scaler.cur_iter, opt.loss_scaler.last_overflow_iter) == \
        (reference.cur_iter, reference.last_overflow_iter)

    _train(model, opt, 6, planted={8}, first=6)
    _train(reference_model, reference, 6, planted={8}, first=6)
    _assert_same(model, reference_model, opt, reference)
    assert (opt.loss_scaler.cur_iter, opt.loss_scaler.last_overflow_iter) == \
        (reference.cur_iter, reference.last_overflow_iter) == (12, 8)


def test_an_apex_checkpoint_of_other_groups_is_refused_untouched():
    reference_model = _model()
    reference = _reference(reference_model, bias_correction=False, max_grad_norm=1.0)
    _train(reference_model, reference, 2)
    saved = reference.state_dict()
    model = _model(seed=3)
    inner = apex_optimizers.FusedAdam(model.parameters(), lr=1e-3, max_grad_norm=1.0)  # one group
    opt = apex_optimizers.FP16_Optimizer(inner, dynamic_loss_scale=True, verbose=False)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="number of param groups"):
        opt.load_state_dict(saved)
    saved["fp32_groups_flat"] = [saved["fp32_groups_flat"][0][:-1]]
    saved["optimizer_state_dict"]["param_groups"] = saved["optimizer_state_dict"]["param_groups"][:1]
    inner2 = apex_optimizers.FusedAdam(_bert_groups(model)[:1], lr=1e-3, max_grad_norm=1.0)
    opt2 = apex_optimizers.FP16_Optimizer(inner2, dynamic_loss_scale=True, verbose=False)
    with pytest.raises(ValueError, match="holds"):
        opt2.load_state_dict(saved)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert opt.loss_scale == opt2.loss_scale == 2.0 ** 16 and not opt2.state


def test_the_pairs_own_checkpoint_resumes_bit_for_bit():
    kwargs = dict(bias_correction=True, max_grad_norm=1.0)
    straight_model = _model()
    straight = _ampinit_pair(straight_model, **kwargs)
    _train(straight_model, straight, 10, planted={3})

    model = _model()
    opt = _ampinit_pair(model, **kwargs)
    _train(model, opt, 5, planted={3})
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=False)
    model = _model(seed=5)
    opt = _ampinit_pair(model, **kwargs)
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["optimizer"])
    _train(model, opt, 5, first=5)
    for p, q in zip(model.parameters(), straight_model.parameters()):
        assert torch.equal(p, q)
    assert opt.loss_scale == straight.loss_scale


def test_fused_adam_dispatches_on_apex_0_1_arguments():
    params = [torch.zeros(3, requires_grad=True)]
    today = apex_optimizers.FusedAdam(params, lr=1e-3, bias_correction=False)
    assert type(today) is apex_optimizers.FusedAdam and isinstance(today, apex_optimizers.FusedAdam)
    for argument in ({"max_grad_norm": 1.0}, {"eps_inside_sqrt": True}, {"use_mt": True}):
        old = apex_optimizers.FusedAdam(params, lr=1e-3, **argument)
        assert type(old) is FusedAdamV1 is apex_optimizers.FusedAdam_v1
    with pytest.raises(ValueError, match="amp_scale_adjustment"):
        apex_optimizers.FusedAdam(params, amp_scale_adjustment=2.0)
    with pytest.raises(ValueError, match="AMSGrad"):
        apex_optimizers.FusedAdam(params, max_grad_norm=1.0, amsgrad=True)
    with pytest.raises(ValueError, match="max_grad_norm"):
        apex_optimizers.FusedAdam(params, max_grad_norm=-1.0)
    with pytest.raises(ValueError, match="beta2"):
        FusedAdamV1(params, betas=(0.9, 1.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fused_adam_v1_alone_with_apex_step_arguments(dtype):
    """Without FP16_Optimizer: ``step(scale=..., grad_norms=...)`` as apex's wrapper called it,
    against the 0.1 update written out in FP32; fp16/bf16 params take the FP32 result rounded."""
    torch.manual_seed(0)
    shapes = [(4, 3), (3,), (2, 2)]
    values = [torch.randn(s) for s in shapes]
    params = [nn.Parameter(v.to(dtype, copy=True)) for v in values]
    opt = FusedAdamV1([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}], lr=0.1,
                      weight_decay=0.05, max_grad_norm=0.3, bias_correction=True)
    masters = [v.to(dtype).float().clone() for v in values]
    m = [torch.zeros_like(v) for v in values]
    s = [torch.zeros_like(v) for v in values]
    scale = 64.0
    for t in range(1, 4):
        grads = [torch.randn(sh) * scale for sh in shapes]
        for p, g in zip(params, grads):
            p.grad = g.to(dtype)
        grads = [p.grad.float() for p in params]
        norms = [float(torch.cat([g.flatten() for g in grads[:2]]).norm()), float(grads[2].norm())]
        given = [p.grad.clone() for p in params]
        opt.step(scale=scale, grad_norms=norms)
        assert all(torch.equal(p.grad, g) for p, g in zip(params, given))  # left as they were
        for i, group_index in enumerate([0, 0, 1]):
            clip = (norms[group_index] / scale + 1e-6) / 0.3
            combined = scale * clip if clip > 1 else scale
            g = grads[i] / combined
            m[i] = 0.9 * m[i] + 0.1 * g
            s[i] = 0.999 * s[i] + 0.001 * g * g
            size = 0.1 * math.sqrt(1 - 0.999 ** t) / (1 - 0.9 ** t)
            wd = 0.05 if group_index == 0 else 0.0
            masters[i] = masters[i] - size * (m[i] / (s[i].sqrt() + 1e-8) + wd * masters[i])
            if dtype != torch.float32:
                masters[i] = masters[i].to(dtype).float()  # the param holds only its rounding
        for p, expected in zip(params, masters):
            torch.testing.assert_close(p.float(), expected, rtol=1e-5 if dtype == torch.float32 else 1e-2,
                                       atol=1e-6)
    # without grad_norms the norm is taken from the gradients themselves, on the device
    clone = FusedAdamV1([{"params": [nn.Parameter(params[0].detach().clone())]}], lr=0.1, max_grad_norm=0.3)
    clone.param_groups[0]["params"][0].grad = params[0].grad.clone()
    given = FusedAdamV1([{"params": [nn.Parameter(params[0].detach().clone())]}], lr=0.1, max_grad_norm=0.3)
    given.param_groups[0]["params"][0].grad = params[0].grad.clone()
    clone.step(scale=scale)
    given.step(scale=scale, grad_norms=[float(params[0].grad.float().norm())])
    torch.testing.assert_close(clone.param_groups[0]["params"][0], given.param_groups[0]["params"][0])


def test_fused_adam_v1_refuses_what_ampinit_replaces_before_changing_anything():
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    opt = FusedAdamV1([p], lr=0.1)
    calls = []
    with pytest.raises(NotImplementedError, match="FP16_Optimizer"):
        opt.step(grads=[[torch.ones(3)]], output_params=[[torch.zeros(3, dtype=torch.half)]])
    with pytest.raises(ValueError, match="one norm per param group"):
        opt.step(grad_norms=[1.0, 2.0])
    with pytest.raises(ValueError, match="scale"):
        opt.step(scale=0.0)
    assert torch.equal(p, torch.ones(3)) and not opt.state
    loss = opt.step(closure=lambda: calls.append(1) or 3.0)
    assert loss == 3.0 and calls == [1] and opt.state[p]["step"] == 1 and not torch.equal(p, torch.ones(3))


def test_zero_grad_sets_none_and_the_dynamic_scale_starts_at_2_16():
    model = _model()
    opt = _ampinit_pair(model, bias_correction=False, max_grad_norm=1.0)
    assert opt.loss_scale == 2.0 ** 16 and opt.loss_scaler.cur_scale == 2.0 ** 16
    x, y = _batch(0)
    opt.backward(((model(x).float() - y) ** 2).mean())
    opt.step()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_subclasses_and_positional_arguments_are_never_silently_the_other_fused_adam():
    """From the review: a subclass built with 0.1's arguments came back as a plain FusedAdamV1
    (its own __init__ and step skipped); seven positional arguments built today's optimizer
    from 0.1's order (eps_inside_sqrt landed on adam_w_mode)."""
    params = [nn.Parameter(torch.zeros(3))]

    class Logged(apex_optimizers.FusedAdam):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.calls = 0

    class Clipped(apex_optimizers.FusedAdam):
        def __init__(self, params):
            super().__init__(params, lr=1e-3, max_grad_norm=1.0)

    class OldStyle(apex_optimizers.FusedAdam_v1):
        pass

    with pytest.raises(TypeError, match="FusedAdam_v1"):
        Logged(params, lr=1e-3, max_grad_norm=1.0)
    with pytest.raises(TypeError, match="FusedAdam_v1"):
        Clipped(params)
    with pytest.raises(TypeError, match="by keyword"):
        apex_optimizers.FusedAdam(params, 1e-3, False, (0.9, 0.999), 1e-8, False, 0.01)
    assert Logged(params, 1e-3).calls == 0 and type(OldStyle(params, max_grad_norm=1.0)) is OldStyle
    old = apex_optimizers.FusedAdam(params, 1e-3, False, (0.9, 0.999), 1e-8, weight_decay=0.01, max_grad_norm=1.0)
    assert isinstance(old, apex_optimizers.FusedAdam) and isinstance(old, FusedAdamV1)
    assert not isinstance(torch.optim.Adam(params), apex_optimizers.FusedAdam)


@pytest.mark.parametrize("saved_by", ["torch_adam", "todays_fused_adam"])
def test_another_adams_checkpoint_continues_in_fused_adam_v1(saved_by):
    """From the review: a group loaded from a checkpoint without ``max_grad_norm`` made the
    next step raise KeyError.  It takes the constructor's; the moments continue."""
    torch.manual_seed(0)
    param = nn.Parameter(torch.randn(5))
    other = torch.optim.Adam([param], lr=0.01) if saved_by == "torch_adam" \
        else apex_optimizers.FusedAdam([param], lr=0.01, adam_w_mode=False)
    param.grad = torch.randn(5)
    other.step()
    opt = FusedAdamV1([param], lr=0.01, max_grad_norm=1e-3, eps_inside_sqrt=True)
    opt.load_state_dict(other.state_dict())
    group = opt.param_groups[0]
    assert group["max_grad_norm"] == 1e-3 and group["lr"] == 0.01
    state = opt.state[param]
    moments = state["exp_avg"].clone(), state["exp_avg_sq"].clone()
    param.grad = torch.randn(5)
    before = param.detach().clone()
    opt.step()
    g = param.grad / ((param.grad.norm() + 1e-6) / 1e-3)  # clipped to the loaded group's max_grad_norm
    m = 0.9 * moments[0] + 0.1 * g
    v = 0.999 * moments[1] + 0.001 * g * g
    size = 0.01 * math.sqrt(1 - 0.999 ** 2) / (1 - 0.9 ** 2)
    torch.testing.assert_close(param.detach(), before - size * m / (v + 1e-8).sqrt())
    assert state["step"] == 2


@pytest.mark.parametrize("missing", ["cur_scale", "scale_window", "optimizer_state_dict", "state"])
def test_an_incomplete_apex_checkpoint_names_what_it_lacks(missing):
    reference_model = _model()
    reference = _reference(reference_model, bias_correction=False, max_grad_norm=1.0)
    _train(reference_model, reference, 2)
    saved = reference.state_dict()
    if missing == "state":
        del saved["optimizer_state_dict"]["state"]
    else:
        del saved[missing]
    model = _model(seed=3)
    opt = _ampinit_pair(model, bias_correction=False, max_grad_norm=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="lacks"):
        opt.load_state_dict(saved)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before)) and not opt.state


def test_apex_0_1_scaler_attributes_live_on_the_wrapper():
    """apex 0.1 kept cur_scale, cur_iter, last_overflow_iter, scale_factor and scale_window on
    the wrapper itself (its state_dict() wrote them from there); scripts log them.  They are
    read-only: apex 0.1's own load_state_dict (copied into UniLM's subclass) sets them one by
    one, and refusing the first write leaves everything as it was."""
    kwargs = dict(bias_correction=False, max_grad_norm=1.0)
    reference_model, model = _model(), _model()
    reference, opt = _reference(reference_model, **kwargs), _ampinit_pair(model, **kwargs)
    _train(reference_model, reference, 5, planted={1, 3})
    _train(model, opt, 5, planted={1, 3})
    _assert_same(model, reference_model, opt, reference)
    got = (opt.cur_scale, opt.cur_iter, opt.last_overflow_iter, opt.scale_factor, opt.scale_window)
    assert got == (reference.cur_scale, reference.cur_iter, reference.last_overflow_iter, 2, 1000) == \
        (2.0 ** 13, 5, 3, 2, 1000)  # a natural overflow at the first step, then the two planted
    saved = reference.state_dict()
    opt.dynamic_loss_scale = saved["dynamic_loss_scale"]  # apex 0.1's load_state_dict, line by line
    with pytest.raises(AttributeError, match="read-only.*loss_scale = s.*drop the override"):
        opt.cur_scale = saved["cur_scale"] * 2
    assert opt.loss_scale == 2.0 ** 13
    static = _ampinit_pair(_model(), dynamic=False, **kwargs)
    assert (static.cur_scale, static.cur_iter) == (1.0, 0)
    for name in ("last_overflow_iter", "scale_factor", "scale_window"):  # apex 0.1's static had none
        assert not hasattr(static, name)


def test_apex_0_1_flat_buffers_are_refused_with_what_to_use():
    """A copy under apex's name would take a hand-written resume's writes and lose them."""
    opt = _ampinit_pair(_model(), bias_correction=False, max_grad_norm=1.0)
    for name in ("fp16_groups_flat", "fp32_groups_flat"):
        with pytest.raises(AttributeError, match="one FP32 master per parameter.*drop the override"):
            getattr(opt, name)

    class Subclass(apex_optimizers.FP16_Optimizer):
        @property
        def weight_decay(self):
            return self.param_groups[0]["wd"]  # a KeyError, not an AttributeError, of its own

        @property
        def warmup(self):
            return self.missing_helper  # its own AttributeError keeps its own name

    sub = Subclass(apex_optimizers.FusedAdam(_model().parameters(), lr=1e-3, max_grad_norm=1.0), verbose=False)
    with pytest.raises(KeyError, match="wd"):
        assert sub.weight_decay is None
    with pytest.raises(AttributeError, match="missing_helper"):
        assert sub.warmup is None
