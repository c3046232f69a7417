"""The ops facade: one function per hot-path op, on the compiled kernels where they can run.

Every op follows one contract, shared by the compiled kernels (``torch.ops.ampinit.*``, from
``csrc/``) and the pure-PyTorch fallback (``_fallback``): ``inv_scale`` and ``found_inf`` are
1-element float32 tensors on the tensors' device; the kernels read them from device memory, so
no op synchronises with the device.  The caller zeroes ``found_inf``; an op only ever sets it
to 1.0, when a value it *writes* is inf/NaN (a finite value that overflows a narrower output
dtype counts; ``accumulate_unscaled_`` flags only what its own contribution brings).  Outputs
may be the inputs (in place).

Each call takes the compiled kernels when the extension is loaded, was built for the tensors'
device type and handles their dtypes (float32, float16, bfloat16, dense); anything else runs
the fallback.  Complex tensors (complex64/complex128) are handled as their real views
(``torch.view_as_real``) by ``unscale_``, ``accumulate_unscaled_``, ``check_finite_`` and
``copy_``: an inf/NaN in either part counts.  :func:`backend` says which path is live and why.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from . import _ext, _fallback

__all__ = ["backend", "unscale_", "accumulate_unscaled_", "check_finite_", "unscale_sparse", "copy_",
           "l2norm", "update_scale_", "fused_adam_", "fused_sgd_",
           "new_remainders", "split_masters_", "join_masters"]

Tensors = Sequence[torch.Tensor]
_KERNEL_DTYPES = frozenset((torch.float32, torch.float16, torch.bfloat16))


def _built_for(device_type: str) -> bool:
    module = _ext.EXTENSION
    if module is None:
        return False
    return device_type == "cpu" or (device_type == "cuda" and bool(getattr(module, "with_cuda", False)))


def backend(device: Optional[torch.device] = None) -> Tuple[str, str]:
    """``(name, reason)`` of the implementation that runs for tensors on ``device``.

    ``name`` is ``"cuda"`` or ``"cpu"`` for the compiled kernels and ``"torch"`` for the
    pure-PyTorch fallback; ``reason`` says why (and which CPU kernels: ``avx2`` or ``default``).
    ``device`` defaults to CUDA when it is available, else the CPU.
    """
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device_type = torch.device(device).type
    module = _ext.EXTENSION
    if module is None:
        return "torch", _ext.REASON
    if not _built_for(device_type):
        return "torch", f"the compiled extension has no {device_type} kernels (built without them)"
    if device_type == "cpu":
        return "cpu", f"compiled extension, {module.cpu_kernels()} CPU kernels"
    return "cuda", "compiled extension, CUDA kernels"


_KERNEL_DTYPES_ONLY, _SOME_COMPLEX = 1, 2


def _kinds(*lists: Tensors) -> int:
    """``_KERNEL_DTYPES_ONLY`` if every tensor is a dense float32/float16/bfloat16 one, ``|
    _SOME_COMPLEX`` if any is complex: one C pass with the extension (a Python loop over 1000
    gradients costs more than the kernels it routes), a Python one without."""
    module = _ext.EXTENSION
    if module is not None:
        return module.tensor_kinds(*lists)
    kinds = _KERNEL_DTYPES_ONLY
    for tensors in lists:
        for t in tensors:
            if t.dtype not in _KERNEL_DTYPES or t.layout != torch.strided:
                kinds &= ~_KERNEL_DTYPES_ONLY
            if t.is_complex():
                kinds |= _SOME_COMPLEX
    return kinds


def _use_kernels(device: torch.device, *lists: Tensors) -> bool:
    """Whether the compiled kernels take these tensors (else the fallback runs)."""
    return _built_for(device.type) and bool(_kinds(*lists) & _KERNEL_DTYPES_ONLY)


def _route_pairs(op: str, device: torch.device, inputs: Tensors, outputs: Tensors):
    """``(use_kernels, inputs, outputs)``: complex pairs as their real views, then whether the
    kernels take every tensor."""
    kinds = _kinds(inputs, outputs)
    if kinds & _SOME_COMPLEX:
        inputs, outputs = _as_real_pairs(op, inputs, outputs)
        kinds = _kinds(inputs, outputs)
    return _built_for(device.type) and bool(kinds & _KERNEL_DTYPES_ONLY), inputs, outputs


def _check_flags_device(op: str, tensors: Tensors, *flags: Optional[torch.Tensor]) -> None:
    """A clear error for flags on another device than the tensors (a CPU ``found_inf`` with CUDA
    gradients would otherwise fail deep in a device guard or a foreach kernel)."""
    if not tensors:
        return
    device = tensors[0].device
    for flag in flags:
        if flag is not None and flag.device != device:
            raise ValueError(f"ampinit.ops.{op}: inv_scale, found_inf and per-tensor flags must be on the "
                             f"tensors' device ({device}); got one on {flag.device}. Create them with "
                             f"device={str(device)!r}")


def _check_rows_apart(op: str, lists: Sequence[Tensors], written: Sequence[bool]) -> None:
    """A tensor the op writes shares no memory with a tensor of another row, as the kernels
    check (``DenseRows`` in ``csrc/common.h``): the fallback would apply the op twice to one
    output listed twice, and the kernels' result would depend on thread timing.  Extents sorted
    by address, only neighbours whose byte ranges meet compared; a strided tensor that does not
    fill its extent overlaps another only if it is that very view (interleaved views pass, as
    torch's own test cannot decide them)."""
    if not any(written):
        return
    extents = []
    for tensors, is_written in zip(lists, written):
        for row, t in enumerate(tensors):
            numel = t.numel()
            if numel == 0:
                continue
            if t.is_contiguous():
                span = numel
            else:
                span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
            begin = t.data_ptr()
            extents.append((begin, begin + span * t.element_size(), row, is_written, t, span == numel))
    extents.sort(key=lambda extent: extent[0])
    count = len(extents)
    for a, (begin, end, row, is_written, t, dense) in enumerate(extents):
        b = a + 1
        while b < count and extents[b][0] < end:
            other_begin, _, other_row, other_written, other, other_dense = extents[b]
            b += 1
            if other_row == row or not (is_written or other_written):
                continue
            same_view = (other_begin == begin and other.shape == t.shape and other.stride() == t.stride()
                         and other.dtype == t.dtype)
            if same_view or (dense and other_dense):
                low, high = sorted((row, other_row))
                raise RuntimeError(f"ampinit.{op}: tensors {low} and {high} share memory, and the op writes one of "
                                   "them (the same tensor listed twice, a tied parameter say?); the result would "
                                   "depend on the order rows run in.  Pass each tensor once")


def _check_fallback_rows(op: str, rows: Sequence[Tuple[str, Tensors]],
                         flags: Sequence[Tuple[str, Optional[torch.Tensor]]] = (),
                         per_tensor: Optional[torch.Tensor] = None, masters: Optional[Tensors] = None,
                         written: Sequence[str] = ()) -> None:
    """What the kernels check in C++ before they write anything, for a call the fallback takes
    (no extension, or a float64/complex tensor in the lists): torch's own ops would broadcast a
    row, ``zip`` would drop one, or an error would come after the first rows were written.
    ``written`` names the lists the op writes."""
    lengths = [len(tensors) for _, tensors in rows]
    if len(set(lengths)) > 1:
        raise ValueError(f"ampinit.ops.{op}: {' and '.join(name for name, _ in rows)} must have the same length; "
                         f"got {lengths}")
    for name, flag in flags:
        if flag is not None and (flag.numel() != 1 or flag.dtype != torch.float32):
            raise ValueError(f"ampinit.ops.{op}: {name} must be a 1-element float32 tensor; got {flag.numel()} "
                             f"element(s) of {flag.dtype}")
    if per_tensor is not None and (per_tensor.numel() != lengths[0] or per_tensor.dtype != torch.float32):
        raise ValueError(f"ampinit.ops.{op}: per_tensor_found_inf must be a float32 tensor of one flag per tensor "
                         f"({lengths[0]}); got {per_tensor.numel()} element(s) of {per_tensor.dtype}")
    for index, row in enumerate(zip(*(tensors for _, tensors in rows))):
        for tensor in row:
            if not (tensor.is_floating_point() or tensor.is_complex()) or tensor.is_sparse:
                raise TypeError(f"ampinit.ops.{op}: tensor {index} is a {tensor.layout} {tensor.dtype} tensor; "
                                "the ops take dense floating-point (or complex) tensors")
            if tensor.shape != row[0].shape:
                raise ValueError(f"ampinit.ops.{op}: the tensors at index {index} have shapes "
                                 f"{tuple(row[0].shape)} and {tuple(tensor.shape)}; each row must have one shape")
        if masters is not None and masters[index].dtype not in (torch.float32, torch.float64):
            raise TypeError(f"ampinit.ops.{op}: master {index} is {masters[index].dtype}; masters are float32")
    _check_rows_apart(op, [tensors for _, tensors in rows], [name in written for name, _ in rows])


# -- complex tensors: their real views -----------------------------------------------------------

def _real_view(tensor: torch.Tensor, op: str, written: bool) -> torch.Tensor:
    if tensor.is_conj():
        if written:
            raise ValueError(f"ampinit.ops.{op}: an output has its conjugate bit set; pass "
                             "tensor.resolve_conj() and use the result")
        tensor = tensor.resolve_conj()
    return torch.view_as_real(tensor)


def _as_real_pairs(op: str, inputs: Tensors, outputs: Tensors) -> Tuple[Tensors, Tensors]:
    """``(inputs, outputs)`` with each complex pair replaced by its real views; a pair stays one
    tensor where it was one (in place)."""
    if len(inputs) != len(outputs):
        raise ValueError(f"ampinit.ops.{op}: inputs and outputs must have the same length; got "
                         f"{len(inputs)} and {len(outputs)}")
    real_in, real_out = [], []
    for i, (x, y) in enumerate(zip(inputs, outputs)):
        if x.is_complex() != y.is_complex():
            raise ValueError(f"ampinit.ops.{op}: tensor {i} pairs a {x.dtype} input with a {y.dtype} output; "
                             "a complex tensor's partner must be complex too")
        if not x.is_complex():
            real_in.append(x)
            real_out.append(y)
        elif y is x:
            view = _real_view(x, op, written=True)
            real_in.append(view)
            real_out.append(view)
        else:
            real_in.append(_real_view(x, op, written=False))
            real_out.append(_real_view(y, op, written=True))
    return real_in, real_out


def _route(op: str, device: torch.device, tensors: Tensors):
    """``(use_kernels, tensors)`` for a read-only list: complex tensors as their real views."""
    kinds = _kinds(tensors)
    if kinds & _SOME_COMPLEX:
        tensors = [_real_view(t, op, written=False) if t.is_complex() else t for t in tensors]
        kinds = _kinds(tensors)
    return _built_for(device.type) and bool(kinds & _KERNEL_DTYPES_ONLY), tensors


# -- ops -------------------------------------------------------------------------------------------

def unscale_(inputs: Tensors, outputs: Tensors, inv_scale: torch.Tensor, found_inf: torch.Tensor,
             per_tensor_found_inf: Optional[torch.Tensor] = None) -> None:
    """``outputs[i] = inputs[i] * inv_scale``, computed in float32 and rounded once to the
    output's dtype, in one pass that also sets ``found_inf`` if a value written is inf/NaN (and
    ``per_tensor_found_inf[i]`` for the tensors that held one, when given).  ``outputs[i]`` may
    be ``inputs[i]``.  No sync."""
    _check_flags_device("unscale_", inputs, inv_scale, found_inf, per_tensor_found_inf)
    if not inputs and not outputs:  # the kernels launch nothing for no rows
        return
    kernels, inputs, outputs = _route_pairs("unscale_", found_inf.device, inputs, outputs)
    if kernels:
        torch.ops.ampinit.unscale_(list(inputs), list(outputs), inv_scale, found_inf, per_tensor_found_inf)
    else:
        _check_fallback_rows("unscale_", [("inputs", inputs), ("outputs", outputs)],
                             [("inv_scale", inv_scale), ("found_inf", found_inf)], per_tensor_found_inf,
                             written=["outputs"])
        _fallback.unscale_(inputs, outputs, inv_scale, found_inf, per_tensor_found_inf)


def accumulate_unscaled_(inputs: Tensors, outputs: Tensors, inv_scale: torch.Tensor,
                         found_inf: torch.Tensor, out_weight: float = 1.0) -> None:
    """``outputs[i] = out_weight * outputs[i] + inputs[i] * inv_scale`` in float32, rounded once,
    setting ``found_inf`` for what this call brings: a non-finite contribution, or a finite
    output value that the sum pushes past its dtype (an inf/NaN an earlier loss left in the
    outputs was flagged for that loss, and is not again).  Used when a second loss (or a second
    backward before ``step``) adds to gradients that are already unscaled.  No sync."""
    _check_flags_device("accumulate_unscaled_", inputs, inv_scale, found_inf)
    if not inputs and not outputs:  # the kernels launch nothing for no rows
        return
    kernels, inputs, outputs = _route_pairs("accumulate_unscaled_", found_inf.device, inputs, outputs)
    if kernels:
        torch.ops.ampinit.accumulate_(list(inputs), list(outputs), inv_scale, found_inf, float(out_weight))
    else:
        _check_fallback_rows("accumulate_unscaled_", [("inputs", inputs), ("outputs", outputs)],
                             [("inv_scale", inv_scale), ("found_inf", found_inf)], written=["outputs"])
        _fallback.accumulate_unscaled_(inputs, outputs, inv_scale, found_inf, out_weight)


def check_finite_(inputs: Tensors, found_inf: torch.Tensor,
                  per_tensor_found_inf: Optional[torch.Tensor] = None) -> None:
    """Set ``found_inf`` if any input holds inf/NaN; read-only on the inputs.  No sync."""
    _check_flags_device("check_finite_", inputs, found_inf, per_tensor_found_inf)
    if not inputs:
        return
    kernels, inputs = _route("check_finite_", found_inf.device, inputs)
    if kernels:
        torch.ops.ampinit.check_finite_(list(inputs), found_inf, per_tensor_found_inf)
    else:
        _check_fallback_rows("check_finite_", [("inputs", inputs)], [("found_inf", found_inf)], per_tensor_found_inf)
        _fallback.check_finite_(inputs, found_inf, per_tensor_found_inf)


def unscale_sparse(grad: torch.Tensor, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """Unscaled copy of a sparse COO gradient in ``dtype``, checking it for inf/NaN."""
    return _fallback.unscale_sparse(grad, inv_scale, found_inf, dtype)


def copy_(outputs: Tensors, inputs: Tensors) -> None:
    """``outputs[i].copy_(inputs[i])`` with round-to-nearest-even conversion (masters -> model)."""
    if not inputs:
        return
    kernels, inputs, outputs = _route_pairs("copy_", inputs[0].device, inputs, outputs)
    if kernels:
        torch.ops.ampinit.copy_(list(outputs), list(inputs))
    else:
        _check_fallback_rows("copy_", [("outputs", outputs), ("inputs", inputs)], written=["outputs"])
        _fallback.copy_(outputs, inputs)


def adopt_changes_(masters: Tensors, models: Tensors, only: Optional[torch.Tensor] = None) -> None:
    """``masters[i] = models[i]`` element by element wherever ``models[i]`` no longer holds
    ``masters[i]`` rounded to its dtype: a write to the model from outside ampinit (through
    ``.data`` included) is adopted, and every other element keeps its FP32 value.  Masters are
    float32.  ``only`` (float32, one flag per tensor, on their device) limits it to the tensors
    whose flag is non-zero.  One pass reading both (the CPU kernel writes only the vectors that
    changed).  No sync."""
    if not models:
        return
    _check_flags_device("adopt_changes_", models, only)
    kernels, models, masters = _route_pairs("adopt_changes_", models[0].device, models, masters)
    if kernels:
        torch.ops.ampinit.adopt_changes_(list(masters), list(models), only)
    else:
        _check_fallback_rows("adopt_changes_", [("masters", masters), ("models", models)], masters=masters,
                             written=["masters"])
        _fallback.adopt_changes_(masters, models, only)


def fingerprint(inputs: Tensors) -> torch.Tensor:
    """One int64 per tensor (in [0, 2**32)): the sum over its elements of
    ``mix(bits ^ (index * 0x9E3779B9))`` mod 2**32, ``mix`` the lowbias32 integer hash, the bits
    read as an unsigned 16- or 32-bit integer (an 8-byte element as two 32-bit words, each with
    its own index) and ``index`` counted in memory order (a dense
    tensor is read where it lies, whatever its strides; one with gaps or overlaps as its
    contiguous copy).  Any change to one element changes it (each term is a bijection of the
    bits), and the hash is not linear, so neither does a change of every element by one amount
    (``w.mul_(0.5)``) cancel out; a random change goes unseen with odds of about 2**-32 (values
    crafted against the hash, such as two elements swapped and XORed with the index keys'
    difference, can be missed: it guards against accidents, not adversaries).  It tells
    a tensor written since it was taken, through ``.data`` included, at 2 or 4 bytes read per
    element.  On the device of the inputs.  No sync;
    safe to capture in a CUDA graph."""
    inputs = list(inputs)
    if not inputs:
        return torch.zeros(0, dtype=torch.int64)
    if _use_kernels(inputs[0].device, inputs):
        return torch.ops.ampinit.fingerprint(inputs)
    return _fallback.fingerprint(inputs)


def l2norm(inputs: Tensors, per_tensor: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """The L2 norm over all ``inputs`` as a 1-element float32 tensor on their device, and the
    norm of each one (empty unless ``per_tensor``).  Each square and every sum is in double, so
    the result is finite whenever the norm is representable; inf/NaN propagate.  No sync (and
    no host-to-device copy: CUDA-graph capturable), so clipping can use it without one:
    ``grads * (max_norm / (norm + 1e-6)).clamp(max=1)``."""
    inputs = list(inputs)
    if inputs and _use_kernels(inputs[0].device, inputs):
        return torch.ops.ampinit.l2norm(inputs, per_tensor)
    return _fallback.l2norm(inputs, per_tensor)


def update_scale_(scale: torch.Tensor, growth_tracker: torch.Tensor, hysteresis_tracker: torch.Tensor,
                  overflow_count: torch.Tensor, found_inf: torch.Tensor, *, growth_factor: float,
                  backoff_factor: float, growth_interval: int, hysteresis: int, min_scale: float,
                  max_scale: float) -> None:
    """Advance the dynamic loss-scale state machine by one backward, on the device (see
    :func:`ampinit._fallback.update_scale_` for the rules).  No sync."""
    if _built_for(scale.device.type):
        torch.ops.ampinit.update_scale_(scale, growth_tracker, hysteresis_tracker, overflow_count, found_inf,
                                        float(growth_factor), float(backoff_factor), int(growth_interval),
                                        int(hysteresis), float(min_scale), float(max_scale))
    else:
        _fallback.update_scale_(scale, growth_tracker, hysteresis_tracker, overflow_count, found_inf,
                                growth_factor=growth_factor, backoff_factor=backoff_factor,
                                growth_interval=growth_interval, hysteresis=hysteresis,
                                min_scale=min_scale, max_scale=max_scale)


def fused_adam_(params: List[torch.Tensor], grads: Tensors, exp_avgs: Tensors, exp_avg_sqs: Tensors,
                steps: Tensors, model_params: Tensors, *, lr: float, beta1: float, beta2: float, eps: float,
                weight_decay: float, decoupled_weight_decay: bool, bias_correction: bool,
                inv_scale: torch.Tensor, found_inf: torch.Tensor, hyper: Optional[torch.Tensor] = None,
                remainders: Tensors = (), ties: Tensors = (), stochastic_state_rounding: bool = False) -> None:
    """One Adam (or AdamW, ``decoupled_weight_decay``) step of ``params`` from
    ``grads * inv_scale``, as ``torch.optim.Adam(fused=True)`` computes it.

    ``params`` are float32, float16 or bfloat16; a param's ``exp_avgs``/``exp_avg_sqs`` are both
    of its dtype, both float32, or (float32 params) both bfloat16; all arithmetic is float32 and
    each stored value is rounded once (to nearest even).  ``grads`` may be
    any of the three dtypes.  ``model_params`` is empty, or one 16-bit copy per (float32) param
    written in the same pass.  ``steps`` are 1-element float32 counters on the device, one
    tensor per param.

    When ``found_inf`` is set nothing changes, steps included: the compiled kernels decide that
    on the device, and the fallback with ``torch.where``, so no path syncs.
    ``hyper`` (capturable optimizers): a float64 tensor ``[lr, beta1, beta2, eps, weight_decay]``
    on the params' device, read instead of the float arguments, so that a CUDA-graph replay
    sees values changed in place.

    ``remainders``/``ties`` (remainder masters, see :func:`split_masters_`): empty, or for each
    param (then contiguous bfloat16, with no ``model_params``) its int16 remainders and int32
    tie words: the kernel updates the FP32 master they make with the param and splits it again.

    ``stochastic_state_rounding``: bfloat16 moments are rounded stochastically (unbiased) instead
    of to nearest, with noise that is a hash of (step, moment, the element's position in the
    param's memory order): deterministic, the same noise on every backend and for any strides (the
    float32 value it rounds may differ in the last bit between backends, see the fallback).  To
    nearest, ``beta2 * v`` rounds back to ``v`` for ``beta2 > 1 - 2**-9`` and ``exp_avg_sq``
    would never decay.
    """
    if params and _use_kernels(found_inf.device, params, grads, model_params):
        torch.ops.ampinit.fused_adam_(params, list(grads), list(exp_avgs), list(exp_avg_sqs), list(steps),
                                      list(model_params), list(remainders), list(ties), float(lr), float(beta1),
                                      float(beta2), float(eps),
                                      float(weight_decay), bool(decoupled_weight_decay), bool(bias_correction),
                                      inv_scale, found_inf, hyper, bool(stochastic_state_rounding))
    else:
        _check_rows_apart("fused_adam_", [params, grads, exp_avgs, exp_avg_sqs, model_params],
                          [True, False, True, True, True])
        _fallback.fused_adam_(params, grads, exp_avgs, exp_avg_sqs, steps, model_params, lr=lr, beta1=beta1,
                              beta2=beta2, eps=eps, weight_decay=weight_decay,
                              decoupled_weight_decay=decoupled_weight_decay, bias_correction=bias_correction,
                              inv_scale=inv_scale, found_inf=found_inf, hyper=hyper, remainders=list(remainders),
                              ties=list(ties), stochastic_state_rounding=stochastic_state_rounding)


def fused_sgd_(params: List[torch.Tensor], grads: Tensors, momentum_buffers: Tensors, steps: Tensors,
               model_params: Tensors, *, lr: float, momentum: float, dampening: float, weight_decay: float,
               nesterov: bool, inv_scale: torch.Tensor, found_inf: torch.Tensor,
               new_buffer_flags: Optional[Tensors] = None, hyper: Optional[torch.Tensor] = None,
               remainders: Tensors = (), ties: Tensors = ()) -> None:
    """One SGD step (momentum, dampening, nesterov, weight decay) like :func:`fused_adam_`, as
    ``torch.optim.SGD`` computes it; dtypes and skipping as there.

    ``momentum_buffers`` is empty exactly when ``momentum == 0`` (with ``hyper``: when the
    caller has no buffers).  ``new_buffer_flags``: one 1-element float32 device tensor per
    buffer, nonzero while that buffer has never been applied: torch's rule, the buffer then
    becomes the gradient (its contents are ignored).  An applied step zeroes the flag, a
    skipped one leaves it, on the device.  ``None`` keeps the rule of counting steps: a buffer
    is new on its param's first step (``steps == 0``).
    ``hyper``: a float64 tensor ``[lr, momentum, dampening, weight_decay]``, as in
    :func:`fused_adam_`; ``momentum_buffers`` of the param's dtype or float32; ``remainders``/``ties``
    as in :func:`fused_adam_`.
    """
    if new_buffer_flags is None:
        new_buffer_flags = [(step == 0).float().reshape(1) for step in steps] if momentum_buffers else []
    if params and _use_kernels(found_inf.device, params, grads, model_params):
        torch.ops.ampinit.fused_sgd_(params, list(grads), list(momentum_buffers), list(steps), list(model_params),
                                     list(remainders), list(ties), float(lr), float(momentum), float(dampening),
                                     float(weight_decay),
                                     bool(nesterov), inv_scale, found_inf, list(new_buffer_flags), hyper)
    else:
        _check_rows_apart("fused_sgd_", [params, grads, momentum_buffers, model_params], [True, False, True, True])
        _fallback.fused_sgd_(params, grads, momentum_buffers, steps, model_params, lr=lr, momentum=momentum,
                             dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                             inv_scale=inv_scale, found_inf=found_inf, new_buffer_flags=new_buffer_flags,
                             hyper=hyper, remainders=list(remainders), ties=list(ties))


# -- remainder masters -------------------------------------------------------------------------
# An FP32 master kept as the model's bfloat16 weight (its round-to-nearest-even) plus an int16
# remainder: bits(master) = (bits(weight) << 16) + remainder, mod 2^32.  A bfloat16 value of
# even mantissa is the rounding of 65537 floats (both ties), one more than 16 bits can tell
# apart, so one tie bit per element (int32 words, bit j % 32 of word j // 32) marks the upper
# tie.  The fused optimizers join and split in their kernels; these two serve checkpoints,
# state_dict() and setup, on the same kernels (an EMA reading state_dict() every step needs them).

def new_remainders(weight: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Zeroed remainders and tie words for a contiguous bfloat16 ``weight``: its master is the weight."""
    return (torch.zeros(weight.shape, dtype=torch.int16, device=weight.device),
            torch.zeros((weight.numel() + 31) // 32, dtype=torch.int32, device=weight.device))


def _check_remainder_lists(op: str, weights: Tensors, remainders: Tensors, ties: Tensors,
                           masters: Optional[Tensors] = None) -> None:
    """Clear errors for lists that :func:`new_remainders` did not make, before anything is written."""
    lists = [weights, remainders, ties] + ([] if masters is None else [masters])
    if len({len(items) for items in lists}) != 1:
        raise ValueError(f"ampinit.ops.{op}: weights, remainders, ties{' and masters' if masters is not None else ''} "
                         f"must have the same length; got {[len(items) for items in lists]}")
    for index, (weight, remainder, tie_words) in enumerate(zip(weights, remainders, ties)):
        if not (weight.dtype == torch.bfloat16 and weight.is_contiguous()):
            raise TypeError(f"ampinit.ops.{op}: weights[{index}] must be a contiguous bfloat16 tensor; got "
                            f"{weight.dtype}{'' if weight.is_contiguous() else ', not contiguous'}")
        if remainder.dtype != torch.int16 or remainder.numel() != weight.numel() or \
                tie_words.dtype != torch.int32 or tie_words.numel() != (weight.numel() + 31) // 32:
            raise ValueError(f"ampinit.ops.{op}: entry {index} needs an int16 remainder per element and "
                             f"ceil(numel / 32) int32 tie words, as ops.new_remainders makes them")
        if masters is not None and masters[index].shape != weight.shape:
            raise ValueError(f"ampinit.ops.{op}: masters[{index}] has shape {tuple(masters[index].shape)}, its "
                             f"weight {tuple(weight.shape)}")


def _remainder_kernels(weights: Tensors, remainders: Tensors, ties: Tensors) -> bool:
    """Whether the compiled join/split takes these rows: all on one device the extension was
    built for, remainders and tie words contiguous (the fallback takes any layout)."""
    if not weights:
        return False
    device = weights[0].device
    return _built_for(device.type) and all(
        weight.device == device and remainder.device == device and tie_words.device == device
        and remainder.is_contiguous() and tie_words.is_contiguous()
        for weight, remainder, tie_words in zip(weights, remainders, ties))


def split_masters_(weights: Tensors, remainders: Tensors, ties: Tensors, masters: Tensors) -> None:
    """Write each FP32 ``masters[i]`` as ``weights[i]`` (bfloat16, round to nearest even) plus
    its remainders: :func:`join_masters` gives the master back bit for bit (NaN as bfloat16's NaN;
    a master beyond bfloat16's range, which rounds to an inf weight, as that inf).  The tie
    words are defined only where a remainder is -32768 (the compiled kernels write no other
    bit; the fallback clears them).  No sync."""
    _check_remainder_lists("split_masters_", weights, remainders, ties, masters)
    if _remainder_kernels(weights, remainders, ties):
        values = [master.detach().to(device=weight.device, dtype=torch.float32).contiguous()
                  for weight, master in zip(weights, masters)]
        torch.ops.ampinit.split_masters_(list(weights), list(remainders), list(ties), values)
        return
    for weight, remainder, tie_words, master in zip(weights, remainders, ties, masters):
        _fallback.split_master_(weight, remainder, tie_words, master)


def join_masters(weights: Tensors, remainders: Tensors, ties: Tensors) -> List[torch.Tensor]:
    """The FP32 masters of bfloat16 ``weights`` and their remainders, as new tensors.  A weight
    written since the split keeps its remainder only where it is finite and still the rounding
    of weight + remainder; else the master is the weight itself (never NaN from a kept remainder).
    No sync."""
    _check_remainder_lists("join_masters", weights, remainders, ties)
    if _remainder_kernels(weights, remainders, ties):
        return list(torch.ops.ampinit.join_masters(list(weights), list(remainders), list(ties)))
    return [_fallback.join_master(w, r, t) for w, r, t in zip(weights, remainders, ties)]
