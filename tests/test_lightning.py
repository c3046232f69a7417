"""The Lightning precision plugin trains, skips overflows, clips masters and checkpoints."""
import pytest
import torch
from torch import nn

pytest.importorskip("lightning")
import lightning.pytorch as pl  # noqa: E402

import ampinit as amp  # noqa: E402
from ampinit.lightning import AmpinitPrecision  # noqa: E402
from ampinit.optim import FusedAdam  # noqa: E402


class Regression(pl.LightningModule):
    def __init__(self, poison_step=-1):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 1))
        self.poison_step = poison_step
        self.losses = []
        self.input_dtypes = set()

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.input_dtypes.add(x.dtype)
        loss = nn.functional.mse_loss(self.net(x).float(), y)
        self.losses.append(loss.item())
        if self.global_step == self.poison_step:
            loss = loss * float("inf")
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, eps=1e-6)


def loader():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    y = x[:, :1] * 2 + 0.1 * torch.randn(256, 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)


def trainer(plugin, steps, tmp_path, **kwargs):
    return pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, plugins=[plugin], logger=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                      **kwargs)


@pytest.mark.parametrize("level", ["O1", "O2", "O5"])
def test_trains_and_skips_the_poisoned_step(level, tmp_path):
    module = Regression(poison_step=3)
    plugin = AmpinitPrecision(level, max_loss_scale=2.0 ** 12)  # below natural overflows: one skip
    trainer(plugin, 40, tmp_path, gradient_clip_val=1.0).fit(module, loader())
    handle = plugin.handle
    assert handle.skipped_steps == 1 and handle.last_overflow_step == 3
    assert module.losses[-1] < module.losses[0] / 4
    optimizer = handle.optimizers[0]
    if level in ("O2", "O5"):
        low = torch.float16 if level == "O2" else torch.bfloat16
        assert module.net[0].weight.dtype == low and module.input_dtypes == {low}
        assert all(p.dtype == torch.float32 for p in amp.master_params(optimizer))
    if level == "O2":
        assert handle.loss_scale() == 2.0 ** 11


def test_checkpoint_round_trip(tmp_path):
    plugin = AmpinitPrecision("O2", max_loss_scale=2.0 ** 12)
    trainer(plugin, 10, tmp_path).fit(Regression(poison_step=2), loader())
    (ckpt,) = (tmp_path / "checkpoints").iterdir()
    checkpoint = torch.load(ckpt, weights_only=False)
    assert checkpoint["AmpinitPrecision"]["loss_scaler0"]["loss_scale"] == 2.0 ** 11
    assert checkpoint["state_dict"]["net.0.weight"].dtype == torch.float32  # masters, not fp16

    resumed = AmpinitPrecision("O2", max_loss_scale=2.0 ** 12)
    module = Regression()
    trainer(resumed, 12, tmp_path / "resume").fit(module, loader(), ckpt_path=str(ckpt))
    assert resumed.handle.skipped_steps == 1  # the counters came back with the checkpoint
    assert resumed.handle.loss_scale() == 2.0 ** 11
    optimizer = resumed.handle.optimizers[0]
    master = next(amp.master_params(optimizer))
    assert torch.equal(module.net[0].weight, master.half())


class Scheduled(Regression):
    """configure_optimizers builds the LR scheduler before the plugin initializes the optimizer
    (r03): its wrapper of the optimizer's step must not bypass the skip."""

    def __init__(self, poison_step=-1, fused=False):
        super().__init__(poison_step)
        self.fused = fused

    def configure_optimizers(self):
        opt = FusedAdam(self.parameters(), lr=1e-2, eps=1e-6, weight_decay=0.01) if self.fused else \
            torch.optim.AdamW(self.parameters(), lr=1e-2, eps=1e-6)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


@pytest.mark.parametrize("level", ["O1", "O2", "O5"])
def test_scheduler_from_configure_optimizers_still_skips(level, tmp_path):
    torch.manual_seed(0)
    module = Scheduled(poison_step=3)
    plugin = AmpinitPrecision(level, max_loss_scale=2.0 ** 12)
    trainer(plugin, 30, tmp_path).fit(module, loader())
    assert plugin.handle.skipped_steps == 1 and plugin.handle.last_overflow_step == 3
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert module.losses[-1] < module.losses[0] * 0.7  # the lr halves every 10 steps: slower than the others
    optimizer = plugin.handle.optimizers[0]
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5 ** 3)


@pytest.mark.parametrize("level", ["O2", "O5"])
def test_gradient_clip_val_with_a_fused_optimizer_clips_the_unscaled_gradients(level, tmp_path):
    results = []
    for fused in (True, False):
        torch.manual_seed(0)
        module = Scheduled(fused=fused)
        plugin = AmpinitPrecision(level, max_loss_scale=2.0 ** 12)
        trainer(plugin, 12, tmp_path / str(fused), gradient_clip_val=0.05).fit(module, loader())
        results.append([p.detach().float().clone() for p in amp.master_params(plugin.handle.optimizers[0])])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_bad_options_fail_at_construction():
    with pytest.raises(ValueError, match="letter O"):
        AmpinitPrecision("02")
