"""apex 0.1's ``FusedAdam`` (later ``apex.optimizers.FusedAdam_v1``; apex then moved it to
``apex.contrib.optimizers``, which the alias does not provide), the optimizer of the
pytorch-pretrained-BERT era.

Scripts of that era build it as ``FusedAdam(params, lr, bias_correction=False,
max_grad_norm=1.0)`` and wrap it in ``apex.optimizers.FP16_Optimizer``.  Its update is not
torch's Adam, nor today's ``FusedAdam``, so it is written out here, with torch's foreach ops:
for each element of a param group, with ``c`` the group's combined scale (below),

    g = grad / c
    m = beta1*m + (1-beta1)*g
    v = beta2*v + (1-beta2)*g*g
    denom = sqrt(v) + eps            (sqrt(v + eps) with eps_inside_sqrt=True)
    p = p - step_size * (m/denom + weight_decay*p)

where ``step_size = lr * sqrt(1-beta2**t) / (1-beta1**t)`` with ``bias_correction`` (eps is
not bias-corrected), else ``lr``.  The weight decay is decoupled from the moments, and scaled
by ``step_size``.

Clipping is **per param group**: with ``max_grad_norm > 0``, the group's gradient norm ``G``
(of the gradients divided by ``scale``) gives ``clip = (G + 1e-6) / max_grad_norm``, and
``c = scale * clip`` where ``clip > 1``, else ``c = scale``.  The norm is computed on the device
from the gradients (apex took it from ``FP16_Optimizer``, and failed without it), so a step
makes no host sync; ``step(grad_norms=...)`` still takes apex's per-group norms of the scaled
gradients.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple

import torch

from ._hyper import check_betas, check_number

__all__ = ["FusedAdamV1", "V1_ONLY_ARGUMENTS"]

# The constructor arguments that only apex 0.1's FusedAdam took: a FusedAdam built with one of
# them is this optimizer (``apex.optimizers.FusedAdam`` under the alias decides so).
V1_ONLY_ARGUMENTS = frozenset({"eps_inside_sqrt", "max_grad_norm", "use_mt", "amp_scale_adjustment"})

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class FusedAdamV1(torch.optim.Optimizer):
    """apex 0.1's ``FusedAdam``: see the module docstring for its update and its clipping.

    State: ``state[p]['step']`` (an int, as apex saved it), ``exp_avg`` and ``exp_avg_sq`` in
    FP32 whatever the param's dtype; fp16/bf16 params take their new value rounded once.  A
    param without a gradient is skipped.  Under ``ampinit.initialize`` or ``FP16_Optimizer``
    it updates the FP32 masters from their unscaled gradients, so ``scale`` is 1 there.

    Differences from apex: ``amp_scale_adjustment`` other than 1 and ``step(grads=...,
    output_params=...)`` raise (ampinit's masters take their place); ``use_mt`` is accepted
    and changes nothing (the update is always multi-tensor).
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, bias_correction: bool = True,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0.0, max_grad_norm: float = 0.0, amsgrad: bool = False,
                 use_mt: bool = False, amp_scale_adjustment: float = 1.0):
        if amsgrad:
            raise ValueError("FusedAdam does not support the AMSGrad variant (amsgrad=True), as in apex; "
                             "use torch.optim.Adam(amsgrad=True)")
        if amp_scale_adjustment != 1.0:
            raise ValueError("FusedAdam(amp_scale_adjustment=...) is not supported by ampinit: ampinit hands the "
                             "optimizer unscaled gradients; divide the loss by the adjustment instead")
        check_number("learning rate (lr)", lr)
        check_number("epsilon (eps)", eps)
        check_number("weight_decay", weight_decay)
        check_number("max_grad_norm (0 disables clipping)", max_grad_norm)
        defaults = dict(lr=lr, bias_correction=bool(bias_correction), betas=check_betas(betas),
                        eps=eps, weight_decay=weight_decay, max_grad_norm=max_grad_norm)
        super().__init__(params, defaults)
        # apex's names: mode 0 puts eps under the square root
        self.eps_mode = 0 if eps_inside_sqrt else 1
        self.use_mt = bool(use_mt)

    def __setstate__(self, state: dict) -> None:
        """Also run by ``load_state_dict``: groups loaded from a checkpoint of another Adam
        (``torch.optim.Adam``, today's FusedAdam) take the keys they lack from our defaults."""
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None, grads: Any = None, output_params: Any = None,
             scale: float = 1.0, grad_norms: Optional[Sequence[Optional[float]]] = None) -> Any:
        """One update of every param with a ``.grad``, each divided by ``scale`` (and clipped per
        group); ``grad_norms``, one per group, are norms of the gradients *before* dividing by
        ``scale``, as apex's ``FP16_Optimizer`` passed them.  Returns ``closure()``'s loss."""
        if grads is not None or output_params is not None:
            raise NotImplementedError(
                "FusedAdam.step(grads=..., output_params=...) is not supported by ampinit: let "
                "apex.optimizers.FP16_Optimizer or ampinit.initialize keep the FP32 master weights, and "
                "call step() without them")
        check_number("scale", scale, low=math.ulp(0.0))
        if grad_norms is not None and len(grad_norms) != len(self.param_groups):
            raise ValueError(f"grad_norms needs one norm per param group ({len(self.param_groups)}); "
                             f"got {len(grad_norms)}")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = [self._params_with_grads(group) for group in self.param_groups]  # every check before any update
        for index, (group, params) in enumerate(zip(self.param_groups, work)):
            if params:
                norm = None if grad_norms is None else grad_norms[index]
                self._update(group, params, scale, norm)
        return loss

    def _params_with_grads(self, group: dict) -> List[torch.Tensor]:
        params = []
        for param in group["params"]:
            if param.grad is None:
                continue
            if param.grad.layout != torch.strided:
                raise RuntimeError("FusedAdam does not support sparse gradients; use torch.optim.SparseAdam")
            if param.dtype not in _SUPPORTED_DTYPES:
                raise TypeError(f"FusedAdam updates float32, float16 and bfloat16 params; got a {param.dtype} param")
            params.append(param)
        return params

    def _combined_scale(self, group: dict, grads32: List[torch.Tensor], scale: float,
                        norm: Optional[float]) -> torch.Tensor:
        """``scale``, times the group's clipping factor where it exceeds 1 (a 0-dim device tensor,
        so that no host sync is needed)."""
        device = grads32[0].device
        combined = torch.tensor(float(scale), dtype=torch.float32, device=device)
        max_norm = group["max_grad_norm"]
        if max_norm <= 0:
            return combined
        if norm is None:
            norm_tensor = torch.linalg.vector_norm(torch.stack([n.to(device) for n in torch._foreach_norm(grads32)]))
        else:
            norm_tensor = torch.tensor(float(norm), dtype=torch.float32, device=device)
        clip = (norm_tensor / scale + 1e-6) / max_norm
        return torch.where(clip > 1, combined * clip, combined)

    def _update(self, group: dict, params: List[torch.Tensor], scale: float, norm: Optional[float]) -> None:
        beta1, beta2 = group["betas"]
        eps, weight_decay = group["eps"], group["weight_decay"]
        params32 = [p if p.dtype == torch.float32 else p.float() for p in params]
        grads32 = [p.grad.float() for p in params]  # FP32 grads are p.grad itself: not written
        combined = self._combined_scale(group, grads32, scale, norm)
        grads32 = torch._foreach_div(grads32, combined)

        exp_avgs, exp_avg_sqs, step_sizes = [], [], []
        for param in params:
            state = self.state[param]
            if "exp_avg" not in state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(param, dtype=torch.float32, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.float32,
                                                       memory_format=torch.preserve_format)
            state["step"] = int(state["step"]) + 1
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            step_sizes.append(self._step_size(group, state["step"]))

        torch._foreach_lerp_(exp_avgs, grads32, 1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads32, grads32, value=1.0 - beta2)
        if self.eps_mode == 0:
            denoms = torch._foreach_add(exp_avg_sqs, eps)
            torch._foreach_sqrt_(denoms)
        else:
            denoms = torch._foreach_sqrt(exp_avg_sqs)
            torch._foreach_add_(denoms, eps)
        updates = torch._foreach_div(exp_avgs, denoms)
        if weight_decay != 0:
            torch._foreach_add_(updates, params32, alpha=weight_decay)
        torch._foreach_mul_(updates, [-size for size in step_sizes])
        torch._foreach_add_(params32, updates)
        for param, value in zip(params, params32):
            if value is not param:
                param.copy_(value)

    @staticmethod
    def _step_size(group: dict, step: int) -> float:
        if not group["bias_correction"]:
            return group["lr"]
        beta1, beta2 = group["betas"]
        return group["lr"] * math.sqrt(1.0 - beta2 ** step) / (1.0 - beta1 ** step)

    def load_state_dict(self, state_dict: dict) -> None:
        """As ``torch.optim.Optimizer.load_state_dict``, but the moments stay FP32 (torch would
        cast them to each param's dtype) and ``step`` stays an int."""
        super().load_state_dict(state_dict)
        for param, state in self.state.items():
            for key in ("exp_avg", "exp_avg_sq"):
                if isinstance(state.get(key), torch.Tensor):
                    state[key] = state[key].to(device=param.device, dtype=torch.float32)
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = int(state["step"].item())
