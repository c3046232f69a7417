"""A whole training step when the loop keeps its gradient tensors (``zero_grad(set_to_none=False)``).

Torch zeroes the kept gradients in place; ampinit's fused O2 step drops every gradient (the
kernel took them scaled, from the model) and owes the zeros back.  This measures what keeping
them costs, against ``torch.autocast`` + ``GradScaler`` + ``AdamW(foreach=True)`` in the same
run, each side with both ``set_to_none`` values.  A small batch, so that the step, not the
matmuls, dominates.

    python benchmarks/bench_zero_grad_kept.py [--width 1024 --batch 2 --steps 30]
"""

import argparse

import torch
from _common import print_table_head, timed

import ampinit as amp
from ampinit.optim import FusedAdamW


def make_model(width):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, width), torch.nn.Linear(width, 16))


def torch_amp_step(width, batch, set_to_none):
    model = make_model(width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    x, y = torch.randn(batch, width), torch.randn(batch, 16)

    def step():
        opt.zero_grad(set_to_none=set_to_none)
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        scaler.scale(torch.nn.functional.mse_loss(out.float(), y)).backward()
        scaler.step(opt)
        scaler.update()
    return step


def ampinit_step(width, batch, set_to_none):
    model = make_model(width)
    opt = FusedAdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    x, y = torch.randn(batch, width), torch.randn(batch, 16)

    def step():
        opt.zero_grad(set_to_none=set_to_none)
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
    return step


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    cpu = torch.device("cpu")
    print_table_head(f"A training step, {3 * args.width ** 2 // 10 ** 6}M-parameter MLP, batch {args.batch}, "
                     f"median of {args.steps} (ms)", cpu,
                     ["zero_grad", "torch.amp (fp16 autocast)", "ampinit O2 + FusedAdamW", "torch / ampinit"])
    for set_to_none in (True, False):
        t = timed(torch_amp_step(args.width, args.batch, set_to_none), args.steps, cpu)
        a = timed(ampinit_step(args.width, args.batch, set_to_none), args.steps, cpu)
        print(f"| set_to_none={set_to_none} | {t:.1f} | {a:.1f} | {t / a:.2f}x |")


if __name__ == "__main__":
    main()
