"""Bytes per parameter, process memory and step time of one training step, per precision recipe.

The model is GPT-2-small-sized, built from torch.nn pieces: token and position embeddings
(vocabulary 50257, context 1024), ``--layers`` (12) ``nn.TransformerEncoderLayer(768, 12 heads,
3072, dropout=0, activation="gelu", batch_first=True, norm_first=True)`` run with a causal
mask, a final ``LayerNorm`` and an LM head *tied* to the token embedding (GPT-2's layout:
124,439,808 parameters at 12 layers).  Each step trains on ``--batch`` x ``--seq`` synthetic
tokens (the same batches, model initialization and lr 1e-4 / weight decay 0.01 for every row)
with ``cross_entropy`` on float32 logits.  Rows:

- ``fp32``: ``torch.optim.AdamW`` with torch's default implementation (on CPU neither
  ``foreach`` nor ``fused``: the single-tensor loop);
- ``torch.amp bf16``: ``torch.autocast(dtype=torch.bfloat16)`` on the FP32 model + AdamW;
- ``torch.amp fp16``: fp16 autocast + ``torch.amp.GradScaler`` + AdamW;
- ``ampinit O2`` / ``O5``: ``ampinit.initialize(model, FusedAdamW, opt_level=...)`` (fp16 / bf16
  model, FP32 masters);
- ``O5 + remainders``: ``master_weights="remainder"`` (bf16 weight + int16 remainder + 1 tie bit
  per parameter stand for the FP32 master), and the same with ``FusedAdamW(state_dtype=bf16)``.

Columns:

- bytes per parameter, from the storages held in the last warm-up step (the optimizer's state
  exists by then), each storage counted once, by data pointer, in the first column that holds
  it: *weights* the model's parameters; *grads* the ``.grad`` of the model's parameters and of
  the optimizer's params, read right after the backward (after ``scale_loss`` exits) and before
  ``step``; *masters* the optimizer's params that are not model parameters, every FP32 value
  ``optimizer.amp.masters`` keeps, and its remainders and tie words; *state* every tensor in
  ``optimizer.state``, the per-parameter ``step`` scalars included (4 bytes each: < 0.001
  bytes/param).  Ratio: the total against the fp32 row's.
- memory: on CPU each row runs in its own process (``--config NAME --json``, spawned by this
  script), so ``VmRSS``/``VmHWM`` of ``/proc/self/status`` are that row's own: *after setup*
  the RSS once the model and optimizer are built (and ``initialize`` ran), before any step;
  *peak, setup* the high-water mark then (since the process started, torch's import included:
  ``ru_maxrss`` at that point); *peak, warm-up* and *peak, steady* the high-water marks of the
  warm-up steps and of the timed steps alone (reset in between through ``/proc/self/clear_refs``;
  the process's ``ru_maxrss`` is the largest of the three).  On CUDA the same columns come from
  ``torch.cuda.memory_allocated`` and ``max_memory_allocated``.
- step time: median over ``--steps`` timed steps (forward, backward, step, zero_grad) after the
  warm-up, and of its optimizer part alone (``step`` and ``zero_grad``; with ``GradScaler`` its
  ``step`` and ``update``), each with its ratio to the ``ampinit O5`` row.  Warm-up goes on
  (up to 6 more steps) while the dynamic loss scale still skips steps; *skipped* counts them.

The CPU defaults are small (batch 1 x 16 tokens) because on a CPU without AVX512-BF16/FP16
torch runs some 16-bit matmuls in a scalar fallback kernel (pytorch/pytorch#146508): there the
backward of the 50257-wide LM head alone takes tens of seconds in bf16 or fp16 at 128 tokens,
against a fraction of a second in fp32, so the 16-bit rows' step time mostly measures that.
The optimizer column is the part that mixed-precision recipes change.

    python benchmarks/bench_memory.py [--layers 12 --batch 1 --seq 16 --warmup 2 --steps 5 --device cpu]
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from _common import current_peak, environment, memory_now, reset_peak
from torch import nn

import ampinit
from ampinit.optim import FusedAdamW

VOCAB, WIDTH, HEADS, CONTEXT = 50257, 768, 12, 1024
LR, WEIGHT_DECAY = 1e-4, 0.01

# name -> (label, kind, keyword arguments)
CONFIGS = {
    "fp32": ("fp32 + AdamW", "torch", {}),
    "amp-bf16": ("torch.amp bf16 autocast + AdamW", "torch", {"dtype": torch.bfloat16}),
    "amp-fp16": ("torch.amp fp16 autocast + GradScaler + AdamW", "torch", {"dtype": torch.float16}),
    "O2": ("ampinit O2 + FusedAdamW", "ampinit", {"opt_level": "O2"}),
    "O5": ("ampinit O5 + FusedAdamW", "ampinit", {"opt_level": "O5"}),
    "O5-rem": ("ampinit O5 + remainders + FusedAdamW", "ampinit",
               {"opt_level": "O5", "master_weights": "remainder"}),
    "O5-rem-bf16": ("ampinit O5 + remainders + FusedAdamW(state_dtype=bf16)", "ampinit",
                    {"opt_level": "O5", "master_weights": "remainder", "state_dtype": torch.bfloat16}),
}
BASELINE_BYTES, BASELINE_TIME = "fp32", "O5"
EXTRA_WARMUP = 6  # most warm-up steps added while steps are skipped (see run_one)


class GPT(nn.Module):
    """GPT-2 small from torch.nn pieces, LM head tied to the token embedding."""

    def __init__(self, layers):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(CONTEXT, WIDTH)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(WIDTH, HEADS, 4 * WIDTH, dropout=0.0, activation="gelu", batch_first=True,
                                       norm_first=True) for _ in range(layers))
        self.ln_f = nn.LayerNorm(WIDTH)

    def forward(self, idx):
        seq = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(seq, device=idx.device))
        mask = torch.ones(seq, seq, dtype=torch.bool, device=idx.device).triu(1)  # True: not attended
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return F.linear(self.ln_f(x), self.wte.weight)


def loss_of(logits, targets):
    return F.cross_entropy(logits.float().view(-1, VOCAB), targets.view(-1))


def storage_bytes(tensors, seen):
    """Bytes of the storages of ``tensors`` not already in ``seen`` (data pointers), added to it."""
    total = 0
    for tensor in tensors:
        if tensor is None:
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def build(name, args, device):
    """Model, optimizer, ``train_step(x, y, inspect)`` and the skipped-step counter for
    configuration ``name``.  ``train_step`` runs ``inspect()`` between the backward and the
    optimizer step and returns (seconds to there, seconds of the optimizer step)."""
    _, kind, kwargs = CONFIGS[name]
    torch.manual_seed(0)
    model = GPT(args.layers).to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    skipped = [0]
    if kind == "torch":
        dtype = kwargs.get("dtype")
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None

        def train_step(x, y, inspect):
            start = time.perf_counter()
            with torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext():
                loss = loss_of(model(x), y)
            (loss if scaler is None else scaler.scale(loss)).backward()
            sync()
            backward = time.perf_counter()
            inspect()
            begin = time.perf_counter()
            if scaler is None:
                opt.step()
            else:
                before = scaler.get_scale()
                scaler.step(opt)
                scaler.update()
                skipped[0] += scaler.get_scale() < before
            opt.zero_grad()
            sync()
            return backward - start, time.perf_counter() - begin
    else:
        kwargs = dict(kwargs)
        opt = FusedAdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                         state_dtype=kwargs.pop("state_dtype", None))
        model, opt = ampinit.initialize(model, opt, verbosity=0, **kwargs)

        def train_step(x, y, inspect):
            start = time.perf_counter()
            loss = loss_of(model(x), y)
            with ampinit.scale_loss(loss, opt) as scaled:
                scaled.backward()
            sync()
            backward = time.perf_counter()
            inspect()
            begin = time.perf_counter()
            opt.step()
            opt.zero_grad()
            sync()
            skipped[0] = opt.amp.skipped_steps
            return backward - start, time.perf_counter() - begin
    return model, opt, train_step, skipped


def count_bytes(model, opt):
    """Bytes per column (see the module docstring), read between a backward and its step."""
    seen = set()
    params = list(model.parameters())
    opt_params = [p for group in opt.param_groups for p in group["params"]]
    ids = {id(p) for p in params}
    counts = {"weights": storage_bytes(params, seen),
              "grads": storage_bytes([p.grad for p in params + opt_params], seen)}
    masters = [p for p in opt_params if id(p) not in ids]
    handle = getattr(opt, "amp", None)
    kept = handle.masters if handle is not None else None
    if kept is not None:
        masters += list(kept._value.values())
        masters += [part for parts in kept._remainders.values() for part in parts]
    counts["masters"] = storage_bytes(masters, seen)
    counts["state"] = storage_bytes([v for state in opt.state.values() for v in state.values()
                                     if isinstance(v, torch.Tensor)], seen)
    return counts


def has_state(opt):
    return any(isinstance(v, torch.Tensor) and v.numel() > 1 for state in opt.state.values() for v in state.values())


def run_one(name, args, device):
    """One configuration in this process: a dict of measurements, or ``{"error": reason}``."""
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(args.warmup + EXTRA_WARMUP + args.steps):
        tokens = torch.randint(0, VOCAB, (args.batch, args.seq + 1), generator=g).to(device)
        batches.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    try:
        model, opt, train_step, skipped = build(name, args, device)
        setup, peak_setup = memory_now(device)  # the peak since the process started
        reset = reset_peak(device)
        counts, warm = {}, 0
        # Bytes are counted once the optimizer has state (torch.optim makes none at a step the
        # loss scaler skips), and warm-up goes on while the dynamic loss scale is still backing
        # off (skipped steps), up to EXTRA_WARMUP more steps: the timed steps are real updates.
        while True:
            x, y = batches[warm]
            before = skipped[0]
            counting = not counts and warm >= args.warmup - 1 and has_state(opt)
            train_step(x, y, (lambda: counts.update(count_bytes(model, opt))) if counting else (lambda: None))
            warm += 1
            settled = counts and skipped[0] == before
            if (warm >= args.warmup and settled) or warm >= args.warmup + EXTRA_WARMUP:
                break
        skipped_warmup = skipped[0]
        peak_warmup = current_peak(device) if reset else None
        reset = reset_peak(device)
        times = [train_step(x, y, lambda: None) for x, y in batches[warm:warm + args.steps]]
        peak_steady = current_peak(device) if reset else None
    except Exception as error:  # noqa: BLE001 - reported as the row's reason
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"}
    if not counts:
        return {"error": f"the optimizer had no state after {warm} warm-up steps ({skipped[0]} skipped)"}
    return {"params": sum(p.numel() for p in model.parameters()), "bytes": counts, "setup": setup,
            "peak_setup": peak_setup, "peak_warmup": peak_warmup, "peak_steady": peak_steady,
            "warmup": warm, "skipped_warmup": skipped_warmup, "skipped_timed": skipped[0] - skipped_warmup,
            "step_s": statistics.median(a + b for a, b in times),
            "opt_s": statistics.median(b for _, b in times)}


def run_child(name, args):
    """Run one configuration in a new process (its own RSS high-water mark)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--config", name, "--json", "--device", args.device,
           "--layers", str(args.layers), "--batch", str(args.batch), "--seq", str(args.seq),
           "--warmup", str(args.warmup), "--steps", str(args.steps)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return {"error": f"child process failed (exit {done.returncode}): {tail}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def gib(n):
    return "-" if n is None else f"{n / 2 ** 30:.2f}"


def table(results, device, args):
    mem = "RSS" if device.type == "cpu" else "allocated"
    header = ["configuration", "weights", "grads", "masters", "state", "total B/param", "vs fp32",
              f"{mem} after setup GiB", f"peak {mem}, setup GiB", f"peak {mem}, warm-up GiB",
              f"peak {mem}, steady GiB", "step s", "vs O5", "opt.step s", "vs O5", "skipped: warm-up, timed"]
    print("| " + " | ".join(header) + " |")
    print("|---|" + "---:|" * (len(header) - 1))
    base = results.get(BASELINE_BYTES, {})
    base_total = sum(base["bytes"].values()) / base["params"] if "bytes" in base else None
    base_step = results.get(BASELINE_TIME, {}).get("step_s")
    base_opt = results.get(BASELINE_TIME, {}).get("opt_s")
    for name, result in results.items():
        label = CONFIGS[name][0]
        if "error" in result:
            print(f"| {label} | n/a: {result['error']} |" + " |" * (len(header) - 2))
            continue
        per = {k: v / result["params"] for k, v in result["bytes"].items()}
        total = sum(per.values())
        cells = [label] + [f"{per[k]:.3f}" for k in ("weights", "grads", "masters", "state")] + [
            f"{total:.3f}", f"{total / base_total:.2f}x" if base_total else "-",
            gib(result["setup"]), gib(result["peak_setup"]), gib(result["peak_warmup"]), gib(result["peak_steady"]),
            f"{result['step_s']:.2f}", f"{result['step_s'] / base_step:.2f}x" if base_step else "-",
            f"{result['opt_s']:.2f}", f"{result['opt_s'] / base_opt:.2f}x" if base_opt else "-",
            f"{result['skipped_warmup']} of {result['warmup']}, {result['skipped_timed']} of {args.steps}"]
        print("| " + " | ".join(cells) + " |")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (>= 2: the state exists)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (median reported)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--config", choices=sorted(CONFIGS), action="append",
                        help="only these configurations (repeatable; default: all)")
    parser.add_argument("--json", action="store_true", help="run the one --config here and print its JSON")
    args = parser.parse_args()
    if args.warmup < 2:
        parser.error("--warmup must be at least 2: bytes are counted in the last warm-up step")
    device = torch.device(args.device)
    if args.json:
        if not args.config or len(args.config) != 1:
            parser.error("--json runs exactly one --config")
        print(json.dumps(run_one(args.config[0], args, device)))
        return
    start = time.perf_counter()
    names = args.config or list(CONFIGS)
    results = {name: run_child(name, args) for name in names}
    n_params = next((r["params"] for r in results.values() if "params" in r), None)
    print(f"## {device.type}: GPT-2-small-sized model, {args.layers} layers, "
          f"{n_params if n_params is None else f'{n_params:,}'} parameters (LM head tied), batch {args.batch} x "
          f"{args.seq} tokens; {args.warmup} warm-up steps, median of {args.steps}\n")
    for line in environment(device):
        print(f"- {line}")
    print()
    table(results, device, args)
    print(f"\nWall time of the whole run: {time.perf_counter() - start:.0f} s.")


if __name__ == "__main__":
    main()
