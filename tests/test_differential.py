"""The differential suite: one small training script run under ampinit and under a reference
written in plain PyTorch, compared after every run.

The reference is the behaviour ampinit promises, implemented the obvious way and nowhere
near ampinit's code: the model cast by hand (batch norm kept in FP32 at O2/O5), FP32 master
copies the optimizer updates, ``torch.autocast`` around the forward at O1/O4, each loss scaled
by its own scale and unscaled into the masters after its backward (``g.float() * (1/scale)``),
a step skipped when any of its gradients is inf/NaN, the scale halved on an overflow, gradients
cleared exactly as the script clears them.  Its optimizers are ``torch.optim``'s.

The script is the same for both (``run_script``): the matrix is patterns x levels x
optimizers (plain, foreach, fused, ampinit.optim) x zero_grad styles x scheduler order, the
last three cycled so that each pattern and level meets every optimizer, style and order.
A first frozen layer that no optimizer holds runs under every case.
"""
import itertools

import pytest
import torch
from torch import nn

import ampinit as amp
from ampinit import optim as amp_optim
from conftest import ZERO_STYLES, clear_grads

LEVELS = ["O0", "O1", "O2", "O3", "O4", "O5"]
CAST = {"O2": torch.float16, "O3": torch.float16, "O5": torch.bfloat16}
AUTOCAST = {"O1": torch.float16, "O4": torch.bfloat16}
DYNAMIC = {"O1", "O2"}
MASTERS = {"O2", "O5"}
STEPS, POISON_STEP, EXCEPTION_STEP = 6, 3, 2

# name -> (optimizer for ampinit, the torch.optim reference)
OPTIMIZERS = {
    "sgd": (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4),) * 2,
    "adam_foreach": (lambda p: torch.optim.Adam(p, lr=1e-2, eps=1e-3, foreach=True),) * 2,
    "adamw_fused": (lambda p: torch.optim.AdamW(p, lr=1e-2, eps=1e-3, fused=True),) * 2,
    # torch's fused AdamW as the reference: FP32 math on fp16 parameters too (O3), as ampinit's
    "ampinit_fused": (lambda p: amp_optim.FusedAdam(p, lr=1e-2, eps=1e-3, weight_decay=1e-2),
                      lambda p: torch.optim.AdamW(p, lr=1e-2, eps=1e-3, weight_decay=1e-2, fused=True)),
}
SCHEDULES = ["none", "before", "after"]
PATTERNS = ["plain", "two_losses", "accumulate_delayed", "accumulate", "clip", "exception", "overflow", "clamp",
            "clamp_masters"]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.trunk = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh())
        self.head_a = nn.Linear(16, 3)
        self.head_b = nn.Linear(16, 2)

    def forward(self, x):
        h = self.trunk(self.frozen(x))
        return self.head_a(h), self.head_b(h)


def data(step, micro=0):
    g = torch.Generator().manual_seed(100 * step + micro)
    return torch.randn(12, 6, generator=g), torch.randn(12, 3, generator=g), torch.randn(12, 2, generator=g)


# -- the two implementations of the same API ---------------------------------------------------------

class Ampinit:
    """The script's calls, through ampinit."""

    def __init__(self, model, make_opt, level, schedule, num_losses):
        opt = make_opt([p for p in model.parameters() if p.requires_grad])
        self.sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if schedule == "before" else None
        self.model, self.opt = amp.initialize(model, opt, opt_level=level, num_losses=num_losses, verbosity=0)
        if schedule == "after":
            self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=2, gamma=0.5)

    def forward(self, x):
        a, b = self.model(x)
        return a, b

    def backward(self, loss, loss_id=0, delay=False, fail=False):
        with amp.scale_loss(loss, self.opt, loss_id=loss_id, delay_unscale=delay) as scaled:
            scaled.backward()
            if fail:
                raise KeyboardInterrupt

    def zero_grad(self, style):
        clear_grads(style, self.model, self.opt)

    def clip(self, max_norm):
        return torch.nn.utils.clip_grad_norm_(amp.master_params(self.opt), max_norm)

    def step(self):
        self.opt.step()
        if self.sched is not None:
            self.sched.step()

    def clamp(self, bound):
        """WGAN's weight clipping, the classic way: through ``.data`` (no version counter)."""
        for p in self.model.parameters():
            if p.requires_grad:
                p.data.clamp_(-bound, bound)

    def clamp_masters(self, bound):
        """The apex way at O2: clip the FP32 masters (the model gets them at the next step)."""
        for p in amp.master_params(self.opt):
            p.data.clamp_(-bound, bound)

    def result(self):
        return {"masters": [p.detach().float().clone() for p in amp.master_params(self.opt)],
                "model": {k: v.detach().float().clone() for k, v in self.model.state_dict().items()},
                "params": [p.detach().float().clone() for p in self.model.parameters()],
                "skipped": self.opt.amp.skipped_steps,
                "scales": [s.loss_scale() for s in self.opt.amp.loss_scalers]}


class Reference:
    """The same calls in plain PyTorch (see the module docstring)."""

    def __init__(self, model, make_opt, level, schedule, num_losses):
        self.model, self.level = model, level
        self.cast, self.autocast = CAST.get(level), AUTOCAST.get(level)
        fp32 = {p: p.detach().clone() for p in model.parameters()}
        if self.cast is not None:
            for module in model.modules():
                if isinstance(module, nn.BatchNorm1d) and level != "O3":
                    continue  # keep_batchnorm_fp32
                for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
                    if t.is_floating_point():
                        t.data = t.data.to(self.cast)
        self.master_of = {p: nn.Parameter(fp32[p]) for p in model.parameters()
                          if level in MASTERS and p.dtype != torch.float32}
        self.fp32_frozen = {name: fp32[p] for name, p in model.named_parameters() if not p.requires_grad}
        self.trained = [p for p in model.parameters() if p.requires_grad]
        self.opt = make_opt([self.master_of.get(p, p) for p in self.trained])
        self.sched = None if schedule == "none" else torch.optim.lr_scheduler.StepLR(self.opt, 2, gamma=0.5)
        self.scales = [2.0 ** 16 if level in DYNAMIC else 1.0] * num_losses
        self.found_inf = False
        self.skipped = 0

    def forward(self, x):
        if self.autocast is not None:
            with torch.autocast("cpu", dtype=self.autocast):
                a, b = self.model(x)
        else:
            a, b = self.model(x.to(self.cast) if self.cast is not None else x)
        return a.float(), b.float()

    def _grad(self, p):
        return self.master_of[p].grad if p in self.master_of else p.grad

    def _set_grad(self, p, value):
        if p in self.master_of:
            self.master_of[p].grad = value
        else:
            p.grad = value

    def backward(self, loss, loss_id=0, delay=False, fail=False):
        if not getattr(self, "_pending", False):
            self._stash = {p: self._grad(p) for p in self.trained}
            for p in self.trained:
                self._set_grad(p, None)
                p.grad = None
        (loss.float() * self.scales[loss_id]).backward()
        self._pending = delay
        if not delay:
            inv = torch.tensor(1.0 / self.scales[loss_id], dtype=torch.float64).float()
            bad = False
            for p in self.trained:
                new = p.grad
                p.grad = None
                old = self._stash[p]
                if new is None:
                    self._set_grad(p, old)
                    continue
                unscaled = new.float() * inv
                bad |= not bool(torch.isfinite(unscaled).all())
                unscaled = unscaled.to(p.dtype if p not in self.master_of else torch.float32)
                self._set_grad(p, unscaled if old is None else old + unscaled)
            if bad:
                self.found_inf = True
                if self.level in DYNAMIC:
                    self.scales[loss_id] = max(self.scales[loss_id] / 2, 2.0 ** -24)
        if fail:
            raise KeyboardInterrupt

    def zero_grad(self, style):
        to_none = style in ("opt", "model", "grad_none")
        for p in self.trained:
            grad = self._grad(p)
            if to_none:
                self._set_grad(p, None)
            elif grad is not None:
                grad.zero_()
        # ampinit forgets an overflow when the gradients that had it are cleared, or zeroed
        # through the optimizer; zeroing only the model's gradients keeps it (the next
        # step is skipped, with a warning): a conservative difference from FP32.
        if style not in ("model_zeros", "grad_data_zero", "grad_zeros_like"):
            self.found_inf = False

    def clip(self, max_norm):
        return torch.nn.utils.clip_grad_norm_([self.master_of.get(p, p) for p in self.trained], max_norm)

    def step(self):
        if self.found_inf:
            self.skipped += 1
            for p in self.trained:
                self._set_grad(p, None)
        else:
            self.opt.step()
            with torch.no_grad():
                for p, master in self.master_of.items():
                    p.copy_(master)
        self.found_inf = False
        if self.sched is not None:
            self.sched.step()

    def clamp(self, bound):
        with torch.no_grad():
            for p in self.trained:
                self.master_of.get(p, p).clamp_(-bound, bound)
                p.copy_(self.master_of.get(p, p))

    def clamp_masters(self, bound):
        with torch.no_grad():
            for p in self.trained:
                self.master_of.get(p, p).clamp_(-bound, bound)

    def result(self):
        state = {k: v.detach().float().clone() for k, v in self.model.state_dict().items()}
        for name, p in self.model.named_parameters():
            if p in self.master_of:
                state[name] = self.master_of[p].detach().clone()
        state.update({k: v.clone() for k, v in self.fp32_frozen.items()})
        return {"masters": [self.master_of.get(p, p).detach().float().clone() for p in self.trained],
                "model": state, "params": [p.detach().float().clone() for p in self.model.parameters()],
                "skipped": self.skipped, "scales": list(self.scales)}


# -- the script -----------------------------------------------------------------------------------

def loss_of(outputs, ya, yb, which="both"):
    a, b = outputs
    la, lb = ((a - ya) ** 2).mean(), ((b - yb) ** 2).mean()
    return {"a": la, "b": lb, "both": la + lb}[which]


def run_script(api_cls, pattern, level, optimizer, style, schedule):
    torch.manual_seed(0)
    model = Net()
    make_opt = OPTIMIZERS[optimizer][0 if api_cls is Ampinit else 1]
    api = api_cls(model, make_opt, level, schedule, num_losses=2 if pattern == "two_losses" else 1)
    for step in range(STEPS):
        api.zero_grad(style)
        x, ya, yb = data(step)
        if pattern == "two_losses":
            api.backward(loss_of(api.forward(x), ya, yb, "a"), loss_id=0)
            api.backward(loss_of(api.forward(x), ya, yb, "b"), loss_id=1)
        elif pattern in ("accumulate_delayed", "accumulate"):
            for micro in range(3):
                xm, yam, ybm = data(step, micro + 1)
                api.backward(loss_of(api.forward(xm), yam, ybm) / 3,
                             delay=pattern == "accumulate_delayed" and micro < 2)
        elif pattern == "exception" and step == EXCEPTION_STEP:
            try:  # the interrupted backward's gradients stay, as they would without amp
                api.backward(loss_of(api.forward(x), ya, yb), fail=True)
            except KeyboardInterrupt:
                pass
            api.backward(loss_of(api.forward(x), ya, yb))
        else:
            loss = loss_of(api.forward(x), ya, yb)
            if pattern == "overflow" and step == POISON_STEP:
                loss = loss * float("inf")
            api.backward(loss)
        if pattern == "clip":
            api.clip(0.05)
        api.step()
        if pattern == "clamp":
            api.clamp(0.125)  # a power of two: the same bound in every dtype
        elif pattern == "clamp_masters":
            api.clamp_masters(0.1)
    return api.result()


def cases():
    """Each (pattern, level) with 4 combinations of the other axes, cycled so that each
    pattern and each level meets every optimizer, zero_grad style and scheduler order."""
    combos = list(itertools.product(OPTIMIZERS, ZERO_STYLES, SCHEDULES))
    out = []
    for i, (pattern, level) in enumerate(itertools.product(PATTERNS, LEVELS)):
        for j in range(4):
            optimizer, style, schedule = combos[(i + 13 * j) % len(combos)]
            optimizer = list(OPTIMIZERS)[(i + j) % len(OPTIMIZERS)]
            out.append(pytest.param(pattern, level, optimizer, style, schedule,
                                    id=f"{pattern}-{level}-{optimizer}-{style}-sched_{schedule}"))
    return out


def tolerance(level, pattern=None):
    if level == "O0":
        return dict(rtol=1e-5, atol=1e-6)
    if pattern == "clamp" and level == "O5":
        # A master up to half a bfloat16 ulp past the bound rounds to the bound: the clamp leaves
        # the model unchanged, so the master keeps its value (the reference clamps the master).
        return dict(rtol=4e-3, atol=2e-4)
    return dict(rtol=2e-3, atol=2e-4)


@pytest.mark.parametrize("pattern, level, optimizer, style, schedule", cases())
def test_ampinit_matches_the_reference(pattern, level, optimizer, style, schedule):
    ours = run_script(Ampinit, pattern, level, optimizer, style, schedule)
    ref = run_script(Reference, pattern, level, optimizer, style, schedule)
    assert ours["skipped"] == ref["skipped"]  # the planted overflow, and natural fp16 ones at a scale of 2**16
    assert ours["skipped"] >= (pattern == "overflow")
    assert ours["scales"] == ref["scales"]
    start = run_script_initial()
    for name, value in ref["model"].items():
        if not value.is_floating_point():
            continue
        mine = ours["model"][name]
        assert torch.isfinite(mine).all(), name
        torch.testing.assert_close(mine, value, **tolerance(level, pattern), msg=lambda m, name=name: f"{name}: {m}")
        if name in start and "frozen" not in name and "running" not in name:
            moved, ref_moved = mine - start[name], value - start[name]
            scale = ref_moved.abs().max().item()  # 0: every update was below half an ulp (O3)
            torch.testing.assert_close(moved, ref_moved, rtol=2e-2, atol=2e-2 * scale,
                                       msg=lambda m, name=name: f"update of {name}: {m}")
    for mine, value in zip(ours["params"], ref["params"]):
        torch.testing.assert_close(mine, value, **tolerance(level, pattern))
    if level in MASTERS:  # the frozen layer reports its FP32 values, not their rounding
        assert torch.equal(ours["model"]["frozen.weight"], start["frozen.weight"])


_initial = {}


def run_script_initial():
    if not _initial:
        torch.manual_seed(0)
        _initial.update({k: v.detach().clone() for k, v in Net().state_dict().items()})
    return _initial


def test_the_matrix_covers_every_axis():
    seen = {key: set() for key in ("pattern_opt", "level_opt", "pattern_style", "level_style", "pattern_sched",
                                   "level_sched")}
    for case in cases():
        pattern, level, optimizer, style, schedule = case.values
        seen["pattern_opt"].add((pattern, optimizer))
        seen["level_opt"].add((level, optimizer))
        seen["pattern_style"].add((pattern, style))
        seen["level_style"].add((level, style))
        seen["pattern_sched"].add((pattern, schedule))
        seen["level_sched"].add((level, schedule))
    assert len(seen["pattern_opt"]) == len(PATTERNS) * len(OPTIMIZERS)
    assert len(seen["level_opt"]) == len(LEVELS) * len(OPTIMIZERS)
    assert len(seen["pattern_sched"]) == len(PATTERNS) * len(SCHEDULES)
    assert len(seen["level_sched"]) == len(LEVELS) * len(SCHEDULES)
    assert len(seen["level_style"]) == len(LEVELS) * len(ZERO_STYLES)
    assert len(seen["pattern_style"]) == len(PATTERNS) * len(ZERO_STYLES)
