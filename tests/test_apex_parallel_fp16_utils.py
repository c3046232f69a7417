"""apex.parallel and apex.fp16_utils as ampinit provides them: DistributedDataParallel with
apex's arguments, SyncBatchNorm on the CPU, LARC, and FP16_Optimizer, each against a reference."""
import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from _ranks import WORLD, spawn
from torch import nn

import ampinit as amp
from ampinit.apex import fp16_utils, parallel

INF = float("inf")


def _shard(rank, n=8):
    g = torch.Generator().manual_seed(rank)
    return torch.randn(n, 6, generator=g), torch.randn(n, 3, generator=g)


def ddp_worker(rank, kwargs, out_dir):
    torch.manual_seed(rank)  # apex's DDP broadcasts rank 0's weights; so does torch's
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))
    model = parallel.convert_syncbn_model(model)  # apex's order: convert, initialize, wrap
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    ddp = parallel.DistributedDataParallel(model, **kwargs)
    x, y = _shard(rank)
    opt.zero_grad()
    with amp.scale_loss(((ddp(x).float() - y) ** 2).mean(), opt) as scaled:
        scaled.backward()
    grads = [p.grad.detach().clone() for p in amp.master_params(opt)]
    opt.step()
    torch.save({"grads": grads, "running_mean": model[1].running_mean.clone()},
               os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("kwargs, average", [
    ({}, True),
    ({"message_size": 10, "allreduce_always_fp32": True, "gradient_predivide_factor": 2.0}, True),
    ({"delay_allreduce": True, "gradient_average": False}, False),
])
def test_distributed_data_parallel_with_apex_arguments(kwargs, average, tmp_path):
    """2 ranks, different seeds and data, SyncBatchNorm on the CPU: the gradients equal one
    process's on the whole batch (averaged) or twice that (gradient_average=False)."""
    spawn(ddp_worker, kwargs, str(tmp_path))
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for a, b in zip(results[0]["grads"], results[1]["grads"]):
        assert torch.equal(a, b)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    xs, ys = zip(*(_shard(r) for r in range(WORLD)))
    x, y = torch.cat(xs), torch.cat(ys)
    # the whole batch through one batch norm; each rank's loss is a mean over its own shard
    out = model(x).float()
    loss = sum(((out[r * 8:(r + 1) * 8] - y[r * 8:(r + 1) * 8]) ** 2).mean() for r in range(WORLD))
    with amp.scale_loss(loss / WORLD * (1 if average else WORLD), opt) as scaled:
        scaled.backward()
    for got, want in zip(results[0]["grads"], amp.master_params(opt)):
        torch.testing.assert_close(got, want.grad, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(results[0]["running_mean"], model[1].running_mean, rtol=1e-3, atol=1e-4)


class _MaskHead(nn.Module):
    """A detection model's shape: a head used on some iterations only (maskrcnn's mask head)."""

    def __init__(self):
        super().__init__()
        self.body, self.mask_head = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x, use_mask):
        h = torch.tanh(self.body(x))
        return h.sum(dim=1, keepdim=True) + (self.mask_head(h) if use_mask else 0.0)


def unused_worker(rank, out_dir):
    torch.manual_seed(0)
    model = _MaskHead()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0, loss_scale=128.0)
    ddp = parallel.DistributedDataParallel(model, delay_allreduce=True)
    x, y = _shard(rank)
    for step in range(4):
        opt.zero_grad()
        with amp.scale_loss(((ddp(x, step % 2 == 0).float() - y) ** 2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
    torch.save([p.detach().clone() for p in model.parameters()], os.path.join(out_dir, f"rank{rank}.pt"))


def test_delay_allreduce_takes_parameters_unused_in_an_iteration(tmp_path):
    """DeepLearningExamples' MaskRCNN: ``DDP(model, delay_allreduce=True)`` over heads that some
    iterations leave without gradients.  apex all-reduced the gradients that exist at the end of
    the backward; torch's DDP raised at the second iteration.  Reference: one process on the
    whole batch (each rank's loss a mean over its shard)."""
    spawn(unused_worker, str(tmp_path))
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for a, b in zip(*results):
        assert torch.equal(a, b)
    torch.manual_seed(0)
    model = _MaskHead()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs, ys = zip(*(_shard(r) for r in range(WORLD)))
    for step in range(4):
        opt.zero_grad()
        sum(((model(x, step % 2 == 0) - y) ** 2).mean() for x, y in zip(xs, ys)).div(WORLD).backward()
        opt.step()
    for got, want in zip(results[0], model.parameters()):
        torch.testing.assert_close(got, want.detach(), rtol=1e-2, atol=1e-3)


def test_distributed_data_parallel_rejects_what_apex_rejected():
    with pytest.raises(ValueError, match="shared_param"):
        parallel.DistributedDataParallel(nn.Linear(2, 2), shared_param=True)
    with pytest.raises(ValueError, match="contradict"):
        parallel.DistributedDataParallel(nn.Linear(2, 2), delay_allreduce=True, allreduce_trigger_params=[])
    with pytest.raises(ValueError, match="message_size"):
        parallel.DistributedDataParallel(nn.Linear(2, 2), message_size=0)


def test_sync_batchnorm_in_one_process_is_batchnorm():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    converted = parallel.convert_syncbn_model(copy.deepcopy(plain))
    assert isinstance(converted[1], parallel.SyncBatchNorm)
    x = torch.randn(5, 3, 8, 8)
    torch.testing.assert_close(converted(x), plain(x))
    torch.testing.assert_close(converted[1].running_var, plain[1].running_var)
    converted.eval()
    plain.eval()
    torch.testing.assert_close(converted(x), plain(x))
    with pytest.raises(ValueError, match="channel_last"):
        parallel.SyncBatchNorm(4, channel_last=True)


def test_larc_matches_its_definition():
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(5))
    g = torch.randn(5)
    sgd = torch.optim.SGD([w], lr=0.5, weight_decay=0.01)
    larc = parallel.LARC(sgd, trust_coefficient=0.02, clip=True)
    w.grad = g.clone()
    before = w.detach().clone()
    larc.step()
    local = 0.02 * before.norm() / (g.norm() + before.norm() * 0.01 + 1e-8)
    local = min(local / 0.5, torch.tensor(1.0))
    expected = before - 0.5 * (g + 0.01 * before) * local
    torch.testing.assert_close(w.detach(), expected)
    assert sgd.param_groups[0]["weight_decay"] == 0.01  # restored after the step
    assert larc.param_groups is sgd.param_groups and larc.state is sgd.state


# -- fp16_utils ------------------------------------------------------------------------------------

def test_model_helpers():
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    half = fp16_utils.network_to_half(copy.deepcopy(net))
    assert half[1][0].weight.dtype == torch.float16 and half[1][1].weight.dtype == torch.float32
    assert half(torch.randn(5, 3)).dtype == torch.float16
    model_params, masters = fp16_utils.prep_param_lists(half)
    assert all(m.dtype == torch.float32 for m in masters) and len(masters) == len(model_params)
    half(torch.randn(5, 3)).float().sum().backward()
    fp16_utils.model_grads_to_master_grads(model_params, masters)
    assert all(torch.equal(m.grad, p.grad.float()) for p, m in zip(model_params, masters))
    with torch.no_grad():
        for m in masters:
            m.add_(1)
    fp16_utils.master_params_to_model_params(model_params, masters)
    assert all(torch.equal(p, m.to(p.dtype)) for p, m in zip(model_params, masters))
    flat_model = fp16_utils.convert_network(copy.deepcopy(net), torch.float16)
    model_params, (flat,) = fp16_utils.prep_param_lists(nn.Sequential(flat_model[0], flat_model[2]), flat_master=True)
    assert flat.numel() == sum(p.numel() for p in model_params) and flat.grad is not None
    assert fp16_utils.to_python_float(torch.tensor(3.0)) == 3.0


@pytest.mark.parametrize("dynamic", [False, True])
def test_fp16_optimizer_trains_like_ampinit_o2(dynamic):
    """apex's FP16_Optimizer loop (model.half(), optimizer.backward(loss), step) against the same
    model under ampinit's O2: the masters agree; an overflow is skipped."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    data = [(torch.randn(8, 6), torch.randn(8, 3)) for _ in range(6)]
    model = copy.deepcopy(base).half()
    opt = fp16_utils.FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                    static_loss_scale=128.0, dynamic_loss_scale=dynamic,
                                    dynamic_loss_args={"init_scale": 2.0 ** 10} if dynamic else None, verbose=False)
    ref = copy.deepcopy(base)
    ref, ref_opt = amp.initialize(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), opt_level="O2",
                                  loss_scale="dynamic" if dynamic else 128.0, verbosity=0,
                                  **({"init_scale": 2.0 ** 10} if dynamic else {}))
    for step, (x, y) in enumerate(data):
        poison = float("inf") if step == 2 else 1.0
        opt.zero_grad()
        opt.backward(((model(x.half()).float() - y) ** 2).mean() * poison)
        assert opt.overflow == (step == 2)
        opt.step()
        ref_opt.zero_grad()
        with amp.scale_loss(((ref(x).float() - y) ** 2).mean() * poison, ref_opt) as scaled:
            scaled.backward()
        ref_opt.step()
    for a, b in zip(opt.all_fp32_from_fp16_params, amp.master_params(ref_opt)):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3)
    assert opt.loss_scale == (2.0 ** 9 if dynamic else 128.0)
    # accumulation with update_master_grads=False, then a state_dict round trip
    opt.zero_grad()
    for x, y in data[:2]:
        opt.backward(((model(x.half()).float() - y) ** 2).mean(), update_master_grads=False)
    opt.update_master_grads()
    norm = opt.clip_master_grads(1.0)
    assert norm > 0
    opt.step()
    state = opt.state_dict()
    fresh = copy.deepcopy(base).half()
    opt2 = fp16_utils.FP16_Optimizer(torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9),
                                     static_loss_scale=128.0, dynamic_loss_scale=dynamic, verbose=False)
    opt2.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(opt.all_fp32_from_fp16_params, opt2.all_fp32_from_fp16_params))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    assert opt2.loss_scale == opt.loss_scale


@pytest.mark.parametrize("update_master_grads", [True, False])
@pytest.mark.parametrize("fused,plain", [("FusedAdam", "AdamW"), ("FusedSGD", "SGD")])
def test_fp16_optimizer_over_a_fused_optimizer_clips_like_over_torchs(fused, plain, update_master_grads):
    """Megatron's pattern, FP16_Optimizer(apex.optimizers.FusedAdam) + clip_master_grads: the
    fused kernel reads the model's gradients, so the masters' must be filled before the clip
    (they were left empty: the norm was 0 and nothing was clipped).  Reference: the same loop
    over the torch optimizer, which the fused one matches bit for bit without clipping."""
    import ampinit.optim

    def run(make):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)).half()
        opt = fp16_utils.FP16_Optimizer(make(model.parameters()), static_loss_scale=128.0, verbose=False)
        gen = torch.Generator().manual_seed(1)
        norms, grads = [], []
        for _ in range(6):
            x, y = torch.randn(16, 8, generator=gen).half(), torch.randn(16, 4, generator=gen)
            opt.zero_grad()
            opt.backward(((model(x).float() - y) ** 2).mean(), update_master_grads=update_master_grads)
            if not update_master_grads:
                opt.update_master_grads()
            grads.append([g.clone() for group in opt.inspect_master_grad_data() for g in group])
            norms.append(opt.clip_master_grads(1e-3))
            opt.step()
        return norms, grads, [p.detach().clone() for p in model.parameters()]

    kwargs = {"lr": 1e-2, "weight_decay": 0.0} if plain == "AdamW" else {"lr": 0.1, "momentum": 0.9}
    norms, grads, params = run(lambda ps: getattr(ampinit.optim, fused)(ps, **kwargs))
    ref_norms, ref_grads, ref_params = run(lambda ps: getattr(torch.optim, plain)(ps, **kwargs))
    assert norms == ref_norms and all(n > 1e-3 for n in norms)  # every step clipped
    for got, want in zip(grads, ref_grads):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    for got, want in zip(params, ref_params):
        torch.testing.assert_close(got, want, rtol=0, atol=2e-3)  # the kernels' arithmetic order


def test_fp16_optimizer_rejects_bad_input():
    with pytest.raises(TypeError):
        fp16_utils.FP16_Optimizer("sgd")
    model = nn.Linear(2, 2).half()
    # apex ignored dynamic_loss_args next to a static scale (from a review): so does ampinit
    static = fp16_utils.FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=128.0,
                                       dynamic_loss_args={"init_scale": 2.0}, verbose=False)
    assert static.loss_scale == 128.0
    amp.end(static.optimizer)
    with pytest.raises(ValueError, match="unknown"):
        fp16_utils.FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True,
                                  dynamic_loss_args={"bogus": 1})
    opt = fp16_utils.FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), verbose=False)
    with pytest.raises(NotImplementedError, match="closure"):
        opt.step(lambda: 0)
    with pytest.raises(RuntimeError, match="state_dict"):
        copy.deepcopy(opt)


# -- FP16_Optimizer checkpoints written by apex ----------------------------------------------------

# A stand-in for apex's own package, only as far as pickling needs: apex's FP16_Optimizer.state_dict()
# holds its scaler object, whose class lives in apex.fp16_utils.loss_scaler.
_FAKE_APEX_SCALERS = """
class LossScaler:
    def __init__(self, scale=1):
        self.cur_scale = scale

class DynamicLossScaler:
    def __init__(self, init_scale=2**32, scale_factor=2., scale_window=1000):
        self.cur_scale = init_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = scale_factor
        self.scale_window = scale_window
"""

_WRITE_APEX_CHECKPOINT = """
import sys, torch
from torch import nn
from apex.fp16_utils.loss_scaler import DynamicLossScaler, LossScaler
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).half()
masters = [[p.detach().float() + 0.01 for p in model[0].parameters()],
           [p.detach().float() - 0.01 for p in model[1].parameters()]]
inner = torch.optim.SGD([{"params": masters[0]}, {"params": masters[1], "lr": 0.05}], lr=0.1, momentum=0.9)
for group in masters:
    for p in group:
        inner.state[p]["momentum_buffer"] = torch.full_like(p, 0.5)
if sys.argv[2] == "dynamic":
    scaler = DynamicLossScaler(init_scale=2**32, scale_factor=4.0, scale_window=8)
    scaler.cur_scale, scaler.cur_iter, scaler.last_overflow_iter = 512.0, 40, 30
else:
    scaler = LossScaler(128.0)
torch.save({"model": model.state_dict(),
            "optimizer": {"loss_scaler": scaler, "dynamic_loss_scale": sys.argv[2] == "dynamic", "overflow": False,
                          "first_closure_call_this_step": True, "optimizer_state_dict": inner.state_dict(),
                          "fp32_from_fp16": masters}}, sys.argv[1])
"""


def _apex_checkpoint(tmp_path, kind):
    """Written in a separate process where ``apex`` is the stand-in above, so that the pickle
    names apex's module, as a real apex checkpoint does."""
    package = tmp_path / "fakeapex" / "apex" / "fp16_utils"
    package.mkdir(parents=True)
    (package.parent / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "loss_scaler.py").write_text(_FAKE_APEX_SCALERS)
    path = tmp_path / f"apex_{kind}.pt"
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(_WRITE_APEX_CHECKPOINT), str(path), kind],
                            env=dict(os.environ, PYTHONPATH=str(tmp_path / "fakeapex")), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return path


@pytest.fixture
def apex_alias():
    amp.install_apex_alias()
    yield
    amp.uninstall_apex_alias()


def _apex_dynamic_scales(scale, cur_iter, last_overflow_iter, factor, window, overflows):
    """apex's DynamicLossScaler.update_scale, written out: the scale after each update."""
    scales = []
    for overflow in overflows:
        if overflow:
            scale, last_overflow_iter = max(scale / factor, 1), cur_iter
        elif (cur_iter - last_overflow_iter) % window == 0:
            scale *= factor
        cur_iter += 1
        scales.append(scale)
    return scales


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_fp16_optimizer_loads_an_apex_checkpoint(tmp_path, apex_alias, kind):
    """The pickled scaler unpickles through apex.fp16_utils.loss_scaler, the per-group
    fp32_from_fp16 lists load, and the scale then moves as apex's scaler object would."""
    checkpoint = torch.load(_apex_checkpoint(tmp_path, kind), weights_only=False)
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).half()
    inner = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 0.05}],
                            lr=0.1, momentum=0.9)
    opt = fp16_utils.FP16_Optimizer(inner, static_loss_scale=1.0, dynamic_loss_scale=kind == "dynamic",
                                    verbose=False)
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["optimizer"])
    saved = [m for group in checkpoint["optimizer"]["fp32_from_fp16"] for m in group]
    for master, value, param in zip(opt.all_fp32_from_fp16_params, saved, model.parameters()):
        assert torch.equal(master, value) and torch.equal(param, value.half())
        assert torch.equal(opt.state[master]["momentum_buffer"], torch.full_like(value, 0.5))
    assert opt.loss_scale == (512.0 if kind == "dynamic" else 128.0)
    # the counters go on from the checkpoint's (apex's static LossScaler has none)
    first = 40 if kind == "dynamic" else 0
    assert (opt.loss_scaler.cur_iter, opt.loss_scaler.last_overflow_iter) == ((40, 30) if kind == "dynamic"
                                                                              else (0, -1))

    overflows = [False] * 7 + [True] + [False] * 9
    x = torch.randn(5, 4).half()
    scales = []
    for overflow in overflows:
        opt.zero_grad()
        opt.backward(model(x).float().pow(2).mean() * (float("inf") if overflow else 1.0))
        opt.step()
        scales.append(opt.loss_scale)
    expected = _apex_dynamic_scales(512.0, 40, 30, 4.0, 8, overflows) if kind == "dynamic" else [128.0] * 17
    assert scales == expected
    assert (opt.loss_scaler.cur_iter, opt.loss_scaler.last_overflow_iter) == (first + 17, first + 7)
    other = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).half()
    resumed = fp16_utils.FP16_Optimizer(
        torch.optim.SGD([{"params": other[0].parameters()}, {"params": other[1].parameters(), "lr": 0.05}], lr=0.1,
                        momentum=0.9), verbose=False, dynamic_loss_scale=kind == "dynamic", static_loss_scale=1.0)
    resumed.load_state_dict(opt.state_dict())  # ampinit's own checkpoint keeps them too
    assert (resumed.loss_scaler.cur_iter, resumed.loss_scaler.last_overflow_iter) == (first + 17, first + 7)
    for bad in ({"cur_iter": -1}, {"cur_iter": 3, "last_overflow_iter": 3}, {"cur_iter": 2.5}):
        with pytest.raises(ValueError, match="cur_iter|last_overflow_iter"):
            resumed.load_state_dict({**opt.state_dict(), **bad})
    assert resumed.loss_scaler.cur_iter == first + 17


def test_fp16_optimizer_refuses_an_apex_scaler_of_the_other_kind(tmp_path, apex_alias):
    checkpoint = torch.load(_apex_checkpoint(tmp_path, "dynamic"), weights_only=False)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).half()
    opt = fp16_utils.FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                    static_loss_scale=128.0, verbose=False)
    with pytest.raises(ValueError, match="dynamic_loss_scale=True"):
        opt.load_state_dict(checkpoint["optimizer"])


@pytest.mark.parametrize("args, steps, planted", [
    (None, 3, {0}),
    ({"scale_window": 4}, 12, {1}),
    ({"init_scale": 2 ** 10, "scale_factor": 4.0, "scale_window": 3}, 10, {0, 5}),
    ({"init_scale": 4.0, "scale_window": 100}, 6, {0, 1, 2, 3}),
    ({"init_scale": 2 ** 10, "scale_factor": 3.0, "scale_window": 2}, 8, {2}),
], ids=["defaults", "window", "factor-4", "floor", "factor-3"])
@pytest.mark.parametrize("backwards", [1, 2], ids=["one_backward", "two_backwards"])
def test_fp16_optimizer_dynamic_scale_follows_apex(args, steps, planted, backwards):
    """The scale after each step against apex's DynamicLossScaler rule written out in the test
    (back off to max(scale / scale_factor, 1), grow by scale_factor after scale_window clean
    steps; defaults 2**32, 2, 1000).  The loss is tiny, so only the planted infs overflow.
    apex updated it once per step(): with two backwards per step (OpenNMT's accum_count=2) it
    grew twice as fast, and halved twice on a step whose two backwards both overflowed."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4).half()
    opt = fp16_utils.FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.01), dynamic_loss_scale=True,
                                    dynamic_loss_args=args, verbose=False)
    defaults = {"init_scale": 2 ** 32, "scale_factor": 2.0, "scale_window": 1000}
    defaults.update(args or {})
    assert opt.loss_scale == defaults["init_scale"]
    x = torch.randn(8, 4).half()
    overflows, scales = [], []
    apex_scaler = fp16_utils.DynamicLossScaler(**defaults)  # apex's host-side class, driven alike
    for step in range(steps):
        opt.zero_grad()
        for _ in range(backwards):
            loss = model(x).float().pow(2).mean() * 1e-12
            opt.backward(loss * (float("inf") if step in planted else 1.0))
        overflows.append(opt.overflow)
        opt.step()
        scales.append(opt.loss_scale)
        apex_scaler.update_scale(overflows[-1])
        live = opt.loss_scaler  # apex code reads optimizer.loss_scaler.cur_scale
        assert (live.cur_scale, live.loss_scale, live.cur_iter, live.last_overflow_iter) == \
            (apex_scaler.cur_scale, apex_scaler.loss_scale, apex_scaler.cur_iter, apex_scaler.last_overflow_iter)
        assert (live.scale_factor, live.scale_window) == (apex_scaler.scale_factor, apex_scaler.scale_window)
    assert overflows == [step in planted for step in range(steps)]
    expected = _apex_dynamic_scales(defaults["init_scale"], 0, -1, defaults["scale_factor"],
                                    defaults["scale_window"], overflows)
    assert scales == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused_sgd"])
def test_fp16_optimizer_overflow_stays_set_after_the_skipped_step(fused):
    """Megatron's loop: `optimizer.step(); if not optimizer.overflow: lr_scheduler.step()`.  apex
    keeps `overflow` from the backward through step() and zero_grad() until the next backward
    unscales: the LR schedule must not advance on a skipped step."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1).half()
    inner = (amp.optim.FusedSGD if fused else torch.optim.SGD)(model.parameters(), lr=0.1)
    opt = fp16_utils.FP16_Optimizer(inner, dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 2 ** 10},
                                    verbose=False)
    sched = torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=1, gamma=0.5)
    x = torch.randn(8, 4).half()
    seen = []
    for it in range(5):
        opt.zero_grad()
        after_zero_grad = opt.overflow
        loss = model(x).float().pow(2).mean() * (float("inf") if it == 2 else 1.0)
        opt.backward(loss)
        opt.step()
        seen.append((after_zero_grad, opt.overflow))
        if not opt.overflow:
            sched.step()
    assert seen == [(False, False), (False, False), (False, True), (True, False), (False, False)]
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 4) and opt.loss_scale == 2 ** 9
    # apex's state_dict carries the flag, and its load_state_dict restores it
    saved_after_skip = None
    opt.zero_grad()
    opt.backward(model(x).float().pow(2).mean() * float("inf"))
    opt.step()
    saved_after_skip = copy.deepcopy(opt.state_dict())
    assert saved_after_skip["overflow"] is True
    opt.zero_grad()
    opt.backward(model(x).float().pow(2).mean())
    opt.step()
    clean = copy.deepcopy(opt.state_dict())
    opt.load_state_dict(saved_after_skip)
    assert opt.overflow is True
    opt.load_state_dict(clean)
    assert opt.overflow is False


def test_fp16_optimizer_loss_scaler_attribute_is_live_and_settable():
    """apex code sets the scale through the scaler object (``optimizer.loss_scaler.cur_scale = s``)
    and reads it back; driving it by hand (``update_scale``) would double the optimizer's own."""
    model = nn.Linear(4, 1).half()
    opt = fp16_utils.FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=128.0,
                                    verbose=False)
    assert opt.loss_scaler.cur_scale == 128.0 and not opt.loss_scaler.dynamic
    opt.loss_scaler.cur_scale = 64.0
    assert opt.loss_scale == 64.0 and opt.loss_scaler.loss_scale == 64.0
    with pytest.raises(RuntimeError, match="updates its loss scale in step"):
        opt.loss_scaler.update_scale(False)
    assert opt.loss_scale == 64.0


def test_fp16_optimizer_bad_scale_factor():
    model = nn.Linear(2, 2).half()
    with pytest.raises(ValueError, match="scale_factor"):
        fp16_utils.FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True,
                                  dynamic_loss_args={"scale_factor": 0.5})


def test_apex_dynamic_loss_scaler_class_follows_apex():
    """apex.fp16_utils.loss_scaler.DynamicLossScaler used by hand: the same rule, its attributes."""
    from ampinit.apex.loss_scaler import DynamicLossScaler, LossScaler
    scaler = DynamicLossScaler(init_scale=8.0, scale_factor=2.0, scale_window=3)
    overflows = [True, True, True, True, False, False, False, False, True, False, False, False]
    scales = []
    for overflow in overflows:
        scaler.update_scale(overflow)
        scales.append(scaler.loss_scale)
    assert scales == _apex_dynamic_scales(8.0, 0, -1, 2.0, 3, overflows)
    assert (scaler.cur_iter, scaler.last_overflow_iter) == (12, 8)
    p = nn.Parameter(torch.ones(2))
    p.grad = torch.tensor([1.0, float("nan")])
    assert scaler.has_overflow([p]) and not LossScaler(4.0).has_overflow([p]) and LossScaler(4.0).loss_scale == 4.0
    # apex's staticmethod, called on the class (Megatron-era checks of a reduced loss)
    assert not LossScaler._has_inf_or_nan(torch.tensor([float("nan")]))  # the static one never overflows
    assert DynamicLossScaler._has_inf_or_nan(torch.tensor([1.0, float("inf")]))
    assert not DynamicLossScaler._has_inf_or_nan(torch.ones(3))


def test_fp16_optimizer_has_apexs_group_lists():
    """apex's public per-group lists (``fp16_groups``, ``fp32_from_fp16_groups``,
    ``fp32_from_fp32_groups``) and ``dynamic_loss_scale``: each master beside its model
    parameter, a FP32 parameter on its own, group by group (they raised AttributeError)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).half()
    model[1].bias.data = model[1].bias.data.float()  # a FP32 parameter among fp16 ones
    opt = fp16_utils.FP16_Optimizer(torch.optim.SGD([{"params": model[0].parameters()},
                                                     {"params": model[1].parameters(), "lr": 0.5}], lr=0.1),
                                    dynamic_loss_scale=True, verbose=False)
    assert opt.dynamic_loss_scale
    assert [len(g) for g in opt.fp16_groups] == [2, 1] and [len(g) for g in opt.fp32_from_fp32_groups] == [0, 1]
    assert opt.fp16_groups[1][0] is model[1].weight and opt.fp32_from_fp32_groups[1][0] is model[1].bias
    for fp16, fp32 in zip(sum(opt.fp16_groups, []), sum(opt.fp32_from_fp16_groups, [])):
        assert fp32.dtype == torch.float32 and torch.equal(fp32, fp16.float())
    assert all(a is b for a, b in zip(sum(opt.fp32_from_fp16_groups, []), opt.all_fp32_from_fp16_params))


def test_fp16_optimizer_state_dict_lays_out_live_masters_per_group_as_apex():
    """From a review of sparse_learning (Masking.init_optimizer zips model.named_parameters() with
    optimizer.state_dict()['fp32_from_fp16'][0] and masks those masters in place): ampinit saved
    one flat list of clones, so the zip paired names with the wrong tensors, or raised."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5)).half()
    inner = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.01}],
                            lr=0.1, momentum=0.9)
    opt = fp16_utils.FP16_Optimizer(inner, dynamic_loss_scale=True, verbose=False)
    saved = opt.state_dict()["fp32_from_fp16"]
    assert [[tuple(t.shape) for t in group] for group in saved] == [[(64, 20), (64,)], [(5, 64), (5,)]]
    assert all(a is b for group, mine in zip(saved, opt.fp32_from_fp16_groups) for a, b in zip(group, mine))


def test_fp16_optimizer_wrapped_before_model_half_resumes_bit_for_bit():
    """sparse_learning's order: FP16_Optimizer over FP32 parameters, then model.half().  The masters
    come at the first backward, so a fresh optimizer loading a checkpoint before its first step
    had none and refused it as mismatched; apex's own checkpoint of that order has no masters."""
    g = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(12, 16, 8, generator=g), torch.randn(12, 16, 2, generator=g)

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        opt = fp16_utils.FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                        dynamic_loss_scale=True, dynamic_loss_args={"init_scale": 1024.0},
                                        verbose=False)
        return model.half(), opt

    def train(model, opt, steps):
        for i in steps:
            opt.zero_grad()
            opt.backward(((model(xs[i].half()).float() - ys[i]) ** 2).mean())
            opt.step()

    def uninterrupted(round_masters_at_6):
        model, opt = build()
        train(model, opt, range(6))
        if round_masters_at_6:  # what a checkpoint without masters leaves: the model's rounding
            with torch.no_grad():
                for master in opt.all_fp32_from_fp16_params:
                    master.copy_(master.half())
        train(model, opt, range(6, 12))
        return [p.detach().clone() for p in model.parameters()]

    model, opt = build()
    train(model, opt, range(6))
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    for checkpoint, rounded in ((saved["opt"], False), (dict(saved["opt"], fp32_from_fp16=[[]]), True)):
        resumed, resumed_opt = build()  # ours, then apex's layout of that order (no masters)
        resumed.load_state_dict(saved["model"])
        resumed_opt.load_state_dict(copy.deepcopy(checkpoint))  # torch.optim trains the loaded tensors in place
        train(resumed, resumed_opt, range(6, 12))
        assert all(torch.equal(a, b) for a, b in zip(uninterrupted(rounded), resumed.parameters()))


@pytest.mark.parametrize("wrapper", ["fp16_utils", "optimizers"])
def test_fp16_optimizer_resume_setting_dynamic_loss_scale_again_as_unilm_does(wrapper):
    """UniLM-v1's run_seq2seq.py (and its forks) resume with ``optimizer.load_state_dict(saved)``
    then ``optimizer.dynamic_loss_scale = True``: apex's plain attribute, set to what it was.
    Switching a static scale to dynamic that way is refused, nothing changed."""
    from ampinit.apex import optimizers as apex_optimizers
    g = torch.Generator().manual_seed(2)
    xs, ys = torch.randn(8, 16, 6, generator=g), torch.randn(8, 16, 3, generator=g)

    def build(dynamic=True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).half()
        if wrapper == "optimizers":
            inner = apex_optimizers.FusedAdam(model.parameters(), lr=1e-2, bias_correction=False, max_grad_norm=1.0)
            return model, apex_optimizers.FP16_Optimizer(inner, dynamic_loss_scale=dynamic, verbose=False)
        inner = torch.optim.Adam(model.parameters(), lr=1e-2)
        return model, fp16_utils.FP16_Optimizer(inner, dynamic_loss_scale=dynamic, verbose=False)

    def train(model, opt, steps):
        for i in steps:
            opt.zero_grad()
            opt.backward(((model(xs[i].half()).float() - ys[i]) ** 2).mean() * (INF if i == 2 else 1.0))
            opt.step()

    straight, straight_opt = build()
    train(straight, straight_opt, range(8))
    model, opt = build()
    train(model, opt, range(4))
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    model, opt = build()
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    opt.dynamic_loss_scale = True
    train(model, opt, range(4, 8))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), straight.parameters()))
    assert opt.loss_scale == straight_opt.loss_scale

    static_model, static = build(dynamic=False)
    static.dynamic_loss_scale = False
    with pytest.raises(ValueError, match="static, chosen at construction.*dynamic_loss_scale=True"):
        static.dynamic_loss_scale = True
    assert not static.dynamic_loss_scale and static.loss_scale == 1.0


def test_fp16_optimizer_checkpoint_carries_the_dynamic_schedule():
    """apex's checkpoint pickled its DynamicLossScaler, scale_factor and scale_window with it, and
    a load replaced the optimizer's: this class's own checkpoint carries them too, so a run with
    dynamic_loss_args resumed into an optimizer built with the defaults keeps its schedule."""
    g = torch.Generator().manual_seed(4)
    xs, ys = torch.randn(12, 16, 6, generator=g), torch.randn(12, 16, 3, generator=g)
    args = {"init_scale": 256.0, "scale_factor": 4.0, "scale_window": 3}

    def build(dynamic_loss_args):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).half()
        return model, fp16_utils.FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.05), dynamic_loss_scale=True,
                                                dynamic_loss_args=dynamic_loss_args, verbose=False)

    def train(model, opt, steps, scales):
        for i in steps:
            opt.zero_grad()
            opt.backward(((model(xs[i].half()).float() - ys[i]) ** 2).mean() * (INF if i == 4 else 1.0))
            opt.step()
            scales.append(opt.loss_scale)

    straight, straight_opt = build(args)
    want = []
    train(straight, straight_opt, range(12), want)
    model, opt = build(args)
    got = []
    train(model, opt, range(5), got)
    for first, last in ((5, 8), (8, 12)):  # twice: the resumed optimizer's own checkpoint carries them on
        saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
        model, opt = build(None)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        train(model, opt, range(first, last), got)
    assert got == want and len(set(want)) == 3  # grown twice (4x), backed off once
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), straight.parameters()))
    static_model, static = build(None)
    static_saved = fp16_utils.FP16_Optimizer(torch.optim.SGD(static_model.parameters(), lr=0.05),
                                             static_loss_scale=8.0, verbose=False).state_dict()
    assert "scale_window" not in static_saved
    from ampinit.apex.loss_scaler import DynamicLossScaler
    before = copy.deepcopy(opt.optimizer.state_dict())
    bad_scaler = DynamicLossScaler(init_scale=64.0, scale_factor=2.0, scale_window=3)
    bad_scaler.scale_factor = float("nan")  # what unpickling a corrupt apex scaler gives: no __init__ checks
    for bad, match in ((dict(saved["opt"], scale_window=0), "scale_window must be an int in"),
                       (dict(saved["opt"], scale_window=2 ** 31), "scale_window must be an int in"),
                       (dict(saved["opt"], scale_factor=float("nan")), "scale_factor must be a finite number"),
                       (dict(saved["opt"], loss_scaler=bad_scaler), "scale_factor must be a finite number")):
        with pytest.raises(ValueError, match=match):  # refused before anything changed (G16)
            opt.load_state_dict(copy.deepcopy(bad))
        assert opt.loss_scaler.scale_window == 3 and opt.loss_scaler.scale_factor == 4.0
        assert str(opt.optimizer.state_dict()) == str(before)


def test_a_static_fp16_optimizers_scaler_has_no_growth_schedule():
    # apex's static LossScaler had no scale_factor/scale_window; reading 2.0 and 1000 here
    # said a scale that never changes would grow
    model = nn.Linear(4, 3).half()
    opt = fp16_utils.FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=8.0,
                                    verbose=False)
    for name in ("scale_factor", "scale_window"):
        with pytest.raises(AttributeError, match=f"static loss scale has no {name}.*dynamic_loss_scale=True"):
            getattr(opt.loss_scaler, name)
    with pytest.raises(AttributeError, match="static loss scale has no scale_window"):
        opt.loss_scaler.scale_window = 10
    assert opt.loss_scaler.cur_iter == 0 and opt.loss_scaler.last_overflow_iter == -1
    assert opt.loss_scaler.cur_scale == 8.0 and not opt.loss_scaler.dynamic
    dynamic = fp16_utils.FP16_Optimizer(torch.optim.SGD(nn.Linear(4, 3).half().parameters(), lr=0.1),
                                        dynamic_loss_scale=True, dynamic_loss_args={"scale_window": 7},
                                        verbose=False)
    dynamic.loss_scaler.scale_window = 9
    assert (dynamic.loss_scaler.scale_factor, dynamic.loss_scaler.scale_window) == (2.0, 9)
