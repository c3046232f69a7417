"""Many small tensors: 1000 gradients of 1-4k elements, where launches and host work dominate.

Rows: in-place fp32 unscale (``torch._amp_foreach_non_finite_check_and_unscale_`` against
``ampinit.ops.unscale_(grads, grads, ...)``), and fp16 grads into fp32 masters (torch: copy,
then the same), with each kernel-parameter space.  Device time is the median over CUDA events
around one call; host time is the wall time per call over a burst of calls (the CPU side of
building the launches: what a training loop waits for when the GPU is not the bottleneck).

Target (reported, not asserted): ampinit <= 0.8x torch's foreach unscale time.

    python benchmarks/gpu/bench_many_small.py [--device cuda] [--tensors 1000] [--quick]
"""

from __future__ import annotations

import time

import torch
from _gpu_common import (
    device_of,
    environment,
    markdown_table,
    param_spaces,
    parser,
    report,
    synchronize,
    timed,
    use_param_space,
    verdict,
)

import ampinit.ops


def host_time_us(fn, device, calls):
    fn()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / calls * 1e6


def main():
    p = parser(__doc__)
    p.add_argument("--tensors", type=int, default=1000)
    args = p.parse_args()
    device = device_of(args)
    count = 50 if args.quick else args.tensors
    repeats = args.repeats or (3 if args.quick else 50)
    g = torch.Generator().manual_seed(0)
    sizes = [int(n) for n in torch.randint(1024, 4097, (count,), generator=g)]
    env = environment(device)
    found = torch.zeros(1, device=device)
    # Alternating scales keep repeated in-place calls from drifting the values.
    scales = [torch.full((1,), 2.0 ** -4, device=device), torch.full((1,), 2.0 ** 4, device=device)]
    flip = [0]

    def inv():
        flip[0] ^= 1
        return scales[flip[0]]

    fp32 = [torch.randn(n, generator=g).to(device) for n in sizes]
    fp16 = [torch.randn(n, generator=g).half().to(device) for n in sizes]
    masters = [torch.empty(n, device=device) for n in sizes]
    cases = {
        "fp32 in place": (lambda: torch._amp_foreach_non_finite_check_and_unscale_(fp32, found, inv()),
                          lambda: ampinit.ops.unscale_(fp32, fp32, inv(), found)),
        "fp16 -> fp32 masters": (lambda: (torch._foreach_copy_(masters, fp16),
                                          torch._amp_foreach_non_finite_check_and_unscale_(masters, found, inv())),
                                 lambda: ampinit.ops.unscale_(fp16, masters, inv(), found)),
    }
    rows, results = [], []
    for case, (torch_fn, amp_fn) in cases.items():
        t_torch = timed(torch_fn, device, repeats)
        h_torch = host_time_us(torch_fn, device, repeats)
        for space in param_spaces(device):
            use_param_space(space)
            t_amp = timed(amp_fn, device, repeats)
            h_amp = host_time_us(amp_fn, device, repeats)
            ratio = t_amp / t_torch
            space_name = "-" if space is None else f"{space // 1024} KiB"
            target = verdict(ratio, 0.8, False) if device.type == "cuda" else "n/a"
            results.append(dict(case=case, param_space=space_name, torch_ms=t_torch, ampinit_ms=t_amp,
                                ratio=ratio, torch_host_us=h_torch, ampinit_host_us=h_amp, target=target))
            rows.append([case, space_name, t_torch, t_amp, f"{ratio:.2f}x", h_torch, h_amp, target])
        use_param_space(0 if device.type == "cuda" else None)
    table = markdown_table(["pass", "kernel params", "torch ms", "ampinit ms", "ampinit / torch", "torch host us",
                            "ampinit host us", "target <= 0.8x"], rows)
    report(args, "many_small", f"{count} tensors of 1-4k elements", env, {"rows": results},
           f"{count} tensors, {sum(sizes)} elements in all.\n\n{table}")


if __name__ == "__main__":
    main()
