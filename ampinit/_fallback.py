"""Pure-PyTorch implementations of ampinit's ops.

They honour exactly the contract of the compiled kernels (see ``ops``): ``inv_scale`` and
``found_inf`` are 1-element float32 tensors on the gradients' device, read and written with
tensor ops only, so nothing here synchronises the host with the device.  ``found_inf`` is
OR-ed into (set to 1.0 when a value written is inf/NaN, never cleared): the caller zeroes it.
Arithmetic is float32 (float64 where a float64 tensor takes part: complex128's real views),
rounded once into each output.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Optional, Sequence, Tuple, Union

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
                              found_inf: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Unscaled copy of a sparse gradient in ``dtype``, computed in float32 and rounded once;
    flags the non-finite values it holds (a finite product that overflows ``dtype`` included,
    as the dense ops do)."""
    grad = grad.coalesce()
    values = (grad._values().float() * inv_scale.reshape(())).to(dtype)
    found_inf.copy_(torch.maximum(found_inf, (~torch.isfinite(values)).any().float().reshape(1)))
    # indices of a coalesced tensor: valid by construction, so no invariant check (and no warning)
    return torch.sparse_coo_tensor(grad._indices(), values, grad.shape, is_coalesced=True, check_invariants=False)


def _compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    return torch.float64 if torch.float64 in dtypes else torch.float32


def _exact_cast(source: torch.dtype, target: torch.dtype) -> bool:
    """Whether ``target`` holds every ``source`` value exactly (so casting first rounds nothing)."""
    return source == target or target == torch.float64 or \
        (target == torch.float32 and source in (torch.float16, torch.bfloat16))


def _nonfinite(tensors: Tensors) -> torch.Tensor:
    """One bool per tensor: whether it holds inf/NaN.  The max-norm propagates NaN, so one
    multi-tensor pass per dtype finds both."""
    flags: List[Optional[torch.Tensor]] = [None] * len(tensors)
    by_dtype: Dict[torch.dtype, List[int]] = defaultdict(list)
    for index, tensor in enumerate(tensors):
        if tensor.numel() == 0:  # no inf-norm (no identity), and nothing to flag
            flags[index] = torch.zeros((), dtype=torch.bool, device=tensor.device)
        else:
            by_dtype[tensor.dtype].append(index)
    for indices in by_dtype.values():
        norms = torch._foreach_norm([tensors[i] for i in indices], float("inf"))
        bad = torch.logical_not(torch.isfinite(torch.stack(norms)))
        for position, index in enumerate(indices):
            flags[index] = bad[position]
    return torch.stack(flags)


def _record(tensors: Tensors, found_inf: torch.Tensor, per_tensor_found_inf: Optional[torch.Tensor]) -> None:
    """Set ``found_inf`` (and ``per_tensor_found_inf[i]``) for the tensors holding inf/NaN."""
    if not tensors:
        return
    bad = _nonfinite(tensors).to(found_inf.device)
    found_inf.copy_(torch.maximum(found_inf, bad.any().float().reshape(1)))
    if per_tensor_found_inf is not None:
        per_tensor_found_inf.copy_(torch.maximum(per_tensor_found_inf, bad.float()))


def _foreach_by_dtype(fn, *lists: Tensors) -> None:
    for group in _group_by_dtype(*lists).values():
        fn(*group)


def unscale_(inputs: Tensors, outputs: Tensors, inv_scale: torch.Tensor,
             found_inf: torch.Tensor, per_tensor_found_inf: Optional[torch.Tensor] = None) -> None:
    """``outputs[i] = inputs[i] * inv_scale``, rounded once to the output's dtype, flagging the
    outputs that hold inf/NaN (a finite product that overflows the output's dtype included).

    ``outputs[i]`` may be ``inputs[i]`` (in place).  An output that holds every input value
    exactly is scaled in place after the copy; a narrower one gets the product of a float32
    copy.  Sparse inputs are not supported here; use :func:`unscale_sparse`.
    """
    if not inputs:
        return
    scaled: List[torch.Tensor] = []  # scaled in place: outputs, or staging copies
    copies: List[Tuple[torch.Tensor, torch.Tensor]] = []
    staged: List[Tuple[torch.Tensor, torch.Tensor]] = []
    for x, y in zip(inputs, outputs):
        if y is x:
            scaled.append(y)
        elif _exact_cast(x.dtype, y.dtype):
            copies.append((y, x))
            scaled.append(y)
        else:
            staging = x.to(_compute_dtype(x.dtype, y.dtype), copy=True)
            staged.append((y, staging))
            scaled.append(staging)
    if copies:
        _foreach_by_dtype(torch._foreach_copy_, *zip(*copies))
    _foreach_by_dtype(lambda group: torch._foreach_mul_(group, inv_scale.reshape(())), scaled)
    if staged:
        _foreach_by_dtype(torch._foreach_copy_, *zip(*staged))
    _record(outputs, found_inf, per_tensor_found_inf)


def accumulate_unscaled_(inputs: Tensors, outputs: Tensors, inv_scale: torch.Tensor,
                         found_inf: torch.Tensor, out_weight: float = 1.0) -> None:
    """``outputs[i] = out_weight * outputs[i] + inputs[i] * inv_scale``, computed in float32 and
    rounded once, flagging what this call brings: a non-finite contribution, or a finite output
    value that the sum pushes past its dtype.

    Used when a second loss (or a second backward before ``step``) adds to gradients that
    are already unscaled: each contribution is unscaled with its own loss scale, and an inf/NaN
    an earlier loss left in the outputs (flagged for that loss) is not flagged again.
    """
    if not inputs:
        return
    flags = []
    for x, y in zip(inputs, outputs):
        compute = _compute_dtype(x.dtype, y.dtype)
        contribution = x.to(compute) * inv_scale.reshape(())  # a 0-dim row stays 0-dim
        previous = y.to(compute, copy=True)
        y.copy_(previous * out_weight + contribution)
        overflowed = torch.logical_and(torch.logical_not(torch.isfinite(y)), torch.isfinite(previous)).any()
        flags.append(torch.logical_or(torch.logical_not(torch.isfinite(contribution).all()), overflowed))
    bad = torch.stack(flags).any().to(found_inf.device)
    found_inf.copy_(torch.maximum(found_inf, bad.float().reshape(1)))


def check_finite_(inputs: Tensors, found_inf: torch.Tensor,
                  per_tensor_found_inf: Optional[torch.Tensor] = None) -> None:
    """Set ``found_inf`` if any input holds inf/NaN, without writing the inputs."""
    _record(inputs, found_inf, per_tensor_found_inf)


def l2norm(inputs: Tensors, per_tensor: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """Total L2 norm (1-element float32) and, if ``per_tensor``, each tensor's norm; squares and
    sums in double."""
    device = inputs[0].device if inputs else torch.device("cpu")
    if not inputs:
        return torch.zeros(1, device=device), torch.empty(0, device=device)
    # complex: both parts (t.double() would drop the imaginary one)
    squares = torch.stack([(torch.view_as_real(t.resolve_conj()) if t.is_complex() else t).double().square().sum()
                           for t in inputs])
    total = squares.sum().sqrt().float().reshape(1)
    norms = squares.sqrt().float() if per_tensor else torch.empty(0, device=device)
    return total, norms


def unscale_sparse(grad: torch.Tensor, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """Unscaled copy of a sparse COO gradient in ``dtype``, checking it for inf/NaN."""
    return _check_sparse_and_unscale(grad, inv_scale, found_inf, dtype)


def copy_(outputs: Tensors, inputs: Tensors) -> None:
    """``outputs[i].copy_(inputs[i])`` with dtype conversion (masters -> model)."""
    for group_outputs, group_inputs in _group_by_dtype(outputs, inputs).values():
        torch._foreach_copy_(group_outputs, group_inputs)


def adopt_changes_(masters: Tensors, models: Tensors, only: Optional[torch.Tensor] = None) -> None:
    """Masters take the model's values where the model no longer holds their rounding (for the
    tensors whose ``only`` flag is non-zero, when given)."""
    for i, (master, model) in enumerate(zip(masters, models)):
        changed = model.ne(master.to(model.dtype))
        if only is not None:
            changed &= only[i].ne(0)
        torch.where(changed, model, master, out=master)


# an 8- or 16-byte element (float64, complex64, complex128) is read as 32-bit words, each keyed by its own index
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int32, 16: torch.int32}
_MASK32 = 0xFFFFFFFF


def _dense_order(tensor: torch.Tensor) -> Optional[List[int]]:
    """The order of dims in which a dense tensor is contiguous (its memory order), or ``None``
    for a tensor with gaps or overlaps."""
    order = sorted(range(tensor.dim()), key=tensor.stride, reverse=True)
    return order if tensor.permute(order).is_contiguous() else None


def _memory_order(tensor: torch.Tensor) -> torch.Tensor:
    """A dense tensor's elements in memory order, as a 1-D view (no copy), or the elements of its
    contiguous copy (a tensor with gaps or overlaps)."""
    order = _dense_order(tensor)
    return (tensor.contiguous() if order is None else tensor.permute(order)).reshape(-1)


_FINGERPRINT_SLICE = 1 << 20  # elements per pass: the int64 temporaries stay at a few MiB


def _mix_bits(x: torch.Tensor) -> torch.Tensor:
    """Chris Wellons' lowbias32 hash of uint32 values held in int64 (the kernels' ``bf16_bits::mix``)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def fingerprint(inputs: Tensors) -> torch.Tensor:
    """See ``ampinit.ops.fingerprint``: the sum of ``mix(bits ^ (index * 0x9E3779B9))`` mod 2**32
    (``fingerprint_bits::term`` in ``csrc/master_bits.h``), in int64 held below 2**32."""
    out = []
    for tensor in inputs:
        flat = _memory_order(tensor.detach()).view(_BITS[tensor.element_size()])
        unsigned = (1 << (8 * flat.element_size())) - 1
        total = torch.zeros((), dtype=torch.int64, device=tensor.device)
        for start in range(0, flat.numel(), _FINGERPRINT_SLICE):
            bits = flat[start:start + _FINGERPRINT_SLICE].to(torch.int64) & unsigned
            index = torch.arange(start, start + bits.numel(), dtype=torch.int64, device=bits.device)
            total += _mix_bits(bits ^ ((index * 0x9E3779B9) & _MASK32)).sum()
        out.append(total & _MASK32)
    return torch.stack(out) if out else torch.zeros(0, dtype=torch.int64)


def update_scale_(scale: torch.Tensor, growth_tracker: torch.Tensor,
                  hysteresis_tracker: torch.Tensor, overflow_count: torch.Tensor,
                  found_inf: torch.Tensor, *, growth_factor: float, backoff_factor: float,
                  growth_interval: int, hysteresis: int, min_scale: float,
                  max_scale: float) -> None:
    """Advance the dynamic loss-scale state machine by one backward, on the device.

    - ``found_inf`` set: ``overflow_count += 1``, ``growth_tracker = 0`` and one hysteresis
      credit is spent; once none is left the scale backs off to
      ``max(scale * backoff_factor, min_scale)`` (and at every further consecutive overflow).
    - otherwise the hysteresis credits are refilled and ``growth_tracker += 1``; when it reaches
      ``growth_interval`` the scale grows to ``min(scale * growth_factor, max_scale)`` and the
      tracker restarts.

    ``growth_tracker`` is apex's ``unskipped`` counter.  With ``hysteresis=1`` this is exactly
    apex's ``LossScaler.update_scale``; with more, apex's ``update_scale_hysteresis`` kernel
    (``hysteresis`` consecutive overflows back off), within the floor and the ceiling.
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
    hysteresis_tracker.copy_(torch.where(overflow, torch.clamp(credits, min=0), torch.full_like(credits, hysteresis)))
    overflow_count.add_(overflow.to(overflow_count.dtype))


# -- fused optimizers: torch ops, one tensor at a time ---------------------------------------------
# The update is computed out of place in float32 and kept only where found_inf is 0
# (torch.where on the device): nothing reads a device value on the host, capturable or not.
# Hyper-parameters are Python floats, or 0-dim views of ``hyper`` on the device.

Scalar = Union[float, torch.Tensor]


def _hyper_scalars(hyper: Optional[torch.Tensor], floats: Sequence[float]) -> List[Scalar]:
    if hyper is None:
        return [float(value) for value in floats]
    if hyper.dtype != torch.float64 or hyper.numel() != len(floats):
        raise ValueError(f"hyper must be a float64 tensor of {len(floats)} values; got {hyper.numel()} "
                         f"value(s) of {hyper.dtype}")
    return list(hyper.reshape(-1).unbind())


def _f32(value: Scalar) -> Scalar:
    """A hyper-parameter as the kernels use it, rounded to float32 (a Python float is rounded by
    torch's scalar conversion)."""
    return value.float() if isinstance(value, torch.Tensor) else value


def _add_decay(grad: torch.Tensor, w: torch.Tensor, weight_decay: Scalar) -> torch.Tensor:
    """``grad + w * weight_decay``, but ``grad`` where the decay is 0 (as the kernels skip it:
    an inf weight must not make the gradient NaN)."""
    if not isinstance(weight_decay, torch.Tensor):
        return grad if weight_decay == 0 else grad + w * _f32(weight_decay)
    return torch.where(weight_decay != 0, grad + w * _f32(weight_decay), grad)


def _keep(found_inf: torch.Tensor) -> torch.Tensor:
    """0-dim bool on the device: this step is applied."""
    return (found_inf == 0).reshape(())


def _store(target: torch.Tensor, value: torch.Tensor, keep: torch.Tensor) -> None:
    target.copy_(torch.where(keep, value.to(target.dtype), target))


# -- remainder masters (see ops.split_masters_): an FP32 master as its bfloat16 rounding, an int16
# remainder and a tie bit per element, in int64 arithmetic (no overflow, no sign games) ---------

def _tie_bits(ties: torch.Tensor, numel: int) -> torch.Tensor:
    """Bit ``j % 32`` of word ``j // 32``, for every element ``j``, as bool."""
    index = torch.arange(numel, device=ties.device)
    return ((ties.to(torch.int64)[index >> 5] >> (index & 31)) & 1).bool()


# int64 temporaries cost ~40 bytes per element: large tensors go through in slices of this many
# elements (a multiple of 32, so each slice owns whole tie words).
_SLICE = 1 << 20


def _slices(numel: int):
    return ((start, min(start + _SLICE, numel)) for start in range(0, numel, _SLICE))


def join_master(weight: torch.Tensor, remainder: torch.Tensor, ties: torch.Tensor) -> torch.Tensor:
    """The FP32 master of a bfloat16 ``weight`` (contiguous) and its remainders, a new tensor."""
    out = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
    flat_out, flat_weight, flat_rest = out.view(-1), weight.reshape(-1), remainder.reshape(-1)
    for start, stop in _slices(weight.numel()):
        flat_out[start:stop] = _join_slice(flat_weight[start:stop], flat_rest[start:stop],
                                           ties[start // 32: (stop + 31) // 32])
    return out


def _join_slice(weight: torch.Tensor, remainder: torch.Tensor, ties: torch.Tensor) -> torch.Tensor:
    high = weight.view(torch.int16).to(torch.int64) & 0xFFFF
    rest = remainder.to(torch.int64)
    tie = (rest == -32768) & _tie_bits(ties, weight.numel())
    bits = ((high << 16) + rest + tie.to(torch.int64) * 0x10000) & 0xFFFFFFFF
    # A weight written from outside since the last split may no longer be the rounding of the
    # sum (zeroed: the remainder would carry it across zero, into NaN): its master is the weight.
    keep = (_rounded_bits(bits) == high) & ((high & 0x7FFF) < 0x7F80)  # an inf/NaN weight is its own master
    bits = torch.where(keep, bits, high << 16)
    bits = torch.where(bits >= 2 ** 31, bits - 2 ** 32, bits).to(torch.int32)
    return bits.view(torch.float32)


def _rounded_bits(bits: torch.Tensor) -> torch.Tensor:
    """The bfloat16 rounding (nearest even; c10's NaN for NaN) of float bits held in int64."""
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return torch.where(nan, torch.full_like(bits, 0x7FC0), (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16)


def split_master_(weight: torch.Tensor, remainder: torch.Tensor, ties: torch.Tensor, master: torch.Tensor) -> None:
    """``weight`` = ``master`` rounded to nearest even (bfloat16), ``remainder``/``ties`` the rest."""
    value = master.detach().float().reshape(-1).contiguous()
    direct = weight.is_contiguous() and remainder.is_contiguous() and ties.is_contiguous()
    weights = weight.view(-1) if direct else torch.empty_like(value, dtype=torch.bfloat16)
    rests = remainder.view(-1) if direct else torch.empty_like(value, dtype=torch.int16)
    words = ties if direct else torch.empty_like(ties)
    for start, stop in _slices(value.numel()):
        _split_slice(value[start:stop], weights[start:stop], rests[start:stop], words[start // 32: (stop + 31) // 32])
    if not direct:
        weight.copy_(weights.reshape(weight.shape))
        remainder.copy_(rests.reshape(remainder.shape))
        ties.copy_(words)


def _split_slice(value: torch.Tensor, weight: torch.Tensor, remainder: torch.Tensor, ties: torch.Tensor) -> None:
    bits = value.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    rounded = _rounded_bits(bits)
    nan = torch.isnan(value)
    rest = torch.where(nan, torch.zeros_like(bits), bits - (rounded << 16))
    tie = rest == 32768
    rest = torch.where(tie, torch.full_like(rest, -32768), rest)
    high = torch.where(rounded >= 0x8000, rounded - 0x10000, rounded).to(torch.int16)
    weight.copy_(high.view(torch.bfloat16))
    remainder.copy_(rest.to(torch.int16))
    padded = torch.zeros(ties.numel() * 32, dtype=torch.int64, device=ties.device)
    padded[:tie.numel()] = tie.to(torch.int64)
    words = (padded.reshape(-1, 32) << torch.arange(32, device=ties.device)).sum(dim=1)
    ties.copy_(torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32))


def _param_value(param: torch.Tensor, remainders, ties, i: int) -> torch.Tensor:
    return join_master(param, remainders[i], ties[i]) if remainders else param.float()


def _store_param(param: torch.Tensor, value: torch.Tensor, remainders, ties, i: int, keep: torch.Tensor,
                 old: torch.Tensor) -> None:
    if remainders:
        split_master_(param, remainders[i], ties[i], torch.where(keep, value, old))
    else:
        _store(param, value, keep)


def _memory_positions(tensor: torch.Tensor) -> torch.Tensor:
    """Each element's position in ``tensor``'s memory order (see ``_memory_order``; logical order
    for a tensor with gaps), as an int64 tensor of its shape."""
    order = _dense_order(tensor)
    positions = torch.empty(tensor.shape, dtype=torch.int64, device=tensor.device)
    in_memory_order = positions if order is None else positions.permute(order)
    in_memory_order.copy_(torch.arange(tensor.numel(), device=tensor.device).reshape(in_memory_order.shape))
    return positions


def _store_state(target: torch.Tensor, value: torch.Tensor, keep: torch.Tensor, step: torch.Tensor, salt: int,
                 index: Optional[torch.Tensor]) -> None:
    """Store a moment: rounded to nearest even, or (``index`` given: bfloat16 moments rounded
    stochastically) with the kernels' deterministic stochastic rounding: 16 bits of noise from
    (step, salt, ``index``: each element's position in the param's memory order, flattened)
    added below the kept bits, then truncated (inf/NaN to nearest)."""
    if index is None:
        _store(target, value, keep)
        return
    bits = value.detach().float().reshape(-1).contiguous().view(torch.int32).to(torch.int64) & _MASK32
    seed = step.detach().reshape(()).to(torch.int64) & _MASK32
    key = (seed * 0x9E3779B9 + salt * 0x85EBCA6B) & _MASK32
    noise = _mix_bits((index & _MASK32) ^ (index >> 32) ^ key) & 0xFFFF
    finite = (bits & 0x7FFFFFFF) < 0x7F800000
    rounded = torch.where(finite, ((bits + noise) >> 16) & 0xFFFF, _rounded_bits(bits))
    rounded = torch.where(rounded >= 0x8000, rounded - 0x10000, rounded).to(torch.int16)
    _store(target, rounded.view(torch.bfloat16).reshape(target.shape), keep)


def _check_distinct_steps(op: str, steps: Sequence[torch.Tensor]) -> None:
    """One counter per param, as the kernels require (a shared one would advance once per row)."""
    seen = set()
    for i, step in enumerate(steps):
        if step.data_ptr() in seen:
            raise RuntimeError(f"ampinit.{op}: steps[{i}] is the counter of an earlier param too; pass one "
                               "step tensor per param")
        seen.add(step.data_ptr())


def fused_adam_(params, grads, exp_avgs, exp_avg_sqs, steps, model_params, *, lr: float, beta1: float,
                beta2: float, eps: float, weight_decay: float, decoupled_weight_decay: bool,
                bias_correction: bool, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                hyper: Optional[torch.Tensor] = None, remainders=(), ties=(),
                stochastic_state_rounding: bool = False) -> None:
    """Adam/AdamW as torch.optim.Adam computes it, for float32/float16/bfloat16 params with
    state of the param's dtype, float32 or bfloat16; see ``ops.fused_adam_``."""
    if not params:
        return
    _check_distinct_steps("fused_adam_", steps)
    lr, beta1, beta2, eps, weight_decay = _hyper_scalars(hyper, (lr, beta1, beta2, eps, weight_decay))
    keep = _keep(found_inf)
    for i, param in enumerate(params):
        step = steps[i] + keep.to(steps[i].dtype)
        grad = grads[i].float() * inv_scale.reshape(())  # a 1-element flag must not make a 0-dim param 1-dim
        old = w = _param_value(param, remainders, ties, i)
        if decoupled_weight_decay:
            w = w * _f32(1 - lr * weight_decay)
        else:
            grad = _add_decay(grad, w, weight_decay)
        m = exp_avgs[i].float().lerp(grad, _f32(1 - beta1))
        v = exp_avg_sqs[i].float() * _f32(beta2) + _f32(1 - beta2) * grad * grad
        if bias_correction:
            bias_correction1 = 1 - torch.pow(beta1, step.double())
            bias_correction2 = 1 - torch.pow(beta2, step.double())
        else:
            bias_correction1 = bias_correction2 = torch.ones((), dtype=torch.float64, device=param.device)
        denom = v.sqrt() / bias_correction2.sqrt().float() + _f32(eps)
        w = w + (-(lr / bias_correction1)).float() * m / denom
        _store_param(param, w, remainders, ties, i, keep, old)
        stochastic = stochastic_state_rounding and exp_avgs[i].dtype == torch.bfloat16
        index = _memory_positions(param).reshape(-1) if stochastic else None  # once for both moments
        _store_state(exp_avgs[i], m, keep, step, 1, index)
        _store_state(exp_avg_sqs[i], v, keep, step, 2, index)
        if model_params:
            _store(model_params[i], w, keep)
        steps[i].copy_(step)


def fused_sgd_(params, grads, momentum_buffers, steps, model_params, *, lr: float, momentum: float,
               dampening: float, weight_decay: float, nesterov: bool, inv_scale: torch.Tensor,
               found_inf: torch.Tensor, new_buffer_flags: Sequence[torch.Tensor] = (),
               hyper: Optional[torch.Tensor] = None, remainders=(), ties=()) -> None:
    """SGD as torch.optim.SGD computes it; see ``ops.fused_sgd_``."""
    if not params:
        return
    _check_distinct_steps("fused_sgd_", steps)
    lr, momentum, dampening, weight_decay = _hyper_scalars(hyper, (lr, momentum, dampening, weight_decay))
    keep = _keep(found_inf)
    for i, param in enumerate(params):
        grad = grads[i].float() * inv_scale.reshape(())
        old = w = _param_value(param, remainders, ties, i)
        grad = _add_decay(grad, w, weight_decay)
        if momentum_buffers:
            buffer = momentum_buffers[i]
            updated = buffer.float() * _f32(momentum) + _f32(1 - dampening) * grad
            b = torch.where((new_buffer_flags[i] != 0).reshape(()), grad, updated)
            grad = grad + b * _f32(momentum) if nesterov else b
            _store(buffer, b, keep)
            new_buffer_flags[i].mul_((found_inf != 0).to(new_buffer_flags[i].dtype))
        w = w - grad * _f32(lr)
        _store_param(param, w, remainders, ties, i, keep, old)
        if model_params:
            _store(model_params[i], w, keep)
        steps[i].add_(keep.to(steps[i].dtype))
