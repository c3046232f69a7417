"""A character-level transformer trained on real text every machine has: the Python standard
library's own source files.  Reports held-out loss per opt level.

It compares quality, not speed: on a CPU without native fp16/bf16 arithmetic the
low-precision levels run ~10x slower than O0 here (on a GPU they are the fast ones).

    python examples/char_transformer.py                      # O0, O1, O2, O5 in turn
    python examples/char_transformer.py --opt-level O2 --steps 500 --plot chars.png
"""

import argparse
import logging
import math
import os
import sysconfig
import time

import torch
from torch import nn

import ampinit as amp
from ampinit.monitor import TrainingMonitor

STDLIB_FILES = ["textwrap.py", "string.py", "shlex.py", "fnmatch.py", "difflib.py", "csv.py"]


def load_text(limit=400_000):
    stdlib = sysconfig.get_paths()["stdlib"]
    text = "".join(open(os.path.join(stdlib, name), encoding="utf-8").read()
                   for name in STDLIB_FILES if os.path.exists(os.path.join(stdlib, name)))
    if not text:
        raise RuntimeError(f"none of {STDLIB_FILES} found under {stdlib}")
    return text[:limit]


class CharTransformer(nn.Module):
    def __init__(self, vocab, context, width=64, layers=2, heads=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.randn(context, width) * 0.02)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(context))

    def forward(self, tokens):
        h = self.embed(tokens) + self.position[: tokens.shape[1]]
        h = self.blocks(h, mask=self.causal[: tokens.shape[1], : tokens.shape[1]].to(h.dtype), is_causal=True)
        return self.head(self.norm(h))


def batches(data, context, batch_size, generator):
    while True:
        start = torch.randint(len(data) - context - 1, (batch_size,), generator=generator)
        window = torch.stack([data[s: s + context + 1] for s in start.tolist()])
        yield window[:, :-1], window[:, 1:]


def train(level, args, train_data, val_data, vocab, device):
    torch.manual_seed(args.seed)
    model = CharTransformer(vocab, args.context).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6, weight_decay=0.01)
    model, optimizer = amp.initialize(model, optimizer, opt_level=level, verbosity=0)
    monitor = TrainingMonitor(optimizer, total=args.steps, desc=level, show=not args.no_bar)
    stream = batches(train_data, args.context, args.batch_size, torch.Generator().manual_seed(args.seed))
    start = time.perf_counter()
    for _ in range(args.steps):
        x, y = (t.to(device) for t in next(stream))
        loss = nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)
        optimizer.step()
        monitor.update(loss)
    monitor.close()
    model.eval()
    val_stream = batches(val_data, args.context, 64, torch.Generator().manual_seed(1))
    with torch.no_grad():
        losses = [nn.functional.cross_entropy(model(x.to(device)).float().flatten(0, 1), y.to(device).flatten())
                  for x, y in (next(val_stream) for _ in range(8))]
    return torch.stack(losses).mean().item(), time.perf_counter() - start, optimizer.amp.skipped_steps, monitor


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", nargs="+", default=["O0", "O1", "O2", "O5"], choices=list(amp.OPT_LEVELS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--plot", metavar="PNG")
    parser.add_argument("--no-bar", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    text = load_text()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text])
    split = int(0.9 * len(data))
    device = torch.device(args.device)
    results = {level: train(level, args, data[:split], data[split:], len(chars), device)
               for level in args.opt_level}
    print(f"\n{len(text):,} characters of stdlib source, vocabulary {len(chars)}, "
          f"{args.steps} steps each (uniform guess: loss {math.log(len(chars)):.2f})")
    print("| opt level | held-out loss | seconds | skipped steps |")
    print("|---|---|---|---|")
    for level, (loss, seconds, skipped, _) in results.items():
        print(f"| {level} | {loss:.3f} | {seconds:.1f} | {skipped} |")
    if args.plot:
        monitors = [r[3] for r in results.values()]
        print(f"plot written to {monitors[0].save_plot(args.plot, others=monitors[1:])}")


if __name__ == "__main__":
    main()
