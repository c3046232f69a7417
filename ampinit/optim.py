"""Fused optimizers: one pass per parameter reads the gradient, unscales it, updates the FP32
param and state, and writes the low-precision model copy.

On their own they are drop-in ``torch.optim.Adam`` / ``AdamW`` / ``SGD`` for FP32 params, with
``torch.optim``'s state layout (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``, plus a
``step`` tensor on the param's device).  Under :func:`ampinit.initialize` at O2/O5 they read
the model's scaled fp16/bf16 gradients directly, unscale inside the kernel, skip the step on
the device when the gradients overflowed, and write the model weights in the same pass: with
the compiled kernels, ``step()`` makes no host sync (see ``ampinit.handle`` for how skipped
steps are counted without one).

Names and defaults follow apex's ``apex.optimizers``: :class:`FusedAdam` is AdamW unless
``adam_w_mode=False``, as in apex.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch

from . import ops

__all__ = ["FusedAdam", "FusedAdamW", "FusedSGD"]


class _FusedOptimizer(torch.optim.Optimizer):
    """What the fused optimizers share: grouping params per call, and the two ways to step."""

    # Tells ampinit's optimizer wrapper that step() takes scaled model gradients and found_inf.
    _ampinit_fused = True

    def __init__(self, params, defaults: dict):
        super().__init__(params, defaults)
        self._constants: Dict[torch.device, Tuple[torch.Tensor, torch.Tensor]] = {}

    def _unit_flags(self, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(inv_scale=1, found_inf=0)`` on ``device``, made once per device."""
        flags = self._constants.get(device)
        if flags is None:
            flags = self._constants[device] = (torch.ones(1, device=device), torch.zeros(1, device=device))
        return flags

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        """One update from each param's ``.grad``.  No host sync with the compiled kernels.

        Under ``ampinit.initialize`` the step's scaled gradients, overflow flag and model
        parameters come from ampinit (``_ampinit_step_inputs``, set for this one call)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._amp_update(**self.__dict__.pop("_ampinit_step_inputs", {}))
        return loss

    @torch.no_grad()
    def _amp_update(self, found_inf: Optional[torch.Tensor] = None, inv_scale: Optional[torch.Tensor] = None,
                    scaled_grads: Optional[Dict[torch.Tensor, torch.Tensor]] = None,
                    model_of: Optional[Dict[torch.Tensor, torch.Tensor]] = None) -> None:
        """The update, as ampinit drives it: ``scaled_grads[p]`` (multiplied by ``inv_scale``)
        replaces ``p.grad``; ``model_of[p]`` receives the new value of ``p``; nothing changes
        if ``found_inf`` is set."""
        scaled_grads = scaled_grads or {}
        model_of = model_of or {}
        for group in self.param_groups:
            calls: Dict[tuple, Tuple[List[torch.Tensor], List[torch.Tensor], List[torch.Tensor]]] = {}
            for param in group["params"]:
                grad = scaled_grads.get(param)
                scaled = grad is not None
                if grad is None:
                    grad = param.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients; "
                                       "use torch.optim.SparseAdam for sparse embeddings")
                if param.dtype != torch.float32:
                    raise TypeError(f"{type(self).__name__} updates float32 params; got a {param.dtype} param. "
                                    "Keep the model in float32, or use ampinit.initialize at O2/O5 so the "
                                    "optimizer holds FP32 master weights")
                model = model_of.get(param)
                key = (param.device, scaled, model is not None)
                params, grads, models = calls.setdefault(key, ([], [], []))
                params.append(param)
                grads.append(grad)
                if model is not None:
                    models.append(model)
            for (device, scaled, _), (params, grads, models) in calls.items():
                unit_inv, zero_found = self._unit_flags(device)
                self._update(group, params, grads, models,
                             inv_scale if scaled else unit_inv,
                             found_inf if found_inf is not None else zero_found)

    def _step_tensor(self, param: torch.Tensor) -> torch.Tensor:
        state = self.state[param]
        step = state.get("step")
        if step is None or not isinstance(step, torch.Tensor) or step.device != param.device \
                or step.dtype != torch.float32:
            # New, or loaded from a torch.optim checkpoint (which keeps "step" on the CPU).
            step = state["step"] = torch.tensor(float(step or 0), dtype=torch.float32, device=param.device)
        return step

    def _update(self, group: dict, params: List[torch.Tensor], grads: List[torch.Tensor],
                models: List[torch.Tensor], inv_scale: torch.Tensor, found_inf: torch.Tensor) -> None:
        raise NotImplementedError


def _check_hyper(lr: float, eps: Optional[float] = None, weight_decay: float = 0.0,
                 betas: Optional[Tuple[float, float]] = None, momentum: float = 0.0) -> None:
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if eps is not None and not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if not 0.0 <= momentum:
        raise ValueError(f"Invalid momentum value: {momentum}")
    if betas is not None and not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
        raise ValueError(f"Invalid betas: {betas}; each must be in [0, 1)")


class FusedAdam(_FusedOptimizer):
    """Adam/AdamW in one fused pass per parameter (apex's ``FusedAdam``).

    Args:
        params: FP32 parameters (under ``initialize`` at O2/O5: the model's, as usual).
        lr, betas, eps, weight_decay: as in ``torch.optim.Adam``.
        bias_correction: apply Adam's bias corrections (apex's flag).
        adam_w_mode: decoupled weight decay (AdamW), apex's default; ``False`` gives
            ``torch.optim.Adam``'s L2 penalty.
        amsgrad: not supported (as in apex); raises ``ValueError``.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, bias_correction: bool = True,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True):
        if amsgrad:
            raise ValueError(f"{type(self).__name__} does not support AMSGrad; use torch.optim.Adam(amsgrad=True)")
        _check_hyper(lr, eps, weight_decay, tuple(betas))
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adam_w_mode = adam_w_mode
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    def _update(self, group, params, grads, models, inv_scale, found_inf) -> None:
        exp_avgs, exp_avg_sqs, steps = [], [], []
        for param in params:
            state = self.state[param]
            if "exp_avg" not in state:
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            steps.append(self._step_tensor(param))
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
        beta1, beta2 = group["betas"]
        ops.fused_adam_(params, grads, exp_avgs, exp_avg_sqs, steps, models, lr=group["lr"], beta1=beta1,
                        beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                        decoupled_weight_decay=self.adam_w_mode, bias_correction=group["bias_correction"],
                        inv_scale=inv_scale, found_inf=found_inf)


class FusedAdamW(FusedAdam):
    """AdamW (decoupled weight decay) in one fused pass; matches ``torch.optim.AdamW``."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, bias_correction: bool = True):
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         adam_w_mode=True, weight_decay=weight_decay)


class FusedSGD(_FusedOptimizer):
    """SGD with momentum, dampening, nesterov and weight decay in one fused pass per parameter;
    matches ``torch.optim.SGD`` (and apex's ``FusedSGD`` with its defaults)."""

    def __init__(self, params: Iterable, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, wd_after_momentum: bool = False,
                 materialize_master_grads: bool = True, set_grad_none: bool = False):
        _check_hyper(lr, weight_decay=weight_decay, momentum=momentum)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        if wd_after_momentum:
            raise ValueError("FusedSGD(wd_after_momentum=True) is not supported; weight decay is added to the "
                             "gradient before momentum, as torch.optim.SGD does")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov)
        super().__init__(params, defaults)
        self.set_grad_none = set_grad_none

    def _update(self, group, params, grads, models, inv_scale, found_inf) -> None:
        buffers, steps = [], []
        momentum = group["momentum"]
        for param in params:
            steps.append(self._step_tensor(param))
            if momentum != 0:
                state = self.state[param]
                if state.get("momentum_buffer") is None:
                    state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                buffers.append(state["momentum_buffer"])
        ops.fused_sgd_(params, grads, buffers, steps, models, lr=group["lr"], momentum=momentum,
                       dampening=group["dampening"], weight_decay=group["weight_decay"],
                       nesterov=group["nesterov"], inv_scale=inv_scale, found_inf=found_inf)
