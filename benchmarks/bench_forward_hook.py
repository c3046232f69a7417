"""What ampinit's forward pre-hook costs per forward, against the same model cast by hand.

Before each eager forward of an initialized model with FP32 masters (O2/O5), ampinit checks in
Python that each parameter and its master agree: one ``requires_grad`` flag on either side, the
master's version counter (a master written outside ``step()``, SAM's perturbation), and any
``model.state_dict()`` values still alive.  Nothing changes in these runs, so this is the
fixed cost of the checks (``MasterWeights.before_forward``, also timed alone) plus the input
cast; each forward is timed five times alternately with the torch one, median reported.

Rows, in the same run: a stack of small Linear layers (``--layers``, two tensors each, width
``--width``) cast to fp16 by hand with its inputs cast in the loop (torch), and the same model
under ``ampinit.initialize`` at O2 (and O5 in bf16 against a bf16 hand cast).  Inference
forwards under ``torch.no_grad()``, batch 1, so that the per-forward cost is what shows.

    python benchmarks/bench_forward_hook.py [--layers 200] [--width 32] [--repeats 200]
"""

import argparse
import copy

import torch
from _common import print_table_head, timed
from torch import nn

import ampinit as amp


def make_model(layers, width):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=200)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    device = torch.device("cpu")
    print_table_head(f"Per-forward cost of ampinit's forward pre-hook ({args.layers} Linear layers, "
                     f"{2 * args.layers} parameter tensors, width {args.width}, batch 1, median of "
                     f"{args.repeats})", device, ["recipe", "torch, hand cast (us)", "ampinit (us)",
                                                  "ratio", "the checks alone (us)", "per tensor (us)"])
    x = torch.randn(1, args.width)
    base = make_model(args.layers, args.width)
    for level, dtype in (("O2", torch.float16), ("O5", torch.bfloat16)):
        by_hand = copy.deepcopy(base).to(dtype)
        model = copy.deepcopy(base)
        model, _ = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=level, verbosity=0)

        def torch_forward(by_hand=by_hand, dtype=dtype):
            with torch.no_grad():
                by_hand(x.to(dtype))

        def ampinit_forward(model=model):
            with torch.no_grad():
                model(x)

        masters = amp.handle_of(model).masters
        # alternate the two, so that a disturbance of the machine falls on both
        reference, ours = [], []
        for _ in range(5):
            reference.append(timed(torch_forward, args.repeats, device) * 1e3)
            ours.append(timed(ampinit_forward, args.repeats, device) * 1e3)
        checks = timed(masters.before_forward, args.repeats, device) * 1e3
        reference, ours = sorted(reference)[2], sorted(ours)[2]
        print(f"| {level} ({str(dtype).replace('torch.', '')}) | {reference:.1f} | {ours:.1f} | "
              f"{ours / reference:.2f}x | {checks:.1f} | {checks / (2 * args.layers):.3f} |")
        amp.end(model)


if __name__ == "__main__":
    main()
