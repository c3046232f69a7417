"""Many initializations, ending one, weak references, logging."""
import gc
import logging
import weakref

import pytest
import torch
from torch import nn
from torch.nn.utils import prune

import ampinit as amp
from conftest import batch, make_setup, train_step


@pytest.mark.parametrize("level", ["O1", "O2", "O3", "O5"])
def test_end_restores_fp32_model_with_master_values(level):
    model, opt = make_setup(level, optimizer="sgd")
    for step in range(3):
        train_step(model, opt, step)
    masters = [p.detach().clone() for p in amp.master_params(opt)]
    amp.end(opt)
    assert type(opt) is torch.optim.SGD and not hasattr(opt, "amp")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(b.dtype == torch.float32 for b in model.buffers() if b.is_floating_point())
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in model.parameters()]
    if level in ("O2", "O5"):
        assert all(torch.equal(p, m) for p, m in zip(model.parameters(), masters))
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert model(batch(0)[0]).dtype == torch.float32
    # plain fp32 training continues, and the model can be initialized again
    x, y = batch(1)
    ((model(x) - y) ** 2).mean().backward()
    opt.step()
    model2, opt2 = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    train_step(model2, opt2, 2)
    handle = opt2.amp
    amp.end(model2)
    handle.end()  # idempotent on the handle
    with pytest.raises(RuntimeError, match="not initialized"):
        amp.end(model2)  # the model no longer has an initialization to end

@pytest.mark.parametrize("write", ["no_grad", "data", "init", "prune_remove", "state_dict"])
@pytest.mark.parametrize("level", ["O2", "O5"])
def test_end_keeps_writes_to_the_model_made_since_the_last_step(level, write, caplog):
    """An EMA copied into the model for export (diffusers' ema.copy_to), nn.init, pruning made
    permanent, then end(): the FP32 model must hold the write, as model.state_dict() did just
    before, not the masters of the last step."""
    model, opt = make_setup(level, optimizer="sgd")
    for step in range(3):
        train_step(model, opt, step)
    weight = model.fc1.weight
    if write == "no_grad":
        with torch.no_grad():
            weight.fill_(0.5)
    elif write == "data":
        weight.data.zero_()
    elif write == "init":
        nn.init.constant_(weight, 0.25)
    elif write == "state_dict":
        model.state_dict()["fc1.weight"].fill_(0.5)
    else:
        prune.l1_unstructured(model.fc1, "weight", amount=0.5)
        prune.remove(model.fc1, "weight")
    expected = model.state_dict()["fc1.weight"].float().clone()
    untouched = model.state_dict()["fc2.weight"].float().clone()
    with caplog.at_level(logging.WARNING, logger="ampinit"):
        amp.end(opt)
    assert model.fc1.weight.dtype == torch.float32 and torch.equal(model.fc1.weight, expected)
    assert torch.equal(model.fc2.weight, untouched) and "written" not in caplog.text
    if write == "prune_remove":
        assert (model.fc1.weight == 0).sum() == weight.numel() // 2


def test_double_initialize_is_rejected_until_ended():
    model, opt = make_setup("O2")
    with pytest.raises(RuntimeError, match="already initialized"):
        amp.initialize(model, opt_level="O1")
    opt2 = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="already initialized"):
        amp.initialize(nn.Linear(2, 2), opt, opt_level="O1")
    assert type(opt2) is torch.optim.SGD


def test_lr_scheduler_survives_end():
    model, opt = make_setup("O2", optimizer="sgd")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    train_step(model, opt, 0)
    sched.step()
    amp.end(opt)
    x, y = batch(1)
    ((model(x) - y) ** 2).mean().backward()
    opt.step()  # the scheduler's wrapper of the old bound step must still work
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05 * 0.25)


def test_many_initializations_are_independent_and_freed():
    refs = []
    finals = []
    for fold in range(20):
        model, opt = make_setup("O2" if fold % 2 else "O1", seed=fold)
        for step in range(3):
            train_step(model, opt, step, poison=(fold == 5 and step == 1))
        finals.append((model, opt))
        refs.append(weakref.ref(opt.amp))
    assert finals[5][1].amp.skipped_steps == 1
    assert all(o.amp.skipped_steps == 0 for i, (_, o) in enumerate(finals) if i != 5)
    for model, opt in finals[:3]:   # earlier models keep working
        train_step(model, opt, 7)
    del finals, model, opt
    gc.collect()
    assert all(r() is None for r in refs)  # nothing in ampinit keeps them alive
    with pytest.raises(RuntimeError, match="no live"):
        amp.state_dict()


def test_handle_of_errors():
    with pytest.raises(TypeError):
        amp.handle_of(3)
    with pytest.raises(RuntimeError, match="not initialized"):
        amp.handle_of(nn.Linear(2, 2))


def test_overflow_logging_is_rate_limited(caplog):
    model, opt = make_setup("O2", optimizer="sgd", verbosity=1)
    with caplog.at_level(logging.INFO, logger="ampinit"):
        for step in range(40):
            train_step(model, opt, step, poison=True)
    overflow = [r for r in caplog.records if "Gradient overflow" in r.getMessage()]
    # the first 8, then skips 16 and 32
    assert len(overflow) == 10 and opt.amp.skipped_steps == 40
    message = overflow[8].getMessage()
    assert "(16 skipped so far; inf/NaN in fc1.weight, fc1.bias, bn.weight" in message, message
    assert message.endswith("loss scale now 1")
    assert all(r.levelno == logging.WARNING for r in overflow)


def test_verbosity_zero_is_silent(caplog):
    with caplog.at_level(logging.DEBUG, logger="ampinit"):
        model, opt = make_setup("O2", optimizer="sgd", verbosity=0)
        train_step(model, opt, 0, poison=True)
    assert not caplog.records


def test_verbosity_levels(caplog):
    with caplog.at_level(logging.DEBUG, logger="ampinit"):
        make_setup("O2", verbosity=1)
        assert [r.levelno for r in caplog.records] == [logging.INFO]
        caplog.clear()
        make_setup("O2", verbosity=2)
        assert [r.levelno for r in caplog.records] == [logging.INFO, logging.DEBUG]
        assert "FP32 masters" in caplog.records[1].getMessage()


@pytest.mark.parametrize("cast", ["float", "half", "double"])
@pytest.mark.parametrize("level", ["O2", "O5"])
def test_end_is_the_way_out_of_a_model_cast_after_initialize(level, cast):
    """A model cast after initialize cannot train (step() says so), but end() must still work:
    the masters stand, since the cast model's values are no longer what ampinit wrote."""
    model, opt = make_setup(level, optimizer="sgd")
    train_step(model, opt, 0)
    masters = [p.detach().clone() for p in amp.master_params(opt)]
    had_master = [p.dtype != torch.float32 for p in model.parameters()]  # FP32 ones (batchnorm) are cast too
    getattr(model, cast)()
    amp.end(opt)
    assert all(torch.equal(p, m) for p, m, kept in zip(model.parameters(), masters, had_master) if kept)
    restored = [p.dtype for p, kept in zip(model.parameters(), had_master) if kept]
    assert len(restored) >= 2 and set(restored) == {torch.float32}
