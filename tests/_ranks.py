"""Run a test's worker on several CPU processes joined by gloo (``torch.distributed``).

``spawn(worker, *args)`` starts the ranks; each runs ``worker(rank, *args)`` inside an
initialized process group and saves what the test compares to files.  Every rank then frees
what the worker built (DDP's reducer, FSDP's state hold the group), waits for the others, and
destroys the group before leaving, in that order.

A rank leaves with ``os._exit(0)`` after that, skipping the interpreter's teardown: about one
CI run in three lost a rank to ``SIGABRT`` ("terminate called without an active exception",
from C++) after every result had been saved, in five different two-rank tests, and never in a
test's own code.  The tests judge the saved results; the abort is in torch/gloo's teardown,
whose cause stayed unexplained.  ``faulthandler`` is on in every rank, so that an abort before
``os._exit`` (in ``destroy_process_group``, say) shows where it happened.
"""
import faulthandler
import gc
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(worker, *args, nprocs: int = WORLD) -> None:
    """``worker(rank, *args)`` on ``nprocs`` processes, one gloo group; raises what a rank raised."""
    mp.spawn(_run_rank, args=(worker, free_port(), nprocs, args), nprocs=nprocs, join=True)


def _run_rank(rank, worker, port, world, args):
    faulthandler.enable()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    worker(rank, *args)  # an exception leaves through mp.spawn, which stops the other ranks
    gc.collect()  # what the worker built and a reference cycle still holds goes before the group
    dist.barrier()  # leave together: no rank tears gloo down under a peer still communicating
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
