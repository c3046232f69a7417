"""``amp_C`` on ampinit: apex's multi-tensor CUDA ops, emulated on ampinit's kernels.

In apex, ``amp_C`` was the compiled extension behind ``apex.amp`` and ``apex.optimizers``:
CUDA kernels over lists of tensors, called as ``op(chunk_size, noop_flag, tensor_lists,
*args)`` (usually through ``apex.multi_tensor_apply.multi_tensor_applier``).  ``noop_flag``
was a 1-element int32 CUDA tensor that the ops set to 1 when they saw inf/NaN.  Megatron-LM,
NeMo and NVIDIA's BERT scripts call a handful of them directly; this module provides those,
with apex's signatures, on CPU and CUDA tensors:

- :func:`multi_tensor_scale` (``ops.unscale_``), :func:`multi_tensor_axpby`
  (``ops.accumulate_unscaled_``, ``ops.unscale_``, ``ops.check_finite_``, ``ops.copy_``),
  :func:`multi_tensor_l2norm` and :func:`multi_tensor_unscale_l2norm` (``ops.l2norm``): the
  work runs in ampinit's compiled kernels where they are built (the pure-PyTorch fallback
  otherwise); ``chunk_size`` is accepted and ignored, since those kernels chunk by themselves.
- :func:`update_scale_hysteresis`: apex's single-thread kernel, as a few elementwise torch ops
  on the device (ampinit's own ``ops.update_scale_`` follows a different rule).

**No host sync.**  No function here reads a device value on the host: the noop flag is set
with tensor ops from a float32 scratch flag, scales are passed to the kernels as device
tensors, and the loss-scale update is ``torch.where`` on the device.

**Differences from apex**

- ``multi_tensor_scale`` and ``multi_tensor_axpby`` check for inf/NaN as ``ampinit.ops`` does.
  Its compiled kernels check the *scaled* contributions (``in * scale``, ``a * x``, ``b * y``,
  in float32) where apex checked the inputs: a non-finite input always makes a non-finite
  product (``inf * 0`` is NaN), so every case apex flags is flagged, and in addition a finite
  input whose product overflows float32 (apex wrote that inf without flagging it).  The torch
  fallback checks the same values.  When ``out`` is ``y`` (or
  ``x``), the operand that is overwritten is checked as it is, like apex.
- ``multi_tensor_unscale_l2norm`` computes ``|inv_scale| * ||x||`` (and the same per tensor)
  rather than summing the squares of ``x * inv_scale``: equal for the power-of-two scales amp
  uses, up to rounding otherwise, and different only where ``x * inv_scale`` would under- or
  overflow float32 elementwise.
- Norms are accumulated in double (apex: float32 per chunk); the noop flag is set when the
  total norm is non-finite (apex: when a chunk's partial sum was).
- ``multi_tensor_scale`` also takes ``scale`` as a 1-element tensor (used without a sync);
  ``multi_tensor_unscale_l2norm`` also takes ``inv_scale`` as a Python float.
- Tensors may be on the CPU, non-contiguous, float64 (on the fallback path) or in any number.
- :func:`multi_tensor_adam`: apex's (non-capturable) Adam/AdamW step over
  ``[grads, params, exp_avgs, exp_avg_sqs]``, with torch ops in float32, for optimizers written
  against apex that call it themselves (fairseq's ``FusedAdamV2`` reads
  ``FusedAdam.multi_tensor_adam``).
- apex's other ops (``multi_tensor_adam_capturable``, ``_sgd``, ``_lamb``, ``_novograd``, ``_adagrad``,
  ``_l2norm_mp``, ...) are not defined, so ``hasattr(amp_C, name)`` is False and code that
  probes for them takes its fallback; using one raises ``AttributeError`` naming the
  replacement.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple, Union

import torch

from .. import ops
from .multi_tensor_apply import check_tensor_lists, rows_of_one_shape

__all__ = ["multi_tensor_scale", "multi_tensor_axpby", "multi_tensor_l2norm", "multi_tensor_unscale_l2norm",
           "update_scale_hysteresis", "multi_tensor_adam"]

TensorLists = Sequence[Sequence[torch.Tensor]]


def _checks_lists(function):
    """Mark an op that validates its own lists (the applier then skips its check)."""
    function._ampinit_checks_lists = True
    return function


def _scalar_tensor(value: Union[float, torch.Tensor], device: torch.device) -> torch.Tensor:
    """A 1-element float32 tensor on ``device`` holding ``value`` (no sync for tensors on it)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"expected a 1-element tensor, got {value.numel()} elements")
        return value.reshape(1).to(device=device, dtype=torch.float32)
    return torch.full((1,), float(value), dtype=torch.float32, device=device)


def _set_noop(noop_flag: torch.Tensor, found_inf: torch.Tensor) -> None:
    """``noop_flag[:] = 1`` where the float32 scratch flag is set, on the device."""
    noop_flag.masked_fill_((found_inf > 0).reshape(()), 1)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape
                      and a.stride() == b.stride())


@_checks_lists
def multi_tensor_scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: TensorLists,
                       scale: Union[float, torch.Tensor]) -> None:
    """``out[i] = in[i] * scale`` (computed in float32, cast to ``out[i]``'s dtype) for
    ``tensor_lists = [inputs, outputs]``; ``out[i]`` may be ``in[i]``.  Sets ``noop_flag`` to 1
    if a scaled value is inf/NaN; the outputs are written either way."""
    device = check_tensor_lists(noop_flag, tensor_lists, 2, "amp_C.multi_tensor_scale", floating=True)
    inputs, outputs = rows_of_one_shape(tensor_lists, "amp_C.multi_tensor_scale")
    found_inf = torch.zeros(1, dtype=torch.float32, device=device)
    ops.unscale_(list(inputs), list(outputs), _scalar_tensor(scale, device), found_inf)
    _set_noop(noop_flag, found_inf)


@_checks_lists
def multi_tensor_axpby(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: TensorLists, a: float, b: float,
                       arg_to_check: int) -> None:
    """``out[i] = a * x[i] + b * y[i]`` (computed in float32, cast to ``out[i]``'s dtype) for
    ``tensor_lists = [x, y, out]``; ``out[i]`` may be ``x[i]`` or ``y[i]``.  Sets ``noop_flag``
    to 1 if ``x`` (``arg_to_check=0``), ``y`` (1) or either (-1) contributes inf/NaN."""
    device = check_tensor_lists(noop_flag, tensor_lists, 3, "amp_C.multi_tensor_axpby", floating=True)
    if arg_to_check not in (-1, 0, 1):
        raise ValueError(f"amp_C.multi_tensor_axpby: arg_to_check must be -1, 0 or 1, got {arg_to_check!r}")
    xs, ys, outs = rows_of_one_shape(tensor_lists, "amp_C.multi_tensor_axpby")
    found_inf = torch.zeros(1, dtype=torch.float32, device=device)
    ignored = torch.zeros(1, dtype=torch.float32, device=device)
    flag_x = found_inf if arg_to_check in (-1, 0) else ignored
    flag_y = found_inf if arg_to_check in (-1, 1) else ignored
    a_t = _scalar_tensor(a, device)
    b_t = _scalar_tensor(b, device)

    into_y: Tuple[List[torch.Tensor], List[torch.Tensor]] = ([], [])      # out is y: y = b*y + a*x
    into_x: Tuple[List[torch.Tensor], List[torch.Tensor]] = ([], [])      # out is x: x = a*x + b*y
    apart: Tuple[List[torch.Tensor], ...] = ([], [], [])                   # out is separate
    for x, y, out in zip(xs, ys, outs):
        if _same_memory(out, y):
            into_y[0].append(x)
            into_y[1].append(y)
        elif _same_memory(out, x):
            into_x[0].append(x)
            into_x[1].append(y)
        else:
            apart[0].append(x)
            apart[1].append(y)
            apart[2].append(out)

    if into_y[0]:
        x_in, y_out = into_y
        if flag_y is found_inf:
            ops.check_finite_(y_out, found_inf)  # before y is overwritten
        ops.accumulate_unscaled_(x_in, y_out, a_t, flag_x, out_weight=float(b))
    if into_x[0]:
        x_out, y_in = into_x
        if flag_x is found_inf:
            ops.check_finite_(x_out, found_inf)
        ops.accumulate_unscaled_(y_in, x_out, b_t, flag_y, out_weight=float(a))
    if apart[0]:
        x_in, y_in, out = apart
        wide = [i for i, o in enumerate(out) if o.dtype in (torch.float32, torch.float64)]
        narrow = [i for i, o in enumerate(out) if o.dtype not in (torch.float32, torch.float64)]
        if wide:
            # Straight into the output: b*y, then + a*x, each rounded in the output's precision.
            w_out = [out[i] for i in wide]
            ops.unscale_([y_in[i] for i in wide], w_out, b_t, flag_y)
            ops.accumulate_unscaled_([x_in[i] for i in wide], w_out, a_t, flag_x)
        if narrow:
            # A 16-bit output is rounded once, from a float32 scratch sum.
            scratch = [torch.empty(out[i].shape, dtype=torch.float32, device=device) for i in narrow]
            ops.unscale_([y_in[i] for i in narrow], scratch, b_t, flag_y)
            ops.accumulate_unscaled_([x_in[i] for i in narrow], scratch, a_t, flag_x)
            ops.copy_([out[i] for i in narrow], scratch)
    _set_noop(noop_flag, found_inf)


def _per_tensor_flag(per_tensor: Optional[bool]) -> bool:
    return bool(per_tensor) if per_tensor is not None else False


@_checks_lists
def multi_tensor_l2norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: TensorLists,
                        per_tensor: Optional[bool] = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(total, per_tensor_norms)`` for ``tensor_lists = [tensors]``: the L2 norm over all the
    tensors as a 1-element float32 tensor, and each tensor's norm (float32, one per tensor) if
    ``per_tensor`` else an empty float32 tensor, both on the tensors' device.  Sets
    ``noop_flag`` to 1 if the total is inf/NaN."""
    check_tensor_lists(noop_flag, tensor_lists, 1, "amp_C.multi_tensor_l2norm", floating=True)
    total, norms = ops.l2norm(list(tensor_lists[0]), _per_tensor_flag(per_tensor))
    noop_flag.masked_fill_(torch.logical_not(torch.isfinite(total)).reshape(()), 1)
    return total, norms


@_checks_lists
def multi_tensor_unscale_l2norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: TensorLists,
                                inv_scale: Union[torch.Tensor, float],
                                per_tensor: Optional[bool] = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Like :func:`multi_tensor_l2norm`, for the norms of ``x * inv_scale`` (total and per
    tensor); the tensors are not modified.  ``inv_scale`` is a 1-element float32 tensor."""
    device = check_tensor_lists(noop_flag, tensor_lists, 1, "amp_C.multi_tensor_unscale_l2norm", floating=True)
    factor = _scalar_tensor(inv_scale, device).abs()
    total, norms = ops.l2norm(list(tensor_lists[0]), _per_tensor_flag(per_tensor))
    total = total * factor
    norms = norms * factor
    noop_flag.masked_fill_(torch.logical_not(torch.isfinite(total)).reshape(()), 1)
    return total, norms


_TINY = torch.finfo(torch.float32).tiny


def update_scale_hysteresis(current_scale: torch.Tensor, growth_tracker: torch.Tensor,
                            hysteresis_tracker: torch.Tensor, found_inf: torch.Tensor, growth_factor: float,
                            backoff_factor: float, growth_interval: int, hysteresis: int) -> torch.Tensor:
    """apex's dynamic loss-scale update with hysteresis, in place on the device (no sync).

    - ``found_inf > 0``: ``hysteresis_tracker -= 1``; while it stays positive only
      ``growth_tracker`` is reset.
    - Once it is spent (and on every further inf): ``current_scale *= backoff_factor``
      (computed in double, stored in float32; a result below the smallest normal float32
      becomes 0, as in apex's fast-math kernel) and ``growth_tracker = 0``.
    - A clean step counts ``growth_tracker``; on reaching ``growth_interval`` the scale is
      multiplied by ``growth_factor`` unless that is not finite, and the count restarts.
    - A clean step refills ``hysteresis_tracker`` to ``hysteresis``.

    ``current_scale`` and ``found_inf`` are 1-element float32 tensors, the trackers 1-element
    int32 tensors, all on one device.  Returns ``current_scale``.
    """
    where = "amp_C.update_scale_hysteresis"
    state = {"current_scale": current_scale, "growth_tracker": growth_tracker,
             "hysteresis_tracker": hysteresis_tracker, "found_inf": found_inf}
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor) or tensor.numel() != 1:
            raise TypeError(f"{where}: {name} must be a 1-element tensor")
        if tensor.device != current_scale.device:
            raise ValueError(f"{where}: {name} is on {tensor.device}, current_scale on {current_scale.device}")
    if current_scale.dtype != torch.float32:
        raise TypeError(f"{where}: current_scale must be float32, got {current_scale.dtype}")
    for name in ("growth_tracker", "hysteresis_tracker"):
        if state[name].dtype.is_floating_point or state[name].dtype.is_complex or state[name].dtype == torch.bool:
            raise TypeError(f"{where}: {name} must be an integer (int32) tensor, got {state[name].dtype}")

    scale = current_scale.reshape(1)
    growth = growth_tracker.reshape(1)
    credits = hysteresis_tracker.reshape(1)
    found = found_inf.reshape(1)

    saw_inf = found > 0
    credits_after = credits - saw_inf.to(credits.dtype)
    only_reset = saw_inf & (credits_after > 0)    # an inf within the hysteresis budget
    clean = found == 0                            # (NaN and negative found_inf back off, as in apex)
    back_off = torch.logical_not(clean | only_reset)
    successful = growth + 1
    grow = clean & (successful == int(growth_interval))

    wide = scale.double()
    backed_off = (wide * float(backoff_factor)).float()
    backed_off = backed_off.masked_fill(backed_off.abs() < _TINY, 0.0)
    grown = (wide * float(growth_factor)).float()
    grown = torch.where(torch.isfinite(grown), grown, scale)

    current_scale.copy_(torch.where(back_off, backed_off, torch.where(grow, grown, scale)).reshape(current_scale.shape))
    growth_tracker.copy_(successful.masked_fill(grow | torch.logical_not(clean), 0).reshape(growth_tracker.shape))
    hysteresis_tracker.copy_(credits_after.masked_fill(found <= 0, int(hysteresis)).reshape(hysteresis_tracker.shape))
    return current_scale


# apex's other amp_C ops, with what replaces them here.
_REPLACED = {
    "multi_tensor_adam_capturable": "ampinit.optim.FusedAdam (apex.optimizers.FusedAdam under the alias) or "
                                    "torch.optim.Adam(capturable=True)",
    "multi_tensor_adam_capturable_master": "ampinit.optim.FusedAdam with ampinit.initialize's master weights "
                                           "(apex.optimizers.FusedAdam under the alias)",
    "multi_tensor_sgd": "ampinit.optim.FusedSGD (apex.optimizers.FusedSGD under the alias) or torch.optim.SGD",
    "multi_tensor_lamb": "apex.optimizers.FusedLAMB under the alias (ampinit.apex.optimizers.FusedLAMB)",
    "multi_tensor_lamb_mp": "apex.optimizers.FusedLAMB under the alias (ampinit.apex.optimizers.FusedLAMB)",
    "multi_tensor_lamb_stage1_cuda": "apex.optimizers.FusedLAMB under the alias (ampinit.apex.optimizers.FusedLAMB)",
    "multi_tensor_lamb_stage2_cuda": "apex.optimizers.FusedLAMB under the alias (ampinit.apex.optimizers.FusedLAMB)",
    "multi_tensor_novograd": "apex.optimizers.FusedNovoGrad under the alias (ampinit.apex.optimizers.FusedNovoGrad)",
    "multi_tensor_adagrad": "apex.optimizers.FusedAdagrad under the alias (ampinit.apex.optimizers.FusedAdagrad) "
                            "or torch.optim.Adagrad",
    "multi_tensor_l2norm_mp": "amp_C.multi_tensor_l2norm (it accumulates in double already)",
    "multi_tensor_l2norm_scale": "amp_C.multi_tensor_l2norm followed by amp_C.multi_tensor_scale",
    "scale_check_overflow": "amp_C.multi_tensor_scale (apex removed scale_check_overflow itself)",
}


@_checks_lists
def multi_tensor_adam(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: TensorLists, lr: float, beta1: float,
                      beta2: float, epsilon: float, step: Union[int, torch.Tensor], mode: int, bias_correction: int,
                      weight_decay: float) -> None:
    """apex's ``multi_tensor_adam``: one Adam step, in place, on ``tensor_lists = [grads, params,
    exp_avgs, exp_avg_sqs]``.

    With ``bc1 = 1 - beta1**step`` and ``bc2 = 1 - beta2**step`` (both 1 unless
    ``bias_correction``), in float32 for each element: ``mode=0`` (Adam, L2 penalty) first adds
    ``weight_decay * p`` to the gradient; then ``m = beta1*m + (1-beta1)*g``,
    ``v = beta2*v + (1-beta2)*g*g``, ``u = (m/bc1) / (sqrt(v/bc2) + epsilon)``, plus
    ``weight_decay * p`` with ``mode=1`` (AdamW), and ``p = p - lr*u``.  Each result is rounded
    to its tensor's dtype.  As in apex, ``noop_flag`` is neither read nor set, the gradients are
    not modified, and ``step`` is the caller's count (the step being taken, from 1).
    """
    check_tensor_lists(noop_flag, tensor_lists, 4, "amp_C.multi_tensor_adam", floating=True)
    if mode not in (0, 1):  # FusedAdam.adam_w_mode, a bool in ampinit, is passed here as is
        raise ValueError(f"amp_C.multi_tensor_adam: mode must be 0 (Adam, L2 penalty) or 1 (AdamW); got {mode!r}")
    step = float(step.reshape(-1)[0]) if isinstance(step, torch.Tensor) else float(step)
    bc1, bc2 = (1.0 - beta1 ** step, 1.0 - beta2 ** step) if bias_correction else (1.0, 1.0)
    with torch.no_grad():
        for grad, param, exp_avg, exp_avg_sq in zip(*rows_of_one_shape(tensor_lists, "amp_C.multi_tensor_adam")):
            g, p, m, v = (t.float() for t in (grad, param, exp_avg, exp_avg_sq))
            if mode == 0 and weight_decay != 0:
                g = g + weight_decay * p
            m = beta1 * m + (1.0 - beta1) * g
            v = beta2 * v + (1.0 - beta2) * g * g
            update = (m / bc1) / (torch.sqrt(v / bc2) + epsilon)
            if mode == 1 and weight_decay != 0:
                update = update + weight_decay * p
            param.copy_(p - lr * update)
            exp_avg.copy_(m)
            exp_avg_sq.copy_(v)


def __getattr__(name: str) -> Any:
    replacement = _REPLACED.get(name)
    if replacement is not None:
        raise AttributeError(f"ampinit's amp_C does not provide apex's {name}; use {replacement}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
