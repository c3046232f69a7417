"""A small CNN on scikit-learn's handwritten digits (real data, shipped inside the package),
trained at several opt levels side by side, with each level's test accuracy.

    pip install 'ampinit[examples]'
    python examples/digits_cnn.py                          # O0, O1, O2, O5 in turn
    python examples/digits_cnn.py --opt-level O2 --plot digits.png
"""

import argparse
import logging
import time

import torch
from sklearn.datasets import load_digits
from torch import nn

import ampinit as amp
from ampinit.monitor import TrainingMonitor


def load(device):
    digits = load_digits()  # 1,797 8x8 images, 10 classes
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    return (x[:split].to(device), y[:split].to(device)), (x[split:].to(device), y[split:].to(device))


def make_model():
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))


def train(level, args, train_set, test_set, device):
    torch.manual_seed(args.seed)
    model = make_model().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, eps=1e-6)
    model, optimizer = amp.initialize(model, optimizer, opt_level=level, verbosity=0)
    monitor = TrainingMonitor(optimizer, total=args.steps, desc=level, show=not args.no_bar)
    x_train, y_train = train_set
    generator = torch.Generator().manual_seed(args.seed)
    start = time.perf_counter()
    model.train()
    for _ in range(args.steps):
        index = torch.randint(len(x_train), (args.batch_size,), generator=generator).to(device)
        loss = nn.functional.cross_entropy(model(x_train[index]).float(), y_train[index])
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        monitor.update(loss)
    monitor.close()
    model.eval()
    with torch.no_grad():
        x_test, y_test = test_set
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    return accuracy, time.perf_counter() - start, optimizer.amp.skipped_steps, monitor


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", nargs="+", default=["O0", "O1", "O2", "O5"], choices=list(amp.OPT_LEVELS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--plot", metavar="PNG", help="loss and loss scale of every level")
    parser.add_argument("--no-bar", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = torch.device(args.device)
    train_set, test_set = load(device)
    results = {level: train(level, args, train_set, test_set, device) for level in args.opt_level}
    print(f"\ndigits: {len(train_set[0])} train / {len(test_set[0])} test images, {args.steps} steps each")
    print("| opt level | test accuracy | seconds | skipped steps |")
    print("|---|---|---|---|")
    for level, (accuracy, seconds, skipped, _) in results.items():
        print(f"| {level} | {accuracy:.1%} | {seconds:.1f} | {skipped} |")
    if args.plot:
        monitors = [r[3] for r in results.values()]
        print(f"plot written to {monitors[0].save_plot(args.plot, others=monitors[1:])}")


if __name__ == "__main__":
    main()
