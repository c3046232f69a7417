import types

import pytest
import torch
from torch import nn

import ampinit as amp


def _user_module():
    mod = types.ModuleType("my_ext")
    mod.fused = lambda a, b: (a.dtype, b.dtype)
    mod.plain = lambda a: a.dtype
    return mod


class Calls(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.fn = fn

    def forward(self, x):
        return self.fn(self.lin(x), x)


def test_register_on_user_module_casts_only_under_autocast():
    mod = _user_module()
    amp.register_float_function(mod, "fused")
    x = torch.randn(2, 4)
    assert mod.fused(x.half(), x) == (torch.float16, torch.float32)  # outside autocast: untouched
    model = amp.initialize(Calls(lambda h, x: mod.fused(h, x)), opt_level="O1", verbosity=0)
    assert model(x) == (torch.float32, torch.float32)
    amp.register_half_function(mod, "fused")  # re-registering replaces the policy
    assert model(x) == (torch.float16, torch.float16)
    model4 = amp.initialize(Calls(lambda h, x: mod.fused(h, x)), opt_level="O4", verbosity=0)
    assert model4(x) == (torch.bfloat16, torch.bfloat16)  # "half" is the autocast dtype


def test_promote_function():
    mod = _user_module()
    amp.register_promote_function(mod, "fused")
    x = torch.randn(2, 4)
    model = amp.initialize(Calls(lambda h, x: mod.fused(h, x)), opt_level="O1", verbosity=0)
    assert model(x) == (torch.float32, torch.float32)  # fp16 linear output promoted to x's fp32


def test_register_on_torch_namespace_patches_nothing():
    original = torch.special.expit
    amp.register_half_function(torch.special, "expit")
    assert torch.special.expit is original
    model = amp.initialize(Calls(lambda h, x: (torch.special.expit(x).dtype,)), opt_level="O1", verbosity=0)
    assert model(torch.randn(2, 4)) == (torch.float16,)
    assert torch.special.expit(torch.randn(2)).dtype == torch.float32  # outside the forward


def test_decorators():
    @amp.float_function
    def softmax32(t):
        return t.dtype, torch.is_autocast_enabled("cpu")

    @amp.half_function
    def half(t):
        return t.dtype

    model = amp.initialize(Calls(lambda h, x: (softmax32(h), half(x))), opt_level="O1", verbosity=0)
    (dtype, autocast_on), half_dtype = model(torch.randn(2, 4))
    assert dtype == torch.float32 and not autocast_on and half_dtype == torch.float16
    assert softmax32.__name__ == "softmax32"


def test_disable_casts():
    def body(h, x):
        with amp.disable_casts():
            inner = (x @ x.t()).dtype
        return inner, (x @ x.t()).dtype

    model = amp.initialize(Calls(body), opt_level="O1", verbosity=0)
    assert model(torch.randn(2, 4)) == (torch.float32, torch.float16)
    assert not torch.is_autocast_enabled("cpu")


def test_registration_errors():
    mod = _user_module()
    for call, exc in [(lambda: amp.register_half_function(mod, "missing"), ValueError),
                      (lambda: amp.register_half_function(mod, 3), TypeError),
                      (lambda: amp.half_function(3), TypeError)]:
        try:
            call()
        except exc:
            continue
        raise AssertionError("no error")


@pytest.mark.parametrize("policy", ["float", "half"])
@pytest.mark.parametrize("reentrant", [True, False])
def test_registered_torch_functions_keep_their_casts_in_a_checkpoint_recompute(policy, reentrant, monkeypatch):
    """``register_float_function(torch, "exp")`` + activation checkpointing: the recompute in the
    backward runs outside the model's forward (autograd carries no torch-function mode into it),
    so the registered function ran in fp16 there after fp32 in the forward: non-reentrant
    checkpoints raised, reentrant ones trained on a different graph (overflow, every step
    skipped).  Reference: the same O1 run without checkpointing, bit for bit."""
    from torch.utils.checkpoint import checkpoint

    from ampinit import registry
    monkeypatch.setattr(registry, "_TORCH_POLICIES", {})  # registrations are process-wide
    (amp.register_float_function if policy == "float" else amp.register_half_function)(torch, "sigmoid")

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.seen = []

        def forward(self, x):
            h = self.lin(x)
            gate = torch.sigmoid(h)
            self.seen.append(gate.dtype)
            return h * gate

    class Net(nn.Module):
        def __init__(self, checkpointed):
            super().__init__()
            self.block, self.head, self.checkpointed = Block(), nn.Linear(8, 1), checkpointed

        def forward(self, x):
            h = checkpoint(self.block, x, use_reentrant=reentrant) if self.checkpointed else self.block(x)
            return self.head(h)

    def run(checkpointed):
        torch.manual_seed(0)
        model = Net(checkpointed)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0, loss_scale=128.0)
        x = torch.randn(4, 8, requires_grad=True)
        for _ in range(3):
            opt.zero_grad()
            with amp.scale_loss(model(x).float().pow(2).sum(), opt) as scaled:
                scaled.backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()], set(model.block.seen)

    want = torch.float32 if policy == "float" else torch.float16
    params, seen = run(True)
    ref_params, ref_seen = run(False)
    assert seen == ref_seen == {want}  # the forward and the recompute alike
    for got, ref in zip(params, ref_params):
        assert torch.equal(got, ref)


class _ConvBnHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.norm, self.fc = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.LayerNorm(64), \
            nn.Linear(64, 3)

    def forward(self, x):
        return self.fc(self.norm(torch.relu(self.bn(self.conv(x))).flatten(2)).flatten(1)[:, :64])


@pytest.mark.parametrize("level", ["O1", "O4"])
def test_disable_casts_around_an_o1_model_computes_as_fp32(level):
    """``with amp.disable_casts(): model(x)`` is apex's FP32 evaluation (the fast adversarial
    training paper's PGD attack): the model's forward turned autocast back on, so the attack
    saw fp16 input gradients (half of them exactly 0, signs 49% off) and x*1e5 gave inf logits.
    Reference: the FP32 model before initialize, bit for bit, input gradients too."""
    torch.manual_seed(0)
    reference = _ConvBnHead().eval()
    model = amp.initialize(_ConvBnHead().eval(), opt_level=level, verbosity=0)
    model.load_state_dict(reference.state_dict())
    x = torch.randn(2, 3, 8, 8) * 1e4
    grads = []
    for net, context in ((reference, amp.disable_casts), (model, amp.disable_casts)):
        delta = torch.zeros_like(x, requires_grad=True)
        with context():
            out = net(x + delta)
            out.square().sum().backward()
        grads.append((out, delta.grad))
    (want, want_grad), (got, got_grad) = grads
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert torch.equal(got, want) and torch.equal(got_grad, want_grad)
    assert model(x).dtype == torch.float32 and not torch.equal(model(x), want)  # outside: casts again
    with torch.autocast("cpu", dtype=torch.bfloat16), amp.disable_casts():  # inside another autocast
        assert torch.equal(model(x), want)


@pytest.mark.parametrize("level", ["O1", "O4"])
def test_disable_casts_holds_for_the_threads_of_data_parallel(level):
    """``nn.DataParallel`` runs each replica's forward in a thread of its own: apex's
    ``disable_casts`` was one flag for the process, so those forwards ran in FP32; a per-thread
    flag let them cast again.  The worker below does what DataParallel's does (on the CPU,
    DataParallel calls the module directly).  Reference: the FP32 model, bit for bit."""
    import threading
    torch.manual_seed(0)
    reference = _ConvBnHead().eval()
    model = amp.initialize(_ConvBnHead().eval(), opt_level=level, verbosity=0)
    model.load_state_dict(reference.state_dict())
    x = torch.randn(2, 3, 8, 8) * 1e4
    want = reference(x)
    outputs = {}

    def replica(name):
        outputs[name] = model(x)

    with amp.disable_casts():
        workers = [threading.Thread(target=replica, args=(i,)) for i in range(2)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    assert all(torch.equal(out, want) for out in outputs.values()) and len(outputs) == 2
    worker = threading.Thread(target=replica, args=("after",))  # the block closed: casts again
    worker.start()
    worker.join()
    assert not torch.equal(outputs["after"], want)


def test_a_registered_torch_function_covers_its_functional_wrapper(monkeypatch):
    """``register_float_function(torch, 'batch_norm')`` (GradAlign's double backprop): apex patched
    ``torch.batch_norm``, which ``F.batch_norm`` (so ``nn.BatchNorm2d``) calls; ampinit's mode saw only
    ``F.batch_norm`` and left it in fp16.  Reference: the wrapper on the fp16 input cast to fp32."""
    from ampinit import registry
    monkeypatch.setattr(registry, "_TORCH_POLICIES", {})  # registrations are process-wide
    monkeypatch.setattr(registry, "_REGISTERED_DIRECTLY", set())
    amp.register_half_function(torch, "layer_norm")
    amp.register_float_function(torch, "batch_norm")
    amp.register_float_function(torch, "layer_norm")  # registering again replaces the wrapper's policy too
    amp.register_half_function(torch.nn.functional, "group_norm")
    amp.register_float_function(torch, "group_norm")  # the wrapper's own registration wins
    assert registry._TORCH_POLICIES[torch.nn.functional.group_norm] == "half"
    amp.register_half_function(torch, "bmm")  # F.multi_head_attention_forward calls it among much else
    assert torch.nn.functional.multi_head_attention_forward not in registry._TORCH_POLICIES
    torch.manual_seed(0)
    model = amp.initialize(_ConvBnHead().eval(), opt_level="O1", verbosity=0)
    seen = {}
    for name in ("conv", "bn", "norm"):
        getattr(model, name).register_forward_hook(lambda m, i, o, name=name: seen.__setitem__(name, (i[0], o)))
    model(torch.randn(2, 3, 8, 8))
    bn_in, bn_out = seen["bn"]
    norm_in, norm_out = seen["norm"]
    assert bn_in.dtype == torch.float16 and bn_out.dtype == torch.float32 and norm_out.dtype == torch.float32
    bn, norm = model.bn, model.norm
    torch.testing.assert_close(bn_out, torch.nn.functional.batch_norm(
        bn_in.float(), bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.1, bn.eps), rtol=0, atol=0)
    torch.testing.assert_close(norm_out, torch.nn.functional.layer_norm(
        norm_in.float(), (64,), norm.weight, norm.bias, norm.eps), rtol=0, atol=0)
