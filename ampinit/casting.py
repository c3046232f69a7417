"""Casting a model for O2/O3/O5 and scoping O1/O4 autocast to its forward.

Everything here is done with removable module hooks: the model's ``forward`` is never
replaced, so the hooks survive ``DataParallel`` replication and ``DistributedDataParallel``
wrapping, and :class:`ModelCasting.remove` undoes them.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional, Set

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from . import registry
from ._tree import cast_floating

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
        self._local = threading.local()

    def _stack(self) -> list:
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack

    def enter(self) -> None:
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


class ModelCasting:
    """The casting of one model by one ``initialize`` call: which tensors were cast from
    which dtype, and the hooks installed.  :meth:`remove` undoes the hooks."""

    def __init__(self, model: nn.Module, device_type: str, *, cast_model_type: Optional[torch.dtype],
                 keep_batchnorm_fp32: bool, autocast_dtype: Optional[torch.dtype],
                 cast_model_outputs: Optional[torch.dtype]):
        self.model = model
        self.original_dtypes: Dict[torch.Tensor, torch.dtype] = {}
        self._hooks = []
        low_precision = cast_model_type in (torch.float16, torch.bfloat16)
        if cast_model_type is not None:
            for tensor in plan_model_cast(model, cast_model_type, bool(keep_batchnorm_fp32)):
                self.original_dtypes[tensor] = tensor.dtype
        self.cast_model_type = cast_model_type
        self._scope = None
        if autocast_dtype is not None:
            self._scope = _AutocastScope(device_type, autocast_dtype, registry.torch_policies())
            self._hooks.append(model.register_forward_pre_hook(self._enter_autocast))
        elif low_precision:
            self._hooks.append(model.register_forward_pre_hook(self._cast_inputs, with_kwargs=True))
        output_dtype = cast_model_outputs
        if output_dtype is None and low_precision:
            output_dtype = torch.float32
        self.output_dtype = output_dtype
        if self._scope is not None or output_dtype is not None:
            self._hooks.append(model.register_forward_hook(self._leave_forward, always_call=True))

    def apply(self) -> None:
        """Cast the planned parameters and buffers in place (their identities are kept)."""
        with torch.no_grad():
            for tensor in self.original_dtypes:
                tensor.data = tensor.data.to(self.cast_model_type)
                if isinstance(tensor, nn.Parameter) and tensor.grad is not None:
                    tensor.grad = tensor.grad.to(self.cast_model_type)

    def _cast_inputs(self, module, args, kwargs):
        return cast_floating(args, self.cast_model_type), cast_floating(kwargs, self.cast_model_type)

    def _enter_autocast(self, module, args):
        self._scope.enter()

    def _leave_forward(self, module, args, output):
        if self._scope is not None:
            self._scope.exit()
        if self.output_dtype is not None and output is not None:
            return cast_floating(output, self.output_dtype)
        return None

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
