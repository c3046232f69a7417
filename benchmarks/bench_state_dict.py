"""What ``model.state_dict()`` costs under ampinit, and an EMA that reads it every step.

At O2/O5 ``model.state_dict()`` reports the FP32 masters: it first adopts writes made to the
16-bit model since ampinit last marked it (one fingerprint pass over every cast tensor, batched
at the start of the call), then watches each reported value so that an in-place write into it
reaches the model (``ampinit/masters.py``, ``report``).  timm's ``ModelEmaV2`` reads
``model.state_dict()`` after every step, so this is per-step overhead there.

Rows, each against the torch equivalent measured in the same run (an FP32 model of the same
shapes, whose ``state_dict()`` is views of its parameters):

- ``state_dict()``: one call;
- ``EMA update``: timm's ``ModelEmaV2`` update, ``ema_v.copy_(ema_v * d + (1 - d) * model_v)``
  over ``zip(ema.state_dict().values(), model.state_dict().values())``, with the EMA a deep copy
  of the initialized model.

The model: a transformer-like stack of Linear + LayerNorm layers (``--layers``, ``--width``),
trained one step first so that the masters are live.

    python benchmarks/bench_state_dict.py [--layers 12] [--width 768] [--repeats 20] [--levels O2 O5 O5-rem]
"""

import argparse
import copy
import functools

import torch
from _common import print_table_head, timed
from torch import nn

import ampinit as amp
import ampinit.optim


def make_model(layers, width):
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(width, 3 * width), nn.Linear(3 * width, width), nn.LayerNorm(width)]
    return nn.Sequential(*blocks)


def prepared(level, layers, width):
    """An initialized model after one training step, and its EMA (a deep copy)."""
    model = make_model(layers, width)
    if level == "fp32":
        ema = copy.deepcopy(model)
        return model, ema
    remainders = level == "O5-rem"
    opt = amp.optim.FusedAdamW(model.parameters(), lr=1e-3)
    extra = {"master_weights": "remainder"} if remainders else {}
    model, opt = amp.initialize(model, opt, opt_level="O5" if remainders else level, verbosity=0, **extra)
    x = torch.randn(4, width).to(next(model.parameters()).dtype)
    with amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
        scaled.backward()
    opt.step()
    return model, copy.deepcopy(model)


def ema_update(ema, model, decay=0.999):
    with torch.no_grad():
        for ema_v, model_v in zip(ema.state_dict().values(), model.state_dict().values()):
            ema_v.copy_(ema_v * decay + (1.0 - decay) * model_v)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--levels", nargs="+", default=["O2", "O5", "O5-rem"])
    args = parser.parse_args()
    device = torch.device("cpu")
    reference = make_model(args.layers, args.width)
    print_table_head(f"## cpu: model.state_dict() and a timm ModelEmaV2 update, {len(reference.state_dict())} "
                     f"entries, {sum(p.numel() for p in reference.parameters()):,} parameters, median of "
                     f"{args.repeats}", device,
                     ["recipe", "state_dict() ms", "vs torch fp32", "EMA update ms", "vs torch fp32"])
    rows = {}
    for level in ["fp32"] + args.levels:
        model, ema = prepared(level, args.layers, args.width)
        rows[level] = (timed(model.state_dict, args.repeats, device),
                       timed(functools.partial(ema_update, ema, model), args.repeats, device))
    base_sd, base_ema = rows["fp32"]
    for level, (sd_ms, ema_ms) in rows.items():
        name = "torch fp32 model" if level == "fp32" else f"ampinit {level}"
        print(f"| {name} | {sd_ms:.2f} | {sd_ms / base_sd:.1f}x | {ema_ms:.1f} | {ema_ms / base_ema:.2f}x |")
    print("\nThe ampinit rows' state_dict() reads the FP32 masters (a joined copy per tensor for O5-rem); "
          "the EMA is the 16-bit deep copy, updated in place through its state_dict.")


if __name__ == "__main__":
    main()
