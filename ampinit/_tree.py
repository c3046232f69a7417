"""Walking the nested containers (lists, tuples, namedtuples, dicts) that models take and return."""

from __future__ import annotations

import copy
from typing import Any, Iterator

import torch


def iter_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside ``value``, depth first."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from iter_tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from iter_tensors(item)


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating-point tensor cast to ``dtype``; containers are rebuilt
    with their own type (namedtuples and dict subclasses included), other objects kept."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(cast_floating(v, dtype) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(cast_floating(v, dtype) for v in value)
    if type(value) is dict:  # a comprehension, which torch.compile traces without a graph break
        return {key: cast_floating(item, dtype) for key, item in value.items()}
    if isinstance(value, dict):  # OrderedDict, defaultdict, ...: keep the type and its extras
        out = copy.copy(value)
        for key, item in value.items():
            out[key] = cast_floating(item, dtype)
        return out
    return value
