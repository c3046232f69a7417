"""Training throughput and peak memory of a GPT-2-small-like model (124M parameters, 12 layers,
width 768, 12 heads, context 1024, vocabulary padded to 50304), same run:

- ampinit: ``ampinit.initialize(model, FusedAdamW, opt_level="O2")`` (fp16, dynamic loss scale)
  and ``"O5"`` (bf16), ``ampinit.scale_loss`` + ``optimizer.step()``;
  and ``"O5"`` with ``master_weights="remainder"`` and ``FusedAdamW(state_dtype=torch.bfloat16)``
  (10.125 bytes per parameter for weights, masters and state instead of 16: the README's
  "Memory" section);
- torch: ``torch.autocast`` (fp16 with ``torch.amp.GradScaler``; bf16 without) with
  ``torch.optim.AdamW(fused=True)`` on the FP32 model.

Same model code, data, batch and loss (``cross_entropy`` on float32 logits) everywhere; eager
mode, no torch.compile.  Tokens/s over the timed steps after a warm-up; peak memory is
``torch.cuda.max_memory_allocated`` over the timed steps.

Target (reported, not asserted): ampinit >= 1.15x torch.amp's throughput, peak memory <= it.

    python benchmarks/gpu/bench_gpt2.py [--device cuda] [--batch 8] [--steps 10] [--quick]
"""

from __future__ import annotations

import gc
import math
import time
import traceback

import torch
import torch.nn.functional as F
from _gpu_common import device_of, environment, markdown_table, parser, report, synchronize, verdict
from torch import nn

import ampinit as amp
from ampinit.optim import FusedAdamW


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.c_attn, self.c_proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.c_fc, self.mlp_proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab, context, width, depth, heads):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied, as in GPT-2
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * depth) if name.endswith(("c_proj.weight", "mlp_proj.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def config(quick):
    if quick:
        return dict(vocab=256, context=32, width=64, depth=2, heads=2)
    return dict(vocab=50304, context=1024, width=768, depth=12, heads=12)


def loss_of(logits, targets):
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))


def run_ampinit(opt_level, cfg, batches, device, warmup, master_weights=None, state_dtype=None):
    torch.manual_seed(0)
    model = GPT(**cfg).to(device)
    opt = FusedAdamW(model.parameters(), lr=3e-4, weight_decay=0.1, state_dtype=state_dtype)
    extra = {} if master_weights is None else {"master_weights": master_weights}
    model, opt = amp.initialize(model, opt, opt_level=opt_level, loss_scale="dynamic", verbosity=0, **extra)

    def train_step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model(x), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        return loss

    return measure(train_step, batches, device, warmup)


def run_torch_amp(dtype, cfg, batches, device, warmup):
    torch.manual_seed(0)
    model = GPT(**cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)

    def train_step(x, y):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype):
            loss = loss_of(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    return measure(train_step, batches, device, warmup)


def measure(train_step, batches, device, warmup):
    for x, y in batches[:warmup]:
        train_step(x, y)
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for x, y in batches[warmup:]:
        loss = train_step(x, y)
    synchronize(device)
    elapsed = time.perf_counter() - start
    tokens = sum(x.numel() for x, _ in batches[warmup:])
    peak = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None
    return dict(tokens_per_s=tokens / elapsed, ms_per_step=elapsed / (len(batches) - warmup) * 1e3,
                peak_GiB=peak, final_loss=float(loss.detach()))


def main():
    p = parser(__doc__)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    device = device_of(args)
    cfg = config(args.quick)
    batch = 2 if args.quick else args.batch
    steps, warmup = (2, 1) if args.quick else (args.steps, args.warmup)
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(warmup + steps):
        tokens = torch.randint(0, cfg["vocab"], (batch, cfg["context"] + 1), generator=g).to(device)
        batches.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    env = environment(device)
    runs = [("torch.amp fp16 + GradScaler + AdamW(fused)", lambda: run_torch_amp(torch.float16, cfg, batches, device,
                                                                                   warmup)),
            ("ampinit O2 (fp16) + FusedAdamW", lambda: run_ampinit("O2", cfg, batches, device, warmup)),
            ("torch.amp bf16 + AdamW(fused)", lambda: run_torch_amp(torch.bfloat16, cfg, batches, device, warmup)),
            ("ampinit O5 (bf16) + FusedAdamW", lambda: run_ampinit("O5", cfg, batches, device, warmup)),
            ("ampinit O5 + remainder masters + FusedAdamW(bf16 state)",
             lambda: run_ampinit("O5", cfg, batches, device, warmup, "remainder", torch.bfloat16))]
    results = {}
    for name, run in runs:
        try:
            results[name] = run()
        except Exception as error:  # noqa: BLE001 - reported, the other runs go on
            results[name] = dict(error=f"{type(error).__name__}: {error}", traceback=traceback.format_exc())
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    rows = []
    for name, result in results.items():
        if "error" in result:
            rows.append([name, "error", result["error"][:160], "", "", ""])
            continue
        baseline = results[runs[0][0] if "fp16" in name else runs[2][0]]
        speedup = result["tokens_per_s"] / baseline["tokens_per_s"] if "tokens_per_s" in baseline else None
        memory = "n/a" if result["peak_GiB"] is None else f"{result['peak_GiB']:.2f}"
        if name.startswith("ampinit") and device.type == "cuda" and speedup is not None:
            target = f"{verdict(speedup, 1.15, True)} / " + \
                ("met" if result["peak_GiB"] <= baseline["peak_GiB"] else "missed")
        else:
            target = "-"
        result["speedup_vs_torch_amp"] = speedup
        rows.append([name, f"{result['tokens_per_s']:.0f}", f"{result['ms_per_step']:.1f}", memory,
                     "-" if speedup is None else f"{speedup:.2f}x", target])
    table = markdown_table(["run", "tokens/s", "ms/step", "peak GiB", "vs torch.amp (same dtype)",
                            "target >= 1.15x / memory <= torch.amp"], rows)
    n_params = sum(p.numel() for p in GPT(**cfg).parameters())
    report(args, "gpt2", f"GPT-2-small-like training: {n_params / 1e6:.0f}M parameters, batch {batch} x "
           f"{cfg['context']} tokens", env, results, table)


if __name__ == "__main__":
    main()
