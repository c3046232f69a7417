"""The post-backward gradient pass: ampinit's one-pass unscale against torch's, same run.

Rows (``n`` tensors of ``numel`` elements each):

- ``O2 grad path, fp16/bf16 -> fp32``: the model's low-precision gradients become unscaled
  FP32 master gradients with an inf/NaN check.  torch's way is two passes: ``.float()`` copies,
  then ``torch._amp_foreach_non_finite_check_and_unscale_`` on them.  A second torch row copies
  into preallocated buffers (``torch._foreach_copy_``) instead of allocating, the stricter
  baseline.  ampinit: ``ampinit.ops.unscale_(grads, masters, inv_scale, found_inf)``.
- ``fp32 in place``: ``torch._amp_foreach_non_finite_check_and_unscale_`` against
  ``ampinit.ops.unscale_(grads, grads, ...)``.  The scale alternates between 2**-4 and 2**4 so
  repeated calls keep the values where they were.

Bandwidth counts each byte the pass must read and write once.

    python benchmarks/bench_unscale.py [--tensors 200 --numel 100000 --repeats 20 --device all]
"""

import argparse

import torch
from _common import devices, environment, timed

import ampinit.ops


def grads_of(dtype, n, numel, device):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(numel, generator=g) * 64).to(dtype).to(device) for _ in range(n)]


def bench_device(device, n, numel, repeats):
    rows = []
    found = torch.zeros(1, device=device)
    inv = torch.full((1,), 2.0 ** -16, device=device)
    for dtype in (torch.float16, torch.bfloat16):
        grads = grads_of(dtype, n, numel, device)
        masters = [torch.empty(numel, device=device) for _ in range(n)]

        def torch_float_copies(grads=grads):
            copies = [g.float() for g in grads]
            torch._amp_foreach_non_finite_check_and_unscale_(copies, found, inv)

        def torch_preallocated(grads=grads, masters=masters):
            torch._foreach_copy_(masters, grads)
            torch._amp_foreach_non_finite_check_and_unscale_(masters, found, inv)

        def ampinit_one_pass(grads=grads, masters=masters):
            ampinit.ops.unscale_(grads, masters, inv, found)

        t_float = timed(torch_float_copies, repeats, device)
        t_pre = timed(torch_preallocated, repeats, device)
        t_amp = timed(ampinit_one_pass, repeats, device)
        moved = n * numel * (grads[0].element_size() + 4)
        name = str(dtype).replace("torch.", "")
        rows.append((f"O2 grad path, {name} -> fp32 (vs .float() copies)", t_float, t_amp, moved))
        rows.append((f"O2 grad path, {name} -> fp32 (vs copy into buffers)", t_pre, t_amp, moved))

    grads = grads_of(torch.float32, n, numel, device)
    down, up = torch.full((1,), 2.0 ** -4, device=device), torch.full((1,), 2.0 ** 4, device=device)
    flip = [False]

    def next_inv():
        flip[0] = not flip[0]
        return down if flip[0] else up

    t_torch = timed(lambda: torch._amp_foreach_non_finite_check_and_unscale_(grads, found, next_inv()),
                    repeats, device)
    t_amp = timed(lambda: ampinit.ops.unscale_(grads, grads, next_inv(), found), repeats, device)
    rows.append(("fp32 in place", t_torch, t_amp, n * numel * 8))
    return rows


def bandwidth_vs_copy(device, repeats, gigabytes=1.0):
    """ampinit's fp16 -> fp32 unscale against a device-to-device copy of as many bytes."""
    numel = int(gigabytes * 2 ** 30 / 6)
    src = torch.randn(numel, device=device).half()
    dst = torch.empty(numel, device=device)
    found, inv = torch.zeros(1, device=device), torch.full((1,), 0.5, device=device)
    copy_src = torch.empty(numel * 6 // 2, dtype=torch.uint8, device=device)
    copy_dst = torch.empty_like(copy_src)
    t_copy = timed(lambda: copy_dst.copy_(copy_src), repeats, device)
    t_amp = timed(lambda: ampinit.ops.unscale_([src], [dst], inv, found), repeats, device)
    moved = numel * 6
    return moved / t_copy / 1e6, moved / t_amp / 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, default=200)
    parser.add_argument("--numel", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="all", help="cpu, cuda or all (default)")
    args = parser.parse_args()
    for device in devices(args.device):
        print(f"## {device.type}: {args.tensors} tensors x {args.numel} elements, median of {args.repeats}\n")
        for line in environment(device):
            print(f"- {line}")
        print("\n| pass | torch ms | ampinit ms | speed-up | ampinit GB/s |")
        print("|---|---:|---:|---:|---:|")
        for name, t_torch, t_amp, moved in bench_device(device, args.tensors, args.numel, args.repeats):
            print(f"| {name} | {t_torch:.2f} | {t_amp:.2f} | {t_torch / t_amp:.2f}x | {moved / t_amp / 1e6:.1f} |")
        if device.type == "cuda":
            copy_bw, amp_bw = bandwidth_vs_copy(device, args.repeats)
            print(f"\nOn 1 GiB moved: device-to-device copy {copy_bw:.0f} GB/s, ampinit fp16 -> fp32 "
                  f"unscale {amp_bw:.0f} GB/s ({amp_bw / copy_bw:.0%} of the copy)")
        print()


if __name__ == "__main__":
    main()
