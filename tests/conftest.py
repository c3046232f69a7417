import pytest
import torch
from torch import nn

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
LEVELS = ["O0", "O1", "O2", "O3", "O4", "O5"]
LOW_DTYPE = {"O0": torch.float32, "O1": torch.float16, "O2": torch.float16, "O3": torch.float16,
             "O4": torch.bfloat16, "O5": torch.bfloat16}


def pytest_collection_modifyitems(config, items):
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("device") == "cuda":
            item.add_marker(pytest.mark.cuda)


class SmallNet(nn.Module):
    """Linear -> BatchNorm -> ReLU -> Linear, with a buffer, small enough for many steps."""

    def __init__(self, width=16):
        super().__init__()
        self.fc1 = nn.Linear(8, width)
        self.bn = nn.BatchNorm1d(width)
        self.fc2 = nn.Linear(width, 4)
        self.register_buffer("offset", torch.linspace(-0.1, 0.1, 4))

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x)))) + self.offset


def make_setup(opt_level, device="cpu", seed=0, optimizer="adam", **kwargs):
    import ampinit as amp
    torch.manual_seed(seed)
    model = SmallNet().to(device)
    params = model.parameters()
    from ampinit.optim import FusedAdamW, FusedSGD
    optimizers = {
        "adam": lambda: torch.optim.Adam(params, lr=1e-2, eps=1e-4),
        "sgd": lambda: torch.optim.SGD(params, lr=0.05, momentum=0.9),
        "fused_adamw": lambda: FusedAdamW(params, lr=1e-2, eps=1e-4),
        "fused_adamw_bf16": lambda: FusedAdamW(params, lr=1e-2, eps=1e-4, state_dtype=torch.bfloat16),
        "fused_sgd": lambda: FusedSGD(params, lr=0.05, momentum=0.9, nesterov=True),
    }
    opt = optimizers[optimizer]()
    kwargs.setdefault("verbosity", 0)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, **kwargs)
    return model, opt


def batch(step, device="cpu", n=32):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(n, 8, generator=g)
    y = torch.randn(n, 4, generator=g)
    return x.to(device), y.to(device)


def train_step(model, opt, step, device="cpu", poison=False):
    import ampinit as amp
    x, y = batch(step, device)
    opt.zero_grad()
    loss = ((model(x).float() - y) ** 2).mean()
    if poison:
        loss = loss * float("inf")
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    return loss.detach()


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


ZERO_STYLES = ["opt", "opt_zeros", "model", "model_zeros", "grad_none", "grad_data_zero", "grad_zeros_like"]


def clear_grads(style, model, opt):
    """Clear gradients the way a script would: ``opt.zero_grad()`` (to None or zeros),
    ``model.zero_grad()`` (to None or zeros), or on the model's parameters ``p.grad = None``,
    ``p.grad.data.zero_()`` (pre-1.0 PyTorch: no version counter sees it) or
    ``p.grad = torch.zeros_like(p)``."""
    if style == "opt":
        opt.zero_grad()
    elif style == "opt_zeros":
        opt.zero_grad(set_to_none=False)
    elif style == "model":
        model.zero_grad()
    elif style == "model_zeros":
        model.zero_grad(set_to_none=False)
    elif style == "grad_data_zero":
        for p in model.parameters():
            if p.grad is not None:
                p.grad.data.zero_()
    elif style == "grad_zeros_like":
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    else:
        for p in model.parameters():
            p.grad = None


def amp_backward(loss, optimizers, level):
    """``loss.backward()`` for an FP32 reference run (``level`` None), else through
    ``ampinit.scale_loss``."""
    import ampinit as amp
    if level is None:
        loss.backward()
        return
    with amp.scale_loss(loss, optimizers) as scaled:
        scaled.backward()


def initialize_at(model, opt, level, remainders=False, **kwargs):
    """``ampinit.initialize`` at ``level`` (quiet, static scale 128 unless given), with remainder
    masters when asked."""
    import ampinit as amp
    kwargs.setdefault("loss_scale", 128.0)
    if remainders:
        kwargs["master_weights"] = "remainder"
    return amp.initialize(model, opt, opt_level=level, verbosity=0, **kwargs)
