"""Pure-PyTorch implementations of ampinit's ops.

They honour exactly the contract of the compiled kernels (see ``ops``): ``inv_scale`` and
``found_inf`` are 1-element float32 tensors on the gradients' device, read and written with
tensor ops only, so nothing here synchronises the host with the device (the fused optimizers
are the exception: they read found_inf and the step counts on the host).  ``found_inf`` is
OR-ed into (set to 1.0 on a non-finite value, never cleared): the caller zeroes it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Dict, List, Optional, Sequence, Tuple

import torch

Tensors = Sequence[torch.Tensor]


def _group_by_dtype(*lists: Tensors) -> Dict[Tuple[torch.dtype, ...], Tuple[List[torch.Tensor], ...]]:
    """Split parallel lists into groups sharing the dtypes of each list's entry."""
    groups: Dict[Tuple[torch.dtype, ...], Tuple[List[torch.Tensor], ...]] = defaultdict(
        lambda: tuple([] for _ in lists))
    for entries in zip(*lists):
        group = groups[tuple(t.dtype for t in entries)]
        for bucket, tensor in zip(group, entries):
            bucket.append(tensor)
    return groups


def _check_sparse_and_unscale(grad: torch.Tensor, inv_scale: torch.Tensor,
                              found_inf: torch.Tensor) -> torch.Tensor:
    """Unscaled float32 copy of a sparse gradient; flags non-finite values."""
    grad = grad.coalesce()
    values = grad._values().float() * inv_scale
    found_inf.copy_(torch.maximum(found_inf, (~torch.isfinite(values)).any().float().reshape(1)))
    return torch.sparse_coo_tensor(grad._indices(), values, grad.shape, is_coalesced=True)


def _check_and_unscale_dense_(tensors: List[torch.Tensor], inv_scale: torch.Tensor,
                              found_inf: torch.Tensor) -> None:
    for tensors_of_dtype, in _group_by_dtype(tensors).values():
        torch._amp_foreach_non_finite_check_and_unscale_(tensors_of_dtype, found_inf, inv_scale)


def _record_per_tensor(tensors: Tensors, per_tensor_found_inf: Optional[torch.Tensor]) -> None:
    """Set ``per_tensor_found_inf[i]`` for each tensor holding inf/NaN (an extra pass; the
    fallback spends it only when diagnostics ask for it)."""
    if per_tensor_found_inf is None or not tensors:
        return
    bad = torch.stack([torch.logical_not(torch.isfinite(t).all()) for t in tensors]).to(per_tensor_found_inf.device)
    per_tensor_found_inf.copy_(torch.maximum(per_tensor_found_inf, bad.float()))


def unscale_(inputs: Tensors, outputs: Tensors, inv_scale: torch.Tensor,
             found_inf: torch.Tensor, per_tensor_found_inf: Optional[torch.Tensor] = None) -> None:
    """``outputs[i] = inputs[i] * inv_scale`` (cast to the output's dtype), checking for inf/NaN.

    ``outputs[i]`` may be ``inputs[i]`` (in place).  Sparse inputs are not supported here;
    use :func:`unscale_sparse`.
    """
    _record_per_tensor(inputs, per_tensor_found_inf)
    in_place = [o for i, o in zip(inputs, outputs) if o is i]
    copies = [(i, o) for i, o in zip(inputs, outputs) if o is not i]
    if copies:
        sources, targets = zip(*copies)
        for group_sources, group_targets in _group_by_dtype(sources, targets).values():
            torch._foreach_copy_(group_targets, group_sources)
        in_place.extend(targets)
    if in_place:
        # The non-finite check runs on the already-cast output.  A float32 output of a
        # low-precision input represents every input value exactly, so no inf/NaN is lost
        # or invented by checking after the cast.
        _check_and_unscale_dense_(in_place, inv_scale, found_inf)


def accumulate_unscaled_(inputs: Tensors, outputs: Tensors, inv_scale: torch.Tensor,
                         found_inf: torch.Tensor, out_weight: float = 1.0) -> None:
    """``outputs[i] += inputs[i] * inv_scale``, checking the new contributions for inf/NaN.

    Used when a second loss (or a second backward before ``step``) adds to gradients that
    are already unscaled: each contribution is unscaled with its own loss scale.
    """
    if not inputs:
        return
    unscaled = [torch.empty_like(o) for o in outputs]
    unscale_(inputs, unscaled, inv_scale, found_inf)
    for group_outputs, group_unscaled in _group_by_dtype(outputs, unscaled).values():
        if out_weight != 1.0:
            torch._foreach_mul_(group_outputs, out_weight)
        torch._foreach_add_(group_outputs, group_unscaled)


def check_finite_(inputs: Tensors, found_inf: torch.Tensor,
                  per_tensor_found_inf: Optional[torch.Tensor] = None) -> None:
    """Set ``found_inf`` if any input holds inf/NaN, without writing the inputs."""
    if not inputs:
        return
    bad = torch.stack([torch.logical_not(torch.isfinite(t).all()) for t in inputs])
    found_inf.copy_(torch.maximum(found_inf, bad.any().float().reshape(1)))
    if per_tensor_found_inf is not None:
        per_tensor_found_inf.copy_(torch.maximum(per_tensor_found_inf, bad.float()))


def l2norm(inputs: Tensors, per_tensor: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Total L2 norm (1-element float32) and, if ``per_tensor``, each tensor's norm."""
    device = inputs[0].device if inputs else torch.device("cpu")
    if not inputs:
        return torch.zeros(1, device=device), torch.empty(0, device=device)
    squares = torch.stack([t.double().square().sum() for t in inputs])
    total = squares.sum().sqrt().float().reshape(1)
    norms = squares.sqrt().float() if per_tensor else torch.empty(0, device=device)
    return total, norms


def unscale_sparse(grad: torch.Tensor, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """Unscaled copy of a sparse COO gradient in ``dtype``, checking it for inf/NaN."""
    return _check_sparse_and_unscale(grad, inv_scale, found_inf).to(dtype)


def copy_(outputs: Tensors, inputs: Tensors) -> None:
    """``outputs[i].copy_(inputs[i])`` with dtype conversion (masters -> model)."""
    for group_outputs, group_inputs in _group_by_dtype(outputs, inputs).values():
        torch._foreach_copy_(group_outputs, group_inputs)


def update_scale_(scale: torch.Tensor, growth_tracker: torch.Tensor,
                  hysteresis_tracker: torch.Tensor, overflow_count: torch.Tensor,
                  found_inf: torch.Tensor, *, growth_factor: float, backoff_factor: float,
                  growth_interval: int, hysteresis: int, min_scale: float,
                  max_scale: float) -> None:
    """Advance the dynamic loss-scale state machine by one backward, on the device.

    - ``found_inf`` set: ``overflow_count += 1``, ``growth_tracker = 0`` and one hysteresis
      credit is spent; once none is left the scale backs off to
      ``max(scale * backoff_factor, min_scale)``.
    - otherwise ``growth_tracker += 1``; when it reaches ``growth_interval`` the scale grows to
      ``min(scale * growth_factor, max_scale)``, the tracker restarts and the hysteresis
      credits are refilled.

    ``growth_tracker`` is apex's ``unskipped`` counter.  With ``hysteresis=1`` this is exactly
    apex's ``LossScaler.update_scale``.
    """
    overflow = found_inf > 0
    credits = torch.where(overflow, hysteresis_tracker - 1, hysteresis_tracker)
    back_off = overflow & (credits <= 0)
    backed_off = torch.clamp(scale * backoff_factor, min=min_scale)
    new_scale = torch.where(back_off, backed_off, scale)
    tracker = torch.where(overflow, torch.zeros_like(growth_tracker), growth_tracker + 1)
    grow = tracker >= growth_interval
    grown = torch.clamp(new_scale * growth_factor, max=max_scale)
    scale.copy_(torch.where(grow, grown, new_scale))
    growth_tracker.copy_(torch.where(grow, torch.zeros_like(tracker), tracker))
    hysteresis_tracker.copy_(torch.where(grow, torch.full_like(credits, hysteresis),
                                         torch.clamp(credits, min=0)))
    overflow_count.add_(overflow.to(overflow_count.dtype))


# -- fused optimizers: torch ops, one tensor at a time -------------------------------------------
# Without the compiled kernels the fused optimizers still compute exactly their update, but
# the skip decision and the bias corrections read device values on the host (syncs on CUDA).

def fused_adam_(params, grads, exp_avgs, exp_avg_sqs, steps, model_params, *, lr: float, beta1: float,
                beta2: float, eps: float, weight_decay: float, decoupled_weight_decay: bool,
                bias_correction: bool, inv_scale: torch.Tensor, found_inf: torch.Tensor) -> None:
    """Adam/AdamW as torch.optim.Adam's single-tensor path computes it; see ``ops.fused_adam_``."""
    if not params or bool(found_inf.item()):
        return
    for i, param in enumerate(params):
        grad = grads[i].float() * inv_scale
        steps[i] += 1
        step = float(steps[i])
        if weight_decay != 0:
            if decoupled_weight_decay:
                param.mul_(1 - lr * weight_decay)
            else:
                grad = grad.add(param, alpha=weight_decay)
        exp_avgs[i].lerp_(grad, 1 - beta1)
        exp_avg_sqs[i].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1 ** step if bias_correction else 1.0
        bias_correction2 = 1 - beta2 ** step if bias_correction else 1.0
        denom = (exp_avg_sqs[i].sqrt() / math.sqrt(bias_correction2)).add_(eps)
        param.addcdiv_(exp_avgs[i], denom, value=-lr / bias_correction1)
    if model_params:
        copy_(model_params, params)


def fused_sgd_(params, grads, momentum_buffers, steps, model_params, *, lr: float, momentum: float,
               dampening: float, weight_decay: float, nesterov: bool, inv_scale: torch.Tensor,
               found_inf: torch.Tensor) -> None:
    """SGD as torch.optim.SGD computes it; see ``ops.fused_sgd_``."""
    if not params or bool(found_inf.item()):
        return
    for i, param in enumerate(params):
        grad = grads[i].float() * inv_scale
        steps[i] += 1
        if weight_decay != 0:
            grad = grad.add(param, alpha=weight_decay)
        if momentum != 0:
            buffer = momentum_buffers[i]
            if float(steps[i]) == 1.0:
                buffer.copy_(grad)
            else:
                buffer.mul_(momentum).add_(grad, alpha=1 - dampening)
            grad = grad.add(buffer, alpha=momentum) if nesterov else buffer
        param.add_(grad, alpha=-lr)
    if model_params:
        copy_(model_params, params)
