"""Memory stays flat over many initializations; torch.compile after initialize trains."""
import gc

import pytest
import torch
from torch import nn

import ampinit as amp
from conftest import train_step


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def wide_setup(seed, level):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-4)
    return amp.initialize(model, opt, opt_level=level, verbosity=0)


def test_hundred_initializations_keep_memory_flat():
    """Cross-validation style: 100 initializations, every 10th model kept and still trained."""
    kept = []
    baseline = None
    per_model = None
    for fold in range(100):
        model, opt = wide_setup(fold, "O2" if fold % 2 else "O1")
        for step in range(2):
            train_step_wide(model, opt, step)
        if fold % 10 == 0:
            kept.append((model, opt))
        del model, opt
        gc.collect()
        if fold == 9:
            baseline = rss_bytes()
            # params fp32 + fp16 copies + fp32 masters + grads + Adam state: ~ 20 bytes/param
            per_model = 20 * sum(p.numel() for p in kept[0][0].parameters())
    growth = rss_bytes() - baseline
    print(f"RSS growth over inits 10..99: {growth / 2**20:.1f} MiB; one model ~{per_model / 2**20:.1f} MiB; "
          f"90 leaked models would be ~{90 * per_model / 2**20:.0f} MiB")
    # 9 more models are kept on purpose after the baseline; 90 freed ones must not add up
    assert growth < 9 * per_model + 64 * 2 ** 20, (growth / 2 ** 20, per_model / 2 ** 20)
    for model, opt in kept:   # earlier models keep working
        before = [p.detach().clone() for p in amp.master_params(opt)]
        train_step_wide(model, opt, 5)
        assert any(not torch.equal(a, b) for a, b in zip(before, amp.master_params(opt)))


def train_step_wide(model, opt, step):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    opt.zero_grad()
    with amp.scale_loss(((model(x).float() - y) ** 2).mean(), opt) as scaled:
        scaled.backward()
    opt.step()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_torch_compile_after_initialize_trains(level):
    torch._dynamo.reset()
    from conftest import make_setup
    model, opt = make_setup(level, optimizer="sgd")
    compiled = torch.compile(model)
    losses = [train_step(compiled, opt, step % 4).item() for step in range(12)]
    assert losses[-1] < losses[0]
    assert opt.amp.skipped_steps == 0
    if level == "O2":
        master = next(amp.master_params(opt))
        assert model.fc1.weight.dtype == torch.float16 and torch.equal(model.fc1.weight, master.half())
    train_step(compiled, opt, 0, poison=True)
    assert opt.amp.skipped_steps == 1
