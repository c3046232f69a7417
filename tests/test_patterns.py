"""Training patterns at O1, O2 and O5: accumulation, clipping, gradient penalty, sparse
gradients, several models/losses; overflow diagnostics and persistent NaN."""
import collections
import contextlib
import copy
import math

import pytest
import torch
from torch import nn

import ampinit as amp
from conftest import amp_backward, batch, initialize_at

LEVELS = ["O1", "O2", "O5"]
TOL = {"O1": dict(rtol=2e-2, atol=2e-3), "O2": dict(rtol=2e-2, atol=2e-3), "O5": dict(rtol=6e-2, atol=1e-2)}


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))


def setup(level, seed=0, lr=0.05, **kwargs):
    model = mlp(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    return amp.initialize(model, opt, opt_level=level, verbosity=0, **kwargs)


def fp32_grads(x, y, seed=0):
    ref = mlp(seed)
    ((ref(x) - y) ** 2).mean().backward()
    return [p.grad for p in ref.parameters()]


@pytest.mark.parametrize("level", LEVELS)
def test_accumulation_equals_one_big_batch(level):
    x, y = batch(0, n=64)
    model, opt = setup(level)
    k = 4
    for i, (xs, ys) in enumerate(zip(x.chunk(k), y.chunk(k))):
        loss = ((model(xs).float() - ys) ** 2).mean() / k
        with amp.scale_loss(loss, opt, delay_unscale=i < k - 1) as scaled:
            scaled.backward()
    big_model, big_opt = setup(level)
    with amp.scale_loss(((big_model(x).float() - y) ** 2).mean(), big_opt) as scaled:
        scaled.backward()
    reference = fp32_grads(x, y)
    for acc, big, ref in zip(amp.master_params(opt), amp.master_params(big_opt), reference):
        assert acc.grad.dtype == torch.float32
        torch.testing.assert_close(acc.grad, big.grad, **TOL[level])
        torch.testing.assert_close(acc.grad, ref, **TOL[level])


@pytest.mark.parametrize("level", LEVELS)
def test_clipping_unscaled_master_grads(level):
    x, y = batch(1)
    model, opt = setup(level)
    with amp.scale_loss(((model(x).float() - y) ** 2).mean(), opt) as scaled:
        scaled.backward()
    reference_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in fp32_grads(x, y)]))
    norm = torch.nn.utils.clip_grad_norm_(amp.master_params(opt), max_norm=0.1)
    torch.testing.assert_close(norm, reference_norm, rtol=3e-2, atol=0)  # unscaled, not * 65536
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in amp.master_params(opt)]))
    torch.testing.assert_close(clipped, torch.tensor(0.1), rtol=1e-4, atol=0)
    opt.step()
    # an overflow is still skipped when the clipping saw the inf
    with amp.scale_loss(((model(x).float() - y) ** 2).mean() * float("inf"), opt) as scaled:
        scaled.backward()
    torch.nn.utils.clip_grad_norm_(amp.master_params(opt), max_norm=0.1)
    before = [p.detach().clone() for p in amp.master_params(opt)]
    opt.step()
    assert opt.amp.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, amp.master_params(opt)))


def _clip_in_or_after_the_block(level, inside, steps=3):
    """The weights after ``steps`` SGD steps with the masters clipped to norm 0.5, inside the
    ``scale_loss`` block after the backward or after it (``level=None``: plain FP32)."""
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    if level is not None:
        model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    for index in range(steps):
        x, y = batch(index)
        loss = ((model(x).float() - y) ** 2).mean()
        opt.zero_grad()
        if level is None:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        else:
            with amp.scale_loss(loss, opt) as scaled:
                early = list(amp.master_params(opt))  # before the backward: allowed
                scaled.backward()
                if inside:
                    torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 0.5)
            assert len(early) == len(list(model.parameters()))
            if not inside:
                torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 0.5)
        opt.step()
    return [p.detach().float() for p in model.parameters()]


@pytest.mark.parametrize("level", ["O1", "O2", "O5"])
def test_master_params_inside_scale_loss_after_the_backward_is_refused(level):
    """An indentation slip: clipping amp.master_params inside the block clipped the scaled
    gradients at O1 (the update came out loss-scale times too small) and nothing at O2/O5 (the
    masters' gradients come at the exit).  apex did the same, silently."""
    with pytest.raises(RuntimeError, match=r"master_params\(optimizer\) was called inside .*after the with block"):
        _clip_in_or_after_the_block(level, inside=True)
    # nothing was changed: the exit unscaled as usual, and clipping after the block trains
    got = _clip_in_or_after_the_block(level, inside=False)
    for a, b in zip(got, _clip_in_or_after_the_block(None, inside=False)):
        torch.testing.assert_close(a, b, **TOL[level])


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_master_params_in_a_hook_of_the_scaled_backward_is_refused(level):
    """From the review: a hook the backward runs (clipping from a post-accumulate hook) sees the
    gradients scaled too, before the backward is over."""
    model, opt = setup(level)
    model[2].weight.register_post_accumulate_grad_hook(
        lambda _: torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 1.0))
    x, y = batch(0)
    with pytest.raises(RuntimeError, match="master_params"):
        with amp.scale_loss(((model(x).float() - y) ** 2).mean(), opt) as scaled:
            scaled.backward()


@pytest.mark.parametrize("level", ["O0", "O3", "O4"])
def test_master_params_inside_scale_loss_is_right_without_scale_or_masters(level):
    """With a static scale of 1 and no masters the gradients are final inside the block: the
    slip is harmless there, and allowed (O0 stays bit for bit FP32)."""
    ref = _clip_in_or_after_the_block(None, inside=False)
    for a, b in zip(_clip_in_or_after_the_block(level, inside=True), ref):
        torch.testing.assert_close(a, b, rtol=0 if level == "O0" else 2e-2, atol=0 if level == "O0" else 3e-3)


@pytest.mark.parametrize("change", ["clip_model", "divide_last_layer", "replace_first", "none", "second_backward",
                                    "gradient_penalty", "clear"])
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3", "O4", "O5"])
def test_gradients_changed_inside_scale_loss_are_logged_where_still_scaled(level, change, caplog):
    """clip_grad_norm_(model.parameters()) inside the block clips the scaled gradients (O1/O2
    trained 10x off FP32, silently).  A change there is only logged (once): a linear one, such
    as averaging, is right.  Another backward through the scaled loss is not a change, and
    neither is a clear (``zero_grad()`` in the block): it leaves nothing to step, as in torch."""
    model, opt = setup(level)
    initial = [p.detach().clone() for p in model.parameters()]
    message = "gradients were changed inside `with ampinit.scale_loss"
    with caplog.at_level("WARNING", logger="ampinit"):
        for index in range(3):
            x, y = batch(index)
            x.requires_grad_(change == "gradient_penalty")
            out = model(x).float()
            loss = ((out - y) ** 2).mean()
            opt.zero_grad()
            with amp.scale_loss(loss, opt) as scaled:
                if change == "gradient_penalty":  # a backward that fills no .grad, then the real one
                    (gx,) = torch.autograd.grad(scaled, x, create_graph=True)
                    scaled = scaled + gx.pow(2).sum() * 1e-6
                scaled.backward(retain_graph=change == "second_backward")
                if change == "second_backward":
                    scaled.backward()
                elif change == "clip_model":
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                elif change == "divide_last_layer":
                    model[2].bias.grad.div_(2)
                elif change == "replace_first":
                    model[0].weight.grad = model[0].weight.grad * 0.5
                elif change == "clear":
                    opt.zero_grad()
            opt.step()
    changed = change in ("clip_model", "divide_last_layer", "replace_first")
    assert caplog.text.count(message) == (1 if changed and level in ("O1", "O2") else 0)
    if change == "clear":  # torch: every gradient None at step(), nothing moves
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), initial))


@pytest.mark.parametrize("level", LEVELS)
def test_gradient_penalty_double_backward(level):
    """torch's AMP gradient-penalty recipe: autograd.grad of the scaled loss with
    create_graph=True, unscale by hand with the handle's scale tensor, add the penalty."""
    x, y = batch(2)
    model, opt = setup(level)
    params = [p for p in model.parameters()]
    scale = opt.amp.loss_scalers[0].scale_tensor
    loss = ((model(x).float() - y) ** 2).mean()
    scaled_grads = torch.autograd.grad(opt.amp.loss_scalers[0].scale(loss), params, create_graph=True)
    penalty = sum((g.float() / scale).pow(2).sum() for g in scaled_grads)
    with amp.scale_loss(loss + penalty, opt) as scaled:
        scaled.backward()

    ref = mlp()
    ref_loss = ((ref(x) - y) ** 2).mean()
    ref_grads = torch.autograd.grad(ref_loss, list(ref.parameters()), create_graph=True)
    (ref_loss + sum(g.pow(2).sum() for g in ref_grads)).backward()
    for master, p in zip(amp.master_params(opt), ref.parameters()):
        torch.testing.assert_close(master.grad, p.grad, rtol=5e-2, atol=5e-3)
    opt.step()
    assert opt.amp.skipped_steps == 0


class Bag(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 8, sparse=True)
        self.head = nn.Linear(8, 1)

    def forward(self, ids):
        return self.head(self.emb(ids).mean(1))


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("optimizer", ["sparse_adam", "sgd"])
def test_sparse_embedding_gradients(level, optimizer):
    torch.manual_seed(0)
    model = Bag()
    if optimizer == "sparse_adam":
        opts = [torch.optim.SparseAdam(list(model.emb.parameters()), lr=0.05),
                torch.optim.Adam(model.head.parameters(), lr=0.05, eps=1e-4)]
    else:
        opts = [torch.optim.SGD(model.parameters(), lr=0.5)]
    model, opts = amp.initialize(model, opts, opt_level=level, verbosity=0)
    ids = torch.randint(0, 50, (64, 5), generator=torch.Generator().manual_seed(0))
    target = torch.randn(64, 1, generator=torch.Generator().manual_seed(1))
    losses = []
    for step in range(30):
        for o in opts:
            o.zero_grad()
        loss = ((model(ids).float() - target) ** 2).mean()
        if step == 10:
            loss = loss * float("nan")
        with amp.scale_loss(loss, opts) as scaled:
            scaled.backward()
        if level != "O1" and step == 0:
            master = next(amp.master_params(opts[0]))
            assert master.grad.is_sparse and master.grad.dtype == torch.float32
        for o in opts:
            o.step()
        losses.append(loss.item())
    assert opts[0].amp.skipped_steps == len(opts)  # every optimizer skipped the NaN step
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("level", LEVELS)
def test_dcgan_pattern_three_losses(level):
    """apex's DCGAN example: D on real, D on fake, G through D, each with its own scaler."""
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    disc = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    opt_g = torch.optim.Adam(gen.parameters(), lr=2e-3, betas=(0.5, 0.999), eps=1e-4)
    opt_d = torch.optim.Adam(disc.parameters(), lr=2e-3, betas=(0.5, 0.999), eps=1e-4)
    [gen, disc], [opt_g, opt_d] = amp.initialize([gen, disc], [opt_g, opt_d], opt_level=level,
                                                 num_losses=3, verbosity=0)
    bce = nn.BCEWithLogitsLoss()
    real = torch.randn(32, 8) * 0.5 + 1.0
    for step in range(40):
        noise = torch.randn(32, 4)
        opt_d.zero_grad()
        err_real = bce(disc(real).float(), torch.ones(32, 1))
        with amp.scale_loss(err_real, opt_d, loss_id=0) as scaled:
            scaled.backward()
        fake = gen(noise)
        err_fake = bce(disc(fake.detach()).float(), torch.zeros(32, 1))
        if step == 5:
            err_fake = err_fake * float("inf")
        with amp.scale_loss(err_fake, opt_d, loss_id=1) as scaled:
            scaled.backward()
        opt_d.step()
        opt_g.zero_grad()
        err_g = bce(disc(fake).float(), torch.ones(32, 1))
        with amp.scale_loss(err_g, opt_g, loss_id=2) as scaled:
            scaled.backward()
        opt_g.step()
    handle = opt_g.amp
    assert handle.binding(opt_d).skipped_steps == 1 and handle.binding(opt_g).skipped_steps == 0
    if level in ("O1", "O2"):  # dynamic: only loss 1 backed off
        assert [s.loss_scale() for s in handle.loss_scalers] == [2.0 ** 16, 2.0 ** 15, 2.0 ** 16]
    assert all(torch.isfinite(p).all() for m in (gen, disc) for p in m.parameters())


def test_diagnostics_name_the_nonfinite_parameters():
    model, opt = setup("O2")
    poison = {"on": False}
    model[2].weight.register_hook(lambda g: g * float("nan") if poison["on"] else g)
    x, y = batch(0)
    for step in range(4):
        poison["on"] = step == 2
        opt.zero_grad()
        with amp.scale_loss(((model(x).float() - y) ** 2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
    assert opt.amp.last_overflow_step == 2 and opt.amp.last_overflow_params == ["2.weight"]
    assert opt.amp.skipped_steps == 1
    state = opt.amp.state_dict()["ampinit"]["optimizers"][0]
    assert state["last_overflow_step"] == 2


@pytest.mark.parametrize("level, kwargs, expected_skips", [
    # 15 skips halve 2**16 down to 2; the 16th lands on the floor of 1.0 and is the first of the
    # 16 consecutive skips that leave the scale at its floor
    ("O2", {"min_loss_scale": 1.0}, 15 + 16),
    ("O5", {}, 16),                              # a static scale is always at its floor
])
def test_persistent_nan_raises_naming_parameters(level, kwargs, expected_skips):
    model, opt = setup(level, **kwargs)
    model[0].bias.register_hook(lambda g: g * float("nan"))
    x, y = batch(0)
    with pytest.raises(RuntimeError, match=r"floor.*Non-finite gradients in: 0\.bias"):
        for _ in range(100):
            opt.zero_grad()
            with amp.scale_loss(((model(x).float() - y) ** 2).mean(), opt) as scaled:
                scaled.backward()
            opt.step()
    assert opt.amp.skipped_steps == expected_skips
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_overflow_at_a_floor_set_too_high_names_the_floor(level):
    """min_loss_scale=65536 with a gradient of 1.0 overflows fp16 at every step, for real: the
    error names the floor, not a NaN bug (the same model trains with the default floor)."""
    for floor, raises in ((2.0 ** 16, True), (None, False)):
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        kwargs = {} if floor is None else {"min_loss_scale": floor}
        model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0, **kwargs)
        x = torch.ones(8, 4)
        message = r"cannot go below min_loss_scale=65536: either these gradients overflow even at that scale " \
            r"\(lower min_loss_scale.*or they are inf/NaN"
        context = pytest.raises(RuntimeError, match=message) if raises else contextlib.nullcontext()
        with context:
            for _ in range(40):
                opt.zero_grad()
                with amp.scale_loss(model(x).float().sum() / 8, opt) as scaled:  # bias gradient 1.0
                    scaled.backward()
                opt.step()
        assert (opt.amp.skipped_steps >= 16) == raises


@pytest.mark.parametrize("level", ["O1", "O2", "O5"])
@pytest.mark.parametrize("cause", ["inf_weight", "nan_input"])
def test_persistent_overflow_from_broken_weights_says_so(level, cause):
    """amazon-science/transformer-gan (E13) steps the generator with an optimizer it never
    passed to initialize, on the scaled gradients: the weights became inf, every later step
    was skipped, and the error blamed NaN in the data or a DDP hook.  It now names the inf/NaN
    weights and the likely writer; a NaN in the data still gets the data message."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    x = torch.ones(8, 4)
    if cause == "inf_weight":  # what the foreign optimizer left
        with torch.no_grad():
            model[0].weight[0, 0] = float("inf")
    else:
        x[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="consecutive steps") as raised:
        for _ in range(60):
            opt.zero_grad()
            with amp.scale_loss(model(x).float().sum(), opt) as scaled:
                scaled.backward()
            opt.step()
    message = str(raised.value)
    if cause == "inf_weight":
        assert "weights themselves hold inf/NaN (0.weight)" in message, message
        assert "not passed to ampinit.initialize" in message
    else:
        assert "weights themselves" not in message and "NaN in the data" in message, message


def test_persistent_nan_check_can_be_disabled():
    model, opt = setup("O5")
    opt.amp.max_skips_at_floor = None
    model[0].bias.register_hook(lambda g: g * float("nan"))
    x, y = batch(0)
    for _ in range(40):
        with amp.scale_loss(((model(x).float() - y) ** 2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
    assert opt.amp.skipped_steps == 40


# -- an optimizer wrapper that never calls Optimizer.__init__ (the widely copied Lookahead) ------

class _Lookahead(torch.optim.Optimizer):
    """alphadl/lookahead.pytorch's Lookahead: shares the inner optimizer's param_groups and
    skips ``Optimizer.__init__``, so torch never hooks its class's step."""

    def __init__(self, optimizer, k=2, alpha=0.5):
        self.optimizer, self.k, self.alpha = optimizer, k, alpha
        self.param_groups = optimizer.param_groups
        self.state = collections.defaultdict(dict)
        for group in self.param_groups:
            group["counter"] = 0

    @torch.no_grad()
    def step(self, closure=None):
        loss = self.optimizer.step()
        for group in self.param_groups:
            if group["counter"] == 0:
                for fast in group["params"]:
                    slow = self.state[fast].setdefault("slow", fast.detach().clone())
                    slow += (fast - slow) * self.alpha
                    fast.copy_(slow)
            group["counter"] = (group["counter"] + 1) % self.k
        return loss


class _LookaheadWithInit(_Lookahead):
    """The same, calling ``Optimizer.__init__`` (which hooks this subclass's step only)."""

    def __init__(self, optimizer, k=2, alpha=0.5):
        torch.optim.Optimizer.__init__(self, optimizer.param_groups, {})
        super().__init__(optimizer, k, alpha)


@pytest.mark.parametrize("level", ["O0", "O2", "O5"])
@pytest.mark.parametrize("scheduler", [None, "after"])
def test_lookahead_without_optimizer_init_trains_like_with_it(level, scheduler):
    """The copied Lookahead crashed in initialize (no step hooks); it must train exactly like
    the same wrapper that does call ``Optimizer.__init__`` (the reference)."""
    def run(call_init):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        opt = (_LookaheadWithInit if call_init else _Lookahead)(torch.optim.SGD(model.parameters(), lr=0.1,
                                                                                momentum=0.9))
        model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0, loss_scale=128.0)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if scheduler else None
        gen = torch.Generator().manual_seed(1)
        for _ in range(6):
            x = torch.randn(16, 4, generator=gen).to(next(model.parameters()).dtype)
            model.zero_grad()  # torch's Optimizer.zero_grad needs the attributes its __init__ sets
            with amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
                scaled.backward()
            opt.step()
            if sched is not None:
                sched.step()
        return [p.detach().clone() for p in model.parameters()]

    torch.manual_seed(0)
    start = [p.detach().clone() for p in nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).parameters()]
    got, want = run(call_init=False), run(call_init=True)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert any(not torch.equal(a.float(), b) for a, b in zip(got, start))  # it trained


def test_lookahead_without_optimizer_init_and_a_scheduler_made_before_initialize_is_refused():
    """Its step bound by the scheduler would bypass ampinit's (no hooks to reach it): a clear
    error, and the optimizer left untouched."""
    model = nn.Linear(4, 2)
    opt = _Lookahead(torch.optim.SGD(model.parameters(), lr=0.1))
    torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    before = type(opt), [list(g["params"]) for g in opt.param_groups]
    with pytest.raises(RuntimeError, match="LR scheduler after"):
        amp.initialize(model, opt, opt_level="O2", verbosity=0)
    assert (type(opt), [list(g["params"]) for g in opt.param_groups]) == before
    assert model.weight.dtype == torch.float32


class _Sam(torch.optim.Optimizer):
    """Sharpness-aware minimization as the widely used implementation structures it: a
    ``base_optimizer`` sharing this optimizer's ``param_groups``, stepped from ``second_step``
    (the loop calls ``first_step``/``second_step``, never ``step``)."""

    def __init__(self, params, base, rho=0.5, **kwargs):
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base_optimizer = base(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["old"] = p.detach().clone()
                    p.add_(p.grad * (group["rho"] / (norm + 1e-12)))  # climb to the local worst case
        self.zero_grad()

    @torch.no_grad()
    def second_step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data = self.state[p]["old"]
        self.base_optimizer.step()
        self.zero_grad()


@pytest.mark.parametrize("level", ["O1", "O2", "O5"])
def test_sam_trains_like_fp32_sam_when_its_base_optimizer_is_initialized(level):
    """SAM perturbs the weights through ``param_groups`` (the masters at O2/O5) between two
    backwards: the second forward must see the perturbation (it did not: the run was plain SGD),
    as with FP32 torch.  Initializing the SAM itself, whose base optimizer steps outside its
    ``step()``, is refused at that step with what to do instead (the model never moved)."""
    def run(level, initialize_base=True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        sam = _Sam(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
        scaled_by = sam.base_optimizer if initialize_base else sam
        if level is not None:
            model, _ = amp.initialize(model, scaled_by, opt_level=level, verbosity=0, loss_scale=128.0)

        def backward(loss):
            if level is None:
                loss.backward()
            else:
                with amp.scale_loss(loss, scaled_by) as scaled:
                    scaled.backward()

        for i in range(10):
            gen = torch.Generator().manual_seed(i)
            x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
            x = x.to(next(model.parameters()).dtype) if level in ("O2", "O5") else x
            backward((model(x).float() - y).pow(2).mean())
            sam.first_step()
            backward((model(x).float() - y).pow(2).mean())
            sam.second_step()
        return [p.detach().float() for p in model.parameters()]

    def plain_sgd():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for i in range(10):
            gen = torch.Generator().manual_seed(i)
            x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
            opt.zero_grad()
            (model(x) - y).pow(2).mean().backward()
            opt.step()
        return list(model.parameters())

    reference, sgd = run(None), plain_sgd()
    got = run(level)
    distance = lambda a, b: max(float((x - y).abs().max()) for x, y in zip(a, b))  # noqa: E731
    assert distance(reference, sgd) > 0.1  # SAM is not SGD here
    assert distance(got, reference) < (0.01 if level == "O5" else 1e-3)
    with pytest.raises(RuntimeError, match=r"base_optimizer.step\(\) ran outside _Sam.step\(\)"):
        run(level, initialize_base=False)


@pytest.mark.parametrize("level", ["O1", "O2", "O5"])
@pytest.mark.parametrize("style", ["zero_d_first", "model_zero_grad", "both_optimizers", "unzeroed"])
def test_a_generator_loss_reaching_the_discriminator(level, style):
    """GAN step: the generator's loss backpropagates through D, so its scale_loss(loss_G, opt_G)
    leaves gradients on D's parameters, multiplied by the loss scale (only opt_G's are
    unscaled).  Cleared before D uses them (pix2pixHD's ``optimizer_D.zero_grad()``, DCGAN's
    ``netD.zero_grad()``) or unscaled with both optimizers in the scale_loss, D trains like FP32
    torch; used as they are, D stepped on ~1000x its FP32 gradient at O1 (and the O2 error
    blamed a backward outside scale_loss): now a clear error, before anything changes."""
    def run(level):
        torch.manual_seed(0)
        G, D = nn.Linear(4, 4), nn.Linear(4, 1)
        opt_g, opt_d = torch.optim.SGD(G.parameters(), lr=0.1), torch.optim.SGD(D.parameters(), lr=0.1)
        if level is not None:
            [G, D], [opt_g, opt_d] = amp.initialize([G, D], [opt_g, opt_d], opt_level=level, verbosity=0,
                                                    loss_scale=1024.0)
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            z, real = torch.randn(8, 4, generator=gen), torch.randn(8, 4, generator=gen)
            opt_g.zero_grad()
            opt_d.zero_grad()
            amp_backward(-D(G(z)).float().mean(), [opt_g, opt_d] if style == "both_optimizers" else opt_g, level)
            opt_g.step()
            if style == "zero_d_first":
                opt_d.zero_grad()
            elif style == "model_zero_grad":
                D.zero_grad()
            amp_backward(D(real).float().mean() - D(G(z).detach()).float().mean(), opt_d, level)
            opt_d.step()
        return [p.detach().float().clone() for p in list(G.parameters()) + list(D.parameters())]

    if style == "unzeroed":
        with pytest.raises(RuntimeError, match=r"gradients of models\[1\].weight, models\[1\].bias that the "
                                               r"backward of a scale_loss for another optimizer"):
            run(level)
        return
    for got, want in zip(run(level), run(None)):
        torch.testing.assert_close(got, want, rtol=0, atol=2e-2 if level == "O5" else 3e-3)


@pytest.mark.parametrize("level", ["O1", "O2", "O5"])
def test_d_step_inside_the_generator_scale_loss_block_is_refused(level):
    """D's step inside G's ``scale_loss`` block, after G's backward: D's gradients hold G's loss
    still multiplied by G's scale (O1 stepped D on them, 1024x too far; FP32 would step on the
    sum of both losses' gradients).  Refused as after the block, before anything changes."""
    torch.manual_seed(0)
    G, D = nn.Linear(4, 4), nn.Linear(4, 1)
    opt_g, opt_d = torch.optim.SGD(G.parameters(), lr=0.1), torch.optim.SGD(D.parameters(), lr=0.1)
    [G, D], [opt_g, opt_d] = amp.initialize([G, D], [opt_g, opt_d], opt_level=level, verbosity=0, loss_scale=1024.0)
    z, real = torch.randn(8, 4), torch.randn(8, 4)
    opt_d.zero_grad()
    amp_backward(D(real).float().mean() - D(G(z).detach()).float().mean(), opt_d, level)
    before = [p.detach().clone() for p in opt_d.param_groups[0]["params"]]
    grads = [p.grad.clone() for p in opt_d.param_groups[0]["params"]]
    with amp.scale_loss(-D(G(z)).float().mean(), opt_g) as scaled:
        scaled.backward()
        with pytest.raises(RuntimeError, match=r"gradients of models\[1\].weight, models\[1\].bias that the "
                                               r"backward of a scale_loss for another optimizer"):
            opt_d.step()
    for b, p in zip(before, opt_d.param_groups[0]["params"]):
        assert torch.equal(b, p)
    opt_d.zero_grad()  # the way out the message gives: D's own gradients again, then its step
    amp_backward(D(real).float().mean() - D(G(z).detach()).float().mean(), opt_d, level)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, opt_d.param_groups[0]["params"]))
    opt_d.step()


@pytest.mark.parametrize("level", ["O2", "O5"])
@pytest.mark.parametrize("overflow_in", ["first", "second"])
def test_sam_recovers_from_a_skipped_step_like_fp32_sam(level, overflow_in):
    """An inf in one of SAM's backwards: the perturbation (inf/NaN, or finite) reaches the model
    at the second forward, second_step restores the masters through ``p.data = old`` (no version
    counter sees that) and the step is skipped, so nothing copied the masters back: the model
    kept the perturbed (or NaN, for good) weights.  Reference: FP32 SAM that skips that step."""
    def run(level):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        sam = _Sam(model.parameters(), torch.optim.SGD, lr=0.05, momentum=0.9, rho=0.05)
        base = sam.base_optimizer
        if level is not None:
            model, _ = amp.initialize(model, base, opt_level=level, verbosity=0, loss_scale=128.0)
        losses = []
        for i in range(8):
            gen = torch.Generator().manual_seed(i)
            x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
            x = x.to(next(model.parameters()).dtype)
            poison = [float("inf") if i == 3 and overflow_in == which else 1.0 for which in ("first", "second")]
            bad = False
            for k in range(2):
                loss = (model(x).float() - y).pow(2).mean() * poison[k]
                if level is None:
                    loss.backward()
                    bad = bad or any(not torch.isfinite(p.grad).all() for p in model.parameters())
                else:
                    with amp.scale_loss(loss, base) as scaled:
                        scaled.backward()
                if k == 0:
                    sam.first_step()
            if level is None and bad:  # the FP32 reference skips the step: restore, no update
                for group in sam.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            p.data = sam.state[p]["old"]
                sam.zero_grad()
            else:
                sam.second_step()
            losses.append(float(loss))
        return [p.detach().float() for p in model.parameters()], losses

    reference, ref_losses = run(None)
    got, losses = run(level)
    assert all(math.isfinite(v) for i, v in enumerate(losses) if i != 3)
    for g, r in zip(got, reference):
        torch.testing.assert_close(g, r, rtol=0, atol=0.02 if level == "O5" else 1e-3)


@pytest.mark.parametrize("forward", ["model", "submodule"])
def test_sam_with_a_forward_the_check_does_not_see_is_logged(forward, caplog):
    """The forward pre-hook that carries SAM's perturbation into the model runs on the
    initialized model's own eager forward; a forward through a submodule (or under
    torch.compile) computes with the old weights, which the next scale_loss tells and logs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    sam = _Sam(model.parameters(), torch.optim.SGD, lr=0.1)
    model, _ = amp.initialize(model, sam.base_optimizer, opt_level="O2", verbosity=0, loss_scale=128.0)
    run = model if forward == "model" else model[0]
    x, y = torch.randn(16, 8).half(), torch.randn(16, 4)
    with caplog.at_level("WARNING", logger="ampinit"):
        for _ in range(2):
            for k in range(2):
                with amp.scale_loss((run(x).float() - y).pow(2).mean(), sam.base_optimizer) as scaled:
                    scaled.backward()
                if k == 0:
                    sam.first_step()
            sam.second_step()
    assert ("the forward since did not see it" in caplog.text) == (forward == "submodule")
    assert caplog.text.count("the forward since did not see it") <= 1


def _step_inside_scale_loss(level, in_hook, poisoned_step=None, steps=3):
    """The weight after ``steps`` steps taken inside the block (or from a hook the backward
    runs).  ``poisoned_step``'s batch holds an inf; the plain run (``level=None``) skips that
    step as GradScaler would."""
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if level is not None:
        model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    params = list(model.parameters())

    def step():
        if level is not None or all(torch.isfinite(q.grad).all() for q in params):
            opt.step()

    if in_hook:  # the "optimizer step in the backward" recipe: a hook steps once every grad is in
        for param in params:
            param.register_post_accumulate_grad_hook(
                lambda _: step() if all(q.grad is not None for q in params) else None)
    for index in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(index))
        if index == poisoned_step:
            x[0, 0] = float("inf")
        loss = model(x).float().pow(2).mean()
        opt.zero_grad()
        if level is None:
            loss.backward()
            if not in_hook:
                step()
        else:
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
                if not in_hook:
                    step()
    return model.weight.detach().float()


@pytest.mark.parametrize("in_hook", [False, True], ids=["in_block", "in_backward_hook"])
@pytest.mark.parametrize("level", ["O1", "O2", "O5"])
def test_a_step_inside_scale_loss_is_refused_where_gradients_are_not_final(level, in_hook):
    """Stepping in the with-block, or from a hook the backward runs, updates with gradients still
    multiplied by the loss scale (O1 stepped 65536x too far, then NaN) or not yet in the masters."""
    with pytest.raises(RuntimeError, match="inside `with ampinit.scale_loss.*after the with block") as raised:
        _step_inside_scale_loss(level, in_hook)
    # each reason only where it holds: O5's static scale is 1, O1 has no masters
    assert ("multiplied by the loss scale" in str(raised.value)) == (level != "O5")
    assert ("not yet in the FP32 master weights" in str(raised.value)) == (level != "O1")


@pytest.mark.parametrize("in_hook", [False, True], ids=["in_block", "in_backward_hook"])
@pytest.mark.parametrize("level", ["O0", "O3", "O4"])
def test_a_step_inside_scale_loss_trains_like_fp32_without_scale_or_masters(level, in_hook):
    """With a static scale of 1 and no masters the gradients are final inside the block, as in apex."""
    ref = _step_inside_scale_loss(None, in_hook)
    torch.testing.assert_close(_step_inside_scale_loss(level, in_hook), ref,
                               rtol=0 if level == "O0" else 2e-2, atol=0 if level == "O0" else 2e-3)


@pytest.mark.parametrize("in_hook", [False, True], ids=["in_block", "in_backward_hook"])
@pytest.mark.parametrize("level", ["O0", "O3", "O4"])
def test_a_step_inside_scale_loss_skips_non_finite_gradients(level, in_hook):
    """A step inside the block comes before the block's exit checks the gradients.  It stepped
    inf/NaN into the weights at O0/O4 (the recipe O1's error recommends O4 for), against "static
    scales still skip non-finite steps": it checks them itself now."""
    ref = _step_inside_scale_loss(None, in_hook, poisoned_step=1, steps=4)
    got = _step_inside_scale_loss(level, in_hook, poisoned_step=1, steps=4)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, rtol=0 if level == "O0" else 2e-2, atol=0 if level == "O0" else 2e-3)


def _unused_branch_with_zeroed_grads(level, make_opt, planted_overflow, model_zero_grad=False):
    """A branch that only some steps use (MoE experts, auxiliary heads), and
    zero_grad(set_to_none=False): the branch's parameters still step on a zero gradient there.
    With ``model_zero_grad``, ``model.zero_grad()`` (set_to_none=True) follows before the
    backward: then torch leaves the unused branch no gradient, and it does not step."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(4, 2), "b": nn.Linear(4, 2)})
    opt = make_opt(model.parameters())
    if level is not None:
        model, opt = initialize_at(model, opt, level)
    for step in range(8):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step)).to(model["a"].weight.dtype)
        opt.zero_grad(set_to_none=False)
        if model_zero_grad:
            model.zero_grad()
        out = model["a"](x) + (model["b"](x) if step % 3 == 0 else 0)
        loss = out.float().pow(2).mean() * (float("inf") if step == planted_overflow else 1.0)
        if level is None:
            if step == planted_overflow:
                continue  # GradScaler's skip: the gradients stay until the next zero_grad
            loss.backward()
        else:
            amp_backward(loss, opt, level)
        opt.step()
    return [p.detach().float() for p in model.parameters()]


@pytest.mark.parametrize("planted_overflow", [None, 4], ids=["clean", "skipped_step"])
@pytest.mark.parametrize("make_opt", [
    lambda p: amp.optim.FusedAdamW(p, lr=1e-2, weight_decay=0.1),
    lambda p: amp.optim.FusedSGD(p, lr=1e-2, momentum=0.9, weight_decay=0.1),
    lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
], ids=["FusedAdamW", "FusedSGD", "AdamW"])
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O5"])
def test_zero_grad_keeping_tensors_steps_an_unused_branch_like_fp32(level, make_opt, planted_overflow):
    """A fused step (and a skipped one) drops the gradients; zero_grad(set_to_none=False) must
    give them back as zeros, as torch's would leave them: else the optimizer skips the branch
    (weight decay and momentum lost: 15% off after 12 steps)."""
    ref = _unused_branch_with_zeroed_grads(None, make_opt, planted_overflow)
    got = _unused_branch_with_zeroed_grads(level, make_opt, planted_overflow)
    tol = {"O0": 0, "O1": 2e-3, "O2": 2e-3, "O5": 2e-2}[level]
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=tol, atol=tol)


@pytest.mark.parametrize("make_opt", [
    lambda p: amp.optim.FusedAdamW(p, lr=1e-2, weight_decay=0.1),
    lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
], ids=["FusedAdamW", "AdamW"])
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O5"])
def test_model_zero_grad_after_zero_grad_keeping_tensors_clears_the_zeros_owed(level, make_opt):
    """The zeros zero_grad(set_to_none=False) gives back are cleared by a later model.zero_grad():
    the unused branch then stops stepping, as in torch (weight decay and Adam's moments)."""
    ref = _unused_branch_with_zeroed_grads(None, make_opt, None, model_zero_grad=True)
    got = _unused_branch_with_zeroed_grads(level, make_opt, None, model_zero_grad=True)
    tol = {"O0": 0, "O1": 2e-3, "O2": 2e-3, "O5": 2e-2}[level]
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=tol, atol=tol)


@pytest.mark.parametrize("make_fused", [
    lambda p: amp.optim.FusedAdamW(p, lr=1e-2, weight_decay=0.1),
    lambda p: amp.optim.FusedSGD(p, lr=1e-2, momentum=0.9, weight_decay=0.1),
], ids=["FusedAdamW", "FusedSGD"])
@pytest.mark.parametrize("level", ["O1", "O2", "O5"])
def test_an_overflow_skips_the_step_of_a_fused_optimizer_whose_branch_it_did_not_reach(level, make_fused):
    """One scale_loss for two optimizers, zero_grad(set_to_none=False), and an inf that reaches only
    the first's parameters: the second's branch (unused that step) holds zeros, gradients of the
    overflowing step, so its step is skipped too (once, the zeros owed at step() forgot the overflow:
    AdamW stepped, 5.6e-3).  Reference: FP32 with that step skipped; the masters' gradients read
    through amp.master_params are zeros there, as torch leaves them (they were None)."""
    def run(level):
        torch.manual_seed(0)
        model = nn.ModuleDict({"a": nn.Linear(4, 2), "c": nn.Linear(4, 2)})
        opt_a, opt_c = torch.optim.SGD(model["a"].parameters(), lr=1e-2), make_fused(model["c"].parameters())
        if level is not None:
            model, (opt_a, opt_c) = initialize_at(model, [opt_a, opt_c], level)
        for step in range(5):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step)).to(model["a"].weight.dtype)
            opt_a.zero_grad(set_to_none=False)
            opt_c.zero_grad(set_to_none=False)
            out = model["a"](x) + (model["c"](x) if step % 2 == 0 else 0)
            if step == 3 and level is None:
                continue  # the overflowing step: skipped by both
            loss = out.float().pow(2).mean() * (float("inf") if step == 3 else 1.0)
            amp_backward(loss, [opt_a, opt_c], level)
            if level is not None and step == 1:
                grads = [p.grad for p in amp.master_params(opt_c)]
                assert all(g is not None and not g.any() for g in grads)
            opt_a.step()
            opt_c.step()
        return [p.detach().float() for p in model.parameters()]

    for got, want in zip(run(level), run(None)):
        torch.testing.assert_close(got, want, rtol=0, atol=2e-2 if level == "O5" else 3e-3)


def test_zeros_given_back_by_zero_grad_raise_no_bf16_sum_warning(caplog):
    """Remainder masters sum several losses in bf16 and say so once; the zeros that
    zero_grad(set_to_none=False) gives back are not an earlier loss (adding to zero is exact)."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Linear(16, 8), "b": nn.Linear(16, 8)})
    opt = amp.optim.FusedAdamW(model.parameters(), lr=1e-2)
    model, opt = initialize_at(model, opt, "O5", remainders=True)
    with caplog.at_level("WARNING", logger="ampinit"):
        for _ in range(3):
            x = torch.randn(3, 16).bfloat16()
            opt.zero_grad(set_to_none=False)
            amp_backward((model["a"](x) + model["b"](x)).float().pow(2).mean(), opt, "O5")
            opt.step()
    assert "several scale_loss" not in caplog.text
    for _ in range(2):  # two losses before one step: that sum is in bf16, and is said
        amp_backward(model["a"](torch.randn(3, 16).bfloat16()).float().pow(2).mean(), opt, "O5")
    assert "several scale_loss" in caplog.text


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2", "O5"])
@pytest.mark.parametrize("reset", ["delete", "assign", "zero_moments"])
def test_optimizer_state_reached_through_the_model_parameters(opt_level, reset):
    """Resetting Adam's state of a re-initialized layer by its weight (ReDo, plasticity work,
    lottery-ticket rewinding), ``del optimizer.state[layer.weight]``: at O2/O5 the state is keyed
    by the FP32 masters, so the lookup made a new empty entry for the model parameter: the reset
    did nothing (the weight ended where no reset leads: -0.337 against FP32's -0.004), reads gave
    {}, and the next optimizer.state_dict() raised KeyError.  Reference: FP32, the same resets."""
    def run(level):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        if level is not None:
            model, opt = amp.initialize(model, opt, opt_level=level, loss_scale=128.0, verbosity=0)
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
        keys = None
        for step in range(12):
            sign = 1.0 if step < 6 else -1.0  # the objective flips when the layer is reset
            opt.zero_grad()
            amp_backward(sign * model(x).float().mean(), opt, level)
            opt.step()
            if step == 5:
                weight = model[2].weight
                keys = sorted(opt.state[weight])
                assert weight in opt.state and opt.state.get(weight) is opt.state[weight]
                if reset == "delete":
                    del opt.state[weight]
                elif reset == "assign":
                    opt.state[weight] = {}
                else:
                    for name in ("exp_avg", "exp_avg_sq"):
                        opt.state[weight][name].zero_()
                opt.state_dict()  # no stray key
        return [p.detach().float().clone() for p in model.parameters()], keys, opt

    want, want_keys, _ = run(None)
    got, got_keys, opt = run(opt_level)
    assert got_keys == want_keys == ["exp_avg", "exp_avg_sq", "step"]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0.0, atol=1e-5 if opt_level == "O0" else 0.02)
    assert len(opt.state_dict()["state"]) == 4


def test_the_master_keyed_state_copies_and_updates_like_a_dict():
    """From the review: ``optimizer.state.copy()`` / ``copy.copy`` / ``|`` raised TypeError, and
    ``update`` stored a stray model-parameter key that the next state_dict() refused."""
    import copy as copy_module
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", loss_scale=128.0, verbosity=0)
    with amp.scale_loss(model(torch.randn(2, 4)).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    weight, master = model[0].weight, opt.param_groups[0]["params"][0]
    for copied in (opt.state.copy(), copy_module.copy(opt.state), opt.state | {}):
        assert dict(copied) == dict(opt.state) and copied is not opt.state
    opt.state.update({weight: {}})
    assert opt.state[master] == {} and all(key is not weight for key in opt.state)
    opt.state |= {weight: {"note": 1}}
    assert opt.state[master] == {"note": 1}
    assert len(opt.state_dict()["state"]) == 2


class _PlainDictSGD(torch.optim.Optimizer):
    """A custom optimizer whose state is a plain dict, initialized on KeyError."""

    def __init__(self, params, lr):
        super().__init__(params, dict(lr=lr))
        self.state = {}

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                try:
                    buf = self.state[p]["buf"]
                except KeyError:
                    buf = self.state[p] = {"buf": torch.zeros_like(p)}
                    buf = buf["buf"]
                buf.mul_(0.9).add_(p.grad)
                p.add_(buf, alpha=-group["lr"])


def test_an_optimizer_with_a_state_of_its_own_kind_keeps_it():
    """From the review: a plain-dict state became a defaultdict at O2, so the optimizer's
    ``except KeyError`` never ran and its step raised.  Reference: FP32."""
    results = []
    for level in (None, "O2"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        opt = _PlainDictSGD(model.parameters(), lr=0.05)
        if level:
            model, opt = amp.initialize(model, opt, opt_level=level, loss_scale=128.0, verbosity=0)
            assert type(opt.state) is dict
        for step in range(4):
            opt.zero_grad()
            amp_backward(model(torch.randn(8, 4, generator=torch.Generator().manual_seed(step))).float().mean(), opt,
                         level)
            opt.step()
        results.append([p.detach().float() for p in model.parameters()])
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=0.0, atol=2e-3)


def _rebuild_groups_run(level, make_opt, edit, steps=12):
    """Two groups (layer 0, layer 2); ``edit`` rebuilds the first from the model's parameters,
    ``"before"`` scale_loss or ``"between"`` it and step(), at step 3 (or never: None)."""
    model = mlp(0)
    opt = make_opt([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.02}])
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    for step in range(steps):
        x, y = batch(step, n=16)
        if step == 3 and edit in ("before", "then_load", None):
            saved = copy.deepcopy(opt.state_dict())
            if edit is not None:
                opt.param_groups[0]["params"] = [p for p in model[0].parameters() if p.requires_grad]
            if edit in ("then_load", None):  # torch casts loaded state to its params' dtype
                opt.load_state_dict(saved)
        loss = ((model(x).float() - y) ** 2).mean()
        opt.zero_grad()
        with amp.scale_loss(loss, opt) as scaled:
            if step == 3 and edit == "inside":
                opt.param_groups[0]["params"] = list(model[0].parameters())
            scaled.backward()
        if step == 3 and edit == "between":
            opt.param_groups[0]["params"] = list(model[0].parameters())
        opt.step()
    return model, opt


@pytest.mark.parametrize("edit", ["before", "between", "inside", "then_load"])
@pytest.mark.parametrize("make_opt", [lambda g: torch.optim.SGD(g, lr=2e-3, momentum=0.9),
                                      lambda g: torch.optim.Adam(g, lr=1e-3)], ids=["sgd", "adam"])
@pytest.mark.parametrize("level", ["O2", "O5"])
def test_a_param_group_rebuilt_from_the_model_trains_through_its_masters(level, make_opt, edit, caplog):
    """From a review: ``group["params"] = list(model[0].parameters())`` after initialize put the
    16-bit model parameters in the optimizer, which then stepped them with no master (80 % of
    the weights never moved at O2, 100 % at O5, against none in FP32), silently.  They take
    their masters' places back, state included: the run equals the one without the edit.  From
    the review of that fix: an edit inside the block made step() raise, and a load_state_dict
    after the edit cast the loaded state to 16 bits (Adam's exp_avg_sq all 0 in fp16)."""
    with caplog.at_level("WARNING", logger="ampinit"):
        model, opt = _rebuild_groups_run(level, make_opt, edit)
    plain_model, plain_opt = _rebuild_groups_run(level, make_opt, None)
    for group, plain in zip(opt.param_groups, plain_opt.param_groups):
        for master, plain_master in zip(group["params"], plain["params"]):
            assert master.dtype == torch.float32 and torch.equal(master, plain_master)
    for p, q in zip(model.parameters(), plain_model.parameters()):
        assert torch.equal(p, q)
    assert "held 2 16-bit parameter(s) with no master (0.weight, 0.bias)" in caplog.text
    assert torch.equal(model.state_dict()["0.weight"], plain_model.state_dict()["0.weight"])


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_a_model_parameter_listed_beside_its_master_is_refused_for_a_plain_optimizer(level):
    """Putting its master back would list the master twice, and torch.optim would update it twice
    per step (it warns only when built): refused, with nothing changed."""
    model = mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    opt.param_groups[0]["params"].append(model[2].weight)
    groups = [list(group["params"]) for group in opt.param_groups]
    x, y = batch(0, n=8)
    with pytest.raises(RuntimeError, match="lists 2.weight twice"):
        with amp.scale_loss(((model(x).float() - y) ** 2).mean(), opt) as scaled:
            scaled.backward()
    assert [list(group["params"]) for group in opt.param_groups] == groups


@pytest.mark.parametrize("how", ["rebuild", "add_param_group"])
def test_another_initializations_parameters_get_no_second_master(how):
    """From the review: a frozen teacher initialized at O2 without an optimizer, its parameters put
    into the student's groups by hand or with add_param_group, got a second FP32 master and
    trained behind the teacher's (which end() would write back).  Refused, nothing changed."""
    teacher = amp.initialize(mlp(1), opt_level="O2", verbosity=0)
    student = mlp(0)
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    student, opt = amp.initialize(student, opt, opt_level="O2", verbosity=0)
    groups = [list(group["params"]) for group in opt.param_groups]
    with pytest.raises(RuntimeError, match="another ampinit initialization .* set up and has not ended"):
        if how == "rebuild":
            opt.param_groups[0]["params"] = list(opt.param_groups[0]["params"]) + list(teacher.parameters())
            opt.step()
        else:
            opt.add_param_group({"params": list(teacher.parameters())})
    if how == "rebuild":
        opt.param_groups[0]["params"] = groups[0]
    assert [list(group["params"]) for group in opt.param_groups] == groups
    assert all(p.dtype == torch.float16 for p in teacher.parameters())


@pytest.mark.parametrize("level", ["O2", "O5"])
@pytest.mark.parametrize("backward", ["old_scale_loss", "plain"])
def test_a_new_optimizer_over_an_initialized_model_is_refused_before_it_steps(level, backward):
    """From a review of stage-wise fine-tuning: a second-stage optimizer built after initialize
    over model.parameters() stepped the 16-bit model directly with the scaled gradients O2 leaves
    there (NaN from the first step, silently).  Refused before the update; ending and
    initializing again with it trains."""
    model = mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    stage2 = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = batch(0, n=16)
    loss = ((model(x).float() - y) ** 2).mean()
    if backward == "plain":
        loss.backward()
    else:
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="was not passed to ampinit.initialize.*ampinit.end\\(model\\)"):
        stage2.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    amp.end(model)
    stage2 = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, stage2 = amp.initialize(model, stage2, opt_level=level, verbosity=0)
    for _ in range(3):
        loss = ((model(x).float() - y) ** 2).mean()
        stage2.zero_grad()
        with amp.scale_loss(loss, stage2) as scaled:
            scaled.backward()
        stage2.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_new_optimizer_over_an_o1_model_is_logged_and_wrappers_of_the_bound_one_are_not(caplog):
    """At O1 the gradients are unscaled after scale_loss, but a foreign optimizer's steps skip no
    overflow: logged once.  A wrapper sharing the bound optimizer's param_groups is its own."""
    model = mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)

    class SharingWrapper(torch.optim.Optimizer):  # SAM / Lookahead style
        def __init__(self, base):
            self.base = base
            super().__init__(base.param_groups, {})
            self.param_groups = base.param_groups

        def step(self, closure=None):
            self.base.step()

    wrapper, stage2 = SharingWrapper(opt), torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = batch(0, n=16)
    with caplog.at_level("WARNING", logger="ampinit"):
        for optimizer in (wrapper, stage2, stage2):
            with amp.scale_loss(((model(x).float() - y) ** 2).mean(), opt) as scaled:
                scaled.backward()
            optimizer.step()
            opt.zero_grad()
    assert caplog.text.count("was not passed to ampinit.initialize") == 1
    assert "SGD.step()" in caplog.text and "SharingWrapper" not in caplog.text


@pytest.mark.parametrize("when", ["at_initialize", "add_param_group", "rebuilt_group"])
@pytest.mark.parametrize("level", ["O2", "O5"])
def test_a_plain_16_bit_tensor_trains_like_a_parameter(level, when):
    """From the review: a 16-bit leaf tensor that is not an nn.Parameter (a learnable temperature
    made with torch.ones(..., requires_grad=True)) got a master no gradient reached: it never
    moved, silently.  It trains bit for bit like the same values as an nn.Parameter."""
    def run(as_parameter):
        model = mlp(0)
        dtype = torch.float16 if level == "O2" else torch.bfloat16
        scale = torch.full((4,), 1.0, dtype=dtype, requires_grad=True)
        if as_parameter:
            scale = nn.Parameter(scale.detach())
        params = list(model.parameters()) + ([scale] if when == "at_initialize" else [])
        opt = torch.optim.SGD(params, lr=0.05)
        model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
        if when == "add_param_group":
            opt.add_param_group({"params": [scale]})
        elif when == "rebuilt_group":
            opt.param_groups[0]["params"] = list(opt.param_groups[0]["params"]) + [scale]
        for step in range(5):
            x, y = batch(step, n=16)
            loss = ((model(x).float() * scale.float() - y) ** 2).mean()
            opt.zero_grad()
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
        return scale.detach().clone(), [p.detach().clone() for p in model.parameters()]

    plain, plain_model = run(False)
    param, param_model = run(True)
    assert not torch.equal(plain, torch.ones_like(plain))
    assert torch.equal(plain, param) and all(torch.equal(a, b) for a, b in zip(plain_model, param_model))


def test_master_of_finds_a_layer_in_param_groups_by_identity():
    """From a review: dropping a layer from param_groups by the ids of its model parameters
    removed nothing at O2 (the groups hold masters), and the layer kept training.  master_of
    gives what the groups hold, at every level."""
    for level in ("O1", "O2", "O5"):
        model = mlp(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
        drop = {id(opt.amp.master_of(p)) for p in model[0].parameters()}
        for group in opt.param_groups:
            group["params"] = [p for p in group["params"] if id(p) not in drop]
        before = model[0].weight.detach().clone()
        x, y = batch(0, n=16)
        with amp.scale_loss(((model(x).float() - y) ** 2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
        assert sum(len(g["params"]) for g in opt.param_groups) == 2 and torch.equal(model[0].weight, before), level
        amp.end(model)


def test_unbound_optimizers_that_are_right_are_left_alone(caplog):
    """From the review of the foreign-step check: it refused test-time adaptation (an O2 model
    initialized without an optimizer, its batch-norm or 16-bit parameters adapted by a plain SGD
    and a plain backward), logged a Lookahead-style wrapper's own base optimizer, and crashed
    torch.compile of any optimizer's step once any initialization existed."""
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 4))
    model = amp.initialize(model, opt_level="O2", verbosity=0)  # inference, then adaptation
    for params in (model[1].parameters(), model.parameters()):
        adapt = torch.optim.SGD(params, lr=0.01)
        x, _ = batch(0, n=16)
        model(x).float().pow(2).mean().backward()
        adapt.step()
        adapt.zero_grad()
    assert all(torch.isfinite(p).all() for p in model.parameters())

    base_model = mlp(0)
    base = torch.optim.SGD(base_model.parameters(), lr=0.05)

    class CopyingLookahead(torch.optim.Optimizer):  # its own param_groups; the base under another name
        def __init__(self, base_optimizer):
            self.base_optimizer = base_optimizer
            super().__init__(base_optimizer.param_groups, {})

        def step(self, closure=None):
            self.base_optimizer.step()

    wrapper = CopyingLookahead(base)
    base_model, wrapper = amp.initialize(base_model, wrapper, opt_level="O1", verbosity=0)
    with caplog.at_level("WARNING", logger="ampinit"):
        for step in range(2):
            x, y = batch(step, n=16)
            with amp.scale_loss(((base_model(x).float() - y) ** 2).mean(), wrapper) as scaled:
                scaled.backward()
            wrapper.step()
            wrapper.zero_grad()
    assert "was not passed to ampinit.initialize" not in caplog.text

    plain = nn.Linear(4, 4)
    compiled_opt = torch.optim.Adam(plain.parameters(), lr=0.1)
    plain(torch.randn(2, 4)).sum().backward()
    torch.compile(compiled_opt.step, backend="eager")()


def test_a_static_scale_other_than_one_logs_an_unbound_optimizer_too(caplog):
    """From the review: the O1 log was gated on a dynamic scale, but a static 1024 scales the
    gradients an unbound optimizer holds just the same (norm 904 where 0.88 was right)."""
    model = mlp(0)
    head = torch.optim.SGD(model[2].parameters(), lr=0.05)
    model, head = amp.initialize(model, head, opt_level="O1", loss_scale=1024.0, verbosity=0)
    body = torch.optim.SGD(model[0].parameters(), lr=0.05)
    x, y = batch(0, n=16)
    with caplog.at_level("WARNING", logger="ampinit"):
        with amp.scale_loss(((model(x).float() - y) ** 2).mean(), head) as scaled:
            scaled.backward()
        body.step()
    assert "SGD.step(): this optimizer was not passed to ampinit.initialize" in caplog.text


def test_marks_of_dropped_initializations_are_dropped_and_their_parameters_can_be_added():
    """From the review: every dropped O1 fold left a mark on each shared parameter, which the step
    check walked (7.7 ms per step after 300 folds, against 0.11); and a dropped O2 model's
    parameter was refused by add_param_group until the collector ran."""
    import gc
    backbone = nn.Linear(4, 4)
    for _ in range(5):
        model = nn.Sequential(backbone, nn.Linear(4, 2))
        amp.initialize(model, torch.optim.SGD(model[1].parameters(), lr=0.1), opt_level="O1", verbosity=0)
        del model
    gc.collect()
    assert amp.links.handles_holding_parameter(backbone.weight) == []
    assert "_ampinit_held_by" not in backbone.weight.__dict__ or not backbone.weight.__dict__["_ampinit_held_by"]

    gc.disable()
    try:
        donor = nn.Linear(4, 4)
        amp.initialize(donor, torch.optim.SGD(donor.parameters(), lr=0.1), opt_level="O2", verbosity=0)
        weight = donor.weight
        del donor
        model = mlp(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
        opt.add_param_group({"params": [weight]})  # the donor's initialization is garbage: accepted
    finally:
        gc.enable()


@pytest.mark.parametrize("where", ["after_step", "in_a_post_step_hook"])
def test_a_new_optimizer_for_a_backbone_frozen_at_initialize_is_refused(where):
    """From the review: stage 1 trains the head of an O2 model, stage 2 unfreezes the backbone
    with a new optimizer.  No bound optimizer trains the backbone's masters, so the check let it
    through, and it stepped the fp16 weights with scaled gradients (78 in one lr=0.01 step).
    Stepped from the bound optimizer's post-step hook it was exempt too."""
    model = mlp(0)
    head = torch.optim.SGD(model[2].parameters(), lr=0.01)
    model, head = amp.initialize(model, head, opt_level="O2", verbosity=0)
    backbone = torch.optim.SGD(model[0].parameters(), lr=0.01)
    if where == "in_a_post_step_hook":
        head.register_step_post_hook(lambda *args: backbone.step())
    x, y = batch(0, n=16)
    with amp.scale_loss(((model(x).float() - y) ** 2).mean(), head) as scaled:
        scaled.backward()
    before = model[0].weight.detach().clone()
    with pytest.raises(RuntimeError, match="was not passed to ampinit.initialize, but it updates 0.weight"):
        head.step() if where == "in_a_post_step_hook" else backbone.step()
    assert torch.equal(model[0].weight, before)


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O5"])
def test_add_param_group_with_named_parameters(level):
    """torch >= 2.6 takes ``(name, tensor)`` pairs (an optimizer built over
    ``model.named_parameters()`` must get named groups): ampinit refused them as "not tensors"
    at every level.  The head added mid-run trains like plain torch's (O0 bit for bit), and the
    names are kept."""
    def run(level):
        torch.manual_seed(0)
        body, head = nn.Linear(4, 4), nn.Linear(4, 2)
        model = nn.Sequential(body, nn.ReLU(), head)
        opt = torch.optim.AdamW(body.named_parameters(prefix="0"), lr=1e-2)
        if level is not None:
            model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
        gen = torch.Generator().manual_seed(1)
        for step in range(4):
            if step == 2:
                opt.add_param_group({"params": list(head.named_parameters(prefix="2")), "lr": 5e-3})
            x = torch.randn(8, 4, generator=gen).to(next(model.parameters()).dtype)
            opt.zero_grad()
            amp_backward(model(x).float().pow(2).mean(), opt, level)
            opt.step()
        assert opt.param_groups[1]["param_names"] == ["2.weight", "2.bias"]
        return [p.detach().float().clone() for p in model.parameters()]

    for got, want in zip(run(level), run(None)):
        if level == "O0":
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=0, atol=2e-2)


@pytest.mark.parametrize("level", ["O0", "O3", "O4", "O1", "O2"])
@pytest.mark.parametrize("plant", [False, True])
def test_every_micro_batch_delayed_steps_where_the_scale_is_one_without_masters(level, plant):
    """``delay_unscale=True`` on every micro-batch (no last block without it): at O0/O3/O4 the
    scale is 1 and there are no masters, so the gradients are final and apex stepped them; ampinit
    refused the step.  It steps now, checking them first (a planted inf skips the step; FP32
    reference: the same accumulation, that step skipped); O0 is bit for bit.  Where the
    gradients are still scaled (O1, dynamic) or wait for masters (O2) it still raises."""
    def run(level):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if level is not None:
            model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
        gen = torch.Generator().manual_seed(1)
        for step in range(3):
            opt.zero_grad()
            bad = plant and step == 1
            for micro in range(2):
                x = torch.randn(4, 4, generator=gen)
                if bad and micro == 1:
                    x[0, 0] = float("inf")
                loss = model(x.to(next(model.parameters()).dtype)).float().pow(2).mean()
                if level is None:
                    loss.backward()
                else:
                    with amp.scale_loss(loss, opt, delay_unscale=True) as scaled:
                        scaled.backward()
            if level is None and bad:
                continue  # the step the planted inf skips
            opt.step()
        return [p.detach().float().clone() for p in model.parameters()]

    if level in ("O1", "O2"):
        with pytest.raises(RuntimeError, match="still scaled"):
            run(level)
        return
    for got, want in zip(run(level), run(None)):
        if level == "O0":
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=0, atol=2e-2)


@pytest.mark.parametrize("level, dtype", [("O1", torch.float16), ("O4", torch.bfloat16)])
@pytest.mark.parametrize("how", ["model_cast", "neither"])
def test_16_bit_weights_reaching_an_o1_optimizer_after_initialize_are_logged(level, dtype, how, caplog):
    """From a review: at O1/O4 nothing keeps masters, so weights cast to 16 bits after
    ``initialize`` (``model.half()``, or a 16-bit layer given to ``add_param_group``) are updated
    directly and most small updates round away (25 % of the weights never moved at O1, 84 % at
    O4).  ``initialize`` logged a model cast before it; these were silent."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    if how == "model_cast":
        model.to(dtype)
    with caplog.at_level("WARNING", logger="ampinit"):
        for _ in range(2):
            opt.zero_grad()
            with amp.scale_loss(model(torch.randn(3, 4).to(model[0].weight.dtype)).float().sum(), opt) as scaled:
                scaled.backward()
            opt.step()
    logged = [r for r in caplog.records if "keeps no FP32 master" in r.getMessage() or
              "cast after initialize" in r.getMessage()]
    assert len(logged) == (1 if how == "model_cast" else 0)


@pytest.mark.parametrize("level, dtype", [("O1", torch.float16), ("O4", torch.bfloat16)])
def test_16_bit_parameters_added_at_o1_are_logged(level, dtype, caplog):
    model = nn.Linear(4, 2)
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=1e-3), opt_level=level, verbosity=0)
    with caplog.at_level("WARNING", logger="ampinit"):
        opt.add_param_group({"params": list(nn.Linear(2, 2).parameters())})  # FP32: fine
        assert not caplog.records
        opt.add_param_group({"params": list(nn.Linear(2, 2).to(dtype).parameters())})
    assert any("add_param_group got 16-bit parameters" in r.getMessage() for r in caplog.records)


def _remove_weight_norm(layer):
    nn.utils.remove_weight_norm(layer)


def _remove_parametrized_weight_norm(layer):
    torch.nn.utils.parametrize.remove_parametrizations(layer, "weight", leave_parametrized=True)


def _remove_spectral_norm(layer):
    nn.utils.remove_spectral_norm(layer)


REMOVALS = {
    "weight_norm": (nn.utils.weight_norm, _remove_weight_norm),
    "parametrizations.weight_norm": (nn.utils.parametrizations.weight_norm, _remove_parametrized_weight_norm),
    "spectral_norm": (nn.utils.spectral_norm, _remove_spectral_norm),
}


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("level", ["O0", "O2", "O5"])
@pytest.mark.parametrize("removal", sorted(REMOVALS))
def test_a_norm_removed_after_initialize_is_logged_and_removed_after_end_is_fp32(level, removal, caplog):
    """Vocoders (HiFi-GAN, WaveGlow) remove weight norm after training.  After initialize at
    O2/O5 torch makes the new weight from the 16-bit values, with no master: logged once (the
    state_dict holds it in 16 bits, end() leaves it 16-bit).  Removed after amp.end(), it is the
    FP32 weight the masters give, as removal in an FP32 run."""
    apply, remove = REMOVALS[removal]
    x, y = batch(0)

    def trained(initialize):
        torch.manual_seed(0)
        model = nn.Sequential(apply(nn.Linear(8, 32)), nn.Tanh(), nn.Linear(32, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        if initialize:
            model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
        for _ in range(3):
            opt.zero_grad()
            amp_backward(((model(x).float() - y) ** 2).mean(), opt, level if initialize else None)
            opt.step()
        return model

    model = trained(True)
    plain = trained(False)  # the FP32 values (the masters) in a plain FP32 model: its removal is the reference
    plain.load_state_dict(model.state_dict())
    remove(plain[0])
    message = "0.weight: 16-bit parameter(s) made after initialize"
    with caplog.at_level("WARNING", logger="ampinit"):
        remove(model[0])
        first = model.state_dict()["0.weight"]
        model.state_dict()  # logged once
        model[0].state_dict()
    masters = level != "O0"
    assert caplog.text.count(message) == (1 if masters else 0)
    assert first.dtype == (torch.float16 if level == "O2" else torch.bfloat16 if masters else torch.float32)

    ended = trained(True)
    amp.end(ended)
    caplog.clear()
    with caplog.at_level("WARNING", logger="ampinit"):
        remove(ended[0])
        weight = ended.state_dict()["0.weight"]
    assert message not in caplog.text
    assert weight.dtype == torch.float32 and torch.equal(weight, plain.state_dict()["0.weight"])


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_16_bit_parameters_without_masters_are_logged_where_they_are_and_only_there(caplog):
    """From the review: a submodule's own state_dict() logs too; two models of one initialize
    with the same names are each logged; a separately initialized model held as a submodule
    (a teacher) is its own initialization's, not logged by the student's."""
    def vocoder():
        torch.manual_seed(0)
        return nn.Sequential(nn.utils.weight_norm(nn.Linear(8, 16)), nn.Tanh(), nn.Linear(16, 4))

    message = "16-bit parameter(s) made after initialize"
    parent = nn.Sequential(vocoder())
    parent, opt = amp.initialize(parent, torch.optim.SGD(parent.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    nn.utils.remove_weight_norm(parent[0][0])
    with caplog.at_level("WARNING", logger="ampinit"):
        assert parent[0].state_dict()["0.weight"].dtype == torch.float16
    assert caplog.text.count("0.weight: " + message) == 1

    caplog.clear()
    a, b = vocoder(), vocoder()
    (a, b), opt = amp.initialize([a, b], torch.optim.SGD(list(a.parameters()) + list(b.parameters()), lr=0.1),
                                 opt_level="O5", verbosity=0)
    nn.utils.remove_weight_norm(a[0])
    nn.utils.remove_weight_norm(b[0])
    with caplog.at_level("WARNING", logger="ampinit"):
        a.state_dict()
        amp.end(b)
    assert caplog.text.count("0.weight: " + message) == 2

    caplog.clear()
    frozen = nn.Sequential(nn.Embedding(10, 8).half().requires_grad_(False), nn.Linear(8, 4))  # 16-bit already
    frozen, _ = amp.initialize(frozen, torch.optim.SGD(frozen[1].parameters(), lr=0.1), opt_level="O2", verbosity=0)
    with caplog.at_level("WARNING", logger="ampinit"):
        frozen.state_dict()
        amp.end(frozen)
    assert message not in caplog.text

    teacher, student = vocoder(), nn.Sequential(nn.Linear(8, 4))
    teacher, _ = amp.initialize(teacher, torch.optim.SGD(teacher.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    student, _ = amp.initialize(student, torch.optim.SGD(student.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    student.teacher = teacher
    with caplog.at_level("WARNING", logger="ampinit"):
        state = student.state_dict()
    assert message not in caplog.text and all(v.dtype == torch.float32 for v in state.values())


class _Gan(nn.Module):
    """mmgeneration's layout: one module holding G and D, whose train_step calls them directly."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.generator = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
        self.discriminator = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, z):
        return self.discriminator(self.generator(z))


@pytest.mark.parametrize("first", ["validation_forward", "one_step_through_the_model"])
def test_o1_submodule_training_is_logged_after_a_forward_that_did_enter(first, caplog):
    """A validation forward (or steps through the model) before submodule-only training must
    not hide it: the check is per step window (G18), and no-grad forwards do not count (G19).
    The two losses of one forward, on either side of a step, are not logged (G19)."""
    model = _Gan()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0, loss_scale=1.0)
    z = torch.randn(16, 8)
    message = "with no training forward of a model given to initialize"
    with caplog.at_level("WARNING", logger="ampinit"):
        if first == "validation_forward":
            with torch.no_grad():
                model(z)
        else:
            for _ in range(3):  # one forward, its two losses on either side of a step: not logged (G19)
                out = model(z)
                for loss_id in range(2):
                    opt.zero_grad()
                    with amp.scale_loss(out.float().pow(2).mean() * (loss_id + 1), opt) as scaled:
                        scaled.backward(retain_graph=loss_id == 0)
                    opt.step()
            assert message not in caplog.text
        for _ in range(2):
            opt.zero_grad()
            with amp.scale_loss(model.discriminator(model.generator(z)).float().pow(2).mean(), opt) as scaled:
                scaled.backward()
            opt.step()
    assert caplog.text.count(message) == 1


def test_autocast_step_applies_registered_casts_and_refuses_an_ended_handle(monkeypatch):
    """As the model's forward: autocast and the registered-function casts (G18: it entered
    autocast only, so a function registered FP32 ran in fp16 there)."""
    from ampinit import registry
    monkeypatch.setattr(registry, "_TORCH_POLICIES", {})  # registrations are process-wide
    amp.register_float_function(torch, "mm")
    model = _Gan()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    handle = amp.handle_of(opt)
    with handle.autocast_step():
        assert torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype == torch.float32  # registered: FP32
        assert torch.matmul(torch.randn(2, 2), torch.randn(2, 2)).dtype == torch.float16
        assert model.generator(torch.randn(2, 8)).dtype == torch.float16
    assert torch.matmul(torch.randn(2, 2), torch.randn(2, 2)).dtype == torch.float32
    amp.end(model)
    with pytest.raises(RuntimeError, match="has ended"):
        with handle.autocast_step():
            pass


@pytest.mark.parametrize("level", ["O1", "O4"])
@pytest.mark.parametrize("call", ["submodules", "model", "both_initialized", "autocast_step"])
def test_o1_o4_training_that_never_calls_the_initialized_model_is_logged(level, call, caplog):
    """O1/O4 scope autocast to the initialized model's forward.  Code that calls its
    submodules directly (mmgeneration) computes in FP32, bit for bit the FP32 run: logged once
    at the first scale_loss; forwards through the initialized models, or a step under the
    handle's autocast_step (Lightning's forward_context), run in 16 bits and are not logged."""
    reference = _Gan()
    model = _Gan()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if call == "both_initialized":
        (generator, discriminator), opt = amp.initialize([model.generator, model.discriminator], opt,
                                                         opt_level=level, verbosity=0, loss_scale=1.0)
    else:
        model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0, loss_scale=1.0)
        generator, discriminator = model.generator, model.discriminator
    step_context = amp.handle_of(opt).autocast_step if call == "autocast_step" else contextlib.nullcontext
    z = torch.randn(16, 8)
    with caplog.at_level("WARNING", logger="ampinit"):
        for _ in range(3):
            opt.zero_grad()
            ref_opt.zero_grad()
            with step_context():
                out = model(z) if call == "model" else discriminator(generator(z))
            with amp.scale_loss(out.float().pow(2).mean(), opt) as scaled:
                scaled.backward()
            opt.step()
            reference(z).pow(2).mean().backward()
            ref_opt.step()
    logged = caplog.text.count("with no training forward of a model given to initialize")
    assert logged == (1 if call == "submodules" else 0)
    same = all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))
    assert same == (call == "submodules")  # the others computed in 16 bits
    if call in ("submodules", "autocast_step"):  # (initialized models' outputs are cast to FP32)
        assert out.dtype == (torch.float32 if call == "submodules" else
                             {"O1": torch.float16, "O4": torch.bfloat16}[level])
