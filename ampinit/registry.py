"""apex's user cast registry: ``register_*_function``, the ``*_function`` decorators and
``disable_casts``, without patching ``torch``.

- The decorators wrap *your* function.  The wrapper casts its floating-point tensor
  arguments only while ``torch.autocast`` is enabled for their device (inside an O1/O4
  forward, or your own autocast region) and then runs the function with autocast off, so
  the function sees exactly the dtype it asked for.  Outside autocast it is a plain call.
- ``register_*_function(module, name)`` on one of your own modules replaces
  ``module.name`` with the decorated function, as apex did.  On a ``torch`` namespace
  (``torch``, ``torch.nn.functional``, ``torch.Tensor``, ...) nothing is patched: the entry is
  recorded and applied by a ``TorchFunctionMode`` that ampinit enters only for the duration of
  an O1/O4 model's forward.

The registry is process-wide by the nature of apex's API (register first, then
``initialize``); it only ever grows.
"""

from __future__ import annotations

import contextlib
import dis
import functools
import threading
import types
from typing import Any, Callable, Dict, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode

from ._tree import cast_floating, iter_tensors

__all__ = ["half_function", "bfloat16_function", "float_function", "promote_function", "register_half_function",
           "register_bfloat16_function", "register_float_function", "register_promote_function", "disable_casts"]

HALF, BFLOAT16, FLOAT, PROMOTE = "half", "bfloat16", "float", "promote"
_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps")

# torch callables registered by the user -> cast policy.  Populated only through the
# register_* functions below.
_TORCH_POLICIES: Dict[Any, str] = {}
# The torch callables registered by name (not only as the wrapper of a registered one).
_REGISTERED_DIRECTLY: set = set()
# How many disable_casts() blocks are open, in any thread: apex's handle._is_active was one flag
# for the process, and DataParallel runs its replicas' forwards in threads of its own.
_DISABLED_DEPTH = [0]
_DISABLED_LOCK = threading.Lock()


def _target_dtype(policy: str, device_type: str, args: tuple, kwargs: dict) -> Optional[torch.dtype]:
    if policy == HALF:
        return torch.get_autocast_dtype(device_type)
    if policy == BFLOAT16:
        return torch.bfloat16
    if policy == FLOAT:
        return torch.float32
    floating = [t.dtype for t in iter_tensors((args, kwargs)) if t.is_floating_point()]
    return functools.reduce(torch.promote_types, floating) if floating else None


def _active_device_type(args: tuple, kwargs: dict) -> Optional[str]:
    """The device type of the first tensor argument, if autocast is enabled for it."""
    for tensor in iter_tensors((args, kwargs)):
        device_type = tensor.device.type
        return device_type if torch.is_autocast_enabled(device_type) else None
    return None


def _call_with_policy(fn: Callable, policy: str, args: tuple, kwargs: dict) -> Any:
    device_type = _active_device_type(args, kwargs)
    if device_type is None:
        return fn(*args, **kwargs)
    dtype = _target_dtype(policy, device_type, args, kwargs)
    if dtype is not None:
        args, kwargs = cast_floating(args, dtype), cast_floating(kwargs, dtype)
    with torch.autocast(device_type, enabled=False):
        return fn(*args, **kwargs)


def _decorator(policy: str) -> Callable[[Callable], Callable]:
    def decorate(fn: Callable) -> Callable:
        if not callable(fn):
            raise TypeError(f"{policy}_function decorates a callable; got {type(fn).__name__}")

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            return _call_with_policy(fn, policy, args, kwargs)

        wrapper.__ampinit_policy__ = policy
        return wrapper

    decorate.__name__ = f"{policy}_function"
    decorate.__doc__ = (f"Decorator: under autocast, run the function with its floating-point "
                        f"tensor arguments cast to the {policy} type and autocast off.")
    return decorate


half_function = _decorator(HALF)
bfloat16_function = _decorator(BFLOAT16)
float_function = _decorator(FLOAT)
promote_function = _decorator(PROMOTE)


def _is_torch_namespace(module: Any) -> bool:
    if module is torch.Tensor:
        return True
    name = getattr(module, "__name__", "")
    return isinstance(module, types.ModuleType) and (name == "torch" or name.startswith("torch."))


def _register(module: Any, name: str, policy: str) -> None:
    if not isinstance(name, str):
        raise TypeError(f"name must be a string; got {type(name).__name__}")
    if not hasattr(module, name):
        raise ValueError(f"No function named {name!r} in module {module!r}")
    fn = getattr(module, name)
    if not callable(fn):
        raise TypeError(f"{module!r}.{name} is not callable")
    if _is_torch_namespace(module):
        _TORCH_POLICIES[fn] = policy
        _REGISTERED_DIRECTLY.add(fn)
        if module is torch:
            # torch.nn.functional's wrapper of ``torch.<name>`` (F.batch_norm -> torch.batch_norm,
            # which nn.BatchNorm2d calls): apex patched the attribute, so the wrapper's call was cast
            # too; the mode sees only the outermost call.  A registration of the wrapper itself wins.
            wrapper = _functional_wrappers().get(name)
            if wrapper is not None and wrapper not in _REGISTERED_DIRECTLY:
                _TORCH_POLICIES[wrapper] = policy
        return
    original = getattr(fn, "__wrapped__", fn) if hasattr(fn, "__ampinit_policy__") else fn
    setattr(module, name, _decorator(policy)(original))


@functools.lru_cache(maxsize=None)
def _functional_wrappers() -> Dict[str, Callable]:
    """``name`` -> ``torch.nn.functional.<name>``, where that function is a wrapper that calls
    ``torch.<name>`` (its bytecode loads the global ``torch``, then the attribute ``name``):
    batch_norm, layer_norm, group_norm, embedding, relu, ...  Larger functions that call a torch
    function among much else (multi_head_attention_forward calls torch.bmm) are not wrappers:
    apex cast only that call.  Built once, at the first registration on ``torch``."""
    wrappers: Dict[str, Callable] = {}
    for function in vars(torch.nn.functional).values():
        if not isinstance(function, types.FunctionType) or function.__module__ != "torch.nn.functional":
            continue
        instructions = list(dis.get_instructions(function))
        if any(first.opname == "LOAD_GLOBAL" and first.argval == "torch" and
               second.opname in ("LOAD_ATTR", "LOAD_METHOD") and second.argval == function.__name__
               for first, second in zip(instructions, instructions[1:])):
            wrappers[function.__name__] = function
    return wrappers


def register_half_function(module: Any, name: str) -> None:
    """Cast the arguments of ``module.name`` to the autocast (half) dtype under O1/O4."""
    _register(module, name, HALF)


def register_bfloat16_function(module: Any, name: str) -> None:
    """Cast the arguments of ``module.name`` to bfloat16 under O1/O4 (apex's bf16 builds)."""
    _register(module, name, BFLOAT16)


def register_float_function(module: Any, name: str) -> None:
    """Cast the arguments of ``module.name`` to float32 under O1/O4."""
    _register(module, name, FLOAT)


def register_promote_function(module: Any, name: str) -> None:
    """Cast the arguments of ``module.name`` to their widest floating dtype under O1/O4."""
    _register(module, name, PROMOTE)


class RegisteredCastMode(TorchFunctionMode):
    """Applies the registered policies to ``torch`` callables inside one forward."""

    def __init__(self, policies: Dict[Any, str]):
        super().__init__()
        self._policies = policies

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        policy = self._policies.get(func)
        if policy is None:
            return func(*args, **kwargs)
        return _call_with_policy(func, policy, args, kwargs)


def torch_policies() -> Dict[Any, str]:
    """A snapshot of the registered ``torch`` callables (taken at ``initialize``)."""
    return dict(_TORCH_POLICIES)


def casts_disabled() -> bool:
    """Whether a :func:`disable_casts` block is open in any thread (an O1/O4 forward then
    enters no autocast)."""
    return _DISABLED_DEPTH[0] > 0


@contextlib.contextmanager
def disable_casts() -> Iterator[None]:
    """Inside this block ops run in the dtypes of their inputs, as in FP32 code (apex's
    ``amp.disable_casts()``): autocast is off on every device where it was on, and an O1/O4
    model called in the block does not turn it on for its forward.  Inputs of an O2/O3/O5
    model are still cast to its dtype, as in apex.

    As apex's, the block holds for every thread while it is open: ``nn.DataParallel`` runs its
    replicas' forwards in threads of its own.  Autocast itself is turned off in this thread only
    (torch's autocast state is per thread; DataParallel passes it on to its threads)."""
    with _DISABLED_LOCK:
        _DISABLED_DEPTH[0] += 1
    try:
        with contextlib.ExitStack() as stack:
            for device_type in _AUTOCAST_DEVICES:
                try:
                    enabled = torch.is_autocast_enabled(device_type)
                except RuntimeError:  # a device type this build does not know
                    continue
                if enabled:
                    stack.enter_context(torch.autocast(device_type, enabled=False))
            yield
    finally:
        with _DISABLED_LOCK:
            _DISABLED_DEPTH[0] -= 1
