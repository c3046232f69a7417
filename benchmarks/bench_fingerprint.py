"""What detecting writes to the model costs: ``ops.fingerprint`` against the torch way.

At O2/O5 ampinit notices writes to the 16-bit model made outside it (``p.data.clamp_()``, a
``load_state_dict`` mid-run) with two fingerprint passes per step: one marks each model tensor
after ampinit writes it, one checks it before the next update (``ampinit/masters.py``).  This
script times one such cycle (mark + check) over the 16-bit weights of a GPT-2-small-sized model
(the shapes of its 148 tensors, 124,439,808 elements) and the extra memory it takes:

- ``ops.fingerprint``: the live backend (the compiled CPU or CUDA kernel);
- ``fallback``: the pure-PyTorch fingerprint (``AMPINIT_DISABLE_EXT=1``), in 2**20-element slices;
- ``torch: snapshot + equal``: what one would write with torch alone: copy every tensor after
  the write, compare with ``torch.equal`` before the update (a host sync per tensor on CUDA, and
  a second copy of the model in memory).

Extra memory is the high-water mark during the timed cycles above what was allocated before
them: ``VmHWM`` (reset through ``/proc/self/clear_refs``) on CPU, ``max_memory_allocated`` on CUDA.

    python benchmarks/bench_fingerprint.py [--device cpu|cuda] [--dtype float16|bfloat16] [--repeats 5] [--quick]
"""

import argparse

import torch
from _common import current_peak, memory_now, print_table_head, reset_peak, timed

from ampinit import _fallback, ops

WIDTH, LAYERS, VOCAB, CONTEXT = 768, 12, 50257, 1024


def gpt2_shapes(quick=False):
    vocab, layers = (512, 1) if quick else (VOCAB, LAYERS)
    shapes = [(vocab, WIDTH), (CONTEXT, WIDTH)]
    for _ in range(layers):
        shapes += [(WIDTH,), (WIDTH,), (3 * WIDTH, WIDTH), (3 * WIDTH,), (WIDTH, WIDTH), (WIDTH,),
                   (WIDTH,), (WIDTH,), (4 * WIDTH, WIDTH), (4 * WIDTH,), (WIDTH, 4 * WIDTH), (WIDTH,)]
    return shapes + [(WIDTH,), (WIDTH,)]


def cases(tensors):
    """name -> a function running one detection cycle (mark after the write, check before the update)."""
    def kernel():
        marks = ops.fingerprint(tensors)
        return ops.fingerprint(tensors).ne(marks)

    def fallback():
        marks = _fallback.fingerprint(tensors)
        return _fallback.fingerprint(tensors).ne(marks)

    snapshots = []

    def snapshot_equal():
        if not snapshots:
            snapshots.extend(torch.empty_like(t) for t in tensors)
        for snapshot, tensor in zip(snapshots, tensors):
            snapshot.copy_(tensor)
        return [not torch.equal(t, s) for t, s in zip(tensors, snapshots)]

    return {"ops.fingerprint (" + ops.backend(tensors[0].device)[0] + ")": kernel,
            "fallback (torch ops, sliced)": fallback,
            "torch: snapshot + equal": snapshot_equal}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="one layer, a 512-word vocabulary: a smoke test")
    args = parser.parse_args()
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(0)
    dtype = getattr(torch, args.dtype)
    tensors = [torch.randn(shape, generator=g).to(dtype).to(device) for shape in gpt2_shapes(args.quick)]
    n = sum(t.numel() for t in tensors)
    print_table_head(f"## {device.type}: one write-detection cycle (mark + check) over {len(tensors)} {args.dtype} "
                     f"tensors, {n:,} elements ({'--quick' if args.quick else 'GPT-2 small'}), median of "
                     f"{args.repeats}", device,
                     ["method", "ms per cycle", "vs torch snapshot + equal", "extra memory MiB"])
    results = {}
    for name, cycle in cases(tensors).items():
        cycle()  # warm-up (the snapshot is allocated here: counted below as memory held)
        before = memory_now(device)[0]
        reset_peak(device)
        ms = timed(cycle, args.repeats, device)
        held = sum(t.numel() * t.element_size() for t in tensors) if name.startswith("torch") else 0
        results[name] = (ms, max(current_peak(device) - before, 0) + held)
    torch_ms = results["torch: snapshot + equal"][0]
    for name, (ms, extra) in results.items():
        print(f"| {name} | {ms:.1f} | {torch_ms / ms:.2f}x | {extra / 2 ** 20:.0f} |")
    print("\nExtra memory of the torch row includes the snapshot it keeps (2 or 4 bytes per element).")


if __name__ == "__main__":
    main()
