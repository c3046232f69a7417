"""Distributed data parallel with ampinit on CPU, launched by torchrun.

    torchrun --nproc_per_node 2 examples/ddp_torchrun.py
    torchrun --nproc_per_node 2 examples/ddp_torchrun.py --opt-level O5 --steps 100
    torchrun --nproc_per_node 2 examples/ddp_torchrun.py --device cuda   # one GPU per rank, NCCL

apex's order: ``amp.initialize`` first, then wrap the returned model in
``DistributedDataParallel``.  Rank 1 plants an overflow at ``--overflow-step``: the gradient
all-reduce carries it to every rank, so all ranks skip that step and stay identical.
"""

import argparse
import gc
import logging
import os

import torch
import torch.distributed as dist
from torch import nn

import ampinit as amp
from ampinit.monitor import TrainingMonitor


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default="O2", choices=list(amp.OPT_LEVELS))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--overflow-step", type=int, default=20)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--no-bar", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    torch.set_num_threads(1)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)  # identical initial weights on every rank
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 1)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level, verbosity=0)
    ddp_model = nn.parallel.DistributedDataParallel(model)
    monitor = TrainingMonitor(optimizer, total=args.steps, desc=f"rank 0 {args.opt_level}",
                              show=rank == 0 and not args.no_bar)

    data = torch.Generator().manual_seed(1234 + rank)  # each rank its own shard of data
    w_true = torch.randn(32, 1, generator=torch.Generator().manual_seed(7))
    for step in range(1, args.steps + 1):
        x = torch.randn(64, 32, generator=data).to(device)
        loss = ((ddp_model(x).float() - x @ w_true.to(device)) ** 2).mean()
        if step == args.overflow_step and rank == 1:
            loss = loss * float("inf")
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        if rank == 0:
            monitor.update(loss)
        if rank == 0 and args.no_bar and (step % 10 == 0 or step == args.steps):
            print(f"step {step:4d} | loss {loss.item():8.4f} | loss scale {optimizer.amp.loss_scale():8g} "
                  f"| skipped steps {optimizer.amp.skipped_steps}", flush=True)

    # every rank holds the same weights: compare a checksum across ranks
    monitor.close()
    checksum = torch.stack([p.detach().float().sum() for p in model.parameters()]).sum().reshape(1)
    gathered = [torch.zeros(1, device=device) for _ in range(world)]
    dist.all_gather(gathered, checksum)
    if rank == 0:
        same = all(torch.equal(g, gathered[0]) for g in gathered)
        print(f"{world} ranks, weights identical across ranks: {same}; "
              f"skipped {optimizer.amp.skipped_steps} step(s)", flush=True)
    # DDP's reducer holds the process group (so does the last graph, through its hooks): free them
    # before the group goes, then leave together (a rank tearing gloo down while its peer is still
    # communicating aborts at exit)
    del ddp_model, loss, scaled_loss
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
