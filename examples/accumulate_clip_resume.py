"""Gradient accumulation over micro-batches, clipping of the unscaled FP32 master gradients,
and a checkpoint that resumes exactly: the resumed run ends bit for bit where the
uninterrupted one does.

    python examples/accumulate_clip_resume.py
    python examples/accumulate_clip_resume.py --opt-level O5 --accumulate 8 --checkpoint /tmp/ckpt.pt
"""

import argparse
import logging
import os
import tempfile

import torch
from torch import nn

import ampinit as amp
from ampinit.monitor import TrainingMonitor


def build(args, device):
    """Model, optimizer and scheduler exactly as a fresh process would build them."""
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.LayerNorm(256), nn.Linear(256, 10)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, eps=1e-6)
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level, verbosity=0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=50, gamma=0.7)
    return model, optimizer, scheduler


def run(model, optimizer, scheduler, args, device, first_step, last_step, monitor=None):
    w_true = torch.randn(32, 10, generator=torch.Generator().manual_seed(123))
    for step in range(first_step, last_step):
        data = torch.Generator().manual_seed(step)  # the data of a step depends on the step alone
        x = torch.randn(args.batch_size, 32, generator=data)
        y = (x @ w_true).argmax(1)
        optimizer.zero_grad()
        for i, (xs, ys) in enumerate(zip(x.chunk(args.accumulate), y.chunk(args.accumulate))):
            loss = nn.functional.cross_entropy(model(xs.to(device)).float(), ys.to(device)) / args.accumulate
            # delay_unscale: the micro-batch gradients add up, still scaled, until the last one
            with amp.scale_loss(loss, optimizer, delay_unscale=i < args.accumulate - 1) as scaled_loss:
                scaled_loss.backward()
        # clip the unscaled FP32 masters, never the fp16 model parameters
        norm = torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), args.clip)
        optimizer.step()
        scheduler.step()
        if monitor is not None:
            monitor.update(loss * args.accumulate, grad_norm=float(norm))


def snapshot(model, optimizer):
    return [p.detach().clone() for p in model.parameters()] + [p.detach().clone() for p in amp.master_params(optimizer)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default="O2", choices=list(amp.OPT_LEVELS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--accumulate", type=int, default=4, help="micro-batches per step")
    parser.add_argument("--clip", type=float, default=1.0, help="max norm of the master gradients")
    parser.add_argument("--checkpoint", help="where to save the checkpoint (default: a temp file)")
    parser.add_argument("--plot", metavar="PNG")
    parser.add_argument("--no-bar", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = torch.device(args.device)
    cut = args.steps // 2
    path = args.checkpoint or os.path.join(tempfile.mkdtemp(), "ckpt.pt")

    # 1. the uninterrupted run
    model, optimizer, scheduler = build(args, device)
    monitor = TrainingMonitor(optimizer, total=args.steps, desc=args.opt_level, show=not args.no_bar)
    run(model, optimizer, scheduler, args, device, 0, args.steps, monitor)
    monitor.close()
    uninterrupted = snapshot(model, optimizer)

    # 2. half the run, then a checkpoint in apex's layout
    model, optimizer, scheduler = build(args, device)
    run(model, optimizer, scheduler, args, device, 0, cut)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "amp": amp.state_dict()}, path)

    # 3. resume as a fresh process would: build, initialize, then load in apex's order
    model, optimizer, scheduler = build(args, device)
    checkpoint = torch.load(path)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    scheduler.load_state_dict(checkpoint["scheduler"])
    amp.load_state_dict(checkpoint["amp"])
    run(model, optimizer, scheduler, args, device, cut, args.steps)
    resumed = snapshot(model, optimizer)

    identical = all(torch.equal(a, b) for a, b in zip(uninterrupted, resumed))
    print(f"\n{args.steps} steps of {args.accumulate} micro-batches at {args.opt_level}, clipped to {args.clip}; "
          f"checkpoint at step {cut} ({path})")
    print(f"final loss {monitor.history['loss'][-1]:.4f}, loss scale {optimizer.amp.loss_scale():g}, "
          f"skipped steps {optimizer.amp.skipped_steps}")
    print(f"resumed run matches the uninterrupted run bit for bit: {identical}")
    if args.plot:
        print(f"plot written to {monitor.save_plot(args.plot)}")
    if not identical:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
