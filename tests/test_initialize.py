import collections

import pytest
import torch
from torch import nn

import ampinit as amp
from conftest import LEVELS, LOW_DTYPE, SmallNet, batch, make_setup, train_step


@pytest.mark.parametrize("level", LEVELS)
def test_levels_cast_and_rewire(level, device):
    model, opt = make_setup(level, device)
    low = LOW_DTYPE[level]
    casts = level in ("O2", "O3", "O5")
    assert model.fc1.weight.dtype == (low if casts else torch.float32)
    assert model.offset.dtype == (low if casts else torch.float32)
    bn_dtype = low if level == "O3" else torch.float32
    assert model.bn.weight.dtype == bn_dtype and model.bn.running_mean.dtype == bn_dtype
    groups = opt.param_groups[0]["params"]
    if level in ("O2", "O5"):
        assert all(p.dtype == torch.float32 for p in groups)
        assert groups[0] is not model.fc1.weight and groups[2] is model.bn.weight
    else:
        assert [id(p) for p in groups] == [id(p) for p in model.parameters()]
    assert isinstance(opt, torch.optim.Adam) and isinstance(opt, torch.optim.Optimizer)
    assert opt.amp is amp.handle_of(model) is amp.handle_of(opt)
    # O1/O4: the last op adds an fp32 buffer, which autocast promotes to fp32.
    assert model(batch(0, device)[0]).dtype == torch.float32
    if level in ("O1", "O4"):
        assert model.fc2(torch.randn(2, 16, device=device)).dtype == torch.float32  # outside forward



@pytest.mark.parametrize("level", LEVELS)
def test_training_reduces_loss_and_masters_drive_model(level, device):
    model, opt = make_setup(level, device, optimizer="sgd")
    first = train_step(model, opt, 0, device).item()
    for step in range(1, 30):
        last = train_step(model, opt, step % 4, device).item()
    assert last < first
    if level in ("O2", "O5"):
        master = opt.param_groups[0]["params"][0]
        assert torch.equal(model.fc1.weight, master.to(LOW_DTYPE[level]))


def test_masters_start_from_fp32_values():
    torch.manual_seed(0)
    model = SmallNet()
    reference = model.fc1.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    assert torch.equal(opt.param_groups[0]["params"][0], reference)  # not its fp16 rounding


def test_masters_take_over_the_fp32_storage_without_copies():
    torch.manual_seed(0)
    model = SmallNet()
    storage = model.fc1.weight.data_ptr()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    assert opt.param_groups[0]["params"][0].data_ptr() == storage != model.fc1.weight.data_ptr()


def test_o2_gradients_match_fp32_reference():
    torch.manual_seed(0)
    ref = SmallNet()
    model = SmallNet()
    model.load_state_dict(ref.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    x, y = batch(0)
    ((ref(x) - y) ** 2).mean().backward()
    with amp.scale_loss(((model(x) - y) ** 2).mean(), opt) as scaled:
        scaled.backward()
    for master, p in zip(amp.master_params(opt), ref.parameters()):
        assert master.grad.dtype == torch.float32
        torch.testing.assert_close(master.grad, p.grad, rtol=2e-2, atol=2e-3)


def test_planted_overflow_skips_exactly_that_step_and_halves_scale():
    model, opt = make_setup("O2")
    before = None
    for step in range(6):
        if step == 3:
            before = [p.detach().clone() for p in amp.master_params(opt)]
            model_before = model.fc1.weight.detach().clone()
        train_step(model, opt, step, poison=(step == 3))
        if step == 3:
            assert all(torch.equal(a, b) for a, b in zip(before, amp.master_params(opt)))
            assert torch.equal(model_before, model.fc1.weight)
            assert all(p.grad is None for p in amp.master_params(opt))
    assert opt.amp.skipped_steps == 1
    assert opt.amp.loss_scale() == 2.0 ** 15
    assert opt.amp.state_dict()["loss_scaler0"]["unskipped"] == 2


@pytest.mark.parametrize("level", ["O0", "O3", "O4", "O5"])
def test_static_levels_skip_nonfinite_steps_without_changing_scale(level):
    model, opt = make_setup(level, optimizer="sgd")
    train_step(model, opt, 0, poison=True)
    assert opt.amp.skipped_steps == 1 and opt.amp.loss_scale() == 1.0
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_growth_after_2000_steps_respects_max_loss_scale():
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0, max_loss_scale=2.0 ** 17)
    x = torch.ones(1, 2)
    for _ in range(4000):
        # every gradient is scale * 0.25: finite in fp16 up to a scale of 2**17, not 2**18
        with amp.scale_loss(model(x).sum() * 0.25, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
    assert opt.amp.loss_scale() == 2.0 ** 17 and opt.amp.skipped_steps == 0


def _accumulated(level, k):
    model, opt = make_setup(level, optimizer="sgd")
    x, y = batch(0, n=32)
    opt.zero_grad()
    for i, (xs, ys) in enumerate(zip(x.chunk(k), y.chunk(k))):
        loss = ((model(xs).float() - ys) ** 2).mean() / k
        with amp.scale_loss(loss, opt, delay_unscale=(i < k - 1)) as scaled:
            scaled.backward()
    return [p.grad.clone() for p in amp.master_params(opt)]


@pytest.mark.parametrize("level", ["O0", "O2", "O5"])
def test_gradient_accumulation_equals_one_batch(level):
    # BatchNorm makes chunks differ from the full batch; compare 4 chunks with 4 chunks
    # done as separate non-delayed losses, and O0 against the exact arithmetic.
    delayed = _accumulated(level, 4)
    model, opt = make_setup(level, optimizer="sgd")
    x, y = batch(0, n=32)
    opt.zero_grad()
    for xs, ys in zip(x.chunk(4), y.chunk(4)):
        with amp.scale_loss(((model(xs).float() - ys) ** 2).mean() / 4, opt) as scaled:
            scaled.backward()
    separate = [p.grad for p in amp.master_params(opt)]
    tol = dict(rtol=1e-5, atol=1e-6) if level == "O0" else dict(rtol=2e-2, atol=2e-3)
    for a, b in zip(delayed, separate):
        torch.testing.assert_close(a, b, **tol)


def test_step_with_scaled_gradients_pending_is_an_error():
    model, opt = make_setup("O2")
    x, y = batch(0)
    with amp.scale_loss(((model(x) - y) ** 2).mean(), opt, delay_unscale=True) as scaled:
        scaled.backward()
    with pytest.raises(RuntimeError, match="delay_unscale"):
        opt.step()


def test_backward_outside_scale_loss_at_o2_is_an_error():
    model, opt = make_setup("O2")
    x, y = batch(0)
    ((model(x) - y) ** 2).mean().backward()
    with pytest.raises(RuntimeError, match="scale_loss"):
        opt.step()


def test_independent_scalers_for_several_losses():
    torch.manual_seed(0)
    gen, disc = SmallNet(), SmallNet()
    opt_g = torch.optim.SGD(gen.parameters(), lr=0.01)
    opt_d = torch.optim.SGD(disc.parameters(), lr=0.01)
    [gen, disc], [opt_g, opt_d] = amp.initialize([gen, disc], [opt_g, opt_d], opt_level="O2",
                                                 num_losses=3, verbosity=0)
    x, y = batch(0)
    for loss_id, loss in enumerate([
            ((disc(x) - y) ** 2).mean() * float("inf"), ((disc(x) + y) ** 2).mean(), (gen(x) ** 2).mean()]):
        target = opt_d if loss_id < 2 else [opt_g]
        with amp.scale_loss(loss, target, loss_id=loss_id) as scaled:
            scaled.backward()
    handle = opt_g.amp
    assert [s.loss_scale() for s in handle.loss_scalers] == [2.0 ** 15, 2.0 ** 16, 2.0 ** 16]
    g_before = gen.fc1.weight.detach().clone()
    opt_d.step()
    opt_g.step()
    assert handle.binding(opt_d).skipped_steps == 1 and handle.binding(opt_g).skipped_steps == 0
    assert not torch.equal(g_before, gen.fc1.weight)


def test_second_loss_accumulates_into_masters():
    model, opt = make_setup("O2", optimizer="sgd", num_losses=2)
    x, y = batch(0)
    with amp.scale_loss(((model(x) - y) ** 2).mean(), opt, loss_id=0) as scaled:
        scaled.backward()
    first = [p.grad.clone() for p in amp.master_params(opt)]
    with amp.scale_loss(((model(x) - y) ** 2).mean(), opt, loss_id=1) as scaled:
        scaled.backward()
    for before, p in zip(first, amp.master_params(opt)):
        torch.testing.assert_close(p.grad, 2 * before, rtol=1e-5, atol=1e-7)


def test_list_of_optimizers_in_one_scale_loss():
    torch.manual_seed(0)
    model = SmallNet()
    opt_a = torch.optim.SGD(list(model.fc1.parameters()), lr=0.1)
    opt_b = torch.optim.SGD(list(model.fc2.parameters()) + list(model.bn.parameters()), lr=0.1)
    model, [opt_a, opt_b] = amp.initialize(model, [opt_a, opt_b], opt_level="O2", verbosity=0)
    x, y = batch(0)
    with amp.scale_loss(((model(x) - y) ** 2).mean(), [opt_a, opt_b]) as scaled:
        scaled.backward()
    assert all(p.grad is not None for o in (opt_a, opt_b) for p in amp.master_params(o))
    opt_a.step()
    opt_b.step()


def test_lr_scheduler_and_add_param_group():
    model, opt = make_setup("O2", optimizer="sgd")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    extra = nn.Linear(3, 3).half()
    opt.add_param_group({"params": extra.parameters(), "lr": 0.3})
    new_master = opt.param_groups[1]["params"][0]
    assert new_master.dtype == torch.float32 and opt.amp._master_of(extra.weight) is new_master
    for step in range(3):
        train_step(model, opt, step)
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05 * 0.5 ** 3)
    assert opt.param_groups[1]["lr"] == pytest.approx(0.3 * 0.5 ** 3)
    with pytest.raises(ValueError, match="more than one"):
        opt.add_param_group({"params": [model.fc1.weight]})


def test_existing_optimizer_state_moves_to_masters():
    torch.manual_seed(0)
    model = SmallNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(batch(0)[0]).sum().backward()
    opt.step()
    exp_avg = opt.state[model.fc1.weight]["exp_avg"].clone()
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    master = opt.param_groups[0]["params"][0]
    assert torch.equal(opt.state[master]["exp_avg"], exp_avg)
    assert all(key is not model.fc1.weight for key in opt.state)  # moved: keyed by the master
    assert opt.state[model.fc1.weight] is opt.state[master]  # and reached through the weight too


def test_zero_grad_clears_model_and_master_grads():
    model, opt = make_setup("O2")
    x, y = batch(0)
    with amp.scale_loss(((model(x) - y) ** 2).mean(), opt) as scaled:
        scaled.backward()
    assert model.fc1.weight.grad is not None and opt.param_groups[0]["params"][0].grad is not None
    opt.zero_grad()
    assert model.fc1.weight.grad is None and all(p.grad is None for p in amp.master_params(opt))


Point = collections.namedtuple("Point", "a b")


class NestedIO(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, pair, extra=None, *, table):
        assert pair[0].dtype == self.lin.weight.dtype and table["x"].dtype == self.lin.weight.dtype
        assert table["ids"].dtype == torch.long
        h = self.lin(pair[0]) + self.lin(pair[1].a)
        return {"out": [h, Point(h, table["ids"])], "extra": extra}


@pytest.mark.parametrize("level, out_dtype", [("O2", torch.float32), ("O5", torch.float32)])
def test_inputs_and_outputs_cast_through_nested_structures(level, out_dtype):
    model = amp.initialize(NestedIO(), opt_level=level, verbosity=0)
    x = torch.randn(2, 4)
    out = model((x, Point(x, 1)), "tag", table={"x": x, "ids": torch.arange(2)})
    assert out["out"][0].dtype == out_dtype and out["out"][1].a.dtype == out_dtype
    assert isinstance(out["out"][1], Point) and out["out"][1].b.dtype == torch.long
    assert out["extra"] == "tag"


class ImageList:
    """maskrcnn-benchmark's batch class: a tensor and metadata, cast by its own ``to``."""

    def __init__(self, tensors, sizes):
        self.tensors, self.sizes = tensors, sizes

    def to(self, *args, **kwargs):
        return ImageList(self.tensors.to(*args, **kwargs), self.sizes)


class DeviceOnlyBatch:
    """A batch class whose ``to`` takes devices only (torch_geometric's ``Data.to(device)``)."""

    def __init__(self, x):
        self.x = x

    def to(self, device):
        if not isinstance(device, (str, torch.device)):
            raise TypeError(f"to() takes a device, got {device!r}")
        return DeviceOnlyBatch(self.x.to(device))


class Targets:
    """maskrcnn's BoxList: boxes and integer labels; its ``to`` maps over both."""

    def __init__(self, boxes, labels):
        self.boxes, self.labels = boxes, labels

    def to(self, *args):
        return Targets(self.boxes.to(*args), self.labels.to(*args))


class InPlaceBatch:
    """A ``to`` that casts in place and returns None."""

    def __init__(self, x):
        self.x = x

    def to(self, *args):
        self.x = self.x.to(*args)


class Detector(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, images, targets, graph, extra):
        assert targets.labels.dtype == torch.long and targets.boxes.dtype == torch.float32  # not cast
        assert extra.x.dtype == self.conv.weight.dtype
        out = ImageList(self.conv(images.tensors), images.sizes)
        return out, graph.x.to(self.conv.weight.dtype).sum()


@pytest.mark.parametrize("level", ["O1", "O2", "O3", "O5"])
def test_batch_classes_with_a_to_method_are_cast_as_apex_cast_them(level):
    """apex cast a cast model's inputs that have a ``to`` method ("custom batch classes");
    ampinit passed them untouched, and torch raised a dtype mismatch.  Reference: the same model on
    the tensor inside, cast.  Left alone: a class whose ``to`` would turn integer tensors into
    floats (targets with labels), one whose ``to`` takes no dtype, and outputs (O1 casts none)."""
    torch.manual_seed(0)
    model = amp.initialize(Detector(), opt_level=level, verbosity=0)
    dtype = model.conv.weight.dtype
    x = torch.randn(2, 3, 8, 8)
    targets = Targets(torch.rand(2, 4), torch.tensor([3, 70001]))
    out, total = model(ImageList(x, [(8, 8)] * 2), targets, DeviceOnlyBatch(torch.ones(3)), InPlaceBatch(x))
    assert isinstance(out, ImageList) and out.sizes == [(8, 8)] * 2 and float(total) == 3.0
    assert out.tensors.dtype == (torch.float16 if level == "O1" else dtype)  # outputs are not batch-cast
    with torch.autocast("cpu", dtype=torch.float16, enabled=level == "O1"):
        want = model.conv(x.to(dtype))
    assert torch.equal(out.tensors, want)


def test_cast_model_outputs_override():
    model = amp.initialize(nn.Linear(4, 4), opt_level="O2", cast_model_outputs=torch.float16, verbosity=0)
    assert model(torch.randn(2, 4)).dtype == torch.float16
    model = amp.initialize(nn.Linear(4, 4), opt_level="O1", cast_model_outputs=torch.float32, verbosity=0)
    assert model(torch.randn(2, 4)).dtype == torch.float32


def test_o1_autocast_is_scoped_to_forward():
    model = amp.initialize(nn.Linear(4, 4), opt_level="O1", cast_model_outputs=torch.float16, verbosity=0)
    assert model(torch.randn(2, 4)).dtype == torch.float16  # the linear ran in fp16 inside forward
    assert not torch.is_autocast_enabled("cpu")
    assert (torch.randn(2, 4) @ torch.randn(4, 4)).dtype == torch.float32

    class Boom(nn.Module):
        def forward(self, x):
            raise KeyError("boom")

    boom = amp.initialize(Boom(), opt_level="O1", verbosity=0)
    with pytest.raises(KeyError):
        boom(torch.randn(2))
    assert not torch.is_autocast_enabled("cpu")  # left even when forward raised


def test_keep_batchnorm_fp32_false_at_o2():
    model, _ = make_setup("O2", keep_batchnorm_fp32=False, optimizer="sgd")
    assert model.bn.weight.dtype == torch.float16


def test_enabled_false_passes_everything_through():
    torch.manual_seed(0)
    model = SmallNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = list(opt.param_groups[0]["params"])
    m2, o2 = amp.initialize(model, opt, opt_level="O2", enabled=False)
    assert m2 is model and o2 is opt and type(opt) is torch.optim.SGD
    assert opt.param_groups[0]["params"] == params and model.fc1.weight.dtype == torch.float32
    loss = model(batch(0)[0]).sum()
    with amp.scale_loss(loss, opt) as scaled:
        assert scaled is loss
    assert amp.state_dict() == {}


def test_list_and_single_shapes():
    models = [nn.Linear(2, 2), nn.Linear(2, 2)]
    out = amp.initialize(models, opt_level="O2", verbosity=0)
    assert isinstance(out, list) and out[0] is models[0]
    single = nn.Linear(2, 2)
    assert amp.initialize(single, opt_level="O0", verbosity=0) is single
    m = nn.Linear(2, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    mm, oo = amp.initialize(m, [opt], opt_level="O2", verbosity=0)
    assert mm is m and isinstance(oo, list) and oo[0] is opt


def test_scale_loss_has_no_host_sync_and_step_has_one(monkeypatch):
    model, opt = make_setup("O2", optimizer="sgd")  # torch's Adam itself calls .item() on CPU
    calls = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _real=real: calls.append(1) or _real(self, *a))
    x, y = batch(0)
    opt.zero_grad()
    with amp.scale_loss(((model(x) - y) ** 2).mean(), opt) as scaled:
        scaled.backward()
    assert calls == []
    opt.step()
    assert len(calls) == 1


def test_failed_backward_restores_earlier_gradients():
    model, opt = make_setup("O1", optimizer="sgd", num_losses=2)
    x, y = batch(0)
    with amp.scale_loss(((model(x).float() - y) ** 2).mean(), opt, loss_id=0) as scaled:
        scaled.backward()
    first = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(ZeroDivisionError):
        with amp.scale_loss(model(x).sum(), opt, loss_id=1):
            raise ZeroDivisionError  # e.g. the backward of the second loss failed
    assert all(torch.equal(a, p.grad) for a, p in zip(first, model.parameters()))
    assert opt.amp.loss_scalers[1].loss_scale() == 2.0 ** 16  # no update for the failed loss


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_zero_grad_discards_the_overflow_of_an_abandoned_backward(level):
    model, opt = make_setup(level, optimizer="sgd")
    x, y = batch(0)
    with amp.scale_loss(((model(x).float() - y) ** 2).mean() * float("inf"), opt) as scaled:
        scaled.backward()
    opt.zero_grad()  # the iteration is abandoned: its gradients and its overflow with it
    before = [p.detach().clone() for p in amp.master_params(opt)]
    train_step(model, opt, 1)  # zero_grad, clean backward, step
    assert opt.amp.skipped_steps == 0
    assert any(not torch.equal(a, b) for a, b in zip(before, amp.master_params(opt)))
    assert opt.amp.loss_scale() == 2.0 ** 15  # the overflow did happen: the scale backed off


def test_o3_with_an_eps_that_is_zero_in_fp16_is_warned_about(caplog):
    """The README's O3 + Adam trap (eps=1e-8 is 0 in fp16: 0/0 = NaN) is logged at initialize
    (NCF's FusedAdam(eps=1e-8) diverged at O3 with nothing said); eps=1e-4 and O2 are quiet."""
    import logging
    for level, eps, warned in [("O3", 1e-8, True), ("O3", 1e-4, False), ("O2", 1e-8, False)]:
        model = torch.nn.Linear(2, 2)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ampinit"):
            amp.initialize(model, torch.optim.Adam(model.parameters(), eps=eps), opt_level=level, verbosity=0)
        assert ("which is 0 in fp16" in caplog.text) == warned, (level, eps)
