"""Every repro of ../shared/repros as a regression test, on more shapes, levels, optimizers and
schedulers than the repro itself: each failed before the fix (silently, or with an unclear
error).  Each test compares against what plain PyTorch (FP32) does with the same script."""
import collections
import copy
import dataclasses
import gc
import io
import logging
import pickle
import re
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ampinit as amp
import ampinit.optim
from conftest import ZERO_STYLES, amp_backward, clear_grads, initialize_at

LEVELS = ["O0", "O1", "O2", "O3", "O4", "O5"]
MASTER_LEVELS = ["O2", "O5"]


def two_heads(seed=0, width=6):
    torch.manual_seed(seed)
    return nn.ModuleList([nn.Linear(width, 3), nn.Linear(width, 2)])


def fp32_like(t):
    return t.detach().float().clone()


# -- r01: several losses before one step, a later one not reaching some parameters --------------

@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("make_opt", [lambda p: torch.optim.SGD(p, lr=0.1),
                                      lambda p: torch.optim.Adam(p, lr=1e-2, eps=1e-3)], ids=["sgd", "adam"])
def test_r01_second_loss_does_not_erase_the_first(level, make_opt):
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    ref = two_heads()
    ref[0](x).pow(2).mean().backward()
    ref[1](x).pow(2).mean().backward()
    model = two_heads()
    opt = make_opt(model.parameters())
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0, num_losses=2)
    xin = x.to(model[0].weight.dtype) if level in ("O2", "O3", "O5") else x
    with amp.scale_loss(model[0](xin).float().pow(2).mean(), opt, loss_id=0) as scaled:
        scaled.backward()
    with amp.scale_loss(model[1](xin).float().pow(2).mean(), opt, loss_id=1) as scaled:
        scaled.backward()
    tol = dict(rtol=1e-5, atol=1e-6) if level == "O0" else dict(rtol=3e-2, atol=3e-3)
    for master, reference in zip(amp.master_params(opt), ref.parameters()):
        assert master.grad is not None
        torch.testing.assert_close(master.grad.float(), reference.grad, **tol)
    before = [fp32_like(p) for p in model.parameters()]
    opt.step()
    assert all(not torch.equal(a, fp32_like(p)) for a, p in zip(before, model.parameters()))


# -- r02, r03, s_scheduler_before_initialize: a step wrapped before initialize -----------------

SCHEDULERS = {
    "steplr": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    "lambdalr": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step)),
    "onecycle": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=20),
}


def _scheduled_run(level, make_sched, when, poison_at=2, steps=6):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, eps=1e-3)  # 1e-8 is 0 in fp16 (O3)
    sched = make_sched(opt) if when == "before" else None
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    if when == "after":
        sched = make_sched(opt)
    data = torch.Generator().manual_seed(3)
    for step in range(steps):
        opt.zero_grad()
        loss = model(torch.randn(9, 5, generator=data)).float().pow(2).mean()
        if step == poison_at:
            loss = loss * float("nan")
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        sched.step()
    return model, opt


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3", "O5"])
@pytest.mark.parametrize("sched", list(SCHEDULERS))
def test_r02_scheduler_made_before_initialize_cannot_bypass_the_step(level, sched):
    model, opt = _scheduled_run(level, SCHEDULERS[sched], "before")
    assert "step" in opt.__dict__  # the scheduler's wrapper of the pre-initialize step is there
    ref_model, ref_opt = _scheduled_run(level, SCHEDULERS[sched], "after")
    assert opt.amp.skipped_steps == ref_opt.amp.skipped_steps == 1
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.isfinite(p).all() and torch.equal(p, q)
    if level in MASTER_LEVELS:
        for p in model.parameters():
            master = opt.amp._master_of(p)
            assert master is None or torch.equal(p, master.to(p.dtype))


@pytest.mark.parametrize("when", ["before", "after"])
def test_r02_torch_step_hooks_see_the_written_model(when):
    """A post-step hook registered before initialize (an EMA of the model) runs after ampinit
    wrote the new weights into the model, on either path of the step."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    seen = []
    opt.register_step_post_hook(lambda o, a, k: seen.append(model.weight.detach().clone()))
    if when == "before":
        torch.optim.lr_scheduler.StepLR(opt, 1)
    model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale=128.0, verbosity=0)
    with amp.scale_loss(model(torch.ones(3, 4)).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert opt.amp.skipped_steps == 0
    assert len(seen) == 1 and torch.equal(seen[0], model.weight), when


# -- r04: clipping with a fused optimizer ---------------------------------------------------

@pytest.mark.parametrize("level", MASTER_LEVELS)
@pytest.mark.parametrize("fused_cls", ["FusedSGD", "FusedAdam"])
def test_r04_clipping_master_params_of_a_fused_optimizer_sees_unscaled_gradients(level, fused_cls):
    from ampinit import optim as amp_optim
    plain_cls = {"FusedSGD": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                 "FusedAdam": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.0)}[fused_cls]
    fused = {"FusedSGD": lambda p: amp_optim.FusedSGD(p, lr=0.1, momentum=0.9),
             "FusedAdam": lambda p: amp_optim.FusedAdam(p, lr=1e-2)}[fused_cls]
    results = []
    for make_opt in (fused, plain_cls):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
        model, opt = amp.initialize(model, make_opt(model.parameters()), opt_level=level, verbosity=0)
        norms = []
        for step in range(4):
            opt.zero_grad()
            x = torch.randn(32, 16, generator=torch.Generator().manual_seed(step))
            with amp.scale_loss(model(x).float().pow(2).mean() * 10, opt) as scaled:
                scaled.backward()
            norms.append(torch.nn.utils.clip_grad_norm_(amp.master_params(opt), max_norm=0.05).item())
            opt.step()
        results.append((norms, [p.detach().clone() for p in amp.master_params(opt)]))
    (fused_norms, fused_masters), (plain_norms, plain_masters) = results
    assert all(n > 0.05 for n in plain_norms)  # the clipping did something
    assert fused_norms == pytest.approx(plain_norms, rel=1e-5)
    for a, b in zip(fused_masters, plain_masters):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# -- r05: wrapper optimizers ----------------------------------------------------------------

@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_r05_zero_redundancy_optimizer(one_rank_group):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    model = nn.Linear(4, 2)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    for level in MASTER_LEVELS:
        with pytest.raises(ValueError, match="ZeroRedundancyOptimizer steps an optimizer of its own"):
            amp.initialize(model, opt, opt_level=level, verbosity=0)
        assert model.weight.dtype == torch.float32 and type(opt) is ZeroRedundancyOptimizer
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    w0 = model.weight.detach().clone()
    for step in range(3):
        opt.zero_grad()
        loss = model(torch.randn(8, 4)).pow(2).mean() * (float("inf") if step == 1 else 1.0)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
    assert opt.amp.skipped_steps == 1 and torch.isfinite(model.weight).all()
    assert not torch.equal(w0, model.weight)


class LarcLike:
    """A LARC-style wrapper (as apex's): not an Optimizer, shares the inner param_groups,
    rescales each gradient by a trust ratio, then steps the inner optimizer."""

    def __init__(self, optimizer, trust_coefficient=0.02):
        self.optim = optimizer
        self.trust_coefficient = trust_coefficient

    @property
    def param_groups(self):
        return self.optim.param_groups

    @property
    def state(self):
        return self.optim.state

    def zero_grad(self):
        self.optim.zero_grad()

    def step(self):
        with torch.no_grad():
            for group in self.optim.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        ratio = self.trust_coefficient * p.norm() / (p.grad.norm() + 1e-8)
                        p.grad.mul_(torch.clamp(ratio / group["lr"], max=1.0))
        self.optim.step()


@pytest.mark.parametrize("level", ["O1", "O2", "O5"])
def test_r05_larc_style_wrapper_trains_like_fp32(level):
    x = torch.randn(16, 5, generator=torch.Generator().manual_seed(0))
    results = []
    for use_amp in (True, False):
        torch.manual_seed(0)
        model = nn.Linear(5, 3)
        larc = LarcLike(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        if use_amp:
            model, larc2 = amp.initialize(model, larc, opt_level=level, verbosity=0)
            assert larc2 is larc and amp.handle_of(larc) is amp.handle_of(model)
        for step in range(4):
            larc.zero_grad()
            loss = model(x.to(model.weight.dtype)).float().pow(2).mean()
            if use_amp:
                with amp.scale_loss(loss * (float("inf") if step == 2 else 1.0), larc) as scaled:
                    scaled.backward()
            elif step != 2:
                loss.backward()
            else:
                continue  # the reference skips the overflowing step
            larc.step()
        results.append(model.weight.detach().float().clone())
    torch.testing.assert_close(results[0], results[1], rtol=2e-2, atol=2e-3)


# -- r06: an exception inside scale_loss -----------------------------------------------------

@pytest.mark.parametrize("level, scale", [("O1", 1024.0), ("O1", "dynamic"), ("O2", 1024.0), ("O5", None),
                                          ("O0", "dynamic")])
@pytest.mark.parametrize("where", ["after_backward", "before_backward"])
def test_r06_exception_in_scale_loss_leaves_what_fp32_leaves(level, scale, where):
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))

    def run(use_amp):
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        if use_amp:
            kwargs = {} if scale is None else {"loss_scale": scale}
            model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0, **kwargs)
        for it in range(3):  # the loop clears gradients at the end of an iteration
            try:
                loss = model(x.to(model.weight.dtype)).float().pow(2).mean()
                if use_amp:
                    with amp.scale_loss(loss, opt) as scaled:
                        if where == "after_backward" or it:
                            scaled.backward()
                        if it == 0:
                            raise KeyboardInterrupt
                else:
                    if where == "after_backward" or it:
                        loss.backward()
                    if it == 0:
                        raise KeyboardInterrupt
                opt.step()
                opt.zero_grad()
            except KeyboardInterrupt:
                grads = [None if p.grad is None else p.grad.float().clone() for p in amp.master_params(opt)] \
                    if use_amp else [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        return grads, model.weight.detach().float()

    (grads, weight), (ref_grads, ref_weight) = run(True), run(False)
    for g, r in zip(grads, ref_grads):
        assert (g is None) == (r is None)
        if g is not None:  # unscaled, not left multiplied by the loss scale
            torch.testing.assert_close(g, r, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(weight, ref_weight, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("level", ["O1", "O2", "O5"])
def test_r06_a_backward_that_raises_on_a_loss_without_history_changes_nothing(level):
    """A loss computed under no_grad: its backward raises inside scale_loss.  Nothing ran, so
    the scaler's counters, the gradients and the next steps are the uninterrupted run's (the
    scaler counted it as a clean backward, moving the next scale growth)."""
    def run(interrupt):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        model, opt = amp.initialize(model, torch.optim.Adam(model.parameters(), lr=1e-3), opt_level=level,
                                    verbosity=0, loss_scale="dynamic", growth_interval=2)
        gen = torch.Generator().manual_seed(1)
        for step in range(5):
            x = torch.randn(8, 4, generator=gen).to(next(model.parameters()).dtype)
            if interrupt and step == 2:
                with torch.no_grad():
                    loss = model(x).float().pow(2).mean()
                before = amp.state_dict()
                with pytest.raises(RuntimeError, match="does not require grad"):
                    with amp.scale_loss(loss, opt) as scaled:
                        scaled.backward()
                assert amp.state_dict() == before
            opt.zero_grad()
            with amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
                scaled.backward()
            opt.step()
        return amp.state_dict(), [p.detach().clone() for p in model.parameters()]

    (state, params), (ref_state, ref_params) = run(True), run(False)
    assert state == ref_state
    for got, want in zip(params, ref_params):
        assert torch.equal(got, want)


def test_r06_exception_during_delayed_accumulation_keeps_the_accumulated_gradients():
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0, loss_scale=64.0)
    for i in range(3):
        try:
            with amp.scale_loss(model(x.half()).float().pow(2).mean() / 3, opt, delay_unscale=i < 2) as scaled:
                scaled.backward()
                if i == 1:
                    raise KeyboardInterrupt
        except KeyboardInterrupt:
            pass
    for _ in range(3):
        (ref(x).pow(2).mean() / 3).backward()
    for master, p in zip(amp.master_params(opt), ref.parameters()):
        torch.testing.assert_close(master.grad, p.grad, rtol=1e-2, atol=1e-3)


# -- r07: a kept gradient is never overwritten -------------------------------------------------

@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("set_to_none", [True, False])
def test_r07_a_kept_gradient_is_not_overwritten(level, set_to_none):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    master = next(amp.master_params(opt))
    kept, copies = [], []
    for i in range(3):
        opt.zero_grad(set_to_none=set_to_none)
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(i)).to(model.weight.dtype)
        with amp.scale_loss(model(x).float().mean(), opt) as scaled:
            scaled.backward()
        kept.append(master.grad)
        copies.append(master.grad.clone())
        opt.step()
    if set_to_none:  # as in torch: a new tensor each step, the kept ones unchanged
        assert kept[0] is not kept[1] is not kept[2]
        assert all(torch.equal(k, c) for k, c in zip(kept, copies))


# -- r09: FP32 values of parameters no optimizer holds --------------------------------------

@pytest.mark.parametrize("level", MASTER_LEVELS)
def test_r09_frozen_parameters_keep_fp32_values(level):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
    model[0].requires_grad_(False)
    original = copy.deepcopy(model.state_dict())
    opt = torch.optim.AdamW(model[2].parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    x = torch.randn(8, 64)
    for _ in range(2):
        opt.zero_grad()
        with amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
    state = model.state_dict()
    for key in ("0.weight", "0.bias"):
        assert state[key].dtype == torch.float32 and torch.equal(state[key], original[key])
    plain = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
    plain.load_state_dict(state)
    # a later add_param_group starts the backbone from its FP32 values
    opt.add_param_group({"params": list(model[0].parameters()), "lr": 1e-3})
    master = opt.param_groups[1]["params"][0]
    assert master.dtype == torch.float32 and torch.equal(master, original["0.weight"])
    amp.end(model)
    assert torch.equal(model[0].weight, original["0.weight"]) and model[0].weight.dtype == torch.float32


def test_r09_cast_buffers_keep_fp32_values():
    class WithBuffer(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.register_buffer("table", torch.linspace(0, 1, 7) / 3)

        def forward(self, x):
            return self.lin(x) + self.table[:3]

    model = WithBuffer()
    table = model.table.clone()
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    assert model.table.dtype == torch.float16
    assert torch.equal(model.state_dict()["table"], table)
    with torch.no_grad():
        model.table.mul_(2)  # a write to the model is adopted
    assert torch.equal(model.state_dict()["table"], (table.half() * 2).float())
    amp.end(model)
    assert model.table.dtype == torch.float32


# -- r10, r11: validate everything before changing anything ----------------------------------

def test_r10_load_state_dict_validates_everything_first(caplog):
    model = nn.Linear(4, 2)
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    before = opt.amp.state_dict()
    bad_cases = [
        {"loss_scaler0": {"loss_scale": 2.0, "unskipped": 0}, "ampinit": {"version": 1, "optimizers": [None]}},
        {"loss_scaler0": {"loss_scale": 2.0, "unskipped": 0},
         "ampinit": {"version": 1, "optimizers": [{"steps": -1}]}},
        {"loss_scaler0": {"loss_scale": 2.0, "unskipped": 0},
         "ampinit": {"version": 1, "optimizers": [{"steps": "3"}]}},
        {"loss_scaler0": {"loss_scale": 2.0, "unskipped": 0}, "ampinit": {"version": 1, "optimizers": {}}},
        {"loss_scaler0": {"loss_scale": 4.0, "unskipped": 2 ** 40}},
        {"loss_scaler0": {"loss_scale": 4.0, "unskipped": 0, "hysteresis_left": -1}},
        {"loss_scaler0": {"loss_scale": float("inf"), "unskipped": 0}},
        {"loss_scaler0": {"loss_scale": 4.0, "unskipped": True}},
        {7: 1, "loss_scaler0": "x"},
    ]
    for bad in bad_cases:
        with pytest.raises(ValueError):
            amp.load_state_dict(bad)
        assert opt.amp.state_dict() == before, bad
    with caplog.at_level(logging.WARNING, logger="ampinit"):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 1e-205, "unskipped": 0}})  # an apex #318 checkpoint
    assert opt.amp.loss_scale() == 2.0 ** -24 and "outside" in caplog.text
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 1e30, "unskipped": 0}})
    assert opt.amp.loss_scale() == 2.0 ** 24


@pytest.mark.parametrize("kwargs, match", [
    (dict(loss_scale=1e39), "float32"), (dict(loss_scale="1e39"), "float32"),
    (dict(max_loss_scale=1e40), "float32"), (dict(init_scale=2.0 ** 30), "init_scale"),
    (dict(init_scale=2.0 ** -30), r"= \[5.96046e-08, "),  # the default floor, 2**-24, not 0
    (dict(growth_interval=0), "growth_interval"), (dict(hysteresis=1.5), "hysteresis"),
    (dict(loss_scale=128.0, growth_interval=100), "dynamic"),
])
def test_r11_initialize_rejects_before_changing_anything(kwargs, match):
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=match):
        amp.initialize(model, opt, opt_level="O2", **kwargs)
    assert model.weight.dtype == torch.float32 and type(opt) is torch.optim.SGD and not hasattr(opt, "amp")
    assert opt.param_groups[0]["params"][0] is model.weight
    model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale=128.0, verbosity=0)  # a retry works
    assert opt.amp.loss_scale() == 128.0
    amp.end(opt)


# -- r12: nested scale_loss, delay_unscale across scales --------------------------------------

def test_r12_nested_scale_loss_raises():
    model = nn.Linear(4, 1)
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2",
                                loss_scale=128.0, verbosity=0)
    x = torch.randn(8, 4).half()
    with pytest.raises(RuntimeError, match="nested"):
        with amp.scale_loss(model(x).float().mean(), opt):
            with amp.scale_loss(model(x).float().mean(), opt):
                pass
    # the outer block's failure left nothing behind: a normal step works
    with amp.scale_loss(model(x).float().mean(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert opt.amp.skipped_steps == 0


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_r12_delay_unscale_across_loss_ids_raises(level):
    model = nn.Linear(4, 1)
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=level,
                                verbosity=0, num_losses=2)
    x = torch.randn(8, 4)
    with amp.scale_loss(model(x).float().mean(), opt, loss_id=0, delay_unscale=True) as scaled:
        scaled.backward()
    with pytest.raises(RuntimeError, match="loss_id 0's scale"):
        with amp.scale_loss(model(x).float().mean(), opt, loss_id=1):
            pass


@pytest.mark.parametrize("level, kwargs", [("O0", {}), ("O3", {}), ("O4", {}), ("O5", {}),
                                           ("O1", {"loss_scale": 128.0}), ("O2", {"loss_scale": 128.0})])
def test_r12_delay_unscale_across_loss_ids_with_one_static_scale_adds_up(level, kwargs):
    """From a review of UNITER-style loops (one task, one loss id, per micro-batch): joining
    another loss id's delayed gradients raised even where every loss has the same static scale,
    where the sum is exact.  The accumulated gradient equals FP32's over the same batches."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    model = copy.deepcopy(plain)
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=level,
                                verbosity=0, num_losses=3, **kwargs)
    batches = [torch.randn(8, 4, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    for i, x in enumerate(batches):
        loss = model(x.to(model[0].weight.dtype)).float().pow(2).mean()
        with amp.scale_loss(loss, opt, loss_id=[0, 2, 1, 0][i], delay_unscale=i < 3) as scaled:
            scaled.backward()
    for x in batches:  # plain accumulation: one backward per micro-batch
        plain(x).pow(2).mean().backward()
    exact = level == "O0"
    for got, ref in zip(amp.master_params(opt), plain.parameters()):
        torch.testing.assert_close(got.grad.float(), ref.grad, rtol=0 if exact else 2e-2, atol=0 if exact else 2e-3)


def test_r12_delay_unscale_across_loss_ids_with_static_scales_made_unequal_raises():
    model = nn.Linear(4, 1)
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1",
                                loss_scale=128.0, verbosity=0, num_losses=2)
    x = torch.randn(8, 4)
    with amp.scale_loss(model(x).float().mean(), opt, loss_id=0, delay_unscale=True) as scaled:
        scaled.backward()
    opt.amp.loss_scalers[1].set_scale(256.0)  # apex scripts poke scales
    with pytest.raises(RuntimeError, match="loss_id 0's scale"):
        with amp.scale_loss(model(x).float().mean(), opt, loss_id=1):
            pass


@pytest.mark.parametrize("how", ["static", "dynamic", "fp16_optimizer"])
def test_r12_delay_unscale_across_a_scale_set_by_hand_raises(how):
    """From a review: a scale set by hand (apex scripts poke _amp_state's _loss_scale, or
    FP16_Optimizer.loss_scale) between a delayed backward and the next of the same loss id
    unscaled the first with the new scale: that micro-batch counted half, silently."""
    model = nn.Linear(4, 1)
    x = torch.randn(8, 4)
    if how == "fp16_optimizer":
        from ampinit.apex.fp16_utils import FP16_Optimizer
        model.half()
        opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.0), static_loss_scale=128.0, verbose=False)
        opt.backward(model(x.half()).float().sum(), update_master_grads=False)
        opt.loss_scale = 256.0
        with pytest.raises(RuntimeError, match="scale changed"):
            opt.backward(model(x.half()).float().sum(), update_master_grads=False)
        return
    kwargs = {"loss_scale": 128.0} if how == "static" else {}
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0,
                                **kwargs)
    with amp.scale_loss(model(x.half()).float().sum(), opt, delay_unscale=True) as scaled:
        scaled.backward()
    amp._amp_state.loss_scalers[0]._loss_scale = 256.0
    with pytest.raises(RuntimeError, match="scale changed"):
        with amp.scale_loss(model(x.half()).float().sum(), opt):
            pass


def _accumulate_with_a_scale_set(where, level="O2"):
    """Two micro-batches (the first with ``delay_unscale``) at a scale set to 128, the scale set
    to 1024 at ``where``; the masters' gradients, and FP32's."""
    torch.manual_seed(0)
    plain = nn.Linear(4, 1)
    model = copy.deepcopy(plain)
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=level, verbosity=0)
    scaler = amp._amp_state.loss_scalers[0]
    scaler._loss_scale = 128.0
    batches = [torch.randn(8, 4, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    for i, x in enumerate(batches):
        with amp.scale_loss(model(x.to(model.weight.dtype)).float().sum(), opt, delay_unscale=i == 0) as scaled:
            if where == (i, "before_backward"):
                scaler._loss_scale = 1024.0
            scaled.backward()
            if where == (i, "after_backward"):
                scaler._loss_scale = 1024.0
        if where == (i, "after_block"):
            scaler._loss_scale = 1024.0
    for x in batches:
        plain(x).sum().backward()
    return [p.grad for p in amp.master_params(opt)], [p.grad for p in plain.parameters()]


@pytest.mark.parametrize("where", [(0, "before_backward"), (0, "after_backward"), (0, "after_block")])
def test_r12_a_scale_set_while_gradients_wait_scaled_is_refused(where):
    """From a review: a scale set inside the delayed block, after its backward, was not refused
    (the first micro-batch was unscaled with the new scale: 27 % off, silently); before the
    backward, torch refused the in-place change of the scale with an error naming no cause.
    The first loss was multiplied by the old scale in each case: the second may not join it."""
    with pytest.raises(RuntimeError, match="scale changed"):
        _accumulate_with_a_scale_set(where)


@pytest.mark.parametrize("where", [(1, "before_backward"), (1, "after_backward")])
def test_r12_a_scale_set_inside_the_block_unscales_with_the_scale_the_loss_got(where):
    """From a review: a scale set inside a block (not delayed) was the one its gradients were
    unscaled with, though the loss had been multiplied by the old one: 87 % off, silently."""
    got, ref = _accumulate_with_a_scale_set(where)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=1e-3)


def test_r12_a_scale_set_to_the_value_it_has_is_no_change():
    """From a review: scripts that cap the scale each iteration (`_loss_scale = min(s, cap)`)
    set it to the value it has; that must not break a delay_unscale accumulation."""
    model = nn.Linear(4, 1)
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0,
                                init_scale=128.0)
    x = torch.randn(8, 4).half()
    with amp.scale_loss(model(x).float().sum(), opt, delay_unscale=True) as scaled:
        scaled.backward()
    scaler = amp._amp_state.loss_scalers[0]
    scaler._loss_scale = min(scaler._loss_scale, 2.0 ** 20)
    with amp.scale_loss(model(x).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert opt.amp.skipped_steps == 0


def test_r12_fp16_optimizer_update_master_grads_after_a_scale_set_is_refused():
    """From a review: update_master_grads() unscaled delayed gradients with a scale set after
    their backward (16x too large, silently)."""
    from ampinit.apex.fp16_utils import FP16_Optimizer
    model = nn.Linear(4, 1).half()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.0), static_loss_scale=128.0, verbose=False)
    opt.backward(model(torch.randn(8, 4).half()).float().sum(), update_master_grads=False)
    opt.loss_scale = 8.0
    with pytest.raises(RuntimeError, match="scale changed"):
        opt.update_master_grads()


def test_r12_delay_unscale_across_a_scale_update_raises():
    a, b = nn.Linear(4, 1), nn.Linear(4, 1)
    [a, b], [oa, ob] = amp.initialize([a, b], [torch.optim.SGD(a.parameters(), lr=0.1),
                                               torch.optim.SGD(b.parameters(), lr=0.1)], opt_level="O2", verbosity=0)
    x = torch.randn(8, 4)
    with amp.scale_loss(a(x).float().mean(), oa, delay_unscale=True) as scaled:
        scaled.backward()
    with amp.scale_loss(b(x).float().mean() * float("inf"), ob) as scaled:  # backs loss 0's scale off
        scaled.backward()
    with pytest.raises(RuntimeError, match="scale changed"):
        with amp.scale_loss(a(x).float().mean(), oa):
            pass


# -- r13: pickling and copying an initialized model -----------------------------------------

@pytest.mark.parametrize("level", LEVELS)
def test_r13_model_pickles_and_deep_copies_without_the_optimizer(level):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-3)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    x = torch.randn(6, 4)
    with amp.scale_loss(model(x).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    ema = copy.deepcopy(model)  # the EMA pattern
    buffer = io.BytesIO()
    torch.save(model, buffer)
    assert len(pickle.dumps(model)) < 3 * len(pickle.dumps(ema)) + 10_000
    restored = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    for copy_ in (ema, restored):
        with pytest.raises(RuntimeError, match="not initialized"):
            amp.handle_of(copy_)
        copy_.eval()
        model.eval()
        torch.testing.assert_close(copy_(x), model(x))
        assert copy_(x).dtype == model(x).dtype
        # a copy has no masters: its state_dict is its own tensors, as in torch
        own = dict(copy_.named_parameters(), **dict(copy_.named_buffers()))
        assert all(v.dtype == own[k].dtype and v.data_ptr() == own[k].data_ptr()
                   for k, v in copy_.state_dict().items())
    with torch.no_grad():  # an EMA update from the live model
        for e, p in zip(ema.parameters(), model.parameters()):
            e.mul_(0.9).add_(p, alpha=0.1)
    # timm's ModelEma / YOLO's ModelEMA update in place through the copy's state_dict: it lands
    model.train()
    with amp.scale_loss(model(x).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    live = model.state_dict()
    expected = {k: v.clone() for k, v in ema.state_dict().items()}
    with torch.no_grad():
        for k, v in ema.state_dict().items():
            if v.dtype.is_floating_point:
                v.mul_(0.5).add_(0.5 * live[k].to(v.dtype))
                expected[k].mul_(0.5).add_(0.5 * live[k].to(v.dtype))
    before = {k: v.clone() for k, v in restored.state_dict().items()}
    assert any(not torch.equal(v, before[k]) for k, v in expected.items())  # the update moved it
    for k, v in ema.state_dict().items():
        assert torch.equal(v, expected[k]), k
    ema.float()  # a copy may be cast back: its inputs follow its parameters
    assert ema(x).dtype == torch.float32
    assert amp.handle_of(model) is opt.amp


def test_r13_a_model_pickled_before_the_links_moved_still_loads():
    """The link and hook classes lived in ``ampinit.handle`` until they moved to
    ``ampinit.links``: a model pickled by then names them there, and must still load."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    pickled = pickle.dumps(model, protocol=0)  # protocol 0 names classes as "c<module>\n<name>\n"
    moved = set(re.findall(rb"campinit\.links\n(\w+)\n", pickled))
    assert {b"HandleLink", b"WeakLink", b"SaveFP32Values", b"RefuseAssign"} <= moved
    old = re.sub(rb"campinit\.links\n(\w+)\n", rb"campinit.handle\n_\1\n", pickled)
    restored = pickle.loads(old)
    model.eval()
    restored.eval()
    x = torch.randn(6, 4)
    torch.testing.assert_close(restored(x), model(x))
    with pytest.raises(RuntimeError, match="not initialized"):
        amp.handle_of(restored)


# -- r13b: writes through model.state_dict() --------------------------------------------------

@pytest.mark.parametrize("level,remainders", [("O2", False), ("O5", False), ("O5", True)])
@pytest.mark.parametrize("idiom", ["one_line", "own_state_loop", "kept_dict", "inference_mode", "kept_alive"])
def test_r13b_in_place_writes_through_model_state_dict_reach_the_model(level, remainders, idiom):
    """torch's state_dict aliases the model, and older repos load partial weights through it
    (``own_state[name].copy_(param)``); the same run with ``load_state_dict`` is the reference.
    At O2/O5 the reported values are the FP32 masters (a joined copy with remainders): the
    write must reach the model before its next forward, and the master too ("kept_alive": the
    dict outlives the whole run, nothing but the forward adopts it)."""
    def run(write):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        opt = (amp.optim.FusedAdam if remainders else torch.optim.Adam)(model.parameters(), lr=1e-2)
        model, opt = initialize_at(model, opt, level, remainders)
        pretrained = {"2.weight": torch.linspace(-1, 1, 16).reshape(2, 8), "2.bias": torch.tensor([0.3, -0.7])}
        write(model, pretrained)
        dtype = next(model.parameters()).dtype
        if idiom != "kept_alive":
            assert torch.equal(model[2].weight, pretrained["2.weight"].to(dtype))  # before any forward
        gen = torch.Generator().manual_seed(1)
        outputs = []
        for _ in range(3):
            x = torch.randn(16, 4, generator=gen).to(dtype)
            opt.zero_grad()
            out = model(x).float()
            outputs.append(out.detach().clone())
            with amp.scale_loss(out.pow(2).mean(), opt) as scaled:
                scaled.backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()] + outputs, model.state_dict()

    def reference(model, pretrained):
        model.load_state_dict(pretrained, strict=False)

    def through_state_dict(model, pretrained):
        if idiom in ("one_line", "inference_mode"):
            with torch.inference_mode(idiom == "inference_mode"):
                for name, value in pretrained.items():
                    model.state_dict()[name].copy_(value)
        elif idiom == "own_state_loop":
            own_state = model.state_dict()
            for name, value in pretrained.items():
                own_state[name].copy_(value)
            del own_state
        elif idiom == "kept_dict":  # the dict is kept alive: the next state_dict() (before the forward) adopts
            through_state_dict.kept = model.state_dict()
            for name, value in pretrained.items():
                through_state_dict.kept[name].copy_(value)
            model.state_dict()
        else:  # kept alive through training: the forward adopts
            through_state_dict.kept = model.state_dict()
            for name, value in pretrained.items():
                through_state_dict.kept[name].copy_(value)

    expected_params, expected_state = run(reference)
    params, state = run(through_state_dict)
    for got, want in zip(params, expected_params):
        assert torch.equal(got, want)
    for key, want in expected_state.items():
        assert torch.equal(state[key], want), key


@pytest.mark.parametrize("level,remainders", [("O2", False), ("O5", False), ("O5", True)])
@pytest.mark.parametrize("dropped", [True, False])
def test_r13b_data_writes_through_state_dict_reach_frozen_parameters_and_buffers(level, remainders, dropped):
    """From a review of imaginaire's ``ModelAverage``: a frozen average held inside the
    initialized model is updated as ``state_dict()[k].data.copy_(...)`` every step.  Frozen
    parameters and cast buffers have no step to carry a ``.data`` write (no version counter sees
    it) into the model: the forward kept the old weights for good (5.2 off at O2), while
    ``state_dict()`` and ``end()`` gave the written ones.  Dropped at once (as the function that
    writes them returns), the same loop writing without ``.data`` is the reference, bit for bit.
    Kept alive until the next write, the write is taken when the dict goes: at the end, the
    model and what ``state_dict()`` reports agree."""
    class Averaged(nn.Module):
        def __init__(self):
            super().__init__()
            self.net, self.average = nn.Linear(4, 4), nn.Linear(4, 4)
            self.average.requires_grad_(False)
            self.register_buffer("shift", torch.zeros(4))

        def forward(self, x):
            return self.net(x) + self.average(x) + self.shift

    def update_average(model, through_data):
        source, target = model.net.state_dict(), model.average.state_dict()
        with torch.no_grad():
            for key in ("weight", "bias"):
                mixed = target[key] * 0.5 + source[key] * 0.5
                (target[key].data if through_data else target[key]).copy_(mixed)
            shift = model.state_dict()["shift"]
            (shift.data if through_data else shift).add_(0.25)
        return source, target, shift

    def run(through_data):
        torch.manual_seed(0)
        model = Averaged()
        opt = (amp.optim.FusedAdam if remainders else torch.optim.Adam)(model.net.parameters(), lr=1e-2)
        model, opt = initialize_at(model, opt, level, remainders)
        gen = torch.Generator().manual_seed(1)
        seen, kept = [], None
        for _ in range(4):
            x = torch.randn(8, 4, generator=gen).to(model.net.weight.dtype)
            out = model(x).float()
            seen.append(out.detach().clone())
            opt.zero_grad()
            with amp.scale_loss(out.pow(2).mean(), opt) as scaled:
                scaled.backward()
            opt.step()
            kept = update_average(model, through_data)
            if dropped:
                kept = None
        del kept
        state = model.state_dict()
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            assert torch.equal(tensor, state[name].to(tensor.dtype)), name
        seen += [t.detach().float().clone() for t in state.values()]
        del state
        amp.end(model)
        return seen + [t.detach().float().clone() for t in model.state_dict().values()]

    if dropped:
        for got, want in zip(run(through_data=True), run(through_data=False)):
            assert torch.equal(got, want)
    else:
        run(through_data=True)


@pytest.mark.parametrize("level,remainders", [("O2", False), ("O5", False), ("O5", True)])
@pytest.mark.parametrize("through_data", [True, False])
def test_r13b_a_dict_kept_across_a_step_still_carries_writes_to_frozen_tensors(level, remainders, through_data, caplog):
    """From a review: a ``model.state_dict()`` taken before a step and written after it (then
    dropped) left a frozen parameter's model value behind for good, while ``state_dict()``
    reported the write; and a buffer the forward updates while an unwritten dict is alive was
    warned about as "written both".  FP32 reference: the same writes into the model itself."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.frozen = nn.Linear(4, 4), nn.Linear(4, 2)
            self.frozen.requires_grad_(False)
            self.register_buffer("running", torch.zeros(4))

        def forward(self, x):
            if self.training:
                with torch.no_grad():
                    self.running.mul_(0.9).add_(0.1 * x.float().mean(0).to(self.running.dtype))
            return self.frozen(self.lin(x) - self.running)

    def run(level):
        torch.manual_seed(0)
        model = Net()
        opt = (amp.optim.FusedAdam if remainders else torch.optim.Adam)(model.lin.parameters(), lr=1e-2)
        if level is not None:
            model, opt = initialize_at(model, opt, level, remainders)
        dtype = model.lin.weight.dtype
        gen = torch.Generator().manual_seed(1)
        kept = model.state_dict()
        outs = []
        for step in range(3):
            out = model(torch.randn(8, 4, generator=gen).to(dtype)).float()
            outs.append(out.detach().clone())
            opt.zero_grad()
            amp_backward(out.pow(2).mean(), opt, level)
            opt.step()
            if step == 0:
                with torch.no_grad():
                    value = kept["frozen.weight"] if level is not None else model.frozen.weight
                    (value.data if through_data else value).fill_(0.25)
                del value
                kept = None
        return outs

    with caplog.at_level("WARNING", logger="ampinit"):
        got, want = run(level), run(None)
    assert not [r for r in caplog.records if "written both" in r.getMessage()]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=5e-2)  # the write moves the outputs by ~1


@pytest.mark.parametrize("level", ["O2", "O5"])
@pytest.mark.parametrize("root", [True, False])
def test_r13b_state_dict_reports_writes_to_the_model_made_through_data(level, root):
    """``model.state_dict()`` syncs every cast tensor once at its start (one fingerprint pass)
    instead of one tensor at a time: a ``.data`` write (no version counter sees it) is still in
    what it reports, from the whole model and from a submodule."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=level, verbosity=0)
    x = torch.randn(3, 4).to(model[0].weight.dtype)
    with amp.scale_loss(model(x).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    model[2].weight.data.mul_(2)
    model[0].bias.data.fill_(0.75)
    state = model.state_dict() if root else {f"2.{k}": v for k, v in model[2].state_dict().items()}
    assert torch.equal(state["2.weight"], model[2].weight.float())
    if root:
        assert torch.equal(state["0.bias"], torch.full((8,), 0.75))


@pytest.mark.parametrize("level,remainders", [("O2", False), ("O5", False), ("O5", True)])
def test_r13b_a_direct_write_while_the_state_dict_is_alive_is_not_overwritten(level, remainders, caplog):
    """Load a backbone through ``own_state[k].copy_``, then re-initialize the head directly while
    the dict is still alive: torch ends with the head's new value, and so must ampinit (the
    dict's write is adopted later, so the model's own write wins, with a warning); a tied weight
    written through one of its keys is adopted too."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(8, 4)
            self.body = nn.Linear(4, 4)
            self.head = nn.Linear(4, 8, bias=False)
            self.head.weight = self.wte.weight  # tied

    def run(use_amp):
        torch.manual_seed(0)
        model = Net()
        opt = amp.optim.FusedAdamW(model.parameters(), lr=1e-2)
        if use_amp:
            extra = {"master_weights": "remainder"} if remainders else {}
            model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0, **extra)
        own_state = model.state_dict()
        own_state["wte.weight"].copy_(torch.full((8, 4), 0.5))
        own_state["body.weight"].copy_(torch.full((4, 4), 0.125))
        with torch.no_grad():
            model.body.weight.fill_(0.25)  # re-initialized while own_state is alive
        del own_state
        return {k: v.float() for k, v in model.state_dict().items()}, model.body.weight.float()

    with caplog.at_level("WARNING", logger="ampinit"):
        state, body = run(True)
    ref_state, ref_body = run(False)
    assert torch.equal(body, ref_body) and torch.equal(body, torch.full((4, 4), 0.25))
    for key, want in ref_state.items():
        if remainders:  # a direct write keeps the remainder the new weight is still the rounding of
            assert torch.equal(state[key].bfloat16(), want.bfloat16()), key
        else:
            assert torch.equal(state[key], want), key
    assert "body.weight was written both" in caplog.text


@pytest.mark.parametrize("level,remainders", [("O2", False), ("O5", False), ("O5", True)])
def test_r13b_state_dict_keep_vars_keeps_requires_grad(level, remainders):
    """LoRA/PEFT save only what trains: ``{k: v for k, v in model.state_dict(keep_vars=True).items()
    if v.requires_grad}``.  The FP32 values ampinit reports must keep each parameter's
    requires_grad, as torch's Parameters do (they were detached: nothing was saved)."""
    def trainable(use_amp):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        model[0].requires_grad_(False)
        opt = amp.optim.FusedAdam([p for p in model.parameters() if p.requires_grad], lr=0.1)
        if use_amp:
            extra = {"master_weights": "remainder"} if remainders else {}
            model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0, **extra)
        return {k: v.detach().float() for k, v in model.state_dict(keep_vars=True).items() if v.requires_grad}

    got, want = trainable(True), trainable(False)
    assert sorted(got) == sorted(want) == ["1.bias", "1.weight"]
    for key in want:
        assert torch.equal(got[key], want[key]) if not remainders else torch.equal(got[key].bfloat16(),
                                                                                 want[key].bfloat16())


# -- r13c: freezing through the optimizer's param_groups ---------------------------------------

@pytest.mark.parametrize("level,remainders", [("O2", False), ("O5", False), ("O5", True)])
@pytest.mark.parametrize("optimizer", ["sgd", "fused_adam"])
def test_r13c_freezing_through_param_groups_freezes_like_through_the_model(level, remainders, optimizer):
    """``for p in opt.param_groups[0]["params"]: p.requires_grad_(False)`` reaches the masters
    at O2/O5; it must freeze as freezing the model's parameters does (the reference), frozen
    mid-run and unfrozen later, not keep training the model (it did)."""
    if remainders and optimizer == "sgd":
        pytest.skip("remainder masters need ampinit's fused optimizers")

    def run(through_groups):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        make = (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01)) if optimizer == "sgd" \
            else (lambda ps: amp.optim.FusedAdam(ps, lr=1e-2, weight_decay=0.01))
        backbone, head = make(model[0].parameters()), make(model[2].parameters())
        extra = {"master_weights": "remainder"} if remainders else {}
        model, (backbone, head) = amp.initialize(model, [backbone, head], opt_level=level, verbosity=0,
                                                 loss_scale=128.0, **extra)
        gen = torch.Generator().manual_seed(1)
        for step in range(8):
            if step in (2, 6):
                frozen = step == 2
                params = [p for g in backbone.param_groups for p in g["params"]] if through_groups \
                    else list(model[0].parameters())
                for p in params:
                    p.requires_grad_(not frozen)
            if step == 3:
                weight = model[0].weight.detach().clone()
            if step == 6:
                assert torch.equal(model[0].weight, weight)  # frozen for steps 2-5
            x = torch.randn(16, 4, generator=gen).to(next(model.parameters()).dtype)
            backbone.zero_grad()
            head.zero_grad()
            with amp.scale_loss(model(x).float().pow(2).mean(), [backbone, head]) as scaled:
                scaled.backward()
            backbone.step()
            head.step()
        return [p.detach().clone() for p in model.parameters()]

    for got, want in zip(run(through_groups=True), run(through_groups=False)):
        assert torch.equal(got, want)


# -- r14: zero_grad(set_to_none=False) must not hide a backward outside scale_loss -------------

@pytest.mark.parametrize("level", MASTER_LEVELS)
@pytest.mark.parametrize("zero", ["set_to_none", "zeros", "model_zero_grad", "model_zeros"])
def test_r14_backward_outside_scale_loss_is_caught_after_any_zero_grad(level, zero):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=level, verbosity=0)
    x = torch.randn(8, 4)

    def clear():
        if zero == "set_to_none":
            opt.zero_grad()
        elif zero == "zeros":
            opt.zero_grad(set_to_none=False)
        elif zero == "model_zero_grad":
            model.zero_grad()
        else:
            model.zero_grad(set_to_none=False)

    clear()
    with amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
        scaled.backward()
    opt.step()
    clear()
    model(x).float().pow(2).mean().backward()  # forgot scale_loss
    weight = model.weight.detach().clone()
    with pytest.raises(RuntimeError, match="scale_loss did not put there"):
        opt.step()
    assert torch.equal(weight, model.weight)


@pytest.mark.parametrize("level", MASTER_LEVELS)
def test_r14_clipping_the_model_parameters_is_caught(level):
    model = nn.Linear(4, 2)
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=level, verbosity=0)
    with amp.scale_loss(model(torch.randn(8, 4)).float().pow(2).mean(), opt) as scaled:
        scaled.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # should be amp.master_params(opt)
    with pytest.raises(RuntimeError, match="clip ampinit.master_params"):
        opt.step()


@pytest.mark.parametrize("clip", ["norm", "mul_zero"])
def test_r14_clipping_where_the_16_bit_norm_overflows_is_caught_not_taken_as_zeroing(clip):
    """At O2 the model's gradients are the fp16 ones times the loss scale (2**16): their fp16
    norm overflows for a true norm above about 1, torch's clip multiplies every gradient by
    max_norm/inf = 0, and the zeros looked like zero_(): every master gradient was zeroed and
    training stopped without a word (F11).  A product with zero keeps the sign (-0.0); zero_()
    does not.  zero_() of every gradient is still a deliberate clear (the step moves nothing
    but the momentum), as in torch."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    with amp.scale_loss(nn.functional.mse_loss(model(torch.randn(8, 16)), torch.randn(8, 4)), opt) as scaled:
        scaled.backward()
    if clip == "norm":
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # should be amp.master_params(opt)
        assert torch.isinf(norm)  # the situation of the report: the scaled fp16 norm overflowed
    else:
        for param in model.parameters():
            param.grad.mul_(0.0)
    with pytest.raises(RuntimeError, match="clip ampinit.master_params"):
        opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    with amp.scale_loss(nn.functional.mse_loss(model(torch.randn(8, 16)), torch.randn(8, 4)), opt) as scaled:
        scaled.backward()
    for param in model.parameters():
        param.grad.zero_()
    opt.step()  # a deliberate clear: nothing to update from
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


_CLEAR_THEN_ZERO_OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01),
    "fused_adam": lambda params: ampinit.optim.FusedAdam(params, lr=0.01),
    "fused_sgd": lambda params: ampinit.optim.FusedSGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)}


@pytest.mark.parametrize("level", [None, "O0", "O1", "O2", "O3", "O5"])
@pytest.mark.parametrize("kind", list(_CLEAR_THEN_ZERO_OPTIMIZERS))
def test_model_zero_grad_then_zero_grad_false_leaves_nothing_to_step(level, kind):
    """torch: model.zero_grad() sets every gradient to None, zero_grad(set_to_none=False) then
    has nothing to zero, and step() moves nothing and makes no state.  At O2/O5 the masters kept
    their gradients until the next scale_loss, the second call zeroed them in place, and the
    step applied weight decay and counted an Adam step (G17's fuzz); master_params showed the
    stale gradients meanwhile."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = _CLEAR_THEN_ZERO_OPTIMIZERS[kind](model.parameters())
    if level is not None:
        model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    amp_backward(model(torch.randn(5, 4)).float().pow(2).mean(), opt, level)
    model.zero_grad()
    if level is not None:
        assert all(p.grad is None for p in amp.master_params(opt))
    opt.zero_grad(set_to_none=False)
    weights = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert opt.state_dict()["state"] == {}


@pytest.mark.parametrize("level", [None, "O0", "O2", "O5"])
def test_a_gradient_cleared_through_param_groups_stays_cleared_at_zero_grad_false(level):
    """backward, step, ``master.grad = None`` through ``param_groups``, zero_grad(set_to_none=False),
    step: torch skips that parameter.  G19 found my first fix for the fused optimizers' deferred
    gradients owing it zeros (any master without a gradient), so SGD stepped it on momentum and
    weight decay."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    if level is not None:
        model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    amp_backward(model(torch.randn(8, 4)).float().pow(2).mean(), opt, level)
    opt.step()
    weight = opt.param_groups[0]["params"][0]
    weight.grad = None
    before = weight.detach().clone()
    opt.zero_grad(set_to_none=False)
    assert weight.grad is None
    opt.step()
    assert torch.equal(weight, before)


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O5"])
@pytest.mark.parametrize("kind", ["fused_adam", "fused_sgd"])
def test_fused_zero_grad_false_after_a_step_without_gradients_still_steps_on_zeros(level, kind):
    """backward, step, a step with no gradients, backward, zero_grad(set_to_none=False), step:
    the last step runs on zero gradients (Adam counts it; momentum moves the weights), as at
    O0/O1 and in torch.  At O2/O5 the fused optimizers' deferred gradients were cleared with no
    zeros owed for them, and the step did nothing (G17's fuzz)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = _CLEAR_THEN_ZERO_OPTIMIZERS[kind](model.parameters())
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    x = torch.randn(5, 4)
    amp_backward(model(x).float().pow(2).mean(), opt, level)
    opt.step()
    opt.step()  # the fused step dropped the gradients: nothing to do
    amp_backward(model(x).float().pow(2).mean(), opt, level)
    opt.zero_grad(set_to_none=False)
    masters = [p.detach().clone() for p in amp.master_params(opt)]
    opt.step()
    assert all(not torch.equal(p, m) for p, m in zip(amp.master_params(opt), masters))  # momentum moved them
    if kind == "fused_adam":
        assert all(float(opt.state[p]["step"]) == 2 for p in amp.master_params(opt))


# -- s_model_zero_grad_o2: every way of clearing gradients, as in torch ------------------------

@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O5"])
@pytest.mark.parametrize("style", ZERO_STYLES)
def test_s_model_zero_grad_every_style_matches_fp32(level, style):
    """apex-era loops clear gradients in every way; at step 1 an abandoned backward is cleared
    the same way before the real one.  Weights after each step must follow FP32's."""
    def run(use_amp):
        torch.manual_seed(0)
        model = nn.Linear(4, 1, bias=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
        if use_amp:
            model, opt = amp.initialize(model, opt, opt_level=level, loss_scale=128.0, verbosity=0)

        def backward(factor):
            loss = model(torch.ones(2, 4).to(model.weight.dtype)).float().sum() * factor
            if not use_amp:
                return loss.backward()
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()

        weights = []
        for step in range(4):
            clear_grads(style, model, opt)
            if step == 1:
                backward(100.0)  # abandoned
                clear_grads(style, model, opt)
            backward(1.0 + step)
            opt.step()
            weights.append(model.weight.detach().float().clone())
        return torch.stack(weights)

    torch.testing.assert_close(run(True), run(False), rtol=2e-3, atol=2e-3)


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 1)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        return self.fc2(h), self.fc2(h * 0 + 1)  # the second output reaches fc1 with exactly zero gradients


@pytest.mark.parametrize("level", ["O2", "O5"])
@pytest.mark.parametrize("case", ["zero_last_gradient", "zero_weight_last_loss", "interrupted_loss"])
def test_data_zeroing_is_seen_after_zero_gradients_and_interrupted_losses(level, case):
    """p.grad.data.zero_() clears the masters' gradients also where the last loss gave a
    parameter an exactly-zero gradient, and after a scale_loss whose body raised before its
    backward (a skipped batch); compared with the same FP32 loop."""
    def run(use_amp):
        torch.manual_seed(0)
        model = _TwoHeads()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
        if use_amp:
            model, opt = amp.initialize(model, opt, opt_level=level, loss_scale=64.0, verbosity=0)

        def backward(loss):
            if not use_amp:
                return loss.backward()
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()

        for step in range(6):
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.data.zero_()
            x = torch.randn(16, 4, generator=torch.Generator().manual_seed(step)).to(model.fc1.weight.dtype)
            backward(model(x)[0].float().pow(2).mean())
            b = model(x)[1]
            if case == "zero_last_gradient":
                backward(b.float().pow(2).mean())
            elif case == "zero_weight_last_loss":  # an auxiliary loss weighted 0 during warm-up
                backward(model(x)[0].float().abs().mean() * 0.0)
            elif step % 2 == 0:
                try:
                    if use_amp:
                        with amp.scale_loss(b.float().mean(), opt):
                            raise ValueError("bad batch")
                    raise ValueError("bad batch")
                except ValueError:
                    continue  # the batch is skipped: no step
            opt.step()
        return torch.cat([p.detach().float().flatten() for p in model.parameters()])

    torch.testing.assert_close(run(True), run(False), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_data_zeroing_clears_an_optimizer_the_last_loss_did_not_reach(level):
    """Two optimizers, both losses through one scale_loss call each: the second reaches only
    the first optimizer's layer, so the second optimizer's tokens are all zero from the start;
    p.grad.data.zero_() must still clear its masters' gradients, as in FP32."""
    def run(use_amp):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        opts = [torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.5),
                torch.optim.SGD(model[2].parameters(), lr=0.1, momentum=0.5)]
        if use_amp:
            model, opts = amp.initialize(model, opts, opt_level=level, loss_scale=64.0, verbosity=0)
        for step in range(5):
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.data.zero_()
            x = torch.randn(16, 4, generator=torch.Generator().manual_seed(step)).to(model[0].weight.dtype)
            losses = [model(x).float().pow(2).mean(), model[0](x).float().pow(2).mean() * 0.1]
            for loss in losses:
                if use_amp:
                    with amp.scale_loss(loss, opts) as scaled:
                        scaled.backward()
                else:
                    loss.backward()
            for opt in opts:
                opt.step()
        return torch.cat([p.detach().float().flatten() for p in model.parameters()])

    torch.testing.assert_close(run(True), run(False), rtol=1e-2, atol=1e-2)


# -- s_o1_loss_dtype: O1/O4 losses in FP32 ----------------------------------------------------

LOSSES = {
    "cross_entropy": lambda out, labels, dense: nn.functional.cross_entropy(out, labels),
    "mse": lambda out, labels, dense: nn.functional.mse_loss(out, dense),
    "logsumexp": lambda out, labels, dense: out.logsumexp(1).mean(),
}


@pytest.mark.parametrize("level", ["O1", "O4"])
@pytest.mark.parametrize("loss", list(LOSSES))
def test_s_o1_losses_outside_the_model_are_fp32(level, loss):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1000))
    model = amp.initialize(model, opt_level=level, verbosity=0)
    x, labels, dense = torch.randn(8, 16), torch.randint(0, 1000, (8,)), torch.randn(8, 1000)
    out = model(x)
    value = LOSSES[loss](out, labels, dense)
    assert out.dtype == torch.float32 and value.dtype == torch.float32
    assert value.item() == LOSSES[loss](out.detach(), labels, dense).item()
    exact = LOSSES[loss](out.detach().double(), labels, dense.double()).item()
    assert value.item() == pytest.approx(exact, rel=1e-6)  # not fp16's 1e-3


@dataclasses.dataclass(frozen=True)
class _Output:
    logits: torch.Tensor
    extras: dict


class _DataclassModel(nn.Module):
    """Takes and returns dataclasses, as many research codebases do."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(16, 1000)

    def forward(self, batch: _Output) -> _Output:
        logits = self.body(batch.logits)
        return _Output(logits, {"hidden": logits * 2})


@pytest.mark.parametrize("level", ["O1", "O2", "O4", "O5"])
def test_s_o1_dataclass_outputs_are_fp32_and_inputs_cast(level):
    """Dataclass outputs are cast like dicts and namedtuples (a sum-reduced cross entropy over
    them overflowed fp16 before); dataclass inputs reach a cast model in its dtype."""
    torch.manual_seed(0)
    model = amp.initialize(_DataclassModel(), opt_level=level, verbosity=0)
    x, labels = torch.randn(20, 16) * 30, torch.randint(0, 1000, (20,))
    out = model(_Output(x, {}))
    assert isinstance(out, _Output)
    assert out.logits.dtype == torch.float32 and out.extras["hidden"].dtype == torch.float32
    loss = torch.nn.functional.cross_entropy(out.logits, labels, reduction="sum") * 100
    assert loss.dtype == torch.float32 and torch.isfinite(loss)


@dataclasses.dataclass
class _Node:
    logits: torch.Tensor
    parent: object = None
    note: str = dataclasses.field(init=False)  # never set

    def __post_init__(self):
        self.doubled = self.logits * 2  # an attribute that is not a field


class _NodeModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 3)

    def forward(self, x):
        node = _Node(self.body(x))
        node.parent = node  # refers to itself
        return node


@pytest.mark.parametrize("level", ["O1", "O2", "O4", "O5"])
def test_dataclass_outputs_with_unset_fields_cycles_and_extra_attributes(level):
    model = amp.initialize(_NodeModel(), opt_level=level, verbosity=0)
    out = model(torch.randn(2, 4))
    assert out.logits.dtype == torch.float32 and out.doubled.dtype == torch.float32
    assert not hasattr(out, "note") and out.parent is not None


@dataclasses.dataclass
class _DictOutput(collections.OrderedDict):
    """A dict and a dataclass, its fields not kept in step with its items (HF's ModelOutput keeps
    them in step; this one copies once)."""
    logits: torch.Tensor = None
    hidden: torch.Tensor = None

    def __post_init__(self):
        self["logits"] = self.logits


class _DictOutputModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 3)

    def forward(self, x):
        logits = self.body(x)
        return _DictOutput(logits=logits, hidden=logits * 2)


@pytest.mark.parametrize("level", ["O1", "O2", "O4", "O5"])
def test_dict_and_dataclass_outputs_cast_items_and_fields_once(level):
    """F12: only the items of an output that is both a dict and a dataclass were cast; its
    fields stayed 16-bit (``out.logits`` float16 where ``out["logits"]`` was float32).  A tensor
    both hold is cast once, and both see that one."""
    model = amp.initialize(_DictOutputModel(), opt_level=level, verbosity=0)
    out = model(torch.randn(2, 4))
    assert isinstance(out, _DictOutput)
    assert out["logits"].dtype == out.logits.dtype == out.hidden.dtype == torch.float32
    assert out.logits is out["logits"] and "hidden" not in out


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_dict_and_dataclass_output_that_refers_to_itself_is_cast(level):
    """G22: the fields of a dict-and-dataclass output were cast without the cycle guard the
    plain dataclass branch has: a self-reference raised RecursionError."""
    class Cyclic(_DictOutputModel):
        def forward(self, x):
            out = super().forward(x)
            out.hidden = out  # refers to itself
            return out

    out = amp.initialize(Cyclic(), opt_level=level, verbosity=0)(torch.randn(2, 4))
    assert out.logits.dtype == out["logits"].dtype == torch.float32 and out.hidden is not None


# -- item 8: clear errors ----------------------------------------------------------------------

def test_static_scale_too_large_says_so():
    model = nn.Linear(4, 2)
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2",
                                loss_scale=1e30, verbosity=0)
    x = torch.randn(8, 4)
    with pytest.raises(RuntimeError, match=r"static loss scale 1e\+30 may be too large.*loss_scale='dynamic'"):
        for _ in range(20):
            opt.zero_grad()
            with amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
                scaled.backward()
            opt.step()


def test_scale_loss_after_end_says_so():
    model = nn.Linear(4, 2)
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    amp.end(model)
    with pytest.raises(RuntimeError, match="ended by ampinit.end"):
        with amp.scale_loss(model(torch.randn(2, 4)).sum(), opt):
            pass


@pytest.mark.parametrize("cast_back", ["float", "double", "other_16_bit", "data_fp32"])
@pytest.mark.parametrize("level", ["O2", "O5"])
def test_model_cast_back_after_o2_is_a_clear_error(cast_back, level):
    """``layer.weight.data = fp32_tensor`` after ``initialize``: the forward says what happened
    (torch's own error was a dtype mismatch in the matmul).  A cast of the whole model
    (``model.float()``, an FP32 evaluation or export) runs its forward, as before, and training
    on without casting back raises at ``scale_loss``; cast back, it trains on.  Nothing was
    stepped in between."""
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=level, verbosity=0)
    dtype = model[0].weight.dtype
    masters = [p.detach().clone() for p in opt.param_groups[0]["params"]]
    if cast_back == "data_fp32":
        model[2].weight.data = torch.ones(2, 3)
        with pytest.raises(RuntimeError, match=r"cast or moved after initialize.*\.data was replaced"):
            model(torch.randn(2, 4))
    else:
        model.half() if cast_back == "other_16_bit" and level == "O5" else \
            getattr(model, "bfloat16" if cast_back == "other_16_bit" else cast_back)()
        out = model(torch.randn(2, 4))  # the forward follows the model's dtype
        with pytest.raises(RuntimeError, match="cast or moved after initialize"):
            with amp.scale_loss(out.float().sum(), opt) as scaled:
                scaled.backward()
        model.to(dtype)  # cast back: trains on
        with amp.scale_loss(model(torch.randn(2, 4)).float().sum(), opt) as scaled:
            scaled.backward()
    assert all(torch.equal(a, b) for a, b in zip(masters, opt.param_groups[0]["params"]))


def test_initialize_returns_the_container_type_it_was_given():
    m1, m2 = nn.Linear(2, 2), nn.Linear(2, 2)
    models = amp.initialize((m1, m2), opt_level="O1", verbosity=0)
    assert isinstance(models, tuple) and models[0] is m1 and models[1] is m2
    m3 = nn.Linear(2, 2)
    opts = (torch.optim.SGD(m3.parameters(), lr=0.1),)
    out_models, out_opts = amp.initialize([m3], opts, opt_level="O2", verbosity=0)
    assert isinstance(out_models, list) and isinstance(out_opts, tuple) and out_opts[0] is opts[0]


@pytest.mark.parametrize("level, scale", [("O0", None), ("O0", 64.0), ("O0", "dynamic"), ("O3", None),
                                          ("O5", None)])
def test_complex_parameters_train(level, scale):
    class Spectral(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(8, dtype=torch.complex64) * 0.1)
            self.lin = nn.Linear(8, 1)

        def forward(self, x):
            mixed = torch.fft.ifft(torch.fft.fft(x.float()) * self.weight).real
            return self.lin(mixed.to(self.lin.weight.dtype))

    def run(use_amp):
        torch.manual_seed(0)
        model = Spectral()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if use_amp:
            kwargs = {} if scale is None else {"loss_scale": scale}
            model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0, **kwargs)
        for step in range(3):
            opt.zero_grad()
            loss = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).float().pow(2).mean()
            if use_amp:
                with amp.scale_loss(loss, opt) as scaled:
                    scaled.backward()
            else:
                loss.backward()
            opt.step()
        return model.weight.detach().clone()

    torch.testing.assert_close(run(True), run(False), rtol=2e-2, atol=2e-3)


# -- writes through .data that the write detection must see (hostile review of the fingerprint) --

def _write_cases():
    def halve(p):  # every element's bits move by one amount: a linear checksum cancels it out
        p.data.mul_(0.5)

    def fill(p):
        p.data.fill_(2.0)

    def negate(p):
        p.data.neg_()

    def transpose(p):  # same storage, bytes and version: only the strides change
        p.data = p.data.t()

    return {"halve_1024x1024": (lambda: nn.Linear(1024, 1024, bias=False), halve),
            "fill_zero_bias_512": (lambda: nn.Linear(4, 512), fill),
            "negate_ones_32x32": (lambda: nn.Linear(32, 32, bias=False).requires_grad_(False).apply(
                lambda m: nn.init.ones_(m.weight) if hasattr(m, "weight") else None).requires_grad_(True), negate),
            "scale_layernorm_8192": (lambda: nn.LayerNorm(8192), halve),
            "transpose_square": (lambda: nn.Linear(64, 64, bias=False), transpose)}


@pytest.mark.parametrize("level", MASTER_LEVELS)
@pytest.mark.parametrize("case", sorted(_write_cases()))
def test_structured_data_writes_to_the_model_are_adopted(level, case):
    """FP32 PyTorch keeps each of these writes; so must the masters: after a step with lr 0 the
    model still holds what was written, and ``model.state_dict()`` has the written value wherever
    the write changed the 16-bit weight."""
    make_model, write = _write_cases()[case]
    torch.manual_seed(0)
    model = make_model()
    if case == "fill_zero_bias_512":
        nn.init.zeros_(model.bias)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = amp.initialize(model, opt, opt_level=level, loss_scale=1.0, verbosity=0)
    param = max(model.parameters(), key=lambda p: p.numel()) if case != "fill_zero_bias_512" else model.bias
    name = next(n for n, p in model.named_parameters() if p is param)
    width = next(p for p in model.parameters()).shape[-1]
    for step in range(3):
        if step == 1:
            before = param.detach().clone()
            write(param)
            written = param.detach().clone()
        x = torch.randn(2, width, generator=torch.Generator().manual_seed(step)).to(param.dtype)
        opt.zero_grad()
        with amp.scale_loss(model(x).float().pow(2).mean(), opt) as loss:
            loss.backward()
        opt.step()
    assert torch.equal(param.detach(), written), "the step overwrote the write with the old master"
    value = model.state_dict()[name]
    changed = written != before  # where the write left the 16-bit value alone, the master keeps its digits
    assert changed.any() and torch.equal(value[changed], written[changed].float())
    assert torch.equal(value.to(written.dtype), written)


@pytest.mark.parametrize("level,remainders", [("O2", False), ("O5", False), ("O5", True)])
@pytest.mark.parametrize("unfreeze", ["model", "staged_group", "param_groups"])
def test_r13d_a_layer_frozen_before_initialize_trains_once_unfrozen(level, remainders, unfreeze):
    """Fine-tuning in stages: a backbone frozen before ``initialize`` (its master was made with
    ``requires_grad=False``) and unfrozen later, through the model, with a staged
    ``add_param_group``, or through ``param_groups``.  It never trained again at O2/O5; the
    reference is the same run frozen just after ``initialize`` (bit for bit), and FP32 torch."""
    def run(level, frozen_before):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        if frozen_before:
            model[0].requires_grad_(False)
        staged = unfreeze == "staged_group"
        cls = amp.optim.FusedAdam if remainders else torch.optim.Adam
        opt = cls(model[2].parameters() if staged else model.parameters(), lr=1e-2)
        if level is not None:
            model, opt = initialize_at(model, opt, level, remainders)
        if not frozen_before:
            model[0].requires_grad_(False)
        gen = torch.Generator().manual_seed(1)

        def step():
            x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
            opt.zero_grad()
            amp_backward((model(x.to(next(model.parameters()).dtype)).float() - y).pow(2).mean(), opt, level)
            opt.step()

        for _ in range(3):
            step()
        if unfreeze == "param_groups" and not staged:
            backbone = {id(p) for p in model[0].parameters()}
            masters = [p for g in opt.param_groups for p in g["params"]
                       if id(getattr(amp.handle_of(model).masters, "model_of", {}).get(p, p)) in backbone] \
                if level is not None else list(model[0].parameters())
            assert len(masters) == 2
            for p in masters:
                p.requires_grad_(True)
        else:
            model[0].requires_grad_(True)
        if staged:
            opt.add_param_group({"params": list(model[0].parameters())})
        before = model[0].weight.detach().float().clone()
        for _ in range(5):
            step()
        assert model[0].weight.requires_grad
        return [p.detach().float().clone() for p in model.parameters()], before

    got, before = run(level, frozen_before=True)
    want, _ = run(level, frozen_before=False)
    fp32, _ = run(None, frozen_before=True)
    assert (got[0] - before).abs().max() > 0.03  # it trains again
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    for g, f in zip(got, fp32):
        assert torch.allclose(g, f, atol=0.02)


@pytest.mark.parametrize("level,remainders", [("O2", False), ("O5", False), ("O5", True)])
def test_r13e_reading_state_dict_while_ema_weights_are_swapped_in_costs_the_masters_nothing(level, remainders):
    """torch_ema / diffusers' ``EMAModel`` / NeMo's EMA callback: back the weights up, copy the
    EMA in, evaluate and save ``model.state_dict()``, copy the backup back.  The read adopted
    the EMA into the masters, so the restore left them at the backup's 16-bit values: every
    sub-ulp step since the last evaluation was lost.  Reference: the same run without the read,
    bit for bit; the saved dict holds the EMA values."""
    def run(save_while_swapped):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        opt = (amp.optim.FusedSGD if remainders else torch.optim.SGD)(model.parameters(), lr=1e-4)
        model, opt = initialize_at(model, opt, level, remainders)
        ema = [p.detach().clone() for p in model.parameters()]
        gen = torch.Generator().manual_seed(0)
        x, y = torch.randn(64, 8, generator=gen), torch.randn(64, 4, generator=gen)
        saved = []
        for i in range(40):
            opt.zero_grad()
            with amp.scale_loss((model(x.to(ema[0].dtype)).float() - y).pow(2).mean(), opt) as scaled:
                scaled.backward()
            opt.step()
            with torch.no_grad():
                for e, p in zip(ema, model.parameters()):
                    e.lerp_(p, 0.1)
            if i % 5 == 4:
                backup = [p.detach().clone() for p in model.parameters()]
                with torch.no_grad():
                    for p, e in zip(model.parameters(), ema):
                        p.copy_(e)
                if save_while_swapped:
                    state = model.state_dict()
                    saved.append([state[name].clone() for name, _ in model.named_parameters()])
                with torch.no_grad():
                    for p, b in zip(model.parameters(), backup):
                        p.copy_(b)
        masters = [m.detach().float().clone() for m in amp.master_params(opt)]
        return masters, {k: v.clone() for k, v in model.state_dict().items()}, saved, ema

    masters, state, saved, ema = run(True)
    ref_masters, ref_state, _, _ = run(False)
    for got, want in zip(masters, ref_masters):
        assert torch.equal(got, want)
    for key, want in ref_state.items():
        assert torch.equal(state[key], want), key
    # where an EMA value is still the rounding of the master (and with remainder masters, of the
    # weight + remainder kept), the FP32 value stands, as an adopted write would leave it: the EMA
    # values to within half a 16-bit ulp, each rounding to the EMA's
    assert len(saved) == 8 and all(torch.equal(s.to(e.dtype), e) for s, e in zip(saved[-1], ema))


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_r13f_a_parameter_sharing_memory_with_a_master_is_refused_at_add_param_group(level):
    """``weight_norm`` registered after ``initialize``: its ``original1`` is made from the old
    weight's memory, which the optimizer still holds, so both masters were copied into the same
    memory every step, in an order the parallel kernels left open (the trained v came out
    different from run to run).  Refused, with nothing changed; non-overlapping views of one
    buffer (flat parameter storage) are fine."""
    from torch.nn.utils import parametrizations
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=level, verbosity=0)
    parametrizations.weight_norm(model[2])
    groups = len(opt.param_groups)
    with pytest.raises(ValueError, match=r"shares memory with 2\.weight.*register it before ampinit.initialize"):
        opt.add_param_group({"params": list(model[2].parametrizations.weight.parameters())})
    assert len(opt.param_groups) == groups
    flat = torch.zeros(40, dtype=model[0].weight.dtype)
    a, b = nn.Parameter(flat[:20].view(4, 5)), nn.Parameter(flat[20:].view(4, 5))
    opt.add_param_group({"params": [a]})
    opt.add_param_group({"params": [b]})  # the other half of the same storage
    assert len(opt.param_groups) == groups + 2


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_r13e_a_checkpoint_after_wgan_clipping_resumes_bit_for_bit(level):
    """WGAN's ``p.data.clamp_()`` after each step writes a few elements of the model; the next
    ``model.state_dict()`` reported the whole written tensor as its 16-bit values, dropping the
    FP32 bits of every element the clamp left alone, so the resume drifted from the
    uninterrupted run.  Now the written elements only; reference: the uninterrupted run."""
    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        return amp.initialize(model, torch.optim.RMSprop(model.parameters(), lr=1e-4), opt_level=level,
                              verbosity=0)

    def train(model, opt, start, stop):
        for i in range(start, stop):
            x = torch.randn(64, 16, generator=torch.Generator().manual_seed(i)).to(next(model.parameters()).dtype)
            opt.zero_grad()
            with amp.scale_loss(model(x).float().mean(), opt) as scaled:
                scaled.backward()
            opt.step()
            for p in model.parameters():
                p.data.clamp_(-0.1, 0.1)

    model, opt = make()
    train(model, opt, 0, 12)
    checkpoint = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                  "opt": copy.deepcopy(opt.state_dict()), "amp": amp.state_dict()}
    train(model, opt, 12, 24)
    model2, opt2 = make()
    model2.load_state_dict(checkpoint["model"])
    opt2.load_state_dict(checkpoint["opt"])
    amp.load_state_dict(checkpoint["amp"])
    train(model2, opt2, 12, 24)
    resumed = model2.state_dict()
    clamped = 0
    for key, value in model.state_dict().items():
        assert torch.equal(resumed[key], value), key
        clamped += int((value.abs() >= 0.099).sum())
    assert clamped > 0  # the clamp did bite


def test_r13f_a_refused_add_param_group_makes_no_master():
    """The refusal comes before any master is made: a fine parameter listed first in the same
    group got one, which stayed behind (memory, per-forward checks); two new parameters that
    overlap each other are refused too."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    masters = amp.handle_of(model).masters
    before = len(masters.tensors())
    extra = nn.Parameter(torch.randn(3, dtype=torch.float16))
    with pytest.raises(ValueError, match="shares memory with 2.weight"):
        opt.add_param_group({"params": [extra, nn.Parameter(model[2].weight.data.view(-1)[4:])]})
    buffer = torch.zeros(20, dtype=torch.float16)
    with pytest.raises(ValueError, match="shares memory with another parameter added with it"):
        opt.add_param_group({"params": [nn.Parameter(buffer[:12]), nn.Parameter(buffer[8:])]})
    assert len(masters.tensors()) == before and extra not in masters and len(opt.param_groups) == 1


def test_a_model_cast_after_initialize_with_remainder_masters_is_a_clear_error():
    """From a review: at O5 with remainder masters, training on after ``model.float()`` failed in
    the kernels ("param 0 has remainders, so it must be a contiguous bfloat16 tensor") or, on the
    fallback, with a size mismatch; cast back, it trains on."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    model, opt = initialize_at(model, amp.optim.FusedSGD(model.parameters(), lr=0.1), "O5", remainders=True)
    with amp.scale_loss(model(torch.randn(2, 4).bfloat16()).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()  # training has started (the first step compares everything once)
    weights = [p.detach().clone() for p in model.parameters()]
    model.float()
    with pytest.raises(RuntimeError, match="cast or moved after initialize"):
        with amp.scale_loss(model(torch.randn(2, 4)).float().sum(), opt) as scaled:
            scaled.backward()
        opt.step()
    assert all(torch.equal(a, b.to(a.dtype)) for a, b in zip(weights, model.parameters()))
    model.to(torch.bfloat16)
    opt.zero_grad()
    with amp.scale_loss(model(torch.randn(2, 4).bfloat16()).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()


# -- G21: the hostile review of session 28's changes ---------------------------------------------

def _overflowed_o2_mlp(level, optimizer="adam"):
    """An MLP whose first layer's gradient overflowed in the last scale_loss, not stepped yet."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    make = {"adam": lambda p: torch.optim.Adam(p, lr=0.01), "sgd": lambda p: torch.optim.SGD(p, lr=0.1)}
    model, opt = amp.initialize(model, make[optimizer](model.parameters()), opt_level=level, verbosity=0)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1)).to(model[0].weight.dtype)
    for poison in (False, True):
        opt.zero_grad()
        handle = model[0].weight.register_hook(lambda g: g * float("inf")) if poison else None
        with amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
        if handle is not None:
            handle.remove()
        else:
            opt.step()
    return model, opt


@pytest.mark.parametrize("level", ["O2", "O5"])
@pytest.mark.parametrize("clear", ["zero_", "zeros_like"])
def test_a_model_side_clear_that_clipping_did_not_see_does_not_step_on_zeros(level, clear):
    """G21: the overflowed layer's gradient zeroed on the model side, then clip_grad_norm_ of
    amp.master_params, then step: the clip still saw the master's inf (a model-side change
    reaches the masters at the step), its norm was inf, and it multiplied every gradient by 0;
    a recheck of the gradients at the step (since taken out) found them all finite and Adam
    stepped on zeros (momentum moved every weight 0.0067).  Such a step is skipped."""
    model, opt = _overflowed_o2_mlp(level)
    if clear == "zero_":
        model[0].weight.grad.zero_()
    else:
        model[0].weight.grad = torch.zeros_like(model[0].weight)
    torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 0.01)
    before = [p.detach().clone() for p in model.parameters()]
    skipped = opt.amp.skipped_steps
    opt.step()
    assert opt.amp.skipped_steps == skipped + 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_an_overflowed_sparse_gradient_zeroed_by_hand_does_not_crash_the_step(level):
    """G21: zeroing an overflowed sparse gradient made step() raise NotImplementedError from a
    dense-only comparison (O2/O5).  The step now skips, as any flagged step, without an error."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 1))
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=level, verbosity=0,
                                init_scale=8.0)  # (at 2**16 the head's own fp16 gradient overflows)
    handle = model[0].weight.register_hook(lambda g: g * float("inf"))
    with amp.scale_loss(model(torch.tensor([[1, 2, 3]])).float().sum(), opt) as scaled:
        scaled.backward()
    handle.remove()
    model[0].weight.grad.zero_()
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert opt.amp.skipped_steps == 1


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_a_load_post_hook_that_raises_leaves_the_masters_loaded_and_the_checkpoint_free(level):
    """G21: a module's load post-hook registered before initialize ran before ampinit's, and
    when it raised (a validation hook the script catches) the masters kept the 16-bit rounding
    of what torch loaded (1.8e-4 off at O2); a load that raised in a pre-hook kept the whole
    checkpoint referenced until the next load."""
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))

    checkpoint = {key: value + 0.1234567 for key, value in build().state_dict().items()}

    def refuse(module, incompatible_keys):
        raise KeyError("validation hook")

    reference = build()  # torch stops at the raise: the second layer is never loaded
    reference[0].register_load_state_dict_post_hook(refuse)
    with pytest.raises(KeyError):
        reference.load_state_dict(checkpoint)
    model = build()
    model[0].register_load_state_dict_post_hook(refuse)
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.0), opt_level=level, verbosity=0)
    with pytest.raises(KeyError):
        model.load_state_dict(checkpoint)
    want = reference.state_dict()
    assert torch.equal(want["0.weight"], checkpoint["0.weight"])
    for key, value in model.state_dict().items():
        assert torch.equal(value, want[key]), key

    def fail_early(module, state_dict, prefix, *args):
        raise ValueError("pre-hook")

    model[0].register_load_state_dict_pre_hook(fail_early)  # after ampinit's, which notes the dict
    big = {key: value.clone() for key, value in checkpoint.items()}
    watch = weakref.ref(big["1.weight"])
    with pytest.raises(ValueError):
        model.load_state_dict(big)
    del big
    gc.collect()
    assert watch() is None


def test_an_optimizers_own_methods_named_like_apexs_backward_halves_stay():
    """G21: the AttributeError for apex's private _prepare_amp_backward/_post_amp_backward
    shadowed a subclass's own methods of those names after initialize."""
    class Mine(torch.optim.SGD):
        def _post_amp_backward(self, scaler=None):
            return "mine"

    model = nn.Linear(2, 2)
    model, opt = amp.initialize(model, Mine(model.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    assert opt._post_amp_backward() == "mine"
    with pytest.raises(AttributeError, match="amp.scale_loss"):
        opt._prepare_amp_backward()


def test_an_attribute_error_inside_an_optimizers_property_names_the_missing_attribute():
    """G22: a __getattr__ on the swapped class (since replaced by two properties) caught the
    AttributeError a property of the optimizer raised and named the property instead."""
    class Mine(torch.optim.SGD):
        @property
        def current_lr(self):
            return self.scheduler_ref.get_last_lr()

    model = nn.Linear(2, 2)
    model, opt = amp.initialize(model, Mine(model.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    with pytest.raises(AttributeError, match="scheduler_ref"):
        _ = opt.current_lr
