"""ampinit quickstart: an apex-style training loop on CPU in a few seconds.

    python examples/quickstart.py                    # O2: fp16 model, FP32 master weights
    python examples/quickstart.py --opt-level O5     # bf16 model, FP32 master weights
    python examples/quickstart.py --opt-level O1     # fp16 autocast inside forward only
    python examples/quickstart.py --plot quickstart.png   # loss and loss scale over steps

A small MLP classifies points of three interleaved spirals (synthetic, made here).  At
``--overflow-step`` the loss is multiplied by inf on purpose, to show what a real fp16
overflow does: that step is skipped, the loss scale halves, and training carries on.
The script is written exactly as an apex user would write it, with ``import ampinit as amp``.
"""

import argparse
import logging
import math
import time

import torch
from torch import nn

import ampinit as amp
from ampinit.monitor import TrainingMonitor


def spirals(n_per_class: int, generator: torch.Generator):
    """Three noisy spiral arms in 2-D, labels 0..2."""
    t = torch.rand(3, n_per_class, generator=generator) * 3 * math.pi + 0.5
    arms = torch.arange(3).unsqueeze(1) * (2 * math.pi / 3)
    x = torch.stack([t * torch.cos(t + arms), t * torch.sin(t + arms)], dim=-1) / (3 * math.pi)
    x = x + 0.02 * torch.randn(x.shape, generator=generator)
    y = torch.arange(3).repeat_interleave(n_per_class)
    return x.reshape(-1, 2), y


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default="O2", choices=list(amp.OPT_LEVELS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--overflow-step", type=int, default=100,
                        help="step whose loss is made inf on purpose (-1: none)")
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--plot", metavar="PNG", help="write loss and loss scale over steps")
    parser.add_argument("--no-bar", action="store_true", help="plain progress lines only")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    x_train, y_train = spirals(2000, generator)
    x_test, y_test = spirals(500, generator)
    device = torch.device(args.device)

    model = nn.Sequential(nn.Linear(2, 128), nn.BatchNorm1d(128), nn.ReLU(),
                          nn.Linear(128, 128), nn.BatchNorm1d(128), nn.ReLU(),
                          nn.Linear(128, 3)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6)
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level, verbosity=0)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    criterion = nn.CrossEntropyLoss()

    print(f"ampinit {amp.__version__}, torch {torch.__version__}, opt_level {args.opt_level}, "
          f"device {device}, params {next(model.parameters()).dtype}")
    monitor = TrainingMonitor(optimizer, total=args.steps, desc=args.opt_level, show=not args.no_bar)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        index = torch.randint(len(x_train), (args.batch_size,), generator=generator)
        inputs, targets = x_train[index].to(device), y_train[index].to(device)
        loss = criterion(model(inputs).float(), targets)
        if step == args.overflow_step:
            loss = loss * float("inf")  # simulate an fp16 overflow
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        scheduler.step()
        monitor.update(loss)
        if args.no_bar and (step % args.log_every == 0 or step == args.steps):
            handle = optimizer.amp
            print(f"step {step:4d}/{args.steps} | loss {loss.item():8.4f} | "
                  f"loss scale {handle.loss_scale():8g} | skipped steps {handle.skipped_steps}")
    monitor.close()

    model.eval()
    with torch.no_grad():
        accuracy = (model(x_test.to(device)).argmax(1).cpu() == y_test).float().mean().item()
    print(f"test accuracy {accuracy:.1%} after {args.steps} steps in "
          f"{time.perf_counter() - start:.1f}s; skipped {optimizer.amp.skipped_steps} step(s) "
          f"(at step {', '.join(map(str, monitor.skipped_steps)) or '-'})")
    if args.plot:
        print(f"plot written to {monitor.save_plot(args.plot)}")


if __name__ == "__main__":
    main()
