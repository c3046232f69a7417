"""Every public entry point rejects bad input with a clear error and changes nothing."""
import pytest
import torch
from torch import nn

import ampinit as amp
from conftest import SmallNet, batch, make_setup


def snapshot(model, opt):
    handle = getattr(opt, "amp", None)
    return {
        "tensors": [(n, t.dtype, t.detach().clone()) for n, t in
                    list(model.named_parameters()) + list(model.named_buffers())],
        "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        "hooks": (len(model._forward_hooks), len(model._forward_pre_hooks)),
        "opt_type": type(opt),
        "groups": [[id(p) for p in g["params"]] for g in opt.param_groups],
        "opt_state": {id(p): {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                      for p, s in opt.state.items()},
        "amp": None if handle is None else handle.state_dict(),
    }


def assert_same(a, b):
    assert [(n, d) for n, d, _ in a["tensors"]] == [(n, d) for n, d, _ in b["tensors"]]
    assert all(torch.equal(x, y) for (_, _, x), (_, _, y) in zip(a["tensors"], b["tensors"]))
    assert len(a["grads"]) == len(b["grads"]) and all(
        (x is None and y is None) or torch.equal(x, y) for x, y in zip(a["grads"], b["grads"]))
    for key in ("hooks", "opt_type", "groups", "amp"):
        assert a[key] == b[key], key
    assert a["opt_state"].keys() == b["opt_state"].keys()


def fresh():
    torch.manual_seed(0)
    model = SmallNet()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


INITIALIZE_CASES = [
    ("model is not a module", lambda m, o: amp.initialize("model", o), TypeError, "Module"),
    ("empty model list", lambda m, o: amp.initialize([], o), ValueError, "empty"),
    ("model twice", lambda m, o: amp.initialize([m, m], o), ValueError, "twice"),
    ("optimizer twice", lambda m, o: amp.initialize(m, [o, o]), ValueError, "twice"),
    ("optimizer wrong type", lambda m, o: amp.initialize(m, "adam"), TypeError, "Optimizer"),
    ("opt level with zero", lambda m, o: amp.initialize(m, o, opt_level="02"), ValueError, "letter O"),
    ("contradiction", lambda m, o: amp.initialize(m, o, opt_level="O1", master_weights=True), ValueError, "master"),
    ("wrapped in DataParallel", lambda m, o: amp.initialize(nn.DataParallel(m), o), TypeError, "wrap"),
    ("param in two optimizers",
     lambda m, o: amp.initialize(m, [o, torch.optim.SGD([m.fc1.weight], lr=1)]), ValueError, "two"),
    ("model on two devices",
     lambda m, o: (m.fc2.to("meta"), amp.initialize(m, o))[1], ValueError, "several devices"),
    ("optimizer param elsewhere",
     lambda m, o: amp.initialize(m, [o, torch.optim.SGD([nn.Parameter(torch.ones(2, device="meta"))], lr=1)]),
     ValueError, "meta"),
]


@pytest.mark.parametrize("name, call, exc, match", INITIALIZE_CASES, ids=[c[0] for c in INITIALIZE_CASES])
def test_initialize_rejects(name, call, exc, match):
    model, opt = fresh()
    if name == "model on two devices":
        model, opt = fresh()
        before = None
    else:
        before = snapshot(model, opt)
    with pytest.raises(exc, match=match):
        call(model, opt)
    if before is not None:
        assert_same(before, snapshot(model, opt))
    assert type(opt) is torch.optim.SGD and not model._forward_pre_hooks


def _trained():
    model, opt = make_setup("O2", optimizer="sgd", num_losses=2)
    x, y = batch(0)
    with amp.scale_loss(((model(x) - y) ** 2).mean(), opt) as scaled:
        scaled.backward()
    return model, opt


SCALE_LOSS_CASES = [
    ("loss not a tensor", lambda m, o, other, loss: amp.scale_loss(1.0, o), TypeError, "floating"),
    ("integer loss", lambda m, o, other, loss: amp.scale_loss(torch.tensor(3), o), TypeError, "floating"),
    ("foreign optimizer", lambda m, o, other, loss: amp.scale_loss(loss,
                                                             torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1)),
     RuntimeError, "initialize"),
    ("optimizers of two initializations", lambda m, o, other, loss: amp.scale_loss(loss, [o, other]),
     ValueError, "different initialize"),
    ("loss_id out of range", lambda m, o, other, loss: amp.scale_loss(loss, o, loss_id=2),
     ValueError, "loss_id"),
    ("loss_id not int", lambda m, o, other, loss: amp.scale_loss(loss, o, loss_id="0"),
     ValueError, "loss_id"),
    ("delay_unscale not bool", lambda m, o, other, loss: amp.scale_loss(loss, o, delay_unscale=1),
     TypeError, "delay_unscale"),
    ("no optimizers", lambda m, o, other, loss: amp.scale_loss(loss, []), ValueError, "empty"),
]


@pytest.mark.parametrize("name, call, exc, match", SCALE_LOSS_CASES, ids=[c[0] for c in SCALE_LOSS_CASES])
def test_scale_loss_rejects(name, call, exc, match):
    model, opt = _trained()
    _, other = make_setup("O2", seed=1)
    loss = model(batch(0)[0]).sum()  # before the snapshot: forward updates BatchNorm stats
    before = snapshot(model, opt)
    masters_before = [p.grad.clone() for p in amp.master_params(opt)]
    with pytest.raises(exc, match=match):
        with call(model, opt, other, loss):
            pass
    assert_same(before, snapshot(model, opt))
    assert all(torch.equal(a, p.grad) for a, p in zip(masters_before, amp.master_params(opt)))


def test_step_with_closure_rejected_and_nothing_changes():
    model, opt = _trained()
    before = snapshot(model, opt)
    with pytest.raises(RuntimeError, match="closure"):
        opt.step(lambda: 0.0)
    assert_same(before, snapshot(model, opt))


def test_misc_entry_points():
    with pytest.raises(TypeError):
        list(amp.master_params("opt"))
    model, opt = make_setup("O2")
    with pytest.raises(TypeError):
        amp.state_dict(destination=[])
    with pytest.raises(TypeError, match="dict"):
        opt.add_param_group([nn.Parameter(torch.ones(2))])
    with pytest.raises(ValueError, match="loss_id"):
        opt.amp.loss_scale(5)


def test_wrong_call_order():
    model, opt = make_setup("O2")
    loss = ((model(batch(0)[0]) - batch(0)[1]) ** 2).mean()
    amp.end(opt)
    with pytest.raises(RuntimeError, match="initialize"):
        with amp.scale_loss(loss, opt):
            pass
    with pytest.raises(RuntimeError, match="not initialized"):
        amp.end(opt)


def test_module_level_calls_before_any_initialize_in_a_fresh_process():
    import subprocess
    import sys
    code = ("import ampinit as amp\n"
            "for call in (amp.state_dict, lambda: amp.load_state_dict({}), amp.end):\n"
            "    try:\n        call()\n    except RuntimeError as e:\n        print('RuntimeError:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.count("RuntimeError: no live ampinit initialization: call ampinit.initialize first") == 3


def test_a_parameter_listed_twice_is_named_for_what_it_is():
    """Twice in one optimizer's groups and once in each of two optimizers are two mistakes, each
    with its own message; nothing is cast."""
    model = nn.Linear(4, 2)
    with pytest.warns(UserWarning, match="duplicate"):  # torch.optim's own warning
        twice = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias, model.bias]}], lr=0.1)
    with pytest.raises(ValueError, match="lists a parameter twice in its param_groups"):
        amp.initialize(model, twice, opt_level="O2", verbosity=0)
    first, second = torch.optim.SGD([model.weight], lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="in two of the optimizers"):
        amp.initialize(model, [first, second], opt_level="O2", verbosity=0)
    assert model.weight.dtype == torch.float32


@pytest.mark.parametrize("opt_level", ["O2", "O3", "O5"])
def test_a_lazy_module_before_its_first_forward_is_refused_untouched(opt_level):
    """nn.LazyLinear has no shape before its first forward: it can be neither cast nor given a
    master.  initialize says so before casting anything; after one dummy forward it works."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.LazyLinear(2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    weight = model[0].weight.detach().clone()  # (snapshot() cannot read a lazy parameter)
    with pytest.raises(ValueError, match="2.weight, 2.bias are uninitialized.*dummy batch"):
        amp.initialize(model, opt, opt_level=opt_level, verbosity=0)
    assert model[0].weight.dtype == torch.float32 and torch.equal(model[0].weight, weight)
    assert not model._forward_pre_hooks and not model._forward_hooks and type(opt) is torch.optim.SGD
    model(torch.zeros(1, 4))
    model, opt = amp.initialize(model, opt, opt_level=opt_level, verbosity=0)
    assert model[2].weight.dtype != torch.float32 and len(model._forward_pre_hooks) >= 1


def test_a_lazy_module_trains_at_o1():
    """Autocast levels neither cast nor copy parameters: a lazy module is fine there."""
    model = nn.Sequential(nn.LazyLinear(2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    loss = model(torch.ones(3, 4)).float().sum()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    assert model[0].weight.shape == (2, 4)


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2", "O5"])
def test_lbfgs_is_refused_at_initialize_untouched(opt_level):
    """LBFGS's step always re-evaluates the loss through a closure, which ampinit refuses: it was
    accepted (the model cast to fp16) and then every step raised.  Now refused before any change."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5)
    with pytest.raises(TypeError, match="LBFGS re-evaluates the loss inside step"):
        amp.initialize(model, opt, opt_level=opt_level, verbosity=0)
    assert model[0].weight.dtype == torch.float32 and not model._forward_pre_hooks and type(opt) is torch.optim.LBFGS


def _head_checkpoint():
    return {"2.weight": torch.randn(1, 8, generator=torch.Generator().manual_seed(3)), "2.bias": torch.zeros(1)}


@pytest.mark.parametrize("opt_level", ["O2", "O3", "O5"])
def test_load_state_dict_with_assign_is_refused_untouched_where_tensors_are_cast(opt_level):
    """``model.load_state_dict(head, strict=False, assign=True)`` after initialize put FP32 tensors
    into the 16-bit model, with no master: the forward died in a dtype mismatch (partial dict), or
    the whole model ran in FP32 and never trained again (full dict).  Refused before anything is
    assigned; the same load without assign=True loads the FP32 values, as torch would."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, verbosity=0)
    before = {name: (p, p.detach().clone()) for name, p in model.named_parameters()}
    for checkpoint in (_head_checkpoint(), {k: v.float() for k, v in model.state_dict().items()}):
        with pytest.raises(RuntimeError, match=r"assign=True\) would replace .*2.weight.*Nothing was loaded"):
            model.load_state_dict(checkpoint, strict=False, assign=True)
        for name, p in model.named_parameters():
            assert p is before[name][0] and torch.equal(p, before[name][1]), name
    model.load_state_dict(_head_checkpoint(), strict=False)
    assert model.state_dict()["2.weight"].dtype == torch.float32
    assert torch.equal(model.state_dict()["2.weight"], _head_checkpoint()["2.weight"]) or opt_level == "O3"


@pytest.mark.parametrize("opt_level", ["O0", "O1"])
def test_load_state_dict_with_assign_works_where_nothing_is_cast(opt_level):
    """Nothing cast, nothing to protect: assign=True does what it does in torch."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=opt_level, verbosity=0)
    checkpoint = _head_checkpoint()
    model.load_state_dict(checkpoint, strict=False, assign=True)
    assert model[2].weight is not None and torch.equal(model[2].weight, checkpoint["2.weight"])


@pytest.mark.parametrize("opt_level", ["O2", "O5"])
def test_an_fp32_module_added_after_initialize_is_named_and_the_cast_recipe_trains(opt_level, caplog):
    """A layer appended after initialize and given to add_param_group stays FP32 in a 16-bit
    model; the forward then fails with torch's bare dtype error.  add_param_group says so and
    how; cast first, the layer gets FP32 masters and trains like FP32 (reference: plain torch)."""
    def run(level, cast_first):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        if level is not None:
            model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0, loss_scale=128.0)
        model.append(nn.Linear(1, 1))
        if level is not None and cast_first:
            model[3].to(model[0].weight.dtype)
        opt.add_param_group({"params": model[3].parameters()})
        for step in range(6):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
            opt.zero_grad()
            loss = model(x).float().pow(2).mean()
            if level is None:
                loss.backward()
            else:
                with amp.scale_loss(loss, opt) as scaled:
                    scaled.backward()
            opt.step()
        return [p.detach().float() for p in model.parameters()]

    with caplog.at_level("WARNING", logger="ampinit"), pytest.raises(RuntimeError, match="dtype"):
        run(opt_level, cast_first=False)
    assert "add_param_group got 2 float32 parameters" in caplog.text and "module.to(" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="ampinit"):
        got = run(opt_level, cast_first=True)
    assert "add_param_group" not in caplog.text
    for g, r in zip(got, run(None, cast_first=True)):
        torch.testing.assert_close(g, r, rtol=0, atol=2e-2 if opt_level == "O5" else 3e-3)


def test_load_state_dict_with_assign_on_a_container_is_refused_before_its_first_child_loads():
    """A container with no tensors of its own had no hook: torch assigned its first child (a
    BatchNorm kept FP32, which then left the optimizer) before the cast Linear's hook refused."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 4)), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    checkpoint = {k: torch.full_like(v, 7.0) if v.is_floating_point() else v for k, v in model[0].state_dict().items()}
    bn_weight = model[0][0].weight
    with pytest.raises(RuntimeError, match=r"assign=True\) would replace 1.weight, 1.bias"):
        model[0].load_state_dict(checkpoint, assign=True)
    assert model[0][0].weight is bn_weight and torch.equal(bn_weight, torch.ones(4))


def _two_objectives():
    """sentence-transformers' fit() with two objectives: one encoder in two loss models."""
    torch.manual_seed(0)
    encoder = nn.Linear(6, 8)
    return encoder, nn.Sequential(encoder, nn.Tanh(), nn.Linear(8, 2)), nn.Sequential(encoder, nn.Linear(8, 1))


@pytest.mark.parametrize("first, second", [("O2", "O2"), ("O5", "O5"), ("O3", "O3"), ("O2", "O1"), ("O1", "O2"),
                                           ("O0", "O5")])
def test_a_second_initialize_sharing_a_module_with_a_cast_model_is_refused_untouched(first, second):
    """Each loss model initialized on its own (sentence-transformers <= 0.3, use_amp=True): the
    shared encoder got a second FP32 master, started from the fp16 rounding, and each optimizer's
    steps reached the other only through that rounding: at O2 the encoder ended 19 % of its
    FP32 progress away (O5 61 %), silently.  Refused before the second model changes."""
    encoder, model_a, model_b = _two_objectives()
    opt_a = torch.optim.SGD(model_a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(model_b.parameters(), lr=0.1)
    amp.initialize(model_a, opt_a, opt_level=first, verbosity=0)
    dtypes = [p.dtype for p in model_b.parameters()]
    with pytest.raises(RuntimeError, match=r"initialize them in one call"):
        amp.initialize(model_b, opt_b, opt_level=second, verbosity=0)
    assert [p.dtype for p in model_b.parameters()] == dtypes and not model_b._forward_pre_hooks
    assert type(opt_b) is torch.optim.SGD and amp.handle_of(model_a).optimizers == [opt_a]
    amp.end(model_a)  # the way out the message names: end the first, and the second goes through
    amp.initialize(model_b, opt_b, opt_level=second, verbosity=0)


@pytest.mark.parametrize("level, dtype", [("O1", torch.float16), ("O4", torch.bfloat16)])
def test_separate_autocast_initializations_may_share_a_module(level, dtype):
    """Where neither initialization casts the model or keeps masters, sharing is harmless and
    still allowed.  Reference: the same two objectives under hand-written autocast with the same
    static loss scale, bit for bit."""
    results = []
    for by_hand in (False, True):
        encoder, model_a, model_b = _two_objectives()
        opt_a = torch.optim.SGD(model_a.parameters(), lr=0.1)
        opt_b = torch.optim.SGD(model_b.parameters(), lr=0.1)
        if not by_hand:
            model_a, opt_a = amp.initialize(model_a, opt_a, opt_level=level, loss_scale=128.0, verbosity=0)
            model_b, opt_b = amp.initialize(model_b, opt_b, opt_level=level, loss_scale=128.0, verbosity=0)
        for step in range(4):
            x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step))
            for model, opt in ((model_a, opt_a), (model_b, opt_b)):
                opt.zero_grad()
                if by_hand:
                    with torch.autocast("cpu", dtype=dtype):
                        out = model(x)
                    (out.float().square().mean() * 128.0).backward()
                    for p in model.parameters():
                        p.grad.div_(128.0)
                else:
                    with amp.scale_loss(model(x).float().square().mean(), opt) as scaled:
                        scaled.backward()
                opt.step()
        results.append(encoder.weight.detach().clone())
    assert torch.equal(results[0], results[1]) and not torch.equal(results[0], _two_objectives()[0].weight)


@pytest.mark.parametrize("first, second", [("O2", "O2"), ("O1", "O2"), ("O2", "O1")])
def test_a_weight_tied_into_a_second_initialization_is_refused(first, second):
    """From the review: ``b.fc.weight = a.fc.weight`` across two models initialized apart shares a
    parameter but no module: it got two FP32 masters (10-35 % of its FP32 progress off)."""
    a, b = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    b[0].weight = a[0].weight
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    amp.initialize(a, opt_a, opt_level=first, verbosity=0)
    with pytest.raises(RuntimeError, match=r"shares its parameter '0.weight'.*initialize them in one call"):
        amp.initialize(b, opt_b, opt_level=second, verbosity=0)
    assert type(opt_b) is torch.optim.SGD and b[1].weight.dtype == torch.float32


def test_a_teacher_initialized_without_an_optimizer_may_sit_inside_the_student():
    """From the review: distillation with the teacher initialized for inference alone (no
    optimizer: it owns no parameters) was refused.  Reference: the wrapper initialized alone,
    the teacher cast by it, bit for bit."""
    class Distill(nn.Module):
        def __init__(self, student, teacher):
            super().__init__()
            self.student, self.teacher = student, teacher

        def forward(self, x):
            with torch.no_grad():
                target = self.teacher(x)
            # in FP32: a teacher initialized on its own returns FP32 outputs, as a root model does
            return (self.student(x).float() - target.float()).square().mean()

    results = []
    for separately in (True, False):
        torch.manual_seed(0)
        student, teacher = nn.Linear(4, 3), nn.Linear(4, 3)
        teacher.requires_grad_(False)
        if separately:
            teacher = amp.initialize(teacher, opt_level="O2", verbosity=0)
        model = Distill(student, teacher)
        opt = torch.optim.SGD(student.parameters(), lr=0.1)
        model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale=128.0, verbosity=0)
        for step in range(3):
            opt.zero_grad()
            with amp.scale_loss(model(torch.randn(8, 4, generator=torch.Generator().manual_seed(step))), opt) as s:
                s.backward()
            opt.step()
        results.append([p.detach().float().clone() for p in amp.master_params(opt)])
    assert all(torch.equal(x, y) for x, y in zip(*results))


def test_the_refusal_names_a_way_out_when_the_first_model_is_gone():
    """From the review: a fold's loss model and optimizer dropped, its encoder reused: the
    refusal said to end the first model, which the script no longer holds.  Any module of an
    initialized model now reaches its initialization."""
    import gc
    encoder = nn.Linear(4, 4)

    def fold():
        model = nn.Sequential(encoder, nn.Linear(4, 2))
        amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0)

    fold()
    gc.collect()
    model = nn.Sequential(encoder, nn.Linear(4, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match=r"ampinit.end\(earlier_model\) \(a module of it will do\)"):
        amp.initialize(model, opt, opt_level="O2", verbosity=0)
    assert amp.handle_of(encoder).config.opt_level == "O2"
    amp.end(encoder)
    assert encoder.weight.dtype == torch.float32
    amp.initialize(model, opt, opt_level="O2", verbosity=0)


def test_a_module_shared_by_two_live_initializations_names_neither_alone():
    """amp.end(shared) with two O1 initializations sharing the module ended whichever was made
    first, silently leaving the other's user with an un-initialized model.  It now asks which."""
    shared = nn.Linear(4, 4)
    first, second = nn.Sequential(shared, nn.Linear(4, 2)), nn.Sequential(shared, nn.Linear(4, 3))
    opt_1 = torch.optim.SGD(first.parameters(), lr=0.1)
    opt_2 = torch.optim.SGD(second.parameters(), lr=0.1)
    amp.initialize(first, opt_1, opt_level="O1", verbosity=0)
    amp.initialize(second, opt_2, opt_level="O1", verbosity=0)
    with pytest.raises(RuntimeError, match="belongs to 2 live ampinit initializations.*pass the model"):
        amp.end(shared)
    assert amp.handle_of(first) is opt_1.amp and amp.handle_of(second) is opt_2.amp  # both still live
    amp.end(second)
    assert amp.handle_of(shared) is opt_1.amp  # one left: no doubt
    amp.end(shared)
    with pytest.raises(RuntimeError, match="not initialized"):
        amp.handle_of(first)


def test_initializations_sharing_a_module_are_freed_when_dropped():
    """From a review: a backbone reused by O1 folds kept every dropped fold's initialization (its
    model, optimizer and handle) alive through the hooks on its modules, against README's
    "dropping them frees it"; and end(backbone) then asked which of them to end.  The hooks hold
    their initialization weakly; a refusal or an ambiguity first collects the cycles of models
    already dropped (here with the collector off, as between two of its runs).  Run alone, the
    first fold also stayed alive: autograd kept the hook on the process's first scaled loss,
    which held its initialization; the hook now holds it weakly."""
    import gc
    import weakref
    backbone = nn.Linear(4, 4)
    dropped = []

    def fold():
        model = nn.Sequential(backbone, nn.Linear(4, 2))
        opt = torch.optim.Adam(model[1].parameters(), lr=0.1)
        model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
        with amp.scale_loss(model(torch.randn(2, 4)).sum(), opt) as scaled:
            scaled.backward()
        opt.step()
        dropped.append(weakref.ref(opt))

    gc.disable()
    try:
        fold()
        fold()
        with pytest.raises(RuntimeError, match="not initialized"):  # both are gone: nothing to end
            amp.handle_of(backbone)
        fold()
        fold()
        model = nn.Sequential(backbone, nn.Linear(4, 3))
        amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    finally:
        gc.enable()
    gc.collect()
    assert all(ref() is None for ref in dropped)
    assert backbone.weight.dtype == torch.float16  # the O2 initialization holds it now
    amp.handle_of(backbone)  # the dropped folds' hooks are pruned on the way: the O2 one is left
    refusals = [getattr(h, "hook", h) for h in backbone._load_state_dict_pre_hooks.values()]
    assert [type(h).__name__ for h in refusals].count("RefuseAssign") == 1


@pytest.mark.parametrize("level, dtype", [("O1", torch.float16), ("O4", torch.bfloat16), ("O1", torch.bfloat16)])
def test_a_16_bit_model_at_a_level_without_masters_is_logged(level, dtype, caplog):
    """From a review of apex scripts: model.half() before initialize at O1 trained the fp16 weights
    with no master (48 % of an embedding never moved in 100 SGD steps), silently.  apex refused
    it; ampinit logs it at any verbosity (pure-bf16 training is a choice some make), and only for
    parameters an optimizer trains (from the review: a frozen 16-bit layer listed is fine)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).to(dtype)
    model[1].requires_grad_(False)  # listed, but never updated: not counted
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level("WARNING", logger="ampinit"):
        amp.initialize(model, opt, opt_level=level, verbosity=0)
    assert f"0.weight is {dtype} (2 trained parameter(s) are 16-bit)" in caplog.text and "O2" in caplog.text
    caplog.clear()
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with caplog.at_level("WARNING", logger="ampinit"):
        amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=level, verbosity=0)
    assert "16-bit" not in caplog.text


class _WithFloat64State(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 2)
        self.head = nn.Linear(4, 1).double()
        self.register_buffer("total", torch.zeros((), dtype=torch.float64))


@pytest.mark.parametrize("level", ["O0", "O2", "O3", "O5"])
def test_float64_tensors_narrowed_by_the_cast_are_logged(level, caplog):
    """From a review of everyday patterns: O0 narrowed a float64 accumulator (1000 adds of 1e-9
    came to 9.99992e-07) and a float64 head to float32, as apex's model.to(torch.float32) did,
    without a word; the head then failed on float64 inputs with a dtype error naming no cause."""
    model = _WithFloat64State()
    with caplog.at_level("WARNING", logger="ampinit"):
        amp.initialize(model, torch.optim.SGD(model.layer.parameters(), lr=0.1), opt_level=level, verbosity=0)
    assert "cast 3 float64 tensor(s)" in caplog.text and "head.weight, head.bias, total" in caplog.text
    assert model.total.dtype != torch.float64
    caplog.clear()
    model = _WithFloat64State()  # O0's own way out, and models without float64: nothing to say
    with caplog.at_level("WARNING", logger="ampinit"):
        amp.initialize(model, torch.optim.SGD(model.layer.parameters(), lr=0.1), opt_level="O0",
                       cast_model_type=False, verbosity=0)
        plain = nn.Linear(4, 2)
        amp.initialize(plain, torch.optim.SGD(plain.parameters(), lr=0.1), opt_level=level, verbosity=0)
    assert model.total.dtype == model.head.weight.dtype == torch.float64
    assert "float64" not in caplog.text


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_a_float64_batch_norm_kept_by_keep_batchnorm_fp32_is_refused_before_anything_changes(level):
    """From a review: keep_batchnorm_fp32 left a float64 BatchNorm as it was (apex too), and the
    forward failed on the cast layers' outputs with torch's "mixed dtype" error naming no cause."""
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4).double())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"1: float64 batch norm.*module.float\(\)"):
        amp.initialize(model, opt, opt_level=level, verbosity=0)
    assert model[0].weight.dtype == torch.float32 and model[1].weight.dtype == torch.float64
    assert type(opt) is torch.optim.SGD
    model[1].float()  # the way out the error gives
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    with amp.scale_loss(model(torch.randn(6, 4)).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    assert model[1].weight.dtype == torch.float32 and torch.isfinite(model[0].weight).all()


def test_a_teacher_the_student_trains_is_refused():
    """From the review: the student's optimizer holding the teacher's parameters (an O2 teacher
    initialized without an optimizer) trained them on its own masters; ending the student and then
    the teacher wrote the teacher's stale masters back (0.209 of training lost, silently)."""
    teacher = amp.initialize(nn.Linear(4, 4), opt_level="O2", verbosity=0)
    student = nn.Sequential(nn.Linear(4, 4), teacher)
    opt = torch.optim.SGD(student.parameters(), lr=0.5)
    with pytest.raises(RuntimeError, match="do not train it"):
        amp.initialize(student, opt, opt_level="O2", verbosity=0)
    assert type(opt) is torch.optim.SGD and student[0].weight.dtype == torch.float32


def test_a_weight_tied_through_several_initializations_keeps_every_owner():
    """From the review: the mark held one initialization, so a later one without an optimizer
    (or an ended one) hid the owner with an optimizer; and parameters given by add_param_group
    to a module added later were never marked."""
    a = nn.Linear(4, 4)
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    amp.initialize(a, opt_a, opt_level="O1", verbosity=0)
    b = nn.Linear(4, 4)
    b.weight = a.weight
    amp.initialize(b, opt_level="O1", verbosity=0)  # no optimizer, O1: allowed
    amp.end(b)
    c = nn.Linear(4, 4)
    c.weight = a.weight
    with pytest.raises(RuntimeError, match="shares its parameter 'weight'"):
        amp.initialize(c, torch.optim.SGD(c.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    head = nn.Linear(4, 2)
    opt_a.add_param_group({"params": list(head.parameters())})
    with pytest.raises(RuntimeError, match="shares its parameter"):
        amp.initialize(nn.Sequential(head), torch.optim.SGD(head.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    amp.end(a)
    assert "_ampinit_held_by" not in head.weight.__dict__ and "_ampinit_held_by" not in a.weight.__dict__


def test_assign_into_a_module_added_after_initialize_is_refused():
    """From a review: load_state_dict(..., assign=True) on a head added after initialize (cast, then
    add_param_group) was not refused, as it is on the modules initialize saw: it swapped FP32
    tensors in place of the 16-bit ones, away from their masters.  Refused, nothing loaded."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    model.add_module("extra", nn.Linear(2, 2).half())
    opt.add_param_group({"params": model.extra.parameters()})
    weight = model.extra.weight
    with pytest.raises(RuntimeError, match=r"assign=True\) would replace weight, bias"):
        model.extra.load_state_dict(nn.Linear(2, 2).state_dict(), assign=True)
    assert model.extra.weight is weight and weight.dtype == torch.float16
