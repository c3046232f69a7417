"""apex's own amp test suite (tests/L0/run_amp at NVIDIA/apex e13873de), re-expressed for ampinit.

Each scenario keeps apex's models, steps, hyper-parameters and assertions, and runs through
ampinit's apex alias exactly as apex's tests import it (``from apex import amp``,
``from apex.amp import _amp_state``, ``from apex.optimizers import FusedSGD``,
``from apex.parallel.LARC import LARC``), on the CPU (and on CUDA where present).  apex's
files build their loops inside one unittest method; here the outer loop (the opt level) is a
pytest parameter.  The scenarios that need apex's legacy ``amp.init()`` (test_basic_casts,
test_cache, test_promotion, test_rnn) are listed in docs/migrating-from-apex.md with the
reason; apex's multi-tensor kernel tests are in tests/test_apex_multi_tensor.py.
"""
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import Parameter

import ampinit

OPT_LEVELS = ["O0", "O1", "O2", "O3"]


@pytest.fixture(scope="module", autouse=True)
def apex_alias():
    ampinit.install_apex_alias()
    yield
    ampinit.uninstall_apex_alias()


@pytest.fixture
def apex():
    """``amp``, ``_amp_state`` and friends imported the way apex's tests import them."""
    from apex import amp
    from apex.amp import _amp_state
    from apex.optimizers import FusedSGD
    from apex.parallel.LARC import LARC

    class Apex:
        pass
    names = Apex()
    names.amp, names.state, names.FusedSGD, names.LARC = amp, _amp_state, FusedSGD, LARC
    return names


class MyModel(nn.Module):
    """apex's two-parameter model: an fp32 and an fp16 parameter, both trained."""

    def __init__(self, unique, device):
        super().__init__()
        self.weight0 = Parameter(unique + torch.arange(2, device=device, dtype=torch.float32))
        self.weight1 = Parameter(1.0 + unique + torch.arange(2, device=device, dtype=torch.float16))

    def forward(self, x):
        return ((x * self.weight0.float()) * self.weight1.float()).sum()


def zero(how, models, optimizers):
    if how == "none":
        for model in models:
            for param in model.parameters():
                param.grad = None
    elif how == "model":
        for model in models:
            model.zero_grad()
    else:
        for optimizer in optimizers:
            optimizer.zero_grad()


def initialize(apex, models, optimizers, opt_level, num_losses=1):
    apex.state.allow_incoming_model_not_fp32 = True
    models, optimizers = apex.amp.initialize(models, optimizers, opt_level=opt_level, verbosity=0,
                                             cast_model_type=False, num_losses=num_losses)
    apex.state.allow_incoming_model_not_fp32 = False
    return models, optimizers


# -- test_add_param_group.py ---------------------------------------------------------------

@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_add_param_group(apex, opt_level, device):
    x = torch.ones(2, device=device)
    for zero_before_add, try_accumulation in itertools.product((True, False), (True, False)):
        model0, model1 = MyModel(1, device), MyModel(2, device)
        optimizer = torch.optim.SGD([{"params": model0.parameters(), "lr": 0.25}], momentum=0.125)
        optimizer.zero_grad()
        model0(x).backward()
        optimizer.step()
        if zero_before_add:
            optimizer.zero_grad()
        optimizer.add_param_group({"params": model1.parameters(), "lr": 0.5})
        if not zero_before_add:
            optimizer.zero_grad()
        for again in (False, True):
            if again:
                optimizer.zero_grad()
            loss = model0(x) + model1(x)
            loss.backward(retain_graph=try_accumulation)
            if try_accumulation:
                loss.backward()
            optimizer.step()
        reference = [p.detach().clone() for m in (model0, model1) for p in m.parameters()]

        for how_to_zero in ("none", "model", "optimizer"):
            model0, model1 = MyModel(1, device), MyModel(2, device)
            optimizer = torch.optim.SGD([{"params": model0.parameters(), "lr": 0.25}], momentum=0.125)
            [model0, model1], optimizer = initialize(apex, [model0, model1], optimizer, opt_level)
            apex.state.loss_scalers[0]._loss_scale = 4.0
            models = [model0, model1]
            zero(how_to_zero, models, [optimizer])
            with apex.amp.scale_loss(model0(x), optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()
            if zero_before_add:
                zero(how_to_zero, models, [optimizer])
            optimizer.add_param_group({"params": model1.parameters(), "lr": 0.5})
            if not zero_before_add:
                zero(how_to_zero, models, [optimizer])
            for again in (False, True):
                if again:
                    zero(how_to_zero, models, [optimizer])
                loss = model0(x) + model1(x)
                with apex.amp.scale_loss(loss, optimizer) as scaled_loss:
                    scaled_loss.backward(retain_graph=try_accumulation)
                if try_accumulation:
                    with apex.amp.scale_loss(loss, optimizer) as scaled_loss:
                        scaled_loss.backward()
                optimizer.step()
            final = [p.detach().clone() for m in (model0, model1) for p in m.parameters()]
            for ref, got in zip(reference, final):
                torch.testing.assert_close(ref.to(got.dtype), got, msg=lambda m, how=how_to_zero: f"{how}: {m}")


# -- test_multiple_models_optimizers_losses.py and test_fused_sgd.py -----------------------------
#
# One scenario runner for apex's four multi-model tests.  ``layout`` says which models each loss
# sums and which optimizers each loss's scale_loss gets; the reference run without amp is apex's:
# a step skipped after an inf in loss k skips exactly the optimizers given to that scale_loss.

LAYOUTS = {
    # name: (models, optimizer groups as (model indices, lr) per optimizer, momentum per optimizer,
    #        loss k -> model indices, loss k -> optimizer indices)
    "2models2losses1optimizer": (2, [[(0, 0.25), (1, 0.5)]], [0.125], [(0,), (1,)], [(0,), (0,)]),
    "3models2losses1optimizer": (3, [[(0, 0.25), (1, 0.5), (2, 0.125)]], [0.125], [(0, 2), (1, 2)],
                                 [(0,), (0,)]),
    "2models2losses2optimizers": (2, [[(0, 0.25)], [(1, 0.5)]], [0.125, 0.25], [(0,), (1,)], [(0,), (1,)]),
    "3models2losses2optimizers": (3, [[(0, 0.25), (1, 1.0)], [(2, 0.5)]], [0.5, 0.25], [(0, 1), (2, 1)],
                                  [(0,), (0, 1)]),
}


def build(layout, device, make_sgd):
    n_models, groups, momenta, _, _ = LAYOUTS[layout]
    models = [MyModel(i + 1, device) for i in range(n_models)]
    optimizers = [make_sgd([{"params": models[m].parameters(), "lr": lr} for m, lr in group], momentum)
                  for group, momentum in zip(groups, momenta)]
    return models, optimizers


def in_group_order(layout, models):
    """The models' parameters in the order of the optimizers' param groups."""
    return [p for group in LAYOUTS[layout][1] for m, _ in group for p in models[m].parameters()]


def reference_run(layout, device, skipped_at, skipped_loss):
    """Plain PyTorch: per-iteration gradients (of the params the test checks) and final params;
    at iteration ``skipped_at`` the optimizers given to loss ``skipped_loss`` do not step."""
    models, optimizers = build(layout, device, lambda groups, m: torch.optim.SGD(groups, momentum=m))
    _, _, _, loss_models, loss_optimizers = LAYOUTS[layout]
    x = torch.ones(2, device=device)
    grads = []
    for i in range(3 if skipped_at >= 0 else 2):
        for optimizer in optimizers:
            optimizer.zero_grad()
        for members in loss_models:
            sum(models[m](x) for m in members).backward()
        if i != skipped_at:
            grads.append([p.grad.detach().clone() for p in in_group_order(layout, models)])
        skip = set(loss_optimizers[skipped_loss]) if i == skipped_at else set()
        for k, optimizer in enumerate(optimizers):
            if k not in skip:
                optimizer.step()
    return grads, [p.detach().clone() for p in in_group_order(layout, models)]


def injection_targets(layout, which_backward):
    """apex's choice of where to put the inf: each model of the loss (3-model layouts), or the
    loss's only model."""
    members = LAYOUTS[layout][3][which_backward]
    return members


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("optimizer_kind", ["sgd", "fused_sgd", "fused_sgd_materialized"])
def test_multiple_models_optimizers_losses(apex, layout, opt_level, optimizer_kind, device):
    if optimizer_kind != "sgd" and layout.endswith("2optimizers"):
        pytest.skip("apex's test_fused_sgd.py covers the 1-optimizer layouts with FusedSGD")
    x = torch.ones(2, device=device)
    _, _, _, loss_models, loss_optimizers = LAYOUTS[layout]
    materialize = optimizer_kind == "fused_sgd_materialized"
    if optimizer_kind == "sgd":
        def make_sgd(groups, momentum):
            return torch.optim.SGD(groups, momentum=momentum)
    else:
        def make_sgd(groups, momentum):
            return apex.FusedSGD(groups, momentum=momentum, materialize_master_grads=materialize)
    dynamic = opt_level in ("O1", "O2")
    references = {}
    for how_to_zero, multiple_scalers in itertools.product(("none", "model", "optimizer"), (True, False)):
        for inject_inf in ((-1, 0, 1) if dynamic else (-1,)):
            places = itertools.product(("fp16", "fp32"), (0, 1)) if inject_inf >= 0 else [(None, None)]
            for inject_loc, which_backward in places:
                targets = injection_targets(layout, which_backward) if inject_inf >= 0 else (None,)
                for which_model in targets:
                    key = (inject_inf, which_backward if inject_inf >= 0 else 0)
                    if key not in references:
                        references[key] = reference_run(layout, device, *key)
                    ref_grads, ref_final = references[key]
                    num_losses, loss_ids = (2, [0, 1]) if multiple_scalers else (1, [0, 0])
                    models, optimizers = build(layout, device, make_sgd)
                    models, optimizers = initialize(apex, models, optimizers, opt_level, num_losses)
                    apex.state.loss_scalers[0]._loss_scale = 4.0
                    if multiple_scalers:
                        apex.state.loss_scalers[1]._loss_scale = 16.0
                    unskipped = 0
                    for i in range(3 if inject_inf >= 0 else 2):
                        zero(how_to_zero, models, optimizers)
                        losses = [sum(models[m](x) for m in members) for members in loss_models]
                        for k, loss in enumerate(losses):
                            targets_k = [optimizers[o] for o in loss_optimizers[k]]
                            with apex.amp.scale_loss(loss, targets_k if len(targets_k) > 1 else targets_k[0],
                                                     loss_id=loss_ids[k]) as scaled_loss:
                                scaled_loss.backward()
                                if i == inject_inf and which_backward == k:
                                    param = models[which_model].weight0 if inject_loc == "fp32" \
                                        else models[which_model].weight1
                                    param.grad[0] = float("inf")
                        if i != inject_inf:
                            if not (opt_level == "O2" and optimizer_kind == "fused_sgd"):
                                masters = [p for opt in optimizers for p in apex.amp.master_params(opt)]
                                for param, ref in zip(masters, ref_grads[unskipped]):
                                    assert torch.allclose(param.grad.float(), ref.float()), \
                                        (how_to_zero, multiple_scalers, inject_inf, i)
                            unskipped += 1
                        for optimizer in optimizers:
                            optimizer.step()
                    model_params = in_group_order(layout, models)
                    for model, reference in zip(model_params, ref_final):
                        assert torch.allclose(model, reference.to(model.dtype)), \
                            (how_to_zero, multiple_scalers, inject_inf, inject_loc, which_backward, which_model)
                    masters = [p for opt in optimizers for p in apex.amp.master_params(opt)]
                    for model, master in zip(model_params, masters):
                        assert torch.allclose(model, master.to(model.dtype))
                    if opt_level == "O1":
                        apex.state.handle._deactivate()


# -- test_larc.py --------------------------------------------------------------------------------

@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_larc_mixed_precision(apex, opt_level, device):
    """apex only checks that initialize and a step accept LARC; here the weights must also end
    where the same LARC step ends without amp."""
    class Single(nn.Module):
        def __init__(self, unique):
            super().__init__()
            self.weight0 = Parameter(unique + torch.arange(2, device=device, dtype=torch.float32))

        def forward(self, x):
            return (x * self.weight0).sum()

    x = torch.ones(2, device=device)
    finals = []
    for use_amp in (True, False):
        model = Single(1)
        optimizer = apex.LARC(torch.optim.SGD([{"params": model.parameters(), "lr": 0.25}], momentum=0.125))
        if use_amp:
            model, optimizer = apex.amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
            apex.state.loss_scalers[0]._loss_scale = 4.0  # 2**16 x a gradient of 1 overflows fp16 at O2
        optimizer.zero_grad()
        loss = model(x.to(model.weight0.dtype)).float()
        if use_amp:
            with apex.amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
        else:
            loss.backward()
        optimizer.step()
        finals.append(model.weight0.detach().float())
    tolerance = {} if opt_level in ("O0", "O1") else dict(rtol=1e-3, atol=1e-3)  # fp16 model at O2/O3
    torch.testing.assert_close(finals[0], finals[1], **tolerance)


# -- test_checkpointing.py -----------------------------------------------------------------------

class CheckpointModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, 1, 1)
        self.bn1 = nn.BatchNorm2d(6)
        self.param = nn.Parameter(torch.randn(1))

    def forward(self, x):
        return self.bn1(F.relu(self.conv1(x * self.param)))


def checkpoint_train_step(amp, model, optimizer, data, loss_ids):
    optimizer.zero_grad()
    output = model(data)
    for idx in loss_ids:
        with amp.scale_loss(output.mean(), optimizer, loss_id=idx) as scaled_loss:
            scaled_loss.backward(retain_graph=True)
    optimizer.step()
    return output


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
@pytest.mark.parametrize("amp_before_load", [True, False])
@pytest.mark.parametrize("num_losses", [1, 2])
def test_checkpointing_restoring(apex, opt_level, amp_before_load, num_losses, device):
    """A model restored from model and optimizer state dicts (apex's FIXME: not the amp state)
    trains on bit for bit like the original; the checkpoint's model state is all FP32."""
    amp = apex.amp
    torch.manual_seed(2809)
    model = CheckpointModel().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, num_losses=num_losses * 2, verbosity=0)
    restore_model = restore_optimizer = None
    for epoch in range(10):
        x = torch.randn(4, 3, 24, 24, device=device)  # apex: a batch of 16; 4 keeps fp16 convs on a CPU quick
        output = checkpoint_train_step(amp, model, optimizer, x, range(num_losses))
        if epoch == 4:
            checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": amp.state_dict()}
            for key, value in checkpoint["model"].items():
                assert "num_batches_tracked" in key or value.dtype == torch.float32, key
            restore_model = CheckpointModel().to(device)
            restore_optimizer = torch.optim.SGD(restore_model.parameters(), lr=1e-3)
            if amp_before_load:
                restore_model, restore_optimizer = amp.initialize(restore_model, restore_optimizer,
                                                                  opt_level=opt_level, num_losses=num_losses * 2,
                                                                  verbosity=0)
            restore_model.load_state_dict(checkpoint["model"])
            restore_optimizer.load_state_dict(checkpoint["optimizer"])
            if not amp_before_load:
                restore_model, restore_optimizer = amp.initialize(restore_model, restore_optimizer,
                                                                  opt_level=opt_level, num_losses=num_losses * 2,
                                                                  verbosity=0)
        elif epoch > 4:
            restore_output = checkpoint_train_step(amp, restore_model, restore_optimizer, x,
                                                   range(num_losses, num_losses * 2))
            assert torch.allclose(output.float(), restore_output.float())
            a, b = model.state_dict(), restore_model.state_dict()
            assert len(a) == len(b)
            for key in a:
                assert (a[key] == b[key]).all(), key


@pytest.mark.parametrize("opt_level", OPT_LEVELS)
def test_checkpointing_loss_scale_decrease(apex, opt_level, device):
    amp = apex.amp
    num_losses, decreases = 3, [0, 1, 2]
    model = CheckpointModel().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, num_losses=num_losses, verbosity=0)
    if amp._amp_state.opt_properties.loss_scale != "dynamic":
        pytest.skip(f"{opt_level} has a static loss scale (apex's test skips it too)")
    initial = [amp._amp_state.loss_scalers[i].loss_scale() for i in range(num_losses)]
    left = list(decreases)
    for _ in range(len(decreases)):
        x = torch.randn(16, 3, 24, 24, device=device)
        for idx in range(num_losses):
            while left[idx] > 0:
                optimizer.zero_grad()
                loss = model(x * 2 ** 17).mean()  # inf in fp16
                with amp.scale_loss(loss, optimizer, loss_id=idx) as scaled_loss:
                    scaled_loss.backward(retain_graph=True)
                optimizer.step()
                left[idx] -= 1
    updated = [amp._amp_state.loss_scalers[i].loss_scale() for i in range(num_losses)]
    assert updated == [scale / 2 ** factor for scale, factor in zip(initial, decreases)]
    state = amp.state_dict()
    for key, factor, scale in zip(state, decreases, initial):  # apex's order: loss_scaler0, 1, 2
        assert state[key]["loss_scale"] == scale / 2 ** factor
        assert state[key]["unskipped"] == 0


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2"])  # apex skips O3
def test_checkpointing_state_dict(apex, opt_level, device):
    amp = apex.amp
    model = CheckpointModel().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    assert not any(value.dtype in (torch.float16, torch.bfloat16) for value in model.state_dict().values())
    data = torch.randn(10, 3, 4, 4, device=device)
    target = torch.randn(10, 6, 4, 4, device=device)
    last = None
    for _ in range(11):
        optimizer.zero_grad()
        loss = F.mse_loss(model(data), target)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        if last is not None:
            assert loss.item() < last
        last = loss.item()
