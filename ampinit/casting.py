"""Casting a model for O2/O3/O5 and scoping O1/O4 autocast to its forward.

Everything here is done with removable module hooks: the model's ``forward`` is never
replaced, so the hooks survive ``DataParallel`` replication and ``DistributedDataParallel``
wrapping, and :meth:`ModelCasting.remove` undoes them.

The hooks are small picklable objects that hold no reference to an optimizer or to ampinit's
state, so an initialized model can be pickled (``torch.save(model)``) and deep-copied (an EMA
copy) on its own.  A copy keeps the casting behaviour: its inputs are cast to its parameters'
dtype and its outputs to FP32, and O1/O4 copies autocast their forward.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from . import registry
from ._tree import cast_floating

logger = logging.getLogger("ampinit")

__all__ = ["plan_model_cast", "ModelCasting"]


def plan_model_cast(model: nn.Module, dtype: torch.dtype, keep_batchnorm_fp32: bool) -> List[torch.Tensor]:
    """The floating-point parameters and buffers that casting ``model`` to ``dtype`` changes.

    Batch-norm layers (``_BatchNorm``, SyncBatchNorm included) keep float32 when
    ``keep_batchnorm_fp32``, as in apex.  Tensors shared between modules appear once.
    """
    seen: Set[int] = set()
    tensors = []
    for module in model.modules():
        if keep_batchnorm_fp32 and isinstance(module, _BatchNorm):
            continue
        for tensor in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            if tensor.is_floating_point() and tensor.dtype != dtype and id(tensor) not in seen:
                seen.add(id(tensor))
                tensors.append(tensor)
    return tensors


class _AutocastScope:
    """Enters ``torch.autocast`` (and the registered-function mode) in a forward pre-hook and
    leaves it in an always-called forward hook.  A per-thread stack makes this correct for
    re-entrant forwards and for DataParallel's replica threads."""

    def __init__(self, device_type: str, dtype: torch.dtype, policies: Dict[Any, str]):
        self.device_type = device_type
        self.dtype = dtype
        self.policies = policies
        self.entered = False  # by a training forward of the model, or a step under AmpHandle.autocast_step
        self._local = threading.local()

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_local"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._local = threading.local()

    def _stack(self) -> list:
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack

    def _submodule_stack(self) -> list:
        if not hasattr(self._local, "submodules"):
            self._local.submodules = []
        return self._local.submodules

    def enter_submodule(self) -> None:
        """A submodule's forward: the registered-function mode, unless the model's forward (or
        an enclosing submodule's) has it.  Activation checkpointing recomputes submodules in the
        backward, outside the model's forward and without its torch-function modes (autograd
        does not carry them), but under the autocast state it saved: without this, a registered
        function ran in fp32 in the forward and in fp16 in the recompute."""
        frames = self._submodule_stack()
        if self._stack() or any(frames) or registry.casts_disabled():
            frames.append(None)
            return
        mode = registry.RegisteredCastMode(self.policies)
        mode.__enter__()
        frames.append(mode)

    def exit_submodule(self) -> None:
        frames = self._submodule_stack()
        if frames:
            mode = frames.pop()
            if mode is not None:
                mode.__exit__(None, None, None)

    def enter(self) -> None:
        if torch.is_grad_enabled():  # a training forward (validation under no_grad does not count)
            self.entered = True
        if registry.casts_disabled():  # amp.disable_casts() around the call: an FP32 forward
            self._stack().append([])
            return
        contexts = [torch.autocast(self.device_type, dtype=self.dtype)]
        if self.policies:
            contexts.append(registry.RegisteredCastMode(self.policies))
        for context in contexts:
            context.__enter__()
        self._stack().append(contexts)

    def exit(self) -> None:
        stack = self._stack()
        if stack:
            for context in reversed(stack.pop()):
                context.__exit__(None, None, None)


class _CastInputs:
    """Forward pre-hook: floating-point inputs take the dtype of the parameter ``probe``
    (the dtype the model was cast to; a copy cast back to FP32 gets FP32 inputs)."""

    def __init__(self, probe: str, dtype: torch.dtype):
        self.probe = probe
        self.dtype = dtype

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        dtype = self.dtype
        if self.probe:
            try:
                dtype = module.get_parameter(self.probe).dtype
            except AttributeError:  # the parameter is gone (a pruned copy): keep the cast dtype
                pass
        return cast_floating(args, dtype, batch_objects=True), cast_floating(kwargs, dtype, batch_objects=True)


class _EnterAutocast:
    """Forward pre-hook of an O1/O4 model: enter autocast.  It also watches one parameter's
    dtype (one attribute read): a model cast after ``initialize`` (``model.half()``) has its
    optimizers update 16-bit weights with no master, where most small updates round away (25 %
    of the weights never moved at O1, 84 % at O4, in a review's run), which is logged once."""

    def __init__(self, scope: _AutocastScope, probe: Optional[Tuple[str, nn.Parameter]] = None):
        self.scope = scope
        self.probe = None if probe is None else (probe[0], weakref.ref(probe[1]), probe[1].dtype)

    def __getstate__(self) -> dict:  # a pickled model (torch.save(model)): a weak reference does not pickle
        return {**self.__dict__, "probe": None}

    def __call__(self, module: nn.Module, args: tuple) -> None:
        if self.probe is not None:
            name, ref, dtype = self.probe
            param = ref()
            if param is not None and param.dtype != dtype:
                self.probe = None  # logged once
                low = param.dtype in (torch.float16, torch.bfloat16)
                logger.warning(
                    "ampinit: %s is %s, but initialize left it %s: the model was cast after initialize "
                    "(model.half(), model.to(...)).  At this level (O1/O4) nothing keeps FP32 master weights, so its "
                    "optimizer updates the cast weights directly%s.  Keep the model in FP32 (the level casts per op)%s",
                    name, param.dtype, dtype, ", and most small 16-bit updates round away" if low else "",
                    ", or end it and initialize at O2/O5" if low else "")
        self.scope.enter()


class _SubmoduleCasts:
    """Forward pre-hook and (always-called) hook of every submodule of a model whose forwards
    apply registered ``torch`` functions (see :meth:`_AutocastScope.enter_submodule`)."""

    def __init__(self, scope: _AutocastScope):
        self.scope = scope

    def enter(self, module: nn.Module, args: tuple) -> None:
        self.scope.enter_submodule()

    def leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.scope.exit_submodule()


class _LeaveForward:
    """Forward hook (always called): leave autocast, cast floating-point outputs."""

    def __init__(self, scope: Optional[_AutocastScope], output_dtype: Optional[torch.dtype]):
        self.scope = scope
        self.output_dtype = output_dtype

    def __call__(self, module: nn.Module, args: tuple, output: Any):
        if self.scope is not None:
            self.scope.exit()
        if self.output_dtype is not None and output is not None:
            return cast_floating(output, self.output_dtype)
        return None


class ModelCasting:
    """The casting of one model by one ``initialize`` call: which tensors were cast from
    which dtype, and the hooks installed.  :meth:`remove` undoes the hooks."""

    def __init__(self, model: nn.Module, device_type: str, *, cast_model_type: Optional[torch.dtype],
                 keep_batchnorm_fp32: bool, autocast_dtype: Optional[torch.dtype],
                 cast_model_outputs: Optional[torch.dtype]):
        self.model = model
        self.cast_model_type = cast_model_type
        self.original_dtypes: Dict[torch.Tensor, torch.dtype] = {}
        low_precision = cast_model_type in (torch.float16, torch.bfloat16)
        if cast_model_type is not None:
            for tensor in plan_model_cast(model, cast_model_type, bool(keep_batchnorm_fp32)):
                self.original_dtypes[tensor] = tensor.dtype
        self._pre_hook: Any = None
        if autocast_dtype is not None:
            scope = _AutocastScope(device_type, autocast_dtype, registry.torch_policies())
            # a trained one (a frozen embedding listed first may stay FP32 while the rest is cast)
            params = [(name, p) for name, p in model.named_parameters() if p.is_floating_point()]
            probe = next(((name, p) for name, p in params if p.requires_grad), params[0] if params else None)
            self._pre_hook = _EnterAutocast(scope, probe)
        elif low_precision:
            cast_params = {id(t) for t in self.original_dtypes if isinstance(t, nn.Parameter)}
            probe = next((name for name, p in model.named_parameters() if id(p) in cast_params), "")
            self._pre_hook = _CastInputs(probe, cast_model_type)
        self._post_hook = _LeaveForward(getattr(self._pre_hook, "scope", None), cast_model_outputs) \
            if autocast_dtype is not None or cast_model_outputs is not None else None
        self._handles: list = []

    def apply(self) -> None:
        """Cast the planned parameters and buffers in place (their identities are kept) and
        install the hooks."""
        with torch.no_grad():
            for tensor in self.original_dtypes:
                tensor.data = tensor.data.to(self.cast_model_type)
                if isinstance(tensor, nn.Parameter) and tensor.grad is not None:
                    tensor.grad = tensor.grad.to(self.cast_model_type)
        if isinstance(self._pre_hook, _CastInputs):
            self._handles.append(self.model.register_forward_pre_hook(self._pre_hook, with_kwargs=True))
        elif self._pre_hook is not None:
            self._handles.append(self.model.register_forward_pre_hook(self._pre_hook))
        if self._post_hook is not None:
            self._handles.append(self.model.register_forward_hook(self._post_hook, always_call=True))
        scope = getattr(self._pre_hook, "scope", None)
        if scope is not None and scope.policies:
            casts = _SubmoduleCasts(scope)
            for module in self.model.modules():
                if module is not self.model:
                    self._handles.append(module.register_forward_pre_hook(casts.enter))
                    self._handles.append(module.register_forward_hook(casts.leave, always_call=True))

    @property
    def autocast_scope(self) -> Optional[_AutocastScope]:
        """The O1/O4 autocast scoped to the model's forward, or ``None`` at other levels."""
        return getattr(self._pre_hook, "scope", None)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
