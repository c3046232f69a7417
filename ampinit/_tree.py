"""Walking the nested containers (lists, tuples, namedtuples, dicts, dataclasses) that models take
and return."""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Mapping
from typing import Any, Iterator, List, Optional, Set

import torch

logger = logging.getLogger("ampinit")


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


def cast_floating(value: Any, dtype: torch.dtype, _open: Optional[Set[int]] = None, batch_objects: bool = False) -> Any:
    """``value`` with every floating-point tensor cast to ``dtype``; containers are rebuilt
    with their own type (namedtuples, dict subclasses and dataclasses included: a shallow copy
    whose set fields and other attributes are replaced, frozen ones too, ``__post_init__`` not
    run again; a dataclass that contains itself is kept as it is), other objects kept.

    With ``batch_objects`` (the inputs of a cast model), another object with a ``to`` method (a
    batch class: maskrcnn-benchmark's ``ImageList``) is cast by ``value.to(dtype)``, as apex cast
    them, if every tensor among its attributes is floating point: a ``to`` maps over all of them,
    and would turn integer ones (labels, a flex-attention ``BlockMask``'s indices) into floats.
    Modules, mappings and torch's own classes are left alone, and so is an object whose ``to``
    refuses a dtype; one whose ``to`` works in place (returns None) is returned, cast."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(cast_floating(v, dtype, _open, batch_objects) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(cast_floating(v, dtype, _open, batch_objects) for v in value)
    if type(value) is dict:  # a comprehension, which torch.compile traces without a graph break
        return {key: cast_floating(item, dtype, _open, batch_objects) for key, item in value.items()}
    if isinstance(value, dict):  # OrderedDict, defaultdict, ...: keep the type and its extras
        out = copy.copy(value)
        done = {}
        for key, item in value.items():
            out[key] = done[id(item)] = cast_floating(item, dtype, _open, batch_objects)
        if _is_dataclass_instance(value):  # its fields too, which it may not keep in step with its items (F12);
            _open = set() if _open is None else _open  # one cast of what both hold (HF's ModelOutput)
            if id(value) in _open:
                return value  # a cycle through its fields: its own reference stays
            _open.add(id(value))
            try:
                for name in _attributes(value):
                    item = getattr(value, name)
                    cast = done[id(item)] if id(item) in done else cast_floating(item, dtype, _open, batch_objects)
                    object.__setattr__(out, name, cast)
            finally:
                _open.discard(id(value))
        return out
    if _is_dataclass_instance(value):
        _open = set() if _open is None else _open
        if id(value) in _open:
            return value  # a cycle: its own reference stays
        _open.add(id(value))
        try:
            out = copy.copy(value)
            for name in _attributes(value):
                object.__setattr__(out, name, cast_floating(getattr(value, name), dtype, _open, batch_objects))
        finally:
            _open.discard(id(value))
        return out
    if batch_objects and _is_floating_batch_object(value):
        try:
            cast_value = value.to(dtype)
        except (TypeError, ValueError, RuntimeError, AttributeError):  # a `to` for devices only
            logger.debug("ampinit: %s.to(%s) failed; it is passed as it is", type(value).__name__, dtype)
            return value
        return value if cast_value is None else cast_value
    return value


def _is_floating_batch_object(value: Any) -> bool:
    """A user's batch class whose ``to(dtype)`` casts floating-point tensors only (see above)."""
    if not callable(getattr(value, "to", None)) or isinstance(value, (torch.nn.Module, Mapping, type)):
        return False
    if type(value).__module__.split(".")[0] == "torch":
        return False
    tensors = list(iter_tensors(list(getattr(value, "__dict__", {}).values())))
    return bool(tensors) and all(t.is_floating_point() for t in tensors)
