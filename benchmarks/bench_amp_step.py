"""Post-backward cost of mixed precision: ampinit against torch, measured in the same run.

What is timed is everything after ``backward()`` up to the updated weights.  Gradients are
copied in from fixed tensors, standing in for the backward; both sides do the same copy, after
backpropagating a scaled scalar that reaches no parameter (``scale_loss`` checks that the
backward went through the scaled loss).

- ``fp32 params (O1-style)``: ampinit ``scale_loss`` exit + ``step`` against
  ``torch.amp.GradScaler`` (``scale``, ``step``, ``update``), with SGD and fp32 gradients.
- ``fp16 model + fp32 masters (O2)``: ampinit O2 against the same work written by hand with
  torch ops: ``.float()`` copies of the grads, ``torch._amp_foreach_non_finite_check_and_unscale_``,
  ``.item()``, SGD on the masters, and a ``_foreach_copy_`` back to the model.  This is torch's
  two-pass way, which the planned fused kernels replace with one pass.

    python benchmarks/bench_amp_step.py [--tensors 200 --numel 100000 --repeats 10]
"""

import argparse
import platform
import statistics
import time

import torch

import ampinit as amp
import ampinit.ops


def timed(fn, repeats):
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def stand_in_loss():
    """A loss whose backward reaches no parameter: the gradients are copied in by hand."""
    return torch.zeros((), requires_grad=True) * 1.0


def make_params(n, numel, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(numel, generator=g).to(dtype)) for _ in range(n)]


def bench_fp32(n, numel, repeats):
    grads = [torch.randn(numel) for _ in range(n)]
    params_t = make_params(n, numel, torch.float32, 0)
    opt_t = torch.optim.SGD(params_t, lr=1e-3, foreach=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)

    def torch_step():
        scaler.scale(stand_in_loss()).backward()
        for p, g in zip(params_t, grads):
            p.grad = g.clone()
        scaler.step(opt_t)
        scaler.update()

    model = torch.nn.ParameterList(make_params(n, numel, torch.float32, 0))
    opt_a = torch.optim.SGD(model.parameters(), lr=1e-3, foreach=True)
    model, opt_a = amp.initialize(model, opt_a, opt_level="O1", verbosity=0)
    params_a = list(model.parameters())

    def ampinit_step():
        opt_a.zero_grad()  # torch's side replaces the grads; without this ampinit would accumulate
        with amp.scale_loss(stand_in_loss(), opt_a) as scaled:
            scaled.backward()
            for p, g in zip(params_a, grads):
                p.grad = g.clone()
        opt_a.step()

    return timed(torch_step, repeats), timed(ampinit_step, repeats)


def bench_o2(n, numel, repeats, low):
    grads = [torch.randn(numel).to(low) for _ in range(n)]
    model_t = make_params(n, numel, low, 1)
    masters = [torch.nn.Parameter(p.detach().float()) for p in model_t]
    opt_t = torch.optim.SGD(masters, lr=1e-3, foreach=True)
    found_inf = torch.zeros(1)
    inv_scale = torch.full((1,), 2.0 ** -16)

    def torch_step():
        (stand_in_loss() * 2.0 ** 16).backward()
        for p, g in zip(model_t, grads):
            p.grad = g.clone()
        master_grads = [p.grad.float() for p in model_t]
        found_inf.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_(master_grads, found_inf, inv_scale)
        for m, g in zip(masters, master_grads):
            m.grad = g
        if not found_inf.item():
            opt_t.step()
            with torch.no_grad():
                torch._foreach_copy_(model_t, masters)

    model = torch.nn.ParameterList(make_params(n, numel, torch.float32, 1))
    opt_a = torch.optim.SGD(model.parameters(), lr=1e-3, foreach=True)
    level = "O2" if low == torch.float16 else "O5"
    model, opt_a = amp.initialize(model, opt_a, opt_level=level, verbosity=0, loss_scale="dynamic")
    params_a = list(model.parameters())

    def ampinit_step():
        opt_a.zero_grad()
        with amp.scale_loss(stand_in_loss(), opt_a) as scaled:
            scaled.backward()
            for p, g in zip(params_a, grads):
                p.grad = g.clone()
        opt_a.step()

    return timed(torch_step, repeats), timed(ampinit_step, repeats)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=200)
    parser.add_argument("--numel", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    n, numel, repeats = args.tensors, args.numel, args.repeats
    print(f"torch {torch.__version__}, ampinit {amp.__version__} (ops backend: {amp.ops.backend()[0]}), "
          f"python {platform.python_version()}, {platform.machine()}, "
          f"{torch.get_num_threads()} threads, {platform.processor() or 'cpu'}")
    print(f"{n} tensors x {numel} elements, median of {repeats} runs, CPU\n")
    print("| case | torch (ms) | ampinit (ms) | torch / ampinit |")
    print("|---|---|---|---|")
    rows = [("fp32 params (O1-style) vs GradScaler", *bench_fp32(n, numel, repeats)),
            ("fp16 model + fp32 masters (O2) vs hand-written torch", *bench_o2(n, numel, repeats, torch.float16)),
            ("bf16 model + fp32 masters (O5) vs hand-written torch", *bench_o2(n, numel, repeats, torch.bfloat16))]
    for name, t_torch, t_amp in rows:
        print(f"| {name} | {t_torch:.1f} | {t_amp:.1f} | {t_torch / t_amp:.2f}x |")


if __name__ == "__main__":
    main()
