"""Agreement across ranks when gradients are sharded (FSDP2 / DTensor).

With replicated gradients (DDP) every rank holds the same all-reduced gradients, so every
rank finds the same inf/NaN.  With sharded gradients each rank checks only its own shard,
so ``found_inf`` must be all-reduced (MAX) over the shards' process groups before the skip
decision and the scale update; otherwise one rank skips a step that another takes.
"""

from __future__ import annotations

from typing import Iterable, List

import torch

try:  # torch builds without distributed support have no DTensor
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    dist = None
    DTensor = ()

__all__ = ["is_sharded", "local", "shard_groups", "all_reduce_found_inf_"]


def is_sharded(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, DTensor)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a view: in-place ops write through), else the tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def shard_groups(params: Iterable[torch.Tensor]) -> List["dist.ProcessGroup"]:
    """The process groups over which the DTensor parameters are laid out, one each."""
    groups, seen = [], set()
    for param in params:
        if isinstance(param, DTensor):
            mesh = param.device_mesh
            for dim in range(mesh.ndim):
                group = mesh.get_group(dim)
                if id(group) not in seen:
                    seen.add(id(group))
                    groups.append(group)
    return groups


def all_reduce_found_inf_(found_inf: torch.Tensor, groups: List["dist.ProcessGroup"]) -> None:
    """``found_inf = max over every rank of the groups`` (a collective, no host sync)."""
    for group in groups:
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
