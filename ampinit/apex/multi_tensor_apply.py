"""``apex.multi_tensor_apply`` on ampinit: the applier that apex-era code calls amp_C ops through.

In apex this module held ``MultiTensorApply``, a thin callable around the CUDA launcher of
``csrc/multi_tensor_apply.cuh``: ``applier(op, noop_flag, tensor_lists, *args)`` became
``op(chunk_size, noop_flag, tensor_lists, *args)``, and the launcher split the lists into
chunks of ``chunk_size`` elements and into launches of a bounded number of tensors.  Its
module-level ``multi_tensor_applier`` (chunk size 2048 * 32) is what Megatron-LM, NeMo and
apex's own optimizers import.

Here the call is the same, and ``op`` is normally one of :mod:`ampinit.apex.amp_C`'s
functions, which run on ampinit's kernels (``ampinit.ops``).  Those kernels chunk by
themselves, so ``chunk_size`` is passed on and ignored; there is no per-launch tensor limit,
and any number of tensors goes in one call.

What apex's launcher refused is refused here too, before anything runs, with a ``TypeError``
or ``ValueError`` instead of a CUDA error: lists that are not lists of tensors, an empty first
list, lists of different lengths, tensors of one row (the i-th tensor of every list) with
different numbers of elements, and tensors (or the noop flag) on different devices.  Unlike
apex, CPU tensors and non-contiguous tensors are accepted (the ops run on the CPU kernels and
on dense copies respectively).

No host-device synchronisation happens in this module: the checks read only tensor metadata.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

__all__ = ["MultiTensorApply", "multi_tensor_applier"]


def check_tensor_lists(noop_flag: Any, tensor_lists: Any, depth: Optional[int] = None,
                       where: str = "multi_tensor_applier", floating: bool = False) -> torch.device:
    """Validate ``noop_flag`` and ``tensor_lists`` as apex's launcher did; return the device.

    ``depth``, when given, is the number of lists the op takes; ``floating`` requires
    floating-point tensors.  Only metadata is read.
    """
    if not isinstance(noop_flag, torch.Tensor):
        raise TypeError(f"{where}: noop_flag must be a tensor (apex used a 1-element int32 tensor), "
                        f"got {type(noop_flag).__name__}")
    if noop_flag.numel() < 1:
        raise ValueError(f"{where}: noop_flag must have at least one element")
    if isinstance(tensor_lists, torch.Tensor) or not isinstance(tensor_lists, (list, tuple)):
        raise TypeError(f"{where}: tensor_lists must be a list of lists of tensors, "
                        f"got {type(tensor_lists).__name__}")
    if depth is not None and len(tensor_lists) != depth:
        raise ValueError(f"{where}: expected {depth} tensor list(s), got {len(tensor_lists)}")
    if len(tensor_lists) == 0:
        raise ValueError(f"{where}: tensor_lists is empty")
    for index, tensors in enumerate(tensor_lists):
        if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
            raise TypeError(f"{where}: tensor_lists[{index}] must be a list of tensors, "
                            f"got {type(tensors).__name__}")
    length = len(tensor_lists[0])
    if length == 0:
        raise ValueError(f"{where}: the first tensor list is empty (apex's launcher needs at least one tensor)")
    for index, tensors in enumerate(tensor_lists):
        if len(tensors) != length:
            raise ValueError(f"{where}: all tensor lists must be equally long; list 0 has {length} tensors, "
                             f"list {index} has {len(tensors)}")
    first = tensor_lists[0][0]
    if not isinstance(first, torch.Tensor):
        raise TypeError(f"{where}: tensor_lists[0][0] is a {type(first).__name__}, not a tensor")
    device = first.device
    for row in range(length):
        numel = None
        for index, tensors in enumerate(tensor_lists):
            tensor = tensors[row]
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{where}: tensor_lists[{index}][{row}] is a {type(tensor).__name__}, not a tensor")
            if tensor.device != device:
                raise ValueError(f"{where}: tensor_lists[{index}][{row}] is on {tensor.device}, but "
                                 f"tensor_lists[0][0] is on {device}; all tensors must be on one device")
            if tensor.layout != torch.strided:
                raise TypeError(f"{where}: tensor_lists[{index}][{row}] has layout {tensor.layout}; only dense "
                                "tensors are supported")
            if floating and not tensor.is_floating_point():
                raise TypeError(f"{where}: tensor_lists[{index}][{row}] is {tensor.dtype}; the op takes "
                                "floating-point tensors (float32, float16, bfloat16)")
            if numel is None:
                numel = tensor.numel()
            elif tensor.numel() != numel:
                raise ValueError(f"{where}: the tensors at index {row} have different numbers of elements "
                                 f"({numel} in list 0, {tensor.numel()} in list {index})")
    if noop_flag.device != device:
        raise ValueError(f"{where}: noop_flag is on {noop_flag.device}, the tensors on {device}; "
                         "put the flag on the tensors' device")
    return device


def rows_of_one_shape(tensor_lists: Sequence[Sequence[torch.Tensor]], where: str) -> list:
    """``tensor_lists`` with each row whose tensors differ in shape (of one numel: a (4, 4)
    gradient beside a (16,) slice of a flat buffer) given as flat views: apex's kernels read
    every tensor as flat memory, while ampinit's ops take one shape per row.  A tensor that has
    no flat view (not contiguous) is refused: apex would have read it in the wrong order."""
    lists = [list(tensors) for tensors in tensor_lists]
    for row in range(len(lists[0]) if lists else 0):
        shape = lists[0][row].shape
        if all(tensors[row].shape == shape for tensors in lists):
            continue
        for index, tensors in enumerate(lists):
            try:
                tensors[row] = tensors[row].view(-1)
            except RuntimeError:
                raise ValueError(f"{where}: tensor_lists[{index}][{row}] has shape {tuple(tensors[row].shape)}, "
                                 f"another tensor of its row {tuple(shape)}, and it is not contiguous: apex reads "
                                 "such a row as flat memory; pass contiguous tensors (.contiguous())") from None
    return lists


class MultiTensorApply:
    """``applier(op, noop_flag_buffer, tensor_lists, *args)`` calls
    ``op(chunk_size, noop_flag_buffer, tensor_lists, *args)`` and returns its result."""

    available = True
    warned = False

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = int(chunk_size)

    def check_avail(self) -> None:
        """apex raised here when its extension was not built; ampinit's ops always run (the
        pure-PyTorch fallback stands in for missing kernels)."""
        if not MultiTensorApply.available:  # pragma: no cover - never False in ampinit
            raise RuntimeError("ampinit's multi-tensor ops are unavailable")

    def __call__(self, op: Callable[..., Any], noop_flag_buffer: torch.Tensor,
                 tensor_lists: Sequence[Sequence[torch.Tensor]], *args: Any) -> Any:
        self.check_avail()
        # amp_C's ops validate their own arguments (with their depth); anything else is
        # checked here, as apex's launcher would have.
        if not getattr(op, "_ampinit_checks_lists", False):
            check_tensor_lists(noop_flag_buffer, tensor_lists)
        return op(self.chunk_size, noop_flag_buffer, tensor_lists, *args)

    def __repr__(self) -> str:
        return f"MultiTensorApply(chunk_size={self.chunk_size})"


multi_tensor_applier = MultiTensorApply(2048 * 32)
