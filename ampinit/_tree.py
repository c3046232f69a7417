"""Walking the nested containers (lists, tuples, namedtuples, dicts, dataclasses) that models take
and return."""

from __future__ import annotations

import copy
import dataclasses
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
    elif _is_dataclass_instance(value):
        for field in dataclasses.fields(value):
            yield from iter_tensors(getattr(value, field.name))


def _is_dataclass_instance(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating-point tensor cast to ``dtype``; containers are rebuilt
    with their own type (namedtuples, dict subclasses and dataclasses included: a shallow copy
    with its fields replaced, frozen ones too, ``__post_init__`` not run again), other objects
    kept."""
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
    if _is_dataclass_instance(value):
        out = copy.copy(value)
        for field in dataclasses.fields(value):
            object.__setattr__(out, field.name, cast_floating(getattr(value, field.name), dtype))
        return out
    return value
