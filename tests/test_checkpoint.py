import collections
import copy
import io
import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.nn.utils import prune

import ampinit as amp
from ampinit.optim import FusedAdam
from conftest import LEVELS, SmallNet, amp_backward, initialize_at, make_setup, train_step

HERE = os.path.dirname(os.path.abspath(__file__))


CASES = {level: (level, {}) for level in LEVELS}
CASES.update({
    "O2-bf16-dynamic": ("O2", {"cast_model_type": "torch.bfloat16"}),
    "O5-dynamic": ("O5", {"loss_scale": "dynamic"}),
    "O3-sgd": ("O3", {"optimizer": "sgd"}),
    "O5-remainder": ("O5", {"optimizer": "fused_adamw", "master_weights": "remainder"}),
    "O5-remainder-bf16-moments": ("O5", {"optimizer": "fused_adamw_bf16", "master_weights": "remainder"}),
    "O5-remainder-sgd": ("O5", {"optimizer": "fused_sgd", "master_weights": "remainder", "loss_scale": "dynamic"}),
    "O5-bf16-moments": ("O5", {"optimizer": "fused_adamw_bf16"}),
})


@pytest.fixture(scope="module")
def resumed_runs(tmp_path_factory):
    """All cases trained in one process, then resumed in a second, fresh one."""
    directory = str(tmp_path_factory.mktemp("resume"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.path.dirname(HERE),
                                                       os.environ.get("PYTHONPATH", "")]))
    for mode in ("train", "resume"):
        subprocess.run([sys.executable, os.path.join(HERE, "resume_worker.py"), mode, directory,
                        json.dumps(CASES)], check=True, env=env, timeout=600)
    return directory


@pytest.mark.parametrize("case", list(CASES))
def test_resume_in_fresh_process_is_bitwise_identical(case, resumed_runs):
    full = torch.load(os.path.join(resumed_runs, case + ".full"))
    resumed = torch.load(os.path.join(resumed_runs, case + ".resumed"))
    for key in ("params", "masters"):
        assert len(full[key]) == len(resumed[key]) > 0
        for a, b in zip(full[key], resumed[key]):
            assert a.dtype == b.dtype and torch.equal(a, b), key
    for name in full["model"]:
        assert torch.equal(full["model"][name], resumed["model"][name]), name
    assert full["amp"] == resumed["amp"]
    assert full["amp"]["ampinit"]["optimizers"][0]["skipped_steps"] == 1  # the poisoned step


def test_o2_state_dict_holds_fp32_masters_and_loads_into_plain_model():
    model, opt = make_setup("O2")
    for step in range(3):
        train_step(model, opt, step)
    state = model.state_dict()
    masters = list(amp.master_params(opt))
    assert state["fc1.weight"].dtype == torch.float32 and torch.equal(state["fc1.weight"], masters[0])
    assert state["offset"].dtype == torch.float32 and state["bn.running_mean"].dtype == torch.float32
    plain = SmallNet()
    plain.load_state_dict(state)
    assert torch.equal(plain.fc1.weight, masters[0])
    assert model.fc1.weight.dtype == torch.float16  # the model itself stays cast


def test_load_state_dict_sets_params_and_masters():
    model, opt = make_setup("O2")
    source = SmallNet()
    with torch.no_grad():
        source.fc1.weight.copy_(torch.randn_like(source.fc1.weight) / 3)
    model.load_state_dict(source.state_dict())
    master = opt.param_groups[0]["params"][0]
    assert torch.equal(master, source.fc1.weight)  # full precision, not via fp16
    assert torch.equal(model.fc1.weight, source.fc1.weight.half())
    model.fc1.load_state_dict({"weight": source.fc1.weight * 2, "bias": source.fc1.bias})  # a submodule
    assert torch.equal(master, source.fc1.weight * 2)


def test_apex_checkpoint_loads():
    model, opt = make_setup("O2", num_losses=2)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 17},
                         "loss_scaler1": {"loss_scale": 8.0, "unskipped": 0}})
    assert [s.loss_scale() for s in opt.amp.loss_scalers] == [1024.0, 8.0]
    assert amp.state_dict()["loss_scaler0"]["unskipped"] == 17


@pytest.mark.parametrize("saved, live", [(3, 1), (3, 2), (1, 3)])
def test_an_amp_checkpoint_with_another_num_losses_loads_its_first_scalers_as_apex(saved, live, caplog):
    """apex's amp.load_state_dict warns and loads min(saved, live) scalers (a GAN checkpoint
    resumed or fine-tuned with another loss count); the rest keep their initial scale."""
    source_model, source_opt = make_setup("O2", num_losses=saved)
    for index, scaler in enumerate(source_opt.amp.loss_scalers):
        scaler.set_scale(2.0 ** (4 + index))
    checkpoint = amp.state_dict()
    model, opt = make_setup("O2", num_losses=live)
    initial = [s.loss_scale() for s in opt.amp.loss_scalers]
    with caplog.at_level("WARNING", logger="ampinit"):
        amp.load_state_dict(checkpoint)
    kept = min(saved, live)
    assert [s.loss_scale() for s in opt.amp.loss_scalers] == [2.0 ** (4 + i) for i in range(kept)] + initial[kept:]
    assert f"holds {saved} loss scalers but this initialization has num_losses={live}" in caplog.text


@pytest.mark.parametrize("bad, match", [
    ({"loss_scaler0": {"loss_scale": 2.0, "unskipped": 0},
      "loss_scaler2": {"loss_scale": 2.0, "unskipped": 0}}, "one per loss"),
    ({"ampinit": {"version": 1}}, "no loss scalers"),
    ({"loss_scaler0": {"loss_scale": 2.0, "unskipped": 0},
      "loss_scaler1": {"loss_scale": -2.0, "unskipped": 0}}, "loss_scale"),
    ({"loss_scaler0": {"loss_scale": 2.0, "unskipped": 0}, "loss_scaler1": {"loss_scale": 2.0, "unskipped": 0},
      "ampinit": {"version": 99}}, "version"),
    ({"loss_scaler0": {"loss_scale": 2.0, "unskipped": 0}, "loss_scaler1": {"loss_scale": 2.0, "unskipped": 0},
      "ampinit": {"version": 1, "optimizers": []}}, "optimizer"),
    ([1, 2], "dict"),
])
def test_mismatched_amp_state_leaves_everything_untouched(bad, match):
    model, opt = make_setup("O2", num_losses=2)
    train_step(model, opt, 0, poison=True)
    before = opt.amp.state_dict()
    with pytest.raises((ValueError, TypeError), match=match):
        amp.load_state_dict(bad)
    assert opt.amp.state_dict() == before


def test_state_dict_refers_to_most_recent_and_handles_are_independent():
    model_a, opt_a = make_setup("O2")
    train_step(model_a, opt_a, 0, poison=True)
    model_b, opt_b = make_setup("O1")
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 2.0 ** 16  # b, the most recent
    assert opt_a.amp.state_dict()["loss_scaler0"]["loss_scale"] == 2.0 ** 15
    assert amp.state_dict(destination={"x": 1})["x"] == 1


def test_module_level_state_dict_says_when_another_initialization_trains_beside_the_most_recent(caplog):
    """HobbitLong/CMC (MoCo): the model, then its EMA with an optimizer that never steps, each
    initialized; amp.state_dict() saved the EMA's scale (apex's one shared scaler was the
    model's), so a resume after an overflow restarted the model's scale.  It is logged, once,
    with the per-optimizer recipe; earlier folds that no longer train are not, nor is loading
    the other's own state (the recipe), and an enabled=False initialize made last is."""
    message = "other initialization(s) trained since it was made"
    fold_model, fold_opt = make_setup("O2")  # a finished fold, still referenced
    train_step(fold_model, fold_opt, 0)
    model, opt = make_setup("O2")
    own_state = opt.amp.state_dict()
    ema, _ = make_setup("O2", optimizer="sgd")  # the EMA's, never stepped
    with caplog.at_level("WARNING", logger="ampinit"):
        opt.amp.load_state_dict(own_state)
        amp.state_dict()
        assert message not in caplog.text  # nothing trained beside it yet
        train_step(model, opt, 1, poison=True)
        saved = amp.state_dict()
        amp.load_state_dict(saved)
    assert caplog.text.count(message) == 1
    assert saved["loss_scaler0"]["loss_scale"] == 2.0 ** 16 != opt.amp.state_dict()["loss_scaler0"]["loss_scale"]
    caplog.clear()
    amp.initialize(nn.Linear(2, 2), enabled=False)
    train_step(model, opt, 2)
    with caplog.at_level("WARNING", logger="ampinit"):
        assert amp.state_dict() == {}
    assert caplog.text.count(message) == 1 and "enabled=False" in caplog.text


@pytest.mark.parametrize("saved_level,saved_scale", [("O5", None), ("O0", None), ("O2", 128.0)])
def test_a_static_scale_does_not_replace_a_dynamic_one(saved_level, saved_scale, caplog):
    """An amp state saved with a static scale (1.0 at O0/O5, or a fixed loss_scale) loaded into
    a dynamic fp16 run: the dynamic scale keeps its own, with a warning; taking 1.0 flushed small
    fp16 gradients to zero for ~16 x growth_interval steps.  Reference: the fresh O2 run."""
    def setup(level, **extra):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        return amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=level, verbosity=0,
                              **extra)

    setup(saved_level, **({"loss_scale": saved_scale} if saved_scale else {}))
    saved = amp.state_dict()

    def grad_after(load):
        model, opt = setup("O2")
        if load:
            with caplog.at_level("WARNING", logger="ampinit"):
                amp.load_state_dict(saved)
        with amp.scale_loss(model(torch.full((1, 4), 1e-4)).float().sum() * 1e-4, opt) as scaled:
            scaled.backward()
        return opt.amp.loss_scale(), next(iter(amp.master_params(opt))).grad.clone()

    fresh_scale, fresh_grad = grad_after(load=False)
    scale, grad = grad_after(load=True)
    assert scale == fresh_scale == 2.0 ** 16
    assert torch.equal(grad, fresh_grad) and bool((grad != 0).all())
    assert "was static" in caplog.text


def _renamed_after_initialize(level, rename):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, opt = initialize_at(model, opt, level)
    if rename.startswith("prune"):  # weight -> weight_orig (+ weight_mask), same module
        prune.l1_unstructured(model[0], "weight", amount=0.5)
    else:  # weight -> parametrizations.weight.original, in a module made now
        torch.nn.utils.parametrizations.spectral_norm(model[2])
    return model, opt


def _renamed_steps(model, opt, level, steps, start):
    for step in range(start, start + steps):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
        loss = model(x).float().pow(2).mean()
        opt.zero_grad()
        amp_backward(loss, opt, level)
        opt.step()


@pytest.mark.parametrize("rename", ["prune", "prune_remove", "spectral_norm"])
@pytest.mark.parametrize("level", ["O2", "O5"])
def test_a_tensor_renamed_after_initialize_keeps_its_fp32_value_in_checkpoints(level, rename):
    """Pruning (weight -> weight_orig) or a parametrization (-> parametrizations.weight.original)
    applied after initialize: the checkpoint still holds the master, and resume is bit for bit
    (it held the 16-bit weight, 1.6e-3 off after 20 steps)."""
    model, opt = _renamed_after_initialize(level, rename)
    _renamed_steps(model, opt, level, 3, 0)
    if rename == "prune_remove":
        prune.remove(model[0], "weight")
    checkpoint = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "amp": amp.state_dict()})
    key, index = {"prune": ("0.weight_orig", 0), "prune_remove": ("0.weight", 0),
                  "spectral_norm": ("2.parametrizations.weight.original", 2)}[rename]
    master = opt.param_groups[0]["params"][index].detach()  # the FP32 master of that parameter
    if rename == "prune_remove":  # written since the step: reported as the model holds it, zeros and all
        master = torch.where(model[0].weight == 0, 0.0, master)
    assert checkpoint["model"][key].dtype == torch.float32 and torch.equal(checkpoint["model"][key], master)
    _renamed_steps(model, opt, level, 4, 3)
    resumed, resumed_opt = _renamed_after_initialize(level, rename)
    if rename == "prune_remove":
        prune.remove(resumed[0], "weight")
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt.load_state_dict(checkpoint["opt"])
    amp.load_state_dict(checkpoint["amp"])
    _renamed_steps(resumed, resumed_opt, level, 4, 3)
    for (name, a), (_, b) in zip(model.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_a_module_made_after_initialize_and_shared_under_two_names_saves_fp32_under_both(level):
    """A parametrization added after initialize, on a layer the model holds under two names
    (tied heads, an alias): torch's state_dict has a key under each name, and each must hold
    the FP32 master (the second held the 16-bit weight)."""
    model, opt = _renamed_after_initialize(level, "spectral_norm")
    _renamed_steps(model, opt, level, 2, 0)
    model.add_module("alias", model[2])  # after the steps: Sequential would run it twice
    state = model.state_dict()
    master = opt.param_groups[0]["params"][2].detach()
    for key in ("2.parametrizations.weight.original", "alias.parametrizations.weight.original"):
        assert state[key].dtype == torch.float32 and torch.equal(state[key], master), key


def _copy_of(obj, how):
    import copy as copy_module
    import io
    if how == "deepcopy":
        return copy_module.deepcopy(obj)
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O4"])
@pytest.mark.parametrize("how", ["deepcopy", "torch_save"])
def test_a_copied_initialized_optimizer_is_a_plain_one_over_copies(opt_level, how):
    """From the review: ``torch.save(optimizer)`` after initialize raised PicklingError (the
    per-class subclass borrows its base's name), and ``copy.deepcopy(optimizer).step()`` recursed
    forever.  Without masters a copy is the base class's optimizer over copies of the parameters,
    unbound, as a copied model is; copied together with the model, it trains the copied model,
    as in plain torch.  Reference: torch's optimizer loaded with the same state."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, loss_scale=128.0, verbosity=0)
    with amp.scale_loss(model(torch.randn(2, 4)).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    copied_model, copied = _copy_of((model, opt), how)
    assert type(copied) is torch.optim.Adam and type(copied.state) is collections.defaultdict
    assert all(a is b for a, b in zip(copied.param_groups[0]["params"], copied_model.parameters()))
    twin = torch.optim.Adam([p.detach().clone().requires_grad_() for p in opt.param_groups[0]["params"]], lr=0.1)
    twin.load_state_dict(opt.state_dict())
    for a, b in zip(copied.param_groups[0]["params"], twin.param_groups[0]["params"]):
        assert torch.equal(a, b) and a is not b
        a.grad = b.grad = torch.ones_like(a)
    copied.step()
    twin.step()
    assert all(torch.equal(a, b) for a, b in zip(copied.param_groups[0]["params"], twin.param_groups[0]["params"]))
    assert amp.handle_of(opt).optimizers == [opt]  # the original is still bound


@pytest.mark.parametrize("opt_level", ["O2", "O5"])
@pytest.mark.parametrize("how", ["deepcopy", "torch_save"])
def test_copying_an_optimizer_with_masters_is_refused(opt_level, how):
    """From the review: a copy of (model, optimizer) at O2/O5 trained copies of the masters that
    the copied model never saw: its step changed the model by 0.0, silently.  Refused, naming the
    state dicts to save instead; the original keeps training."""
    model = nn.Sequential(nn.Linear(4, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, verbosity=0)
    with pytest.raises(TypeError, match=r"optimizer.state_dict\(\) and ampinit.state_dict\(\)"):
        _copy_of((model, opt), how)
    with amp.scale_loss(model(torch.randn(2, 4)).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()


@pytest.mark.parametrize("make", [lambda p: torch.optim.Adam(p, lr=1e-3, eps=1e-4),
                                  lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)], ids=["adam", "sgd"])
def test_o3_resume_with_the_optimizer_state_loaded_before_initialize(make):
    """DeepLearningExamples' order: model and optimizer state loaded, then initialize.  At O3 the
    state stayed FP32 next to the fp16 parameters: Adam's step raised torch's bare dtype error,
    SGD's momentum resumed 1.5e-3 off.  Reference: the uninterrupted O3 run, bit for bit; after
    ampinit.end the state follows the parameters back to FP32."""
    def batches(start, stop):
        return [torch.randn(8, 4, generator=torch.Generator().manual_seed(s)) for s in range(start, stop)]

    def train(model, opt, xs):
        for x in xs:
            opt.zero_grad()
            with amp.scale_loss(model(x.half()).float().square().mean(), opt) as scaled:
                scaled.backward()
            opt.step()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = make(model.parameters())
    model, opt = amp.initialize(model, opt, opt_level="O3", loss_scale=128.0, verbosity=0)
    train(model, opt, batches(0, 3))
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    train(model, opt, batches(3, 6))

    torch.manual_seed(1)
    resumed = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    resumed_opt = make(resumed.parameters())
    resumed.load_state_dict(saved[0])
    resumed_opt.load_state_dict(saved[1])  # before initialize: torch casts the state to FP32 here
    resumed, resumed_opt = amp.initialize(resumed, resumed_opt, opt_level="O3", loss_scale=128.0, verbosity=0)
    train(resumed, resumed_opt, batches(3, 6))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters()))
    amp.end(resumed)
    resumed(torch.randn(2, 4)).sum().backward()
    resumed_opt.step()
    assert all(v.dtype == torch.float32 for entry in resumed_opt.state.values() for k, v in entry.items()
               if torch.is_tensor(v) and k != "step")


def _masters_outside_the_cast(level, how):
    """A model with parameters that have FP32 masters ampinit did not make at the cast: a head
    added after initialize (cast, then add_param_group, as the README says), or a model the user
    cast before initialize."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    low = torch.float16 if level == "O2" else torch.bfloat16
    if how == "user_cast":
        model.to(low)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    if how == "added_head":
        torch.manual_seed(9)
        model.add_module("extra", nn.Linear(4, 4).to(low))
        opt.add_param_group({"params": model.extra.parameters()})
    return model, opt


def _train_masters_outside(model, opt, steps):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 8, generator=g), torch.randn(64, 4, generator=g)
    for _ in range(steps):
        loss = ((model(x).float() - y) ** 2).mean()
        opt.zero_grad()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()


@pytest.mark.parametrize("how", ["added_head", "user_cast"])
@pytest.mark.parametrize("level", ["O2", "O5"])
def test_masters_ampinit_did_not_cast_are_in_the_state_dict_and_resume_bit_for_bit(level, how):
    """From a review: model.state_dict() reported these parameters' 16-bit values, so a
    checkpoint lost their masters' low bits, resume drifted from the uninterrupted run (2e-4 at
    O2, 2e-3 at O5), and load_state_dict left the masters at their old values."""
    model, opt = _masters_outside_the_cast(level, how)
    _train_masters_outside(model, opt, 20)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "amp": amp.state_dict()})
    masters = [p for group in opt.param_groups for p in group["params"]]
    names = ["extra.weight", "extra.bias"] if how == "added_head" else ["0.weight", "0.bias", "2.weight", "2.bias"]
    for name in names:
        master = opt.amp._master_of(model.get_parameter(name))
        assert saved["model"][name].dtype == torch.float32 and torch.equal(saved["model"][name], master), name
        # and through the submodule's own state_dict() (from the review: 16-bit for a head added later)
        owner, _, leaf = name.rpartition(".")
        assert torch.equal(model.get_submodule(owner).state_dict()[leaf], master), name
    _train_masters_outside(model, opt, 10)

    resumed, resumed_opt = _masters_outside_the_cast(level, how)
    resumed.load_state_dict(saved["model"])
    for name in names:  # loaded into the masters, not only into the 16-bit model
        assert torch.equal(resumed_opt.amp._master_of(resumed.get_parameter(name)), saved["model"][name]), name
    resumed_opt.load_state_dict(saved["opt"])
    amp.load_state_dict(saved["amp"])
    _train_masters_outside(resumed, resumed_opt, 10)
    for a, b in zip(masters, [p for group in resumed_opt.param_groups for p in group["params"]]):
        assert torch.equal(a, b)
    for name, value in model.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), name


def _ema_swap_run(level, cut=None, load_level=None, amp_first=False, **kwargs):
    """3 steps; EMA-like weights copied into the model for an evaluation, a checkpoint, the
    training weights copied back from their 16-bit backup (ClassyVision's EMA hook, saving in
    the test phase); 3 more steps.  With ``cut`` the last 3 steps run in a fresh model and
    optimizer loaded from the checkpoint, in apex's order: model, optimizer, amp."""
    def build(opt_level=level, **options):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        make = FusedAdam if options.get("master_weights") == "remainder" else torch.optim.Adam
        return amp.initialize(model, make(model.parameters(), lr=1e-2), opt_level=opt_level, verbosity=0, **options)

    def train(model, opt, steps):
        for step in steps:
            x = torch.randn(32, 8, generator=torch.Generator().manual_seed(step))
            opt.zero_grad()
            with amp.scale_loss((model(x).float() - x.sum(1, keepdim=True)).pow(2).mean(), opt) as scaled:
                scaled.backward()
            opt.step()

    model, opt = build()
    train(model, opt, range(3))
    backup = {name: p.detach().clone() for name, p in model.named_parameters()}  # 16-bit at O2/O5
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.9)
    checkpoint = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "amp": amp.state_dict()})
    if cut:
        model, opt = build(load_level or level, **kwargs)
        backup = {name: value.to(p.dtype) for (name, p), value in zip(model.named_parameters(), backup.values())}
        if amp_first:
            amp.load_state_dict(checkpoint["amp"])
        model.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["opt"])
        if not amp_first:
            amp.load_state_dict(checkpoint["amp"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(backup[name])
    train(model, opt, range(3, 6))
    return model.state_dict(), checkpoint


@pytest.mark.parametrize("level", LEVELS)
def test_a_checkpoint_saved_with_ema_weights_swapped_in_resumes_bit_for_bit(level):
    """From a review of ClassyVision: a checkpoint taken while EMA weights were in the model held
    them and not the FP32 masters behind them, so the resumed run went on from the 16-bit backup
    (5.5e-5 off at O2, 2.4e-4 at O5).  amp.state_dict() keeps those masters now."""
    uninterrupted, checkpoint = _ema_swap_run(level)
    resumed, _ = _ema_swap_run(level, cut=True)
    for name, value in uninterrupted.items():
        assert torch.equal(value, resumed[name]), name
    kept = checkpoint["amp"]["ampinit"].get("masters_behind_writes", {})
    assert sorted(kept) == (["0.bias", "0.weight", "2.bias", "2.weight"] if level in ("O2", "O5") else [])


def test_masters_behind_writes_that_match_no_master_leave_everything_untouched():
    _, checkpoint = _ema_swap_run("O2")
    model, opt = make_setup("O2")
    train_step(model, opt, 0)
    before = (opt.amp.state_dict(), [p.detach().clone() for p in amp.master_params(opt)])
    bad = copy.deepcopy(checkpoint["amp"])
    bad["ampinit"]["masters_behind_writes"] = {"no.such.weight": torch.zeros(3)}
    bad["ampinit"]["optimizers"] = before[0]["ampinit"]["optimizers"]
    with pytest.raises(ValueError, match="no.such.weight.*Nothing was loaded"):
        amp.load_state_dict(bad)
    assert opt.amp.state_dict() == before[0]
    assert all(torch.equal(a, b) for a, b in zip(amp.master_params(opt), before[1]))


@pytest.mark.parametrize("load_level, kwargs", [("O0", {}), ("O1", {}), ("O3", {}),
                                                ("O5", {"master_weights": "remainder"})])
def test_a_checkpoint_with_masters_behind_writes_loads_at_other_levels(load_level, kwargs, caplog):
    """From the review: the masters kept behind EMA weights made an O2 checkpoint refuse to load
    where other O2 checkpoints load (another level, remainder masters); there the model's values
    stand, as for any checkpoint, and that is logged."""
    with caplog.at_level("INFO", logger="ampinit"):
        resumed, _ = _ema_swap_run("O2", cut=True, load_level=load_level, **kwargs)
    assert "take the model's loaded values" in caplog.text
    assert all(torch.isfinite(value.float()).all() for value in resumed.values())


def test_amp_loaded_before_the_model_is_warned_about_the_masters_behind_writes(caplog):
    """Loading amp first, the model's load replaces the masters kept behind the EMA weights:
    training goes on from the EMA's 16-bit backup (1e-4 off at O2), which is now said."""
    uninterrupted, _ = _ema_swap_run("O2")
    with caplog.at_level("WARNING", logger="ampinit"):
        resumed, _ = _ema_swap_run("O2", cut=True, amp_first=True)
    assert "replaced FP32 masters that the amp.load_state_dict() before it" in caplog.text
    assert any(not torch.equal(value, resumed[name]) for name, value in uninterrupted.items())


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O4", "O5"])
def test_parameters_saved_as_tensors_load_with_weights_only(level):
    """TAPE saves ``list(amp.master_params(optimizer))``; others save ``list(model.parameters())``
    or ``model.state_dict(keep_vars=True)``.  torch pickles a parameter's ``__dict__`` with it,
    where ampinit marks the initializations holding it: ``torch.load``'s default
    ``weights_only=True`` refused ampinit's class there.  The loaded values are the saved ones, and
    a loaded parameter is held by nothing until it is initialized again."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    for saved in (list(amp.master_params(opt)), list(model.parameters()), model.state_dict(keep_vars=True)):
        buffer = io.BytesIO()
        torch.save(saved, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer)  # weights_only=True, torch's default
        values = saved.values() if isinstance(saved, dict) else saved
        got = loaded.values() if isinstance(loaded, dict) else loaded
        for before, after in zip(values, got):
            assert torch.equal(before.detach(), after.detach()) and before.dtype == after.dtype
    fresh = nn.Sequential(nn.Linear(4, 3))
    fresh[0].weight = loaded["0.weight"]  # a loaded parameter in a new model, initialized again
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1)
    fresh, fresh_opt = amp.initialize(fresh, fresh_opt, opt_level=level, verbosity=0)
    assert amp.handle_of(fresh[0]) is amp.handle_of(fresh_opt)


# -- the user's own state_dict hooks on submodules (F12) -----------------------------------------

def _hooked_pair(level, when, register):
    """An FP32 reference and a model initialized at ``level``, both with ``register(module)``
    called on a child and a grand-child (for the model, ``when``: before or after initialize)."""
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 6), nn.Sequential(nn.Linear(6, 2)))

    def hook_up(model):
        for module in (model[0], model[1][0]):
            register(module)

    reference, model = build(), build()
    hook_up(reference)
    if when == "before":
        hook_up(model)
    model, _ = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=level, verbosity=0)
    if when == "after":
        hook_up(model)
    return reference, model


def _fold(module, state_dict, prefix, local_metadata):  # an export fold
    state_dict[prefix + "weight"] = state_dict[prefix + "weight"] * 2.0


def _rename(module, state_dict, prefix, local_metadata):
    state_dict[prefix + "renamed"] = state_dict.pop(prefix + "weight")


def _to_half(module, state_dict, prefix, local_metadata):
    state_dict[prefix + "weight"] = state_dict[prefix + "weight"].half()


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3", "O4", "O5"])
@pytest.mark.parametrize("hook", [_fold, _rename, _to_half])
@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("api", ["public", "private"])
def test_a_submodules_state_dict_hooks_see_the_fp32_values(level, hook, when, api):
    """A submodule's state_dict post-hook (registered in its ``__init__``, before initialize)
    ran before ampinit's at O2/O5: a fold was overwritten by the unfolded master (0.39 off), a
    renamed key was skipped and saved 16-bit.  Now it sees the FP32 values, in any order, as on
    the FP32 model; a hook's own dtype choice (``.half()``) is kept."""
    def register(module):
        if api == "public":
            module.register_state_dict_post_hook(hook)
        else:
            module._register_state_dict_hook(lambda m, sd, p, lm: hook(m, sd, p, lm))

    reference, model = _hooked_pair(level, when, register)
    want, got = reference.state_dict(), model.state_dict()
    assert list(want) == list(got)
    for key in want:
        assert got[key].dtype == want[key].dtype, key
        # O3 keeps no masters: the 16-bit values, reported in the original dtype
        tolerance = 1e-3 if level == "O3" else 0
        torch.testing.assert_close(got[key].float(), want[key].float(), rtol=tolerance, atol=tolerance)


def _load_rename(module, state_dict, prefix, *args):  # a checkpoint from before a rename
    if prefix + "old_weight" in state_dict:
        state_dict[prefix + "weight"] = state_dict.pop(prefix + "old_weight")


def _load_halve(module, state_dict, prefix, *args):  # a weight stored times two
    state_dict[prefix + "weight"] = state_dict[prefix + "weight"] / 2.0


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O4", "O5"])
@pytest.mark.parametrize("hook", [_load_rename, _load_halve])
@pytest.mark.parametrize("when", ["before", "after"])
def test_a_submodules_load_pre_hooks_reach_the_masters(level, hook, when):
    """A submodule's load_state_dict pre-hook registered after initialize ran after ampinit's,
    which missed its renamed keys or read the values before the hook changed them: the masters
    took the 16-bit rounding (1e-4 off at O2, 1.4e-3 at O5).  Now the checkpoint's FP32 values,
    as the hooks leave them, reach the masters in any order, as on the FP32 model."""
    torch.manual_seed(1)
    source = nn.Sequential(nn.Linear(6, 6), nn.Sequential(nn.Linear(6, 2)))
    checkpoint = {key: value.clone() for key, value in source.state_dict().items()}
    for prefix in ("0.", "1.0."):
        if hook is _load_rename:
            checkpoint[prefix + "old_weight"] = checkpoint.pop(prefix + "weight")
        else:
            checkpoint[prefix + "weight"] = checkpoint[prefix + "weight"] * 2.0

    reference, model = _hooked_pair(level, when, lambda module: module.register_load_state_dict_pre_hook(hook))
    reference.load_state_dict(checkpoint)
    model.load_state_dict(checkpoint)
    want, got = reference.state_dict(), model.state_dict()
    for key in want:
        assert torch.equal(got[key], want[key]), key
