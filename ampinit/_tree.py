"""Walking the nested containers (lists, tuples, namedtuples, dicts, dataclasses) that models take
and return."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Iterator, List, Optional, Set

import torch


def iter_tensors(value: Any, _open: Optional[Set[int]] = None) -> Iterator[torch.Tensor]:
    """Every tensor inside ``value``, depth first (a dataclass that contains itself, once)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from iter_tensors(item, _open)
    elif isinstance(value, dict):
        for item in value.values():
            yield from iter_tensors(item, _open)
    elif _is_dataclass_instance(value):
        _open = set() if _open is None else _open
        if id(value) in _open:
            return
        _open.add(id(value))
        for name in _attributes(value):
            yield from iter_tensors(getattr(value, name), _open)
        _open.discard(id(value))


def _is_dataclass_instance(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _attributes(value: Any) -> List[str]:
    """A dataclass's fields that are set, and the attributes ``__post_init__`` added."""
    names = [field.name for field in dataclasses.fields(value) if hasattr(value, field.name)]
    extra = getattr(value, "__dict__", {})
    return names + [name for name in extra if name not in names]


def cast_floating(value: Any, dtype: torch.dtype, _open: Optional[Set[int]] = None) -> Any:
    """``value`` with every floating-point tensor cast to ``dtype``; containers are rebuilt
    with their own type (namedtuples, dict subclasses and dataclasses included: a shallow copy
    whose set fields and other attributes are replaced, frozen ones too, ``__post_init__`` not
    run again; a dataclass that contains itself is kept as it is), other objects kept."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(cast_floating(v, dtype, _open) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(cast_floating(v, dtype, _open) for v in value)
    if type(value) is dict:  # a comprehension, which torch.compile traces without a graph break
        return {key: cast_floating(item, dtype, _open) for key, item in value.items()}
    if isinstance(value, dict):  # OrderedDict, defaultdict, ...: keep the type and its extras
        out = copy.copy(value)
        for key, item in value.items():
            out[key] = cast_floating(item, dtype, _open)
        return out
    if _is_dataclass_instance(value):
        _open = set() if _open is None else _open
        if id(value) in _open:
            return value  # a cycle: its own reference stays
        _open.add(id(value))
        try:
            out = copy.copy(value)
            for name in _attributes(value):
                object.__setattr__(out, name, cast_floating(getattr(value, name), dtype, _open))
        finally:
            _open.discard(id(value))
        return out
    return value
