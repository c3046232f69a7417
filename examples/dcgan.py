"""apex's DCGAN pattern: two models, two optimizers and three losses, each loss with its
own loss scaler (``num_losses=3``).  The GAN learns a ring of eight 2-D Gaussians.

    python examples/dcgan.py
    python examples/dcgan.py --opt-level O5 --steps 800 --plot gan.png
"""

import argparse
import logging
import math

import torch
from torch import nn

import ampinit as amp
from ampinit.monitor import TrainingMonitor


def ring(n, generator):
    angle = torch.randint(8, (n,), generator=generator).float() * (2 * math.pi / 8)
    centers = torch.stack([angle.cos(), angle.sin()], dim=1) * 2.0
    return centers + 0.05 * torch.randn(n, 2, generator=generator)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default="O2", choices=list(amp.OPT_LEVELS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--plot", metavar="PNG", help="discriminator loss and its loss scale")
    parser.add_argument("--no-bar", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    generator = nn.Sequential(nn.Linear(8, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                              nn.Linear(128, 2)).to(device)
    discriminator = nn.Sequential(nn.Linear(2, 128), nn.LeakyReLU(0.2), nn.Linear(128, 128), nn.LeakyReLU(0.2),
                                  nn.Linear(128, 1)).to(device)
    opt_g = torch.optim.Adam(generator.parameters(), lr=1e-3, betas=(0.5, 0.999), eps=1e-6)
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=1e-3, betas=(0.5, 0.999), eps=1e-6)
    [generator, discriminator], [opt_g, opt_d] = amp.initialize(
        [generator, discriminator], [opt_g, opt_d], opt_level=args.opt_level, num_losses=3, verbosity=0)
    bce = nn.BCEWithLogitsLoss()
    data = torch.Generator().manual_seed(args.seed)
    monitor = TrainingMonitor(opt_d, total=args.steps, desc=f"{args.opt_level} D", show=not args.no_bar)
    for _ in range(args.steps):
        real = ring(args.batch_size, data).to(device)
        noise = torch.randn(args.batch_size, 8, generator=data).to(device)
        ones = torch.ones(args.batch_size, 1, device=device)
        zeros = torch.zeros(args.batch_size, 1, device=device)

        opt_d.zero_grad()
        err_real = bce(discriminator(real).float(), ones)
        with amp.scale_loss(err_real, opt_d, loss_id=0) as scaled:
            scaled.backward()
        fake = generator(noise)
        err_fake = bce(discriminator(fake.detach()).float(), zeros)
        with amp.scale_loss(err_fake, opt_d, loss_id=1) as scaled:
            scaled.backward()
        opt_d.step()

        opt_g.zero_grad()
        err_g = bce(discriminator(fake).float(), ones)
        with amp.scale_loss(err_g, opt_g, loss_id=2) as scaled:
            scaled.backward()
        opt_g.step()
        monitor.update(err_real + err_fake, g_loss=err_g.item())
    monitor.close()

    with torch.no_grad():
        samples = generator(torch.randn(2000, 8, generator=data).to(device)).float().cpu()
    radius = samples.norm(dim=1)
    angles = torch.atan2(samples[:, 1], samples[:, 0])
    modes = ((angles / (2 * math.pi / 8)).round().remainder(8)).long()
    covered = torch.bincount(modes[(radius - 2.0).abs() < 0.5], minlength=8)
    handle = opt_d.amp
    print(f"\n{args.steps} steps at {args.opt_level}: {((radius - 2.0).abs() < 0.5).float().mean():.0%} of samples "
          f"on the ring, {int((covered > 20).sum())}/8 modes covered")
    print("loss scales (D real, D fake, G):", ", ".join(f"{s.loss_scale():g}" for s in handle.loss_scalers),
          f"| skipped steps: D {handle.binding(opt_d).skipped_steps}, G {handle.binding(opt_g).skipped_steps}")
    if args.plot:
        print(f"plot written to {monitor.save_plot(args.plot)}")


if __name__ == "__main__":
    main()
