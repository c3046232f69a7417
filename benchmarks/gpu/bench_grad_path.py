"""The O2 gradient path at bandwidth: fp16/bf16 grads -> unscaled fp32 master grads with the
inf/NaN check, against a device-to-device copy of as many bytes, measured in the same run.

ampinit: ``ampinit.ops.unscale_(grads, masters, inv_scale, found_inf)``, one pass reading 2 and
writing 4 bytes per element.  torch's way: ``torch._foreach_copy_`` into the masters, then
``torch._amp_foreach_non_finite_check_and_unscale_`` on them (two passes).  The copy baseline
(``dst.copy_(src)`` of uint8 buffers) moves the same 6 bytes per element.

Target (reported, not asserted): ampinit >= 90 % of the copy's bandwidth on >= 1 GiB of grads.

    python benchmarks/gpu/bench_grad_path.py [--device cuda] [--gib 1.0] [--quick]
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

import ampinit.ops


def layouts(total_elements: int, quick: bool):
    """(name, sizes): one flat tensor, and many of about 1M elements (a model's worth)."""
    per = 1 << (10 if quick else 20)
    return [("1 tensor", [total_elements]),
            (f"{total_elements // per} tensors", [per] * (total_elements // per))]


def time_copy(nbytes, device, repeats):
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return timed(lambda: dst.copy_(src), device, repeats)


def passes(sizes, dtype, device, inv, found):
    """torch's two passes and ampinit's one, over fresh grads and masters."""
    grads = [torch.randn(n, device=device).mul_(1000).to(dtype) for n in sizes]
    masters = [torch.empty(n, device=device) for n in sizes]

    def torch_way():
        torch._foreach_copy_(masters, grads)
        torch._amp_foreach_non_finite_check_and_unscale_(masters, found, inv)

    def ampinit_way():
        ampinit.ops.unscale_(grads, masters, inv, found)

    return torch_way, ampinit_way


def main():
    p = parser(__doc__)
    p.add_argument("--gib", type=float, default=1.0, help="GiB of 16-bit gradients")
    args = p.parse_args()
    device = device_of(args)
    repeats = args.repeats or (3 if args.quick else 20)
    total = (1 << 16) if args.quick else int(args.gib * 2 ** 30 / 2)
    env = environment(device)
    found = torch.zeros(1, device=device)
    inv = torch.full((1,), 2.0 ** -16, device=device)

    t_copy = time_copy(total * 3, device, repeats)
    bytes_moved = total * 6
    copy_gbs = bytes_moved / t_copy / 1e6

    rows, results = [], {"copy_ms": t_copy, "copy_GBps": copy_gbs, "rows": []}
    for dtype in (torch.float16, torch.bfloat16):
        for layout, sizes in layouts(total, args.quick):
            torch_way, ampinit_way = passes(sizes, dtype, device, inv, found)
            t_torch = timed(torch_way, device, repeats)
            for space in param_spaces(device):
                use_param_space(space)
                t_amp = timed(ampinit_way, device, repeats)
                amp_gbs = bytes_moved / t_amp / 1e6
                fraction = amp_gbs / copy_gbs
                name = f"{str(dtype)[6:]} -> fp32, {layout}"
                space_name = "-" if space is None else f"{space // 1024} KiB"
                row = dict(case=name, param_space=space_name, ampinit_ms=t_amp, torch_ms=t_torch,
                           ampinit_GBps=amp_gbs, of_copy=fraction, vs_torch=t_torch / t_amp,
                           target=verdict(fraction, 0.9, True) if device.type == "cuda" else "n/a")
                results["rows"].append(row)
                rows.append([name, space_name, t_amp, amp_gbs, f"{fraction:.0%}", t_torch, f"{t_torch / t_amp:.2f}x",
                             row["target"]])
            use_param_space(0 if device.type == "cuda" else None)
            del torch_way, ampinit_way  # frees the 3 GiB before the next layout
    table = markdown_table(["grads", "kernel params", "ampinit ms", "ampinit GB/s", "of copy", "torch ms",
                            "speed-up vs torch", "target >= 90 % of copy"], rows)
    text = (f"{bytes_moved / 2 ** 30:.2f} GiB moved per pass (2 bytes read + 4 written per element); "
            f"device-to-device copy of as many bytes: {t_copy:.3f} ms, {copy_gbs:.0f} GB/s.\n\n{table}")
    report(args, "grad_path", "O2 gradient path vs a device-to-device copy", env, results, text)


if __name__ == "__main__":
    main()
