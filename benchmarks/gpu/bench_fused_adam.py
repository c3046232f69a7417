"""Fused AdamW on a GPT-2-small parameter set (124M parameters, 148 tensors), same run.

Rows:
- ``O2``: FP32 masters behind an fp16 (or bf16) model.  torch: ``torch.optim.AdamW(fused=True)``
  on the FP32 params with FP32 grads, then ``torch._foreach_copy_`` of the params into the
  16-bit model.  ampinit: ``FusedAdamW`` reading the 16-bit *scaled* grads, unscaling, skipping
  on the device, updating the masters and writing the model in one pass (what O2's ``step()``
  runs).
- ``16-bit params``: a pure bf16 model (O3-style): ``torch.optim.AdamW(fused=True)`` against
  ``FusedAdamW`` on the same bf16 params (state in bf16, float32 math: the same semantics).

Target (reported, not asserted): ampinit faster than torch at O2.

    python benchmarks/gpu/bench_fused_adam.py [--device cuda] [--quick]
"""

from __future__ import annotations

import torch
from _gpu_common import (
    device_of,
    environment,
    markdown_table,
    param_spaces,
    parser,
    report,
    timed,
    use_param_space,
    verdict,
)

from ampinit.optim import FusedAdamW


def gpt2_shapes(quick: bool):
    vocab, context, width, layers = (1000, 64, 64, 2) if quick else (50257, 1024, 768, 12)
    shapes = [(vocab, width), (context, width)]
    for _ in range(layers):
        shapes += [(width,), (width,), (width, 3 * width), (3 * width,), (width, width), (width,),
                   (width,), (width,), (width, 4 * width), (4 * width,), (4 * width, width), (width,)]
    return shapes + [(width,), (width,)]


def make(shapes, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).mul_(0.02).to(dtype).to(device) for s in shapes]


def bench_o2(shapes, model_dtype, device, repeats):
    found = torch.zeros(1, device=device)
    inv = torch.full((1,), 2.0 ** -16, device=device)
    scaled16 = [g.mul_(2.0 ** 16) for g in make(shapes, model_dtype, device, 1)]

    params_t = [torch.nn.Parameter(p) for p in make(shapes, torch.float32, device, 0)]
    model_t = [p.detach().to(model_dtype) for p in params_t]
    for p, g in zip(params_t, scaled16):
        p.grad = g.float() * 2.0 ** -16
    opt_t = torch.optim.AdamW(params_t, lr=1e-4, weight_decay=0.1, fused=True)

    def torch_step():
        opt_t.step()
        torch._foreach_copy_(model_t, [p.detach() for p in params_t])

    params_a = [torch.nn.Parameter(p) for p in make(shapes, torch.float32, device, 0)]
    model_a = [p.detach().to(model_dtype) for p in params_a]
    opt_a = FusedAdamW(params_a, lr=1e-4, weight_decay=0.1)
    scaled, model_of = dict(zip(params_a, scaled16)), dict(zip(params_a, model_a))
    return timed(torch_step, device, repeats), lambda: timed(
        lambda: opt_a._amp_update(found, inv, scaled, model_of), device, repeats)


def bench_16bit(shapes, dtype, device, repeats):
    params_t = [torch.nn.Parameter(p) for p in make(shapes, dtype, device, 0)]
    params_a = [torch.nn.Parameter(p) for p in make(shapes, dtype, device, 0)]
    for p, a, g in zip(params_t, params_a, make(shapes, dtype, device, 1)):
        p.grad, a.grad = g, g.clone()
    opt_t = torch.optim.AdamW(params_t, lr=1e-4, weight_decay=0.1, fused=True)
    opt_a = FusedAdamW(params_a, lr=1e-4, weight_decay=0.1)
    return timed(opt_t.step, device, repeats), lambda: timed(opt_a.step, device, repeats)


def main():
    args = parser(__doc__).parse_args()
    device = device_of(args)
    repeats = args.repeats or (3 if args.quick else 20)
    shapes = gpt2_shapes(args.quick)
    numel = sum(torch.Size(s).numel() for s in shapes)
    env = environment(device)
    rows, results = [], []
    cases = [("O2, fp16 model", bench_o2, torch.float16), ("O2, bf16 model", bench_o2, torch.bfloat16),
             ("16-bit params, bf16", bench_16bit, torch.bfloat16)]
    for name, bench, dtype in cases:
        t_torch, run_ampinit = bench(shapes, dtype, device, repeats)
        for space in param_spaces(device):
            use_param_space(space)
            t_amp = run_ampinit()
            speedup = t_torch / t_amp
            space_name = "-" if space is None else f"{space // 1024} KiB"
            target = verdict(speedup, 1.0, True) if device.type == "cuda" and name.startswith("O2") else "n/a"
            results.append(dict(case=name, param_space=space_name, torch_ms=t_torch, ampinit_ms=t_amp,
                                speedup=speedup, target=target))
            rows.append([name, space_name, t_torch, t_amp, f"{speedup:.2f}x", target])
        use_param_space(0 if device.type == "cuda" else None)
        torch.cuda.empty_cache() if device.type == "cuda" else None
    table = markdown_table(["step", "kernel params", "torch ms", "ampinit ms", "speed-up", "target: faster (O2)"],
                           rows)
    report(args, "fused_adam", f"Fused AdamW step, {numel / 1e6:.1f}M parameters in {len(shapes)} tensors", env,
           {"rows": results, "parameters": numel}, table)


if __name__ == "__main__":
    main()
