"""FP32 master weights and the gradient flow between model parameters and the optimizer.

One :class:`OptimizerMasters` per optimizer.  Each parameter the optimizer updates is a pair
``(model_param, master)``: with master weights the master is an FP32 ``nn.Parameter`` that
takes the model parameter's place in ``param_groups``; without them (O0, O1, O3, O4, or
parameters kept FP32) the pair is the same tensor twice.

Gradient flow, per ``scale_loss``:

1. :meth:`prepare_backward` (on entry, unless the previous backward was delayed): model
   gradients of distinct pairs are dropped (they were already unscaled into the masters), and
   gradients of same-tensor pairs are stashed, so the new backward produces only this loss's
   scaled gradient.
2. :meth:`unscale_grads` (on exit, unless ``delay_unscale``): the fresh scaled gradients are
   unscaled into the masters (written, or added to what earlier losses left there), and
   checked for inf/NaN into ``found_inf``, through the ops facade.

With a fused optimizer (``ampinit.optim``) the first backward of a step only *checks* the
model's scaled gradients (one read-only pass) and leaves them where they are, with the inverse
scale they need (``deferred``): the optimizer's kernel reads them directly.  A second backward
before ``step`` first unscales the deferred gradients into the masters, and goes on as above.

Nothing here reads a device value on the host.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

from . import ops
from .distributed import local

__all__ = ["OptimizerMasters", "LOW_PRECISION"]

LOW_PRECISION = (torch.float16, torch.bfloat16)


def _make_master(param: torch.Tensor, fp32_value: Optional[torch.Tensor]) -> nn.Parameter:
    """An FP32 master for ``param``: ``fp32_value`` itself when given (the parameter's FP32
    storage from before the cast, no longer shared with the model), else a new copy."""
    value = param.detach().to(torch.float32, copy=True) if fp32_value is None else fp32_value
    return nn.Parameter(value, requires_grad=param.requires_grad)


def _cast_state_value(key: str, value, dtype: torch.dtype):
    if key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    return value


class OptimizerMasters:
    """The parameter pairs of one optimizer and the per-step gradient state.

    Args:
        optimizer: the user's optimizer; its ``param_groups`` and ``state`` are rewired by
            :meth:`install` and restored by :meth:`uninstall`.
        use_masters: keep FP32 masters for low-precision parameters.
        fp32_values: FP32 storage of parameters from before the model was cast, taken over
            as masters, so they start from the full-precision weights rather than their fp16
            rounding.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, use_masters: bool, device: torch.device,
                 fp32_values: Optional[Dict[torch.Tensor, torch.Tensor]] = None):
        self.optimizer = optimizer
        self.use_masters = use_masters
        self.found_inf = torch.zeros((1,), dtype=torch.float32, device=device)
        self.unscaled_since_step = False   # a scale_loss exit wrote gradients since step()
        self.pending_scaled = False        # a delay_unscale backward left scaled gradients
        self._fp32_values = fp32_values or {}
        self.master_of: Dict[torch.Tensor, torch.Tensor] = {}
        self._model_of: Dict[torch.Tensor, torch.Tensor] = {}  # inverse of master_of, kept in step
        self._stash: Dict[torch.Tensor, Optional[torch.Tensor]] = {}
        # One FP32 gradient buffer per master, reused across steps: after
        # zero_grad(set_to_none=True) a fresh allocation would be page-faulted in again on
        # every step (glibc hands large blocks back to the OS).  Peak memory is unchanged:
        # the master gradients exist at every step's peak anyway.
        self._grad_buffers: Dict[torch.Tensor, torch.Tensor] = {}
        # Fused optimizers: master -> scaled model gradient, still to be unscaled by the kernel.
        self.fused = bool(getattr(optimizer, "_ampinit_fused", False))
        self.deferred: Dict[torch.Tensor, torch.Tensor] = {}
        self.deferred_inv_scale: Optional[torch.Tensor] = None
        # Per-tensor inf/NaN flags of this step's checks (fused optimizers only), with the model
        # params they belong to: the skip is decided on the device, its diagnostics read later.
        self.overflow_records: List[Tuple[torch.Tensor, List[torch.Tensor]]] = []

    # -- construction -------------------------------------------------------------------
    def _master_for(self, param: torch.Tensor) -> torch.Tensor:
        if not self.use_masters or param.dtype not in LOW_PRECISION:
            return param
        master = _make_master(param, self._fp32_values.get(param))
        self.master_of[param] = master
        self._model_of[master] = param
        return master

    def forget(self, param: torch.Tensor) -> None:
        """Drop the master of ``param`` (an ``add_param_group`` that failed)."""
        master = self.master_of.pop(param, None)
        if master is not None:
            self._model_of.pop(master, None)

    def wrap_params(self, params: List[torch.Tensor]) -> List[torch.Tensor]:
        """The list that replaces ``params`` in a param group (masters in their places)."""
        return [self._master_for(p) for p in params]

    def install(self) -> None:
        """Put masters into ``param_groups`` and move existing optimizer state onto them."""
        for group in self.optimizer.param_groups:
            group["params"] = self.wrap_params(group["params"])
        self._fp32_values = {}  # now owned by the masters; later groups copy their own
        self._remap_state(self.master_of, torch.float32)

    def uninstall(self) -> None:
        """Undo :meth:`install`: model parameters get the master values (in FP32) and their
        places back; state follows them."""
        model_of = dict(self._model_of)
        with torch.no_grad():
            for model, master in self.master_of.items():
                model.data = master.data
                model.grad = master.grad
        for group in self.optimizer.param_groups:
            group["params"] = [model_of.get(p, p) for p in group["params"]]
        self._remap_state(model_of, None)
        self.master_of.clear()
        self._model_of.clear()
        self._grad_buffers.clear()

    def _remap_state(self, mapping: Dict[torch.Tensor, torch.Tensor], dtype: Optional[torch.dtype]) -> None:
        state = self.optimizer.state
        for old, new in mapping.items():
            if old in state:
                entry = state.pop(old)
                state[new] = {k: _cast_state_value(k, v, dtype or new.dtype) for k, v in entry.items()}

    # -- views ------------------------------------------------------------------------------
    def pairs(self) -> Iterable[Tuple[torch.Tensor, torch.Tensor]]:
        """``(model_param, master)`` for every parameter of the optimizer."""
        model_of = self._model_of
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                yield model_of.get(param, param), param

    # -- gradient flow ------------------------------------------------------------------------
    def prepare_backward(self) -> None:
        """Make room for one loss's scaled gradients (see the module docstring)."""
        if self.pending_scaled:
            return  # a delayed backward's scaled gradients are still accumulating
        if self.deferred:
            self._materialize_deferred()
        for model, master in self.pairs():
            if model is master:
                if model.grad is not None:
                    self._stash[model] = model.grad
                    model.grad = None
            else:
                model.grad = None

    def restore_after_failed_backward(self) -> None:
        """Put stashed gradients back when the backward raised."""
        for param, grad in self._stash.items():
            param.grad = grad
        self._stash.clear()

    def unscale_grads(self, inv_scale: torch.Tensor, found_inf: torch.Tensor) -> None:
        """Unscale the new gradients into the masters, flagging inf/NaN in ``found_inf``."""
        write_in, write_out, write_models, add_in, add_out = [], [], [], [], []
        check_in, check_models = [], []
        for model, master in self.pairs():
            grad = model.grad
            if grad is None:
                continue
            grad = local(grad)  # sharded (FSDP2): this rank's shard; ranks agree via all-reduce
            if grad.is_sparse:
                self._unscale_sparse(model, master, grad, inv_scale, found_inf)
                continue
            if model is master:
                stashed = self._stash.pop(model, None)
                if stashed is None:
                    write_in.append(grad)
                    write_out.append(grad)
                    write_models.append(model)
                else:
                    add_in.append(grad)
                    add_out.append(stashed)
                    model.grad = stashed
            elif master.grad is None and self.fused:
                self.deferred[master] = grad
                check_in.append(grad)
                check_models.append(model)
            elif master.grad is None:
                master.grad = self._grad_buffer(master)
                write_in.append(grad)
                write_out.append(master.grad)
                write_models.append(model)
            else:
                add_in.append(grad)
                add_out.append(master.grad)
        self._stash.clear()
        if write_in:
            flags = self._overflow_flags(write_models, found_inf.device)
            ops.unscale_(write_in, write_out, inv_scale, found_inf, flags)
        if add_in:
            ops.accumulate_unscaled_(add_in, add_out, inv_scale, found_inf)
        if check_in:
            ops.check_finite_(check_in, found_inf, self._overflow_flags(check_models, found_inf.device))
            self.deferred_inv_scale = inv_scale
        self.pending_scaled = False
        self.unscaled_since_step = True

    def _overflow_flags(self, models: List[torch.Tensor], device: torch.device) -> Optional[torch.Tensor]:
        """A per-tensor flag tensor for the check of ``models``' gradients (fused optimizers only:
        the others find the culprits after a skip, when the gradients are still there)."""
        if not self.fused:
            return None
        flags = torch.zeros(len(models), device=device)
        self.overflow_records.append((flags, models))
        return flags

    def _materialize_deferred(self) -> None:
        """Unscale the deferred gradients into the masters' buffers (a second backward before
        step() is about to add to them).  They were already checked."""
        masters = list(self.deferred)
        for master in masters:
            master.grad = self._grad_buffer(master)
        scratch = torch.zeros_like(self.found_inf)
        ops.unscale_([self.deferred[m] for m in masters], [m.grad for m in masters],
                     self.deferred_inv_scale, scratch)
        self.deferred.clear()

    def _grad_buffer(self, master: torch.Tensor) -> torch.Tensor:
        buffer = self._grad_buffers.get(master)
        if buffer is None:
            buffer = self._grad_buffers[master] = torch.empty_like(master)
        return buffer

    def _unscale_sparse(self, model, master, grad, inv_scale, found_inf) -> None:
        unscaled = ops.unscale_sparse(grad, inv_scale, found_inf, master.dtype)
        previous = self._stash.pop(model, None) if model is master else master.grad
        # For a same-tensor pair ``master`` is ``model``: this sets the model's gradient.
        master.grad = unscaled if previous is None else previous + unscaled

    def copy_masters_to_model(self) -> None:
        """Write the updated masters into the low-precision model parameters."""
        if self.master_of:
            models, masters = zip(*self.master_of.items())
            with torch.no_grad():
                ops.copy_(list(models), list(masters))

    def zero_model_grads(self, set_to_none: bool = True) -> None:
        """Clear the model-side gradients of distinct pairs (the optimizer clears masters)."""
        for model in self.master_of:
            if model.grad is None:
                continue
            if set_to_none:
                model.grad = None
            else:
                model.grad.detach_().zero_()
        self._stash.clear()
        self.deferred.clear()
        self.pending_scaled = False

    def drop_all_grads(self) -> None:
        """After a skipped step: no inf/NaN gradient may leak into the next step."""
        for model, master in self.pairs():
            model.grad = None
            master.grad = None
        self._stash.clear()
        self.deferred.clear()
        self.pending_scaled = False

    def end_step(self) -> None:
        self.found_inf.zero_()
        self.unscaled_since_step = False
        self.deferred_inv_scale = None
        self.overflow_records = []
