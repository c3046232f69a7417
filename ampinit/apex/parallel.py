"""``apex.parallel`` on torch: what apex-era scripts import from it.

- :class:`DistributedDataParallel` is torch's, constructed from apex's arguments (bucket
  size in elements, ``delay_allreduce``, fp32 all-reduce, gradient pre-division);
- :class:`SyncBatchNorm` is torch's, with apex's signature, and it also runs on the CPU (over
  gloo), as apex's Python implementation did; :func:`convert_syncbn_model` converts to it;
- :class:`LARC` is apex's layer-wise adaptive rate wrapper;
- :class:`Reducer` and :func:`flat_dist_call` are apex's manual all-reduce helpers.

``import apex.parallel`` resolves here under ``ampinit.install_apex_alias()``; the module also
stands for ``apex.parallel.distributed`` and ``apex.parallel.LARC``.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["DistributedDataParallel", "SyncBatchNorm", "convert_syncbn_model", "create_syncbn_process_group",
           "LARC", "Reducer", "flat_dist_call"]

logger = logging.getLogger("ampinit")


# -- DistributedDataParallel ---------------------------------------------------------------------

class _AllReduceOptions:
    """What apex's DDP did around its all-reduce that torch's default hook does not."""

    def __init__(self, process_group: Any, always_fp32: bool, predivide: float, average: bool):
        self.process_group = process_group
        self.always_fp32 = always_fp32
        self.predivide = predivide
        self.average = average


def _apex_allreduce_hook(options, bucket):  # no annotations: DDP checks them against its own types
    """A DDP communication hook with apex's arithmetic: divide by ``gradient_predivide_factor``
    before the sum, then multiply by ``predivide / world_size`` after it (``gradient_average``),
    in FP32 when ``allreduce_always_fp32``."""
    group = options.process_group if options.process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    buffer = bucket.buffer()
    work = buffer.float() if options.always_fp32 and buffer.dtype != torch.float32 else buffer
    if options.predivide != 1.0:
        work.div_(options.predivide)
    future = dist.all_reduce(work, group=group, async_op=True).get_future()

    def finish(done: torch.futures.Future) -> torch.Tensor:
        total = done.value()[0]
        if options.average:
            total.mul_(options.predivide / world)
        if total is not buffer:
            buffer.copy_(total)
        return buffer

    return future.then(finish)


class DistributedDataParallel(nn.parallel.DistributedDataParallel):
    """torch's ``DistributedDataParallel`` constructed from apex's arguments.

    ``message_size`` (elements per bucket) becomes ``bucket_cap_mb``; ``delay_allreduce=True``
    one bucket for the whole model, with parameters an iteration leaves unused taken as apex's
    end-of-backward all-reduce took them (``find_unused_parameters``); buffers are not broadcast
    (``broadcast_buffers=False``: each rank keeps its own BatchNorm statistics, as with apex);
    ``retain_allreduce_buffers=True`` gradients that are views of
    the buckets (``gradient_as_bucket_view``); ``allreduce_always_fp32``,
    ``gradient_predivide_factor`` and ``gradient_average=False`` a communication hook doing apex's
    arithmetic.  ``allreduce_trigger_params``, ``num_allreduce_streams``,
    ``allreduce_communicators``, ``gradient_average_split_factor`` and ``prof`` tune apex's own
    scheduling; torch schedules its buckets itself, so they are accepted and have no effect
    (logged).  ``shared_param`` raises, as in apex.  Extra keyword arguments go to torch's DDP
    (``device_ids``, ``find_unused_parameters``, ...).  ``enable_allreduce()`` /
    ``disable_allreduce()`` switch gradient synchronisation, like ``no_sync()``.
    """

    def __init__(self, module: nn.Module, message_size: int = 10_000_000, delay_allreduce: bool = False,
                 shared_param: Any = None, allreduce_trigger_params: Optional[Sequence[torch.Tensor]] = None,
                 retain_allreduce_buffers: bool = False, allreduce_always_fp32: bool = False,
                 num_allreduce_streams: int = 1, allreduce_communicators: Any = None, gradient_average: bool = True,
                 gradient_predivide_factor: float = 1.0, gradient_average_split_factor: Any = None,
                 prof: bool = False, **torch_ddp_kwargs: Any):
        if shared_param is not None:
            raise ValueError("shared_param is no longer supported (as in apex); remove it")
        if allreduce_trigger_params is not None and delay_allreduce:
            raise ValueError("allreduce_trigger_params and delay_allreduce=True contradict each other (as in apex)")
        if num_allreduce_streams > 1 and delay_allreduce:
            raise ValueError("num_allreduce_streams > 1 and delay_allreduce=True contradict each other (as in apex)")
        if isinstance(message_size, bool) or not isinstance(message_size, int) or message_size < 1:
            raise ValueError(f"message_size must be a positive number of elements; got {message_size!r}")
        if not gradient_predivide_factor > 0:
            raise ValueError(f"gradient_predivide_factor must be > 0; got {gradient_predivide_factor!r}")
        ignored = {name: value for name, value in (
            ("allreduce_trigger_params", allreduce_trigger_params), ("num_allreduce_streams", num_allreduce_streams),
            ("allreduce_communicators", allreduce_communicators),
            ("gradient_average_split_factor", gradient_average_split_factor), ("prof", prof))
            if value not in (None, False, 1)}
        if ignored:
            logger.info("ampinit: apex.parallel.DistributedDataParallel: %s tune apex's own scheduling and have no "
                        "effect on torch's DDP", ", ".join(sorted(ignored)))
        params = [p for p in module.parameters() if p.requires_grad]
        element_size = max((p.element_size() for p in params), default=4)
        total_mb = sum(p.numel() * p.element_size() for p in params) / 2 ** 20
        bucket_cap_mb = total_mb + 1.0 if delay_allreduce else message_size * element_size / 2 ** 20
        torch_ddp_kwargs.setdefault("bucket_cap_mb", bucket_cap_mb)
        torch_ddp_kwargs.setdefault("gradient_as_bucket_view", retain_allreduce_buffers)
        if delay_allreduce:  # apex all-reduced whatever gradients the backward produced
            torch_ddp_kwargs.setdefault("find_unused_parameters", True)
        torch_ddp_kwargs.setdefault("broadcast_buffers", False)  # apex never broadcast buffers
        super().__init__(module, **torch_ddp_kwargs)
        if allreduce_always_fp32 or gradient_predivide_factor != 1.0 or not gradient_average:
            options = _AllReduceOptions(torch_ddp_kwargs.get("process_group"), allreduce_always_fp32,
                                        float(gradient_predivide_factor), gradient_average)
            self.register_comm_hook(options, _apex_allreduce_hook)

    def enable_allreduce(self) -> None:
        self.require_backward_grad_sync = True

    def disable_allreduce(self) -> None:
        self.require_backward_grad_sync = False


# -- SyncBatchNorm ------------------------------------------------------------------------------

def _distributed(group: Any) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


class SyncBatchNorm(_BatchNorm):
    """Batch norm whose training statistics are reduced over ``process_group`` (default: all
    ranks), with apex's signature; on the GPU it is torch's ``SyncBatchNorm``, on the CPU it
    runs too (over gloo), as apex's Python implementation did.

    On the CPU the mean and variance come from an all-reduce of per-channel sums (one
    collective per training forward, differentiable).  In one process, or in eval mode, it is
    plain batch norm.  ``channel_last=True`` and ``fuse_relu=True`` needed apex's CUDA
    extension and raise.  (It is not a subclass of torch's ``SyncBatchNorm``, which
    ``DistributedDataParallel`` refuses on CPU modules.)
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group: Any = None, channel_last: bool = False,
                 fuse_relu: bool = False):
        if channel_last or fuse_relu:
            raise ValueError("channel_last=True and fuse_relu=True needed apex's CUDA syncbn extension; use the "
                             "default channels-first layout (and a separate ReLU)")
        super().__init__(num_features, eps=eps, momentum=momentum, affine=affine,
                         track_running_stats=track_running_stats)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _check_non_zero_input_channels(self, input: torch.Tensor) -> None:
        if input.size(1) == 0:
            raise ValueError("SyncBatchNorm number of input channels should be non-zero")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.device.type == "cpu":
            if self.training and _distributed(self.process_group):
                return self._forward_cpu(input)
            return super().forward(input)
        return nn.SyncBatchNorm.forward(self, input)  # torch's kernels, on this module's state

    def _forward_cpu(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        channels = input.shape[1]
        dims = [0] + list(range(2, input.dim()))
        x = input.float()
        count = torch.full((1,), x.numel() // channels, dtype=torch.float32)
        local = torch.cat([x.sum(dims), (x * x).sum(dims), count])
        total = _AllReduceSum.apply(local, self.process_group or dist.group.WORLD)
        n = total[-1]
        mean = total[:channels] / n
        var = (total[channels:2 * channels] / n - mean * mean).clamp(min=0)
        if self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach() * n / (n - 1).clamp(min=1))
        shape = [1, channels] + [1] * (input.dim() - 2)
        out = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            out = out * self.weight.float().view(shape) + self.bias.float().view(shape)
        return out.to(input.dtype)

    def _update_running_stats(self, mean: torch.Tensor, unbiased_var: torch.Tensor) -> None:
        with torch.no_grad():
            self.num_batches_tracked.add_(1)
            factor = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
            self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
            self.running_var.mul_(1 - factor).add_(unbiased_var.to(self.running_var.dtype), alpha=factor)


class _AllReduceSum(torch.autograd.Function):
    """Sum over ranks, differentiable: every rank's loss depends on every rank's input, so the
    gradient of an input is the sum of the ranks' output gradients."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        total = tensor.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        total = grad.clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None


def convert_syncbn_model(module: nn.Module, process_group: Any = None, channel_last: bool = False) -> nn.Module:
    """Replace every batch-norm layer of ``module`` by :class:`SyncBatchNorm` (apex's function):
    running statistics are taken over, affine parameters copied.  Returns the converted module
    (a new one if ``module`` itself is a batch-norm layer)."""
    if channel_last:
        raise ValueError("channel_last=True needed apex's CUDA syncbn extension")
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        converted = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                  module.track_running_stats, process_group)
        if module.affine:
            with torch.no_grad():
                converted.weight = nn.Parameter(module.weight.detach().clone(), module.weight.requires_grad)
                converted.bias = nn.Parameter(module.bias.detach().clone(), module.bias.requires_grad)
        converted.running_mean = module.running_mean
        converted.running_var = module.running_var
        converted.num_batches_tracked = module.num_batches_tracked
        converted.train(module.training)
        device = next(itertools.chain(module.parameters(), module.buffers()), torch.empty(0)).device
        return converted.to(device)
    for name, child in module.named_children():
        module.add_module(name, convert_syncbn_model(child, process_group))
    return module


def create_syncbn_process_group(group_size: int) -> Any:
    """The process group of ``group_size`` consecutive ranks holding this rank (0: all ranks)."""
    if group_size == 0:
        return None
    world, rank = dist.get_world_size(), dist.get_rank()
    if group_size < 0 or world % group_size:
        raise ValueError(f"group_size {group_size} must divide the world size {world}")
    mine = None
    for start in range(0, world, group_size):
        group = dist.new_group(list(range(start, start + group_size)))  # every rank creates every group
        if start <= rank < start + group_size:
            mine = group
    return mine


# -- LARC -----------------------------------------------------------------------------------------

class LARC:
    """Layer-wise adaptive rate control around an optimizer (apex's ``LARC``).

    Not an optimizer itself: it shares ``param_groups`` and ``state`` with ``optimizer`` and,
    at each :meth:`step`, rescales each parameter's gradient by its trust ratio
    ``trust_coefficient * ||p|| / (||g|| + weight_decay * ||p|| + eps)`` (with ``clip``, capped
    so that the step never exceeds the group's ``lr``), folding the group's weight decay into the
    gradient, then steps ``optimizer`` with its weight decay set to 0 for that call.  Parameters
    whose weight or gradient norm is 0 keep their gradient.  ``ampinit.initialize`` accepts it
    where it takes an optimizer.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, trust_coefficient: float = 0.02, clip: bool = True,
                 eps: float = 1e-8):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"LARC wraps a torch.optim.Optimizer; got {type(optimizer).__name__}")
        self.optim = optimizer
        self.trust_coefficient = trust_coefficient
        self.clip = clip
        self.eps = eps

    def __getstate__(self) -> dict:
        return self.optim.__getstate__()

    def __setstate__(self, state: dict) -> None:
        self.optim.__setstate__(state)

    @property
    def state(self) -> Dict[torch.Tensor, Any]:
        return self.optim.state

    def __repr__(self) -> str:
        return f"LARC({self.optim!r})"

    @property
    def param_groups(self) -> List[dict]:
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, value: List[dict]) -> None:
        self.optim.param_groups = value

    def state_dict(self) -> dict:
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optim.load_state_dict(state_dict)

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        self.optim.zero_grad(*args, **kwargs)

    def add_param_group(self, param_group: dict) -> None:
        self.optim.add_param_group(param_group)

    def step(self) -> Any:
        decays = []
        with torch.no_grad():
            for group in self.optim.param_groups:
                decay = group.get("weight_decay", 0)
                decays.append(decay)
                group["weight_decay"] = 0
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    param_norm = torch.linalg.vector_norm(p.float())
                    grad_norm = torch.linalg.vector_norm(p.grad.float())
                    adaptive = self.trust_coefficient * param_norm / (grad_norm + param_norm * decay + self.eps)
                    if self.clip:
                        adaptive = torch.clamp(adaptive / group["lr"], max=1.0)
                    # Only where both norms are non-zero (no host read: a 0/1 mask on the device).
                    apply = (param_norm != 0) & (grad_norm != 0)
                    scaled = (p.grad + decay * p) * adaptive
                    p.grad.copy_(torch.where(apply, scaled, p.grad))
        try:
            return self.optim.step()
        finally:
            for group, decay in zip(self.optim.param_groups, decays):
                group["weight_decay"] = decay


# -- manual all-reduce helpers ----------------------------------------------------------------------

def flat_dist_call(tensors: Sequence[torch.Tensor], call: Callable, extra_args: Optional[Iterable[Any]] = None) -> None:
    """Run a collective ``call(flat, *extra_args)`` on the tensors flattened by dtype and
    device, then copy the results back; an ``all_reduce`` is averaged over the world, as in
    apex."""
    buckets: "OrderedDict[tuple, List[torch.Tensor]]" = OrderedDict()
    for tensor in tensors:
        buckets.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for bucket in buckets.values():
        flat = torch._utils._flatten_dense_tensors([t.detach() for t in bucket])
        call(flat, *(extra_args or ()))
        if call is dist.all_reduce:
            flat.div_(dist.get_world_size())
        with torch.no_grad():
            for tensor, value in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket)):
                tensor.copy_(value)


class Reducer:
    """apex's manual gradient averaging: broadcasts rank 0's parameters on construction;
    :meth:`reduce` averages the gradients over all ranks (call it after ``backward``)."""

    def __init__(self, module_or_grads_list: Any):
        if isinstance(module_or_grads_list, nn.Module):
            self.module: Optional[nn.Module] = module_or_grads_list
            flat_dist_call([p.data for p in self.module.parameters()], dist.broadcast, (0,))
        else:
            self.module = None
            self.grads = list(module_or_grads_list)

    def reduce(self) -> None:
        if self.module is not None:
            grads = [p.grad.data for p in self.module.parameters() if p.grad is not None]
        else:
            grads = self.grads
        flat_dist_call(grads, dist.all_reduce)
