"""``optimizer.zero_grad()`` right after a backward, on a model of many small parameters.

ampinit's ``zero_grad`` first lets a clear made on the model side (``model.zero_grad()``,
``p.grad = None``) reach the FP32 masters, a Python pass over the model's gradient tokens, then
clears the masters and the tokens.  Against torch's ``zero_grad`` on the FP32 model, measured
in the same run, with both ``set_to_none`` values.  The backward that leaves the gradients
runs outside the timed region.

    python benchmarks/bench_zero_grad.py [--layers 1000 --width 64 --repeats 50]
"""

import argparse
import statistics
import time

import torch
from _common import print_table_head

import ampinit as amp


def make_model(layers, width):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def zero_grad_ms(model, opt, backward, set_to_none, repeats):
    """Median time of ``opt.zero_grad(set_to_none)`` in ms, each after a fresh backward."""
    samples = []
    for _ in range(repeats + 1):
        backward()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=set_to_none)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples[1:]) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=1000)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()

    x = torch.randn(2, args.width)
    reference = make_model(args.layers, args.width)
    reference_opt = torch.optim.SGD(reference.parameters(), lr=1e-3)

    def reference_backward():
        reference(x).sum().backward()

    model = make_model(args.layers, args.width)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0, loss_scale=128.0)

    def amp_backward():
        with amp.scale_loss(model(x.half()).float().sum(), opt) as scaled:
            scaled.backward()

    params = sum(1 for _ in model.parameters())
    print_table_head(f"zero_grad after a backward: {params} parameters ({args.layers} x Linear({args.width}, "
                     f"{args.width})), median of {args.repeats}", torch.device("cpu"),
                     ["set_to_none", "torch FP32 (ms)", "ampinit O2 (ms)", "ampinit / torch"])
    for set_to_none in (True, False):
        torch_ms = zero_grad_ms(reference, reference_opt, reference_backward, set_to_none, args.repeats)
        amp_ms = zero_grad_ms(model, opt, amp_backward, set_to_none, args.repeats)
        print(f"| {set_to_none} | {torch_ms:.3f} | {amp_ms:.3f} | {amp_ms / torch_ms:.2f}x |")


if __name__ == "__main__":
    main()
