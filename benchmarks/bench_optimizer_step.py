"""The optimizer step with FP32 masters: ampinit's fused optimizers against torch, same run.

Rows (``n`` tensors of ``numel`` elements each; everything after the backward):

- ``O2 step, Adam``: torch's way for an fp16 model with FP32 masters: copy the fp16 grads into
  the masters' FP32 grads, ``torch._amp_foreach_non_finite_check_and_unscale_``, ``.item()`` to
  decide the skip, ``torch.optim.Adam(foreach=True)`` on the masters, ``torch._foreach_copy_``
  back to the model.  ampinit: ``ampinit.ops.check_finite_`` on the fp16 grads, then
  ``FusedAdam`` reading them, skipping on the device and writing the model in the same pass
  (what an O2 ``scale_loss`` + ``step`` runs).  Same for ``SGD`` (momentum 0.9).
- ``fp32 step``: ``torch.optim.Adam`` (``foreach=True`` and ``fused=True``) against
  ``ampinit.optim.FusedAdam(adam_w_mode=False)`` on FP32 params and grads.

    python benchmarks/bench_optimizer_step.py [--tensors 200 --numel 100000 --repeats 10 --device all]
"""

import argparse

import torch
from _common import devices, environment, timed

import ampinit.ops
from ampinit.optim import FusedAdam, FusedSGD


def make(n, numel, device, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=g).to(dtype).to(device) for _ in range(n)]


def bench_o2(device, n, numel, repeats, kind):
    grads16 = make(n, numel, device, torch.float16, seed=1)
    found, inv = torch.zeros(1, device=device), torch.full((1,), 2.0 ** -16, device=device)

    model_t = make(n, numel, device, torch.float16)
    masters_t = [torch.nn.Parameter(m.float()) for m in model_t]
    for m in masters_t:
        m.grad = torch.empty_like(m)
    opt_t = torch.optim.Adam(masters_t, lr=1e-3, foreach=True) if kind == "Adam" else \
        torch.optim.SGD(masters_t, lr=1e-3, momentum=0.9, foreach=True)

    def torch_step():
        found.zero_()
        torch._foreach_copy_([m.grad for m in masters_t], grads16)
        torch._amp_foreach_non_finite_check_and_unscale_([m.grad for m in masters_t], found, inv)
        if not found.item():
            opt_t.step()
            torch._foreach_copy_(model_t, masters_t)

    model_a = make(n, numel, device, torch.float16)
    masters_a = [torch.nn.Parameter(m.float()) for m in model_a]
    opt_a = FusedAdam(masters_a, lr=1e-3, adam_w_mode=False) if kind == "Adam" else \
        FusedSGD(masters_a, lr=1e-3, momentum=0.9)
    scaled = dict(zip(masters_a, grads16))
    model_of = dict(zip(masters_a, model_a))

    def ampinit_step():
        found.zero_()
        ampinit.ops.check_finite_(grads16, found)
        opt_a._amp_update(found, inv, scaled, model_of)

    return timed(torch_step, repeats, device), timed(ampinit_step, repeats, device)


def bench_fp32(device, n, numel, repeats, fused_torch):
    grads = make(n, numel, device, seed=2)
    params_t = [torch.nn.Parameter(p) for p in make(n, numel, device)]
    params_a = [torch.nn.Parameter(p) for p in make(n, numel, device)]
    for p, a, g in zip(params_t, params_a, grads):
        p.grad, a.grad = g, g
    opt_t = torch.optim.Adam(params_t, lr=1e-3, **({"fused": True} if fused_torch else {"foreach": True}))
    opt_a = FusedAdam(params_a, lr=1e-3, adam_w_mode=False)
    return timed(opt_t.step, repeats, device), timed(opt_a.step, repeats, device)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, default=200)
    parser.add_argument("--numel", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="all", help="cpu, cuda or all (default)")
    args = parser.parse_args()
    for device in devices(args.device):
        print(f"## {device.type}: {args.tensors} tensors x {args.numel} elements, median of {args.repeats}\n")
        for line in environment(device):
            print(f"- {line}")
        print("\n| step | torch ms | ampinit ms | speed-up |")
        print("|---|---:|---:|---:|")
        rows = [(f"O2 step, {kind} (fp16 grads, FP32 masters)", *bench_o2(device, args.tensors, args.numel,
                                                                            args.repeats, kind))
                for kind in ("Adam", "SGD")]
        rows.append(("fp32 step, Adam (torch foreach=True)", *bench_fp32(device, args.tensors, args.numel,
                                                                          args.repeats, False)))
        rows.append(("fp32 step, Adam (torch fused=True)", *bench_fp32(device, args.tensors, args.numel,
                                                                        args.repeats, True)))
        for name, t_torch, t_amp in rows:
            print(f"| {name} | {t_torch:.2f} | {t_amp:.2f} | {t_torch / t_amp:.2f}x |")
        print()


if __name__ == "__main__":
    main()
