"""A whole O2 step with ampinit.optim.FusedAdam, through the public API only: does it make host
syncs, does it capture in one CUDA graph, do replays equal eager steps bit for bit, and what
the graph saves per step.

Checks (reported, not asserted):
- ``torch.cuda.set_sync_debug_mode("error")`` passes over steps after the warm-up;
- the step (``zero_grad``, forward, ``ampinit.scale_loss`` + backward, ``optimizer.step()``)
  captures in one ``torch.cuda.CUDAGraph`` and its replays give the parameters eager steps give;
- time per step, eager and replayed.

    python benchmarks/gpu/bench_o2_step.py [--device cuda] [--opt-level O2] [--quick]
"""

from __future__ import annotations

import traceback

import torch
from _gpu_common import device_of, environment, markdown_table, parser, report, synchronize, timed
from torch import nn

import ampinit as amp
from ampinit.optim import FusedAdam


class Block(nn.Module):
    """A pre-norm transformer block on (batch, seq, width), attention included."""

    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))


def make(opt_level, width, depth, device, capturable):
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(width, max(1, width // 64)) for _ in range(depth)]).to(device)
    opt = FusedAdam(model.parameters(), lr=1e-4, weight_decay=0.01, capturable=capturable)
    return amp.initialize(model, opt, opt_level=opt_level, loss_scale="dynamic", verbosity=0)


def step(model, opt, x, y):
    opt.zero_grad(set_to_none=True)
    loss = ((model(x).float() - y) ** 2).mean()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    return loss.detach()


def check_syncs(opt_level, shape, device, sizes):
    model, opt = make(opt_level, *sizes, device, capturable=True)
    x, y = torch.randn(shape, device=device), torch.randn(shape, device=device)
    for _ in range(3):
        step(model, opt, x, y)
    synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            step(model, opt, x, y)
        return "pass"
    finally:
        torch.cuda.set_sync_debug_mode(0)


def check_graph(opt_level, shape, device, sizes, repeats):
    eager_model, eager_opt = make(opt_level, *sizes, device, capturable=True)
    graph_model, graph_opt = make(opt_level, *sizes, device, capturable=True)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(shape, generator=g).to(device), torch.randn(shape, generator=g).to(device))
               for _ in range(8)]
    static_x, static_y = batches[0][0].clone(), batches[0][1].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x, y in batches[:3]:
            static_x.copy_(x)
            static_y.copy_(y)
            step(graph_model, graph_opt, static_x, static_y)
    torch.cuda.current_stream().wait_stream(side)
    for x, y in batches[:3]:
        step(eager_model, eager_opt, x, y)
    graph = torch.cuda.CUDAGraph()
    graph_opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        step(graph_model, graph_opt, static_x, static_y)
    for x, y in batches[3:]:
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
        step(eager_model, eager_opt, x, y)
    synchronize(device)
    identical = all(torch.equal(a, b) for a, b in zip(graph_model.parameters(), eager_model.parameters())) and \
        all(torch.equal(a, b) for a, b in zip(amp.master_params(graph_opt), amp.master_params(eager_opt)))
    t_eager = timed(lambda: step(eager_model, eager_opt, static_x, static_y), device, repeats)
    t_graph = timed(graph.replay, device, repeats)
    return identical, t_eager, t_graph


def main():
    p = parser(__doc__)
    p.add_argument("--opt-level", default="O2")
    args = p.parse_args()
    device = device_of(args)
    repeats = args.repeats or (3 if args.quick else 30)
    sizes = (64, 2) if args.quick else (1024, 8)  # width, depth
    shape = (4, 32, sizes[0]) if args.quick else (8, 512, sizes[0])
    env = environment(device)
    results, rows = {}, []
    if device.type != "cuda":
        model, opt = make(args.opt_level, *sizes, device, capturable=True)
        x, y = torch.randn(shape), torch.randn(shape)
        t_eager = timed(lambda: step(model, opt, x, y), device, repeats)
        results = dict(host_syncs="n/a on cpu", graph="n/a on cpu", eager_ms=t_eager)
        rows.append(["host syncs after warm-up", "n/a (cpu)"])
        rows.append(["one CUDA graph, replays == eager", "n/a (cpu)"])
        rows.append(["eager ms/step", f"{t_eager:.2f}"])
    else:
        try:
            results["host_syncs"] = check_syncs(args.opt_level, shape, device, sizes)
        except Exception as error:  # noqa: BLE001 - reported, the benchmark goes on
            results["host_syncs"] = f"fail: {type(error).__name__}: {error}"
            results["host_syncs_traceback"] = traceback.format_exc()
        try:
            identical, t_eager, t_graph = check_graph(args.opt_level, shape, device, sizes, repeats)
            results.update(graph="captured", replay_bit_identical=identical, eager_ms=t_eager, graph_ms=t_graph)
        except Exception as error:  # noqa: BLE001
            results["graph"] = f"fail: {type(error).__name__}: {error}"
            results["graph_traceback"] = traceback.format_exc()
        rows.append(["0 host syncs after warm-up (set_sync_debug_mode('error'))", results["host_syncs"][:200]])
        graph = results["graph"] if results["graph"] != "captured" else \
            ("pass" if results.get("replay_bit_identical") else "captured, but replays differ from eager")
        rows.append(["whole step in one CUDA graph, replays bit-identical to eager", graph[:200]])
        if "graph_ms" in results:
            rows.append(["eager ms/step", f"{results['eager_ms']:.2f}"])
            rows.append(["graph replay ms/step", f"{results['graph_ms']:.2f}"])
    table = markdown_table(["check", "result"], rows)
    report(args, "o2_step", f"{args.opt_level} step with FusedAdam: syncs and CUDA graph", env, results,
           f"Transformer blocks, width {sizes[0]}, depth {sizes[1]}, input {tuple(shape)}.\n\n{table}")


if __name__ == "__main__":
    main()
