"""A whole O2 training step with ampinit.optim.FusedAdam on a GPU, through the public API only
(``ampinit.initialize``, ``ampinit.scale_loss``, ``optimizer.step()``): no host sync, and one
CUDA graph that replays bit for bit what eager steps compute.

These hold the Python core (scale_loss, step) to the kernels' promise: every op is on the
device and capturable.  Skipped without a GPU or without the compiled CUDA kernels.
"""
import pytest
import torch
from torch import nn

import ampinit as amp
from ampinit import _ext
from ampinit.optim import FusedAdam

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
    pytest.mark.skipif(_ext.EXTENSION is None or not getattr(_ext.EXTENSION, "with_cuda", False),
                       reason="needs the compiled CUDA kernels"),
]


class MLP(nn.Module):
    def __init__(self, width=256):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, width), nn.GELU(), nn.LayerNorm(width), nn.Linear(width, 64))

    def forward(self, x):
        return self.net(x)


def _setup(opt_level="O2", capturable=True, seed=0, master_weights=None):
    torch.manual_seed(seed)
    model = MLP().cuda()
    opt = FusedAdam(model.parameters(), lr=1e-3, weight_decay=0.01, capturable=capturable)
    extra = {} if master_weights is None else {"master_weights": master_weights}
    return amp.initialize(model, opt, opt_level=opt_level, loss_scale="dynamic", verbosity=0, **extra)


# (opt_level, master_weights): fp16 and bf16 models with FP32 masters, and bf16 weights whose
# masters are kept as remainders (joined, updated and split inside the fused kernel)
RECIPES = [("O2", None), ("O5", None), ("O5", "remainder")]


def _batches(count, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(32, 64, generator=g).cuda(), torch.randn(32, 64, generator=g).cuda()) for _ in range(count)]


def _step(model, opt, x, y):
    opt.zero_grad(set_to_none=True)
    loss = ((model(x).float() - y) ** 2).mean()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    return loss.detach()


@pytest.mark.parametrize("opt_level, master_weights", RECIPES)
def test_o2_step_with_fused_adam_makes_no_host_sync(opt_level, master_weights):
    model, opt = _setup(opt_level, master_weights=master_weights)
    batches = _batches(6)
    for x, y in batches[:3]:  # warm-up: state, flags and hyper-parameter tensors are made here
        _step(model, opt, x, y)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x, y in batches[3:]:
            _step(model, opt, x, y)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("opt_level, master_weights", RECIPES)
def test_o2_step_captures_in_one_graph_and_replays_bit_identically(opt_level, master_weights):
    """Eager steps on one model, graph replays of one captured step on its twin, same data:
    the same parameters bit for bit (the loss scale and the skip decision stay on the device)."""
    eager_model, eager_opt = _setup(opt_level, master_weights=master_weights)
    graph_model, graph_opt = _setup(opt_level, master_weights=master_weights)
    batches = _batches(8)
    static_x, static_y = (t.clone() for t in batches[0])

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for x, y in batches[:3]:  # warm-up, eagerly, on both
            static_x.copy_(x)
            static_y.copy_(y)
            _step(graph_model, graph_opt, static_x, static_y)
    torch.cuda.current_stream().wait_stream(stream)
    for x, y in batches[:3]:
        _step(eager_model, eager_opt, x, y)

    graph = torch.cuda.CUDAGraph()
    graph_opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = _step(graph_model, graph_opt, static_x, static_y)

    for x, y in batches[3:]:
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
        eager_loss = _step(eager_model, eager_opt, x, y)
        torch.cuda.synchronize()
        assert torch.equal(static_loss, eager_loss)
    for a, b in zip(graph_model.parameters(), eager_model.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(amp.master_params(graph_opt), amp.master_params(eager_opt)):
        assert torch.equal(a, b)
    graph_state, eager_state = graph_model.state_dict(), eager_model.state_dict()  # FP32 masters, joined
    assert all(torch.equal(graph_state[name], value) for name, value in eager_state.items())
