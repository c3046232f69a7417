"""torch.distributed on CPU over gloo, two processes spawned by the test.

DDP in apex's order (initialize, then wrap): an overflow on one rank reaches every rank
through the gradient all-reduce, so all ranks skip the same step and stay identical.
"""
import logging
import os

import pytest
import torch
from _ranks import WORLD, spawn
from torch import nn

import ampinit as amp
from ampinit.optim import FusedAdam

POISON_STEP, POISON_RANK, STEPS = 4, 1, 10


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def ddp_worker(rank, level, out_dir):
    torch.manual_seed(0)  # same initial weights on every rank
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    ddp = nn.parallel.DistributedDataParallel(model)
    data = torch.Generator().manual_seed(100 + rank)  # different data per rank
    skipped_at = []
    for step in range(STEPS):
        x, y = torch.randn(16, 8, generator=data), torch.randn(16, 4, generator=data)
        loss = ((ddp(x).float() - y) ** 2).mean()
        if step == POISON_STEP and rank == POISON_RANK:
            loss = loss * float("inf")
        opt.zero_grad()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        before = opt.amp.skipped_steps
        opt.step()
        if opt.amp.skipped_steps != before:
            skipped_at.append(step)
    torch.save({"params": [p.detach() for p in model.parameters()],
                "masters": [p.detach() for p in amp.master_params(opt)],
                "scale": opt.amp.loss_scale(), "skipped_at": skipped_at},
               os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("level", ["O1", "O2", "O5"])
def test_ddp_overflow_on_one_rank_skips_everywhere(level, tmp_path):
    spawn(ddp_worker, level, str(tmp_path))
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for result in results:
        assert result["skipped_at"] == [POISON_STEP]
    assert results[0]["scale"] == results[1]["scale"] == (2.0 ** 15 if level != "O5" else 1.0)
    for key in ("params", "masters"):
        for a, b in zip(results[0][key], results[1][key]):
            assert torch.equal(a, b) and torch.isfinite(a).all()


def in_block_watch_worker(rank, wrapper, out_dir):
    """One rank: DDP (buckets copied back, or gradients as bucket views) and FSDP2 write the
    reduced gradients in final callbacks of the backward.  The watch on gradients changed inside
    the scale_loss block must look after them, or every such step would be logged."""
    from torch.distributed.fsdp import fully_shard
    warnings = _Warnings()
    logger = logging.getLogger("ampinit")
    logger.addHandler(warnings)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
        if wrapper == "fsdp2":
            fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
        run = model if wrapper == "fsdp2" else nn.parallel.DistributedDataParallel(
            model, gradient_as_bucket_view=wrapper == "ddp-bucket-view")
        for _ in range(3):
            x, y = torch.randn(16, 8), torch.randn(16, 4)
            opt.zero_grad()
            with amp.scale_loss(((run(x).float() - y) ** 2).mean(), opt) as scaled:
                scaled.backward()
            opt.step()
        torch.save({"warnings": list(warnings.messages)}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        logger.removeHandler(warnings)


@pytest.mark.parametrize("wrapper", ["ddp", "ddp-bucket-view", "fsdp2"])
def test_gradients_reduced_after_the_backward_are_not_taken_for_changes_in_the_block(wrapper, tmp_path):
    spawn(in_block_watch_worker, wrapper, str(tmp_path), nprocs=1)
    messages = torch.load(tmp_path / "rank0.pt")["warnings"]
    assert not any("changed inside" in message for message in messages), messages


def seeds_worker(rank, level, out_dir):
    """apex's DDP example: no common seed, initialize, then wrap in DDP."""
    torch.manual_seed(rank)  # different initial weights per rank
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    if level == "O5-remainder":  # masters as bf16 weights + remainders: those must agree too
        opt = FusedAdam(model.parameters(), lr=1e-2, eps=1e-4, adam_w_mode=False)
        model, opt = amp.initialize(model, opt, opt_level="O5", master_weights="remainder", verbosity=0)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-4)
        model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    ddp = nn.parallel.DistributedDataParallel(model)
    for step in range(STEPS):
        x, y = _shard(step, rank)
        opt.zero_grad()
        with amp.scale_loss(((ddp(x).float() - y) ** 2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()
    torch.save({"params": [p.detach() for p in model.parameters()],
                "masters": [p.detach() for p in amp.master_params(opt)],
                "fp32": list(model.state_dict().values())}, os.path.join(out_dir, f"rank{rank}.pt"))


def _shard(step, rank):
    data = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 8, generator=data), torch.randn(16, 4, generator=data)


@pytest.mark.parametrize("level", ["O2", "O5", "O5-remainder"])
def test_ddp_ranks_seeded_differently_end_identical_and_train_like_one_process(level, tmp_path):
    spawn(seeds_worker, level, str(tmp_path))
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for key in ("params", "masters", "fp32"):
        for a, b in zip(results[0][key], results[1][key]):
            assert torch.equal(a, b), key
    # one process, rank 0's weights, both shards' data: DDP averages the ranks' gradients
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    model, opt = amp.initialize(model, torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-4),
                                opt_level=level.split("-")[0], verbosity=0)
    for step in range(STEPS):
        opt.zero_grad()
        losses = [((model(x).float() - y) ** 2).mean() for x, y in (_shard(step, r) for r in range(WORLD))]
        with amp.scale_loss(sum(losses) / WORLD, opt) as scaled:
            scaled.backward()
        opt.step()
    for a, b in zip(results[0]["masters"], amp.master_params(opt)):
        torch.testing.assert_close(a.float(), b.detach(), rtol=2e-2, atol=5e-3)


def fsdp_worker(rank, case, out_dir):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32) \
        if case == "fsdp-fp16-O0-dynamic" else MixedPrecisionPolicy()
    for layer in (model[0], model[2]):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if case == "O2-rejected":
        try:
            amp.initialize(model, opt, opt_level="O2", verbosity=0)
        except ValueError as error:
            torch.save({"error": str(error)}, os.path.join(out_dir, f"rank{rank}.pt"))
        return
    kwargs = dict(opt_level="O1") if case == "O1" else dict(opt_level="O0", loss_scale="dynamic")
    model, opt = amp.initialize(model, opt, verbosity=0, **kwargs)
    data = torch.Generator().manual_seed(100 + rank)
    skipped_at = []
    for step in range(STEPS):
        x, y = torch.randn(16, 8, generator=data), torch.randn(16, 4, generator=data)
        opt.zero_grad()
        with amp.scale_loss(((model(x).float() - y) ** 2).mean(), opt) as scaled:
            scaled.backward()
            if step == POISON_STEP and rank == POISON_RANK:
                # inf in this rank's shard only: the other rank's shard is clean
                model[2].weight.grad.to_local()[0, 0] = float("inf")
        before = opt.amp.skipped_steps
        opt.step()
        if opt.amp.skipped_steps != before:
            skipped_at.append(step)
    torch.save({"params": [p.full_tensor().detach() for p in model.parameters()],
                "scale": opt.amp.loss_scale(), "skipped_at": skipped_at,
                "overflow_params": opt.amp.last_overflow_params},
               os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("case", ["O1", "fsdp-fp16-O0-dynamic"])
def test_fsdp2_sharded_overflow_on_one_shard_skips_everywhere(case, tmp_path):
    spawn(fsdp_worker, case, str(tmp_path))
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for result in results:
        assert result["skipped_at"] == [POISON_STEP]
        assert result["scale"] == 2.0 ** 15
    assert results[POISON_RANK]["overflow_params"] == ["2.weight"]  # found in the poisoned shard
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b) and torch.isfinite(a).all()


def test_fsdp2_casting_levels_are_rejected_with_the_recipe(tmp_path):
    spawn(fsdp_worker, "O2-rejected", str(tmp_path))
    error = torch.load(tmp_path / "rank0.pt")["error"]
    assert "MixedPrecisionPolicy" in error and "loss_scale='dynamic'" in error
