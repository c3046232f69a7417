"""``apex_C`` on ampinit: flattening a list of tensors into one buffer and back.

In apex, ``apex_C`` was a small C++ extension (``csrc/flatten_unflatten.cpp``) with two
functions that wrapped torch's own ``flatten_dense_tensors`` / ``unflatten_dense_tensors``;
apex's DDP and NVIDIA's BERT scripts used them to all-reduce many gradients as one buffer.
Both are emulated here with public torch ops and give the same results as
``torch._utils._flatten_dense_tensors`` / ``_unflatten_dense_tensors``:

- :func:`flatten` returns a new contiguous 1-D tensor (for a single contiguous tensor, a 1-D
  view of it, as torch's does);
- :func:`unflatten` returns a list (apex's extension returned a list; torch's Python helper
  a tuple) of views into ``flat``, shaped like ``like_tensors`` (contiguous); an empty
  tensor comes back as a new empty tensor.

Nothing here reads device values, so there is no host sync.  Differences from apex: empty
input lists and a buffer too short for ``like_tensors`` raise ``ValueError`` (apex raised a
RuntimeError from ``cat`` / ``narrow``).
"""

from __future__ import annotations

from typing import List, Sequence

import torch

__all__ = ["flatten", "unflatten"]


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The elements of ``tensors``, in order, in one contiguous 1-D tensor."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("apex_C.flatten: got no tensors to flatten")
    flat = [tensor.contiguous().view(-1) for tensor in tensors]
    return flat[0] if len(flat) == 1 else torch.cat(flat)


def unflatten(flat: torch.Tensor, like_tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """Views into the 1-D ``flat``, one per tensor of ``like_tensors`` and shaped like it."""
    like_tensors = list(like_tensors)
    needed = sum(tensor.numel() for tensor in like_tensors)
    if flat.dim() != 1 or flat.numel() < needed:
        raise ValueError(f"apex_C.unflatten: flat must be a 1-D tensor of at least {needed} elements, "
                         f"got shape {tuple(flat.shape)}")
    views = []
    offset = 0
    for tensor in like_tensors:
        if tensor.numel() == 0:
            # An empty result owns no part of flat, as torch's does.
            views.append(flat.new_empty(tensor.shape))
            continue
        views.append(flat.narrow(0, offset, tensor.numel()).view(tensor.shape))
        offset += tensor.numel()
    return views
