"""``apex.optimizers`` under ampinit's apex alias.

:class:`FusedAdam` and :class:`FusedSGD` are ampinit's own (``ampinit.optim``).  :class:`FusedLAMB`,
:class:`FusedNovoGrad` and :class:`FusedAdagrad` are written here with ``torch._foreach_*`` ops,
one call per (device, dtype) bucket of a param group, and a short per-tensor loop where an update
depends on a per-tensor norm.  They are plain ``torch.optim.Optimizer`` subclasses: they read
``p.grad`` and nothing amp-specific, so ``ampinit.initialize`` drives them through its FP32
master weights like any other optimizer.

Params may be float32, float16 or bfloat16.  The math is done in float32 whatever the param's
dtype, the optimizer state is float32, and a float16/bfloat16 param receives its new value
rounded once, at the end of the step.  ``p.grad`` is never modified.

:class:`FusedMixedPrecisionLamb` is not provided: constructing it raises ``NotImplementedError``
that names the replacement.

apex 0.1's API is here too: ``FusedAdam`` built with ``max_grad_norm`` (or another argument only
that version took) is its optimizer, and ``FP16_Optimizer`` is its cut-down wrapper (modules
``fused_adam_v1`` and ``fp16_optimizer``).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from .. import optim as _optim
from ..optim import FusedSGD
from ._hyper import check_betas, check_number
from .fp16_optimizer import FP16_Optimizer
from .fused_adam_v1 import V1_ONLY_ARGUMENTS, FusedAdamV1

__all__ = ["FusedAdam", "FusedSGD", "FusedLAMB", "FusedNovoGrad", "FusedAdagrad", "FusedMixedPrecisionLamb",
           "FP16_Optimizer", "FusedAdam_v1"]

FusedAdam_v1 = FusedAdamV1  # apex's name for it, once the new FusedAdam came


# Past (params, lr, bias_correction, betas, eps), apex 0.1's FusedAdam and today's take other
# arguments in the same positions (eps_inside_sqrt / adam_w_mode, max_grad_norm / amsgrad).
_SHARED_POSITIONS = 5


def _check_fused_adam_arguments(cls: type, args: tuple, kwargs: dict, where: str) -> bool:
    """Whether ``kwargs`` ask for apex 0.1's FusedAdam; ``TypeError`` where the call is ambiguous."""
    if len(args) > _SHARED_POSITIONS:
        raise TypeError("apex.optimizers.FusedAdam takes the arguments after eps by keyword: apex 0.1's FusedAdam "
                        "(eps_inside_sqrt, weight_decay, max_grad_norm, ...) and today's (adam_w_mode, weight_decay, "
                        f"amsgrad, ...) take different ones in those positions; got {len(args)} positional arguments")
    old = sorted(V1_ONLY_ARGUMENTS.intersection(kwargs))
    if old and (cls is not FusedAdam or where == "__init__"):
        raise TypeError(f"{cls.__name__} subclasses apex.optimizers.FusedAdam (today's), and {old} are arguments of "
                        "apex 0.1's FusedAdam only: subclass apex.optimizers.FusedAdam_v1 for those")
    return bool(old)


class _FusedAdamType(type):
    """``isinstance(opt, apex.optimizers.FusedAdam)`` holds for the 0.1 optimizer it builds."""

    def __instancecheck__(cls, instance: Any) -> bool:
        return type.__instancecheck__(cls, instance) or (cls is FusedAdam and isinstance(instance, FusedAdamV1))


class FusedAdam(_optim.FusedAdam, metaclass=_FusedAdamType):
    """``apex.optimizers.FusedAdam``: :class:`ampinit.optim.FusedAdam`, or apex 0.1's FusedAdam
    (:class:`~ampinit.apex.fused_adam_v1.FusedAdamV1`) when built with an argument only that one
    took (``max_grad_norm``, ``eps_inside_sqrt``, ``use_mt``, ``amp_scale_adjustment``), as the
    scripts that pair it with ``apex.optimizers.FP16_Optimizer`` do.  The two differ: 0.1's
    clips each param group, and with ``bias_correction`` its eps and weight decay are not
    bias-corrected the way today's are.

    The arguments after ``eps`` are taken by keyword only (the two versions order them
    differently), and a subclass is today's optimizer: passing it 0.1's arguments raises."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if _check_fused_adam_arguments(cls, args, kwargs, "__new__"):
            return FusedAdamV1(*args, **kwargs)
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any):
        _check_fused_adam_arguments(type(self), args, kwargs, "__init__")
        super().__init__(*args, **kwargs)


_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# One bucket of a param group: the params of one (device, dtype) with a gradient this step.
_Bucket = List[torch.Tensor]


class _ForeachOptimizer(torch.optim.Optimizer):
    """What the three optimizers share: checking and bucketing the params that have a gradient,
    ``zero_grad`` following ``set_grad_none``, FP32 state, and a ``load_state_dict`` that keeps
    the state in FP32 (``torch.optim.Optimizer`` would cast it to each param's dtype)."""

    def __init__(self, params: Iterable, defaults: dict, set_grad_none: bool):
        super().__init__(params, defaults)
        self.set_grad_none = bool(set_grad_none)

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        """Clear the gradients: set them to ``None`` if ``set_grad_none`` (the default), else zero
        them; an explicit ``set_to_none`` overrides."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    def _buckets(self, group: dict) -> Dict[Tuple[torch.device, torch.dtype], _Bucket]:
        """The params of ``group`` that have a gradient, by (device, dtype).  Raises before
        anything is updated if a gradient is sparse or a param has an unsupported dtype."""
        buckets: Dict[Tuple[torch.device, torch.dtype], _Bucket] = {}
        name = type(self).__name__
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                continue
            if grad.layout != torch.strided:  # sparse COO, CSR, ...
                raise RuntimeError(f"{name} does not support sparse gradients; use torch.optim.SparseAdam "
                                   "(or a dense embedding) for this parameter")
            if param.dtype not in _SUPPORTED_DTYPES:
                raise TypeError(f"{name} updates float32, float16 and bfloat16 params; got a {param.dtype} param")
            buckets.setdefault((param.device, param.dtype), []).append(param)
        return buckets

    def _state_fp32(self, param: torch.Tensor, key: str) -> torch.Tensor:
        """``self.state[param][key]``, made as FP32 zeros shaped like ``param`` if missing."""
        state = self.state[param]
        value = state.get(key)
        if value is None:
            value = state[key] = torch.zeros_like(param, dtype=torch.float32, memory_format=torch.preserve_format)
        return value

    @staticmethod
    def _fp32(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
        """FP32 views of ``tensors``: the tensors themselves if FP32, FP32 copies otherwise."""
        return [t if t.dtype == torch.float32 else t.float() for t in tensors]

    @staticmethod
    def _write_back(params: List[torch.Tensor], params32: List[torch.Tensor]) -> None:
        """Round the FP32 results into low-precision params (FP32 params were updated in place)."""
        if params and params[0].dtype != torch.float32:
            torch._foreach_copy_(params, params32)

    @staticmethod
    def _run_closure(closure: Optional[Callable[[], Any]]) -> Any:
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def load_state_dict(self, state_dict: dict) -> None:
        """As ``torch.optim.Optimizer.load_state_dict``, but floating-point state stays FP32 (moved
        to each param's device) instead of being cast to the param's dtype."""
        super().load_state_dict(state_dict)
        param_of = {}
        for saved, group in zip(state_dict["param_groups"], self.param_groups):
            param_of.update(zip(saved["params"], group["params"]))
        for key, saved_state in state_dict["state"].items():
            param = param_of.get(key)
            if param is None:
                continue
            for name, value in saved_state.items():
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    self.state[param][name] = value.detach().to(device=param.device, dtype=torch.float32,
                                                                copy=True)


class FusedLAMB(_ForeachOptimizer):
    """LAMB (You et al., "Large Batch Optimization for Deep Learning"), as apex's ``FusedLAMB``.

    Each ``step()``:

    1. The global gradient norm ``G`` is the L2 norm of all gradients of all groups together.
       If ``max_grad_norm > 0`` and ``G > max_grad_norm``, every gradient is divided by
       ``c = G / max_grad_norm`` (``max_grad_norm`` is read from the constructor's defaults, so
       it is the same for all groups).
    2. Each group with at least one gradient advances its step ``t = group['step']`` by one.
       With ``beta3 = 1 - beta1`` if ``grad_averaging`` else 1, and bias corrections
       ``bc1 = 1 - beta1**t``, ``bc2 = 1 - beta2**t`` (both 1 without ``bias_correction``), for
       each element of the clipped gradient ``g``:
       ``m = beta1*m + beta3*g``, ``v = beta2*v + (1-beta2)*g**2`` and the Adam direction
       ``u = (m/bc1) / (sqrt(v/bc2) + eps)``.  Weight decay ``wd`` is added to the direction
       (``u += wd*p``, ``adam_w_mode=True``, the default) or to the gradient before the moments
       (``g += wd*p``, ``adam_w_mode=False``: an L2 penalty).
    3. Per tensor, the trust ratio is ``lr * ||p|| / ||u||`` (``||p||`` before the update), or
       ``lr`` when either norm is zero; it is used only when ``use_nvlamb`` or the group's
       ``wd != 0``, otherwise the ratio is ``lr``.  Then ``p = p - ratio*u``.

    State: ``state[p]['exp_avg']`` (m) and ``state[p]['exp_avg_sq']`` (v), FP32 for every param
    dtype; the step count is ``group['step']`` (an int).  A param without a gradient is skipped:
    its state does not change and it does not count towards ``G``.

    Differences from apex: ``p.grad`` is left as it was (apex overwrites it with ``u``); a group
    none of whose params has a gradient does not advance its step; ``adam_w_mode`` and
    ``use_nvlamb`` are optimizer-wide (as in apex), the other hyper-parameters may differ per
    group; float64 params raise ``TypeError`` (apex's kernels do not take them either).
    ``amsgrad=True`` raises ``ValueError`` as in apex.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, bias_correction: bool = True,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.01,
                 amsgrad: bool = False, adam_w_mode: bool = True, grad_averaging: bool = True,
                 set_grad_none: bool = True, max_grad_norm: float = 1.0, use_nvlamb: bool = False):
        if amsgrad:
            raise ValueError("FusedLAMB does not support the AMSGrad variant (amsgrad=True), as in apex")
        check_number("learning rate (lr)", lr)
        check_number("epsilon (eps)", eps)
        check_number("weight_decay", weight_decay)
        check_number("max_grad_norm (0 disables clipping)", max_grad_norm)
        defaults = dict(lr=lr, bias_correction=bool(bias_correction), betas=check_betas(betas), eps=eps,
                        weight_decay=weight_decay, grad_averaging=bool(grad_averaging),
                        max_grad_norm=max_grad_norm)
        super().__init__(params, defaults, set_grad_none)
        self.adam_w_mode = bool(adam_w_mode)
        self.use_nvlamb = bool(use_nvlamb)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One LAMB update from each param's ``.grad``; returns ``closure()``'s loss if given."""
        loss = self._run_closure(closure)
        all_buckets = [(group, self._buckets(group)) for group in self.param_groups]
        # The FP32 copies of low-precision gradients are made per bucket, twice, rather than
        # kept for the whole step: the step then needs at most one bucket's worth of them.
        norms = [norm for _, buckets in all_buckets for params in buckets.values()
                 for norm in torch._foreach_norm(self._fp32([p.grad for p in params]))]
        if not norms:
            return loss
        clip = self._clip_factor(norms)
        for group, buckets in all_buckets:
            if not buckets:
                continue
            group["step"] = group.get("step", 0) + 1
            for (device, _), params in buckets.items():
                self._update(group, params, None if clip is None else clip.to(device))
        return loss

    def _clip_factor(self, norms: List[torch.Tensor]) -> Optional[torch.Tensor]:
        """``G / max_grad_norm`` where the global norm ``G`` exceeds it, else 1 (a 0-dim tensor,
        so the step makes no host sync); ``None`` when clipping is off."""
        max_norm = self.defaults["max_grad_norm"]
        if max_norm <= 0:
            return None
        device = norms[0].device
        total = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]))
        return torch.where(total > max_norm, total / max_norm, torch.ones_like(total))

    def _update(self, group: dict, params: _Bucket, clip: Optional[torch.Tensor]) -> None:
        beta1, beta2 = group["betas"]
        beta3 = 1.0 - beta1 if group["grad_averaging"] else 1.0
        t = group["step"]
        bc1, bc2 = (1.0 - beta1 ** t, 1.0 - beta2 ** t) if group["bias_correction"] else (1.0, 1.0)
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        exp_avgs = [self._state_fp32(p, "exp_avg") for p in params]
        exp_avg_sqs = [self._state_fp32(p, "exp_avg_sq") for p in params]
        params32 = self._fp32(params)
        grads32 = self._fp32([p.grad for p in params])

        # Stage 1, per element: the Adam direction u (new tensors: p.grad is not touched).
        if clip is not None:
            grads = torch._foreach_div(grads32, clip)
        elif params[0].dtype == torch.float32:
            grads = [g.clone() for g in grads32]  # grads32 are the params' .grad
        else:
            grads = grads32  # already FP32 copies
        if not self.adam_w_mode and wd != 0:
            torch._foreach_add_(grads, params32, alpha=wd)
        torch._foreach_mul_(exp_avgs, beta1)
        torch._foreach_add_(exp_avgs, grads, alpha=beta3)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
        denoms = torch._foreach_div(exp_avg_sqs, bc2)
        torch._foreach_sqrt_(denoms)
        torch._foreach_add_(denoms, eps)
        updates = torch._foreach_div(exp_avgs, bc1)
        torch._foreach_div_(updates, denoms)
        if self.adam_w_mode and wd != 0:
            torch._foreach_add_(updates, params32, alpha=wd)

        # Stage 2, per tensor: the trust ratio, then p -= ratio * u.
        if self.use_nvlamb or wd != 0:
            param_norms = torch.stack(torch._foreach_norm(params32))
            update_norms = torch.stack(torch._foreach_norm(updates))
            trusted = (param_norms != 0) & (update_norms != 0)
            ratios = torch.where(trusted, lr * (param_norms / update_norms), torch.full_like(param_norms, lr))
            for update, ratio in zip(updates, ratios.unbind()):
                update.mul_(ratio)
            torch._foreach_sub_(params32, updates)
        else:
            torch._foreach_add_(params32, updates, alpha=-lr)
        self._write_back(params, params32)


class FusedNovoGrad(_ForeachOptimizer):
    """NovoGrad (Ginsburg et al., "Stochastic Gradient Methods with Layer-wise Adaptive Moments"),
    as apex's ``FusedNovoGrad``.

    The second moment is one number per tensor: ``v``, a running norm of the tensor's gradient.
    Each ``step()``, every group with at least one gradient advances ``t = group['step']``; for
    each param with a gradient ``g``:

    * ``n`` is the gradient's norm: L2 (``norm_type=2``) or the largest ``|g|`` (``norm_type=0``).
      On the param's first step ``v`` starts at 0 (``init_zero=True``) or at ``n``.
    * ``n`` is blended into ``v``: ``v = sqrt(beta2*v**2 + (1-beta2)*n**2)`` (L2) or
      ``v = beta2*v + (1-beta2)*n`` (max norm).
    * With ``bc1 = 1 - beta1**t``, ``bc2 = sqrt(1 - beta2**t)`` (both 1 without
      ``bias_correction``), ``beta3 = 1 - beta1`` if ``grad_averaging`` else 1, ``d = v/bc2 + eps``:
      with ``reg_inside_moment=True``, ``m = beta1*m + beta3*(g/d + wd*p)`` and
      ``p = p - lr*m/bc1``; otherwise (the default) ``m = beta1*m + beta3*g`` and
      ``p = p - lr*((m/bc1)/d + wd*p)``.

    State layout: ``state[p]['exp_avg']`` (m, FP32, shaped like ``p``) and
    ``state[p]['exp_avg_sq']`` (v, a 0-dim FP32 tensor on ``p``'s device); the step count is
    ``group['step']``.  ``load_state_dict`` moves both to the param's device, in FP32.

    apex keeps the per-tensor norms in ``group['exp_avg_sq']``, as two tensors (one norm per
    float16 param, then one per float32 param, each in the group's order); ``load_state_dict``
    moves such norms into each param's state, so apex checkpoints continue exactly.

    Differences from apex: ``p.grad`` is never modified; a group without gradients does not
    advance its step; float64 params raise ``TypeError``.  ``amsgrad=True`` raises
    ``ValueError`` as in apex.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, bias_correction: bool = True,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, reg_inside_moment: bool = False, grad_averaging: bool = True,
                 norm_type: int = 2, init_zero: bool = False, set_grad_none: bool = True):
        if amsgrad:
            raise ValueError("FusedNovoGrad does not support the AMSGrad variant (amsgrad=True), as in apex")
        check_number("learning rate (lr)", lr)
        check_number("epsilon (eps)", eps)
        check_number("weight_decay", weight_decay)
        if isinstance(norm_type, bool) or norm_type not in (0, 2):
            raise ValueError(f"Invalid norm_type: {norm_type!r}; FusedNovoGrad supports 2 (L2 norm) and "
                             "0 (max norm, L-infinity)")
        defaults = dict(lr=lr, bias_correction=bool(bias_correction), betas=check_betas(betas), eps=eps,
                        weight_decay=weight_decay, grad_averaging=bool(grad_averaging), norm_type=int(norm_type),
                        init_zero=bool(init_zero))
        super().__init__(params, defaults, set_grad_none)
        self.moment_mode = 0 if reg_inside_moment else 1

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One NovoGrad update from each param's ``.grad``; returns ``closure()``'s loss if given."""
        loss = self._run_closure(closure)
        all_buckets = [(group, self._buckets(group)) for group in self.param_groups]
        for group, buckets in all_buckets:
            if not buckets:
                continue
            if group["norm_type"] not in (0, 2):
                raise ValueError(f"Invalid norm_type in a param group: {group['norm_type']!r}; expected 0 or 2")
            group["step"] = group.get("step", 0) + 1
            for params in buckets.values():
                self._update(group, params)
        return loss

    def _update(self, group: dict, params: _Bucket) -> None:
        beta1, beta2 = group["betas"]
        beta3 = 1.0 - beta1 if group["grad_averaging"] else 1.0
        t = group["step"]
        bc1, bc2 = (1.0 - beta1 ** t, math.sqrt(1.0 - beta2 ** t)) if group["bias_correction"] else (1.0, 1.0)
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        max_norm = group["norm_type"] == 0
        grads32 = self._fp32([p.grad for p in params])
        params32 = self._fp32(params)
        exp_avgs = [self._state_fp32(p, "exp_avg") for p in params]

        # The per-tensor second moments: initialise on a param's first step, then blend in n.
        grad_norms = self._grad_norms(grads32, max_norm)
        moments = []
        for param, norm in zip(params, grad_norms):
            state = self.state[param]
            if "exp_avg_sq" not in state:
                state["exp_avg_sq"] = torch.zeros_like(norm) if group["init_zero"] else norm.clone()
            moments.append(state["exp_avg_sq"])
        v = torch.stack(moments)
        n = torch.stack(grad_norms)
        v = beta2 * v + (1.0 - beta2) * n if max_norm else torch.sqrt(beta2 * v * v + (1.0 - beta2) * n * n)
        torch._foreach_copy_(moments, v.unbind())
        denoms = (v / bc2 + eps).unbind()

        if self.moment_mode == 0:
            scaled = [g / d for g, d in zip(grads32, denoms)]
            if wd != 0:
                torch._foreach_add_(scaled, params32, alpha=wd)
            torch._foreach_mul_(exp_avgs, beta1)
            torch._foreach_add_(exp_avgs, scaled, alpha=beta3)
            updates = torch._foreach_div(exp_avgs, bc1)
        else:
            torch._foreach_mul_(exp_avgs, beta1)
            torch._foreach_add_(exp_avgs, grads32, alpha=beta3)
            updates = torch._foreach_div(exp_avgs, bc1)
            for update, d in zip(updates, denoms):
                update.div_(d)
            if wd != 0:
                torch._foreach_add_(updates, params32, alpha=wd)
        torch._foreach_add_(params32, updates, alpha=-lr)
        self._write_back(params, params32)


    def load_state_dict(self, state_dict: dict) -> None:
        """As :meth:`_ForeachOptimizer.load_state_dict`; an apex checkpoint's per-group norms
        (``group['exp_avg_sq']``) become the per-param ``exp_avg_sq`` this class keeps."""
        super().load_state_dict(state_dict)
        for index, group in enumerate(self.param_groups):
            self._adopt_group_norms(index, group)

    def _adopt_group_norms(self, index: int, group: dict) -> None:
        norms = group.pop("exp_avg_sq", None)
        if norms is None:
            return
        if not isinstance(norms, (list, tuple)) or len(norms) != 2:
            raise ValueError(f"FusedNovoGrad cannot load param group {index}: its 'exp_avg_sq' should be apex's "
                             f"[float16 norms, float32 norms], got {type(norms).__name__}")
        # apex listed the params that had a gradient (and so, state), float16 ones first.
        stepped = [p for p in group["params"] if "exp_avg" in self.state.get(p, {})]
        halves = [p for p in stepped if p.dtype == torch.float16]
        others = [p for p in stepped if p.dtype != torch.float16]
        for params, values, kind in ((halves, norms[0], "float16"), (others, norms[1], "float32")):
            count = 0 if values is None else values.numel()
            if count != len(params):
                raise ValueError(f"FusedNovoGrad cannot load param group {index}: apex saved {count} {kind} norms "
                                 f"for {len(params)} {kind} params with state. Load it into an optimizer built "
                                 "over the same parameters, in the same order and dtypes")
            for param, value in zip(params, () if values is None else values.detach().reshape(-1).unbind()):
                self.state[param].setdefault("exp_avg_sq", value.to(device=param.device, dtype=torch.float32,
                                                                    copy=True))

    @staticmethod
    def _grad_norms(grads: List[torch.Tensor], max_norm: bool) -> List[torch.Tensor]:
        """Each gradient's L2 or max norm (0 for an empty tensor, whose max norm torch refuses)."""
        if not max_norm:
            return list(torch._foreach_norm(grads))
        nonempty = [g for g in grads if g.numel()]
        norms = iter(torch._foreach_norm(nonempty, math.inf) if nonempty else ())
        return [next(norms) if g.numel() else g.new_zeros(()) for g in grads]


class FusedAdagrad(_ForeachOptimizer):
    """Adagrad, as apex's ``FusedAdagrad``.

    Each ``step()``, for each param with a gradient ``g``, with the running sum of squares ``h``:
    with ``adagrad_w_mode=False`` (the default) weight decay is an L2 penalty on the gradient,
    ``g = g + wd*p``, then ``h = h + g**2`` and ``p = p - lr*g/(sqrt(h) + eps)``; with
    ``adagrad_w_mode=True`` it is decoupled: ``h = h + g**2`` and
    ``p = p - lr*(g/(sqrt(h) + eps) + wd*p)``.

    State: ``state[p]['sum']`` (h), FP32 for every param dtype.  There is no step count (apex
    keeps none).  Unlike ``torch.optim.Adagrad`` there is no ``lr_decay`` nor
    ``initial_accumulator_value``.  Differences from apex: ``p.grad`` is never modified;
    float64 params raise ``TypeError``.
    """

    def __init__(self, params: Iterable, lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0.0,
                 set_grad_none: bool = True, adagrad_w_mode: bool = False):
        check_number("learning rate (lr)", lr)
        check_number("epsilon (eps)", eps)
        check_number("weight_decay", weight_decay)
        super().__init__(params, dict(lr=lr, eps=eps, weight_decay=weight_decay), set_grad_none)
        self.adagrad_w_mode = bool(adagrad_w_mode)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One Adagrad update from each param's ``.grad``; returns ``closure()``'s loss if given."""
        loss = self._run_closure(closure)
        all_buckets = [(group, self._buckets(group)) for group in self.param_groups]
        for group, buckets in all_buckets:
            for params in buckets.values():
                self._update(group, params)
        return loss

    def _update(self, group: dict, params: _Bucket) -> None:
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        grads = self._fp32([p.grad for p in params])
        params32 = self._fp32(params)
        sums = [self._state_fp32(p, "sum") for p in params]
        if not self.adagrad_w_mode and wd != 0:
            grads = torch._foreach_add(grads, params32, alpha=wd)  # new tensors: p.grad is not touched
        torch._foreach_addcmul_(sums, grads, grads)
        denoms = torch._foreach_sqrt(sums)
        torch._foreach_add_(denoms, eps)
        if self.adagrad_w_mode:
            updates = torch._foreach_div(grads, denoms)
            if wd != 0:
                torch._foreach_add_(updates, params32, alpha=wd)
            torch._foreach_add_(params32, updates, alpha=-lr)
        else:
            torch._foreach_addcdiv_(params32, grads, denoms, value=-lr)
        self._write_back(params, params32)


class FusedMixedPrecisionLamb(torch.optim.Optimizer):
    """Not provided by ampinit: apex's LAMB variant that keeps its own FP32 master weights and
    takes a ``GradScaler``.  Constructing it raises ``NotImplementedError``; use
    :class:`FusedLAMB` under ``ampinit.initialize(model, optimizer, opt_level="O2")``, which keeps
    the FP32 masters and unscales the gradients for it."""

    def __init__(self, *args: Any, **kwargs: Any):
        raise NotImplementedError(
            "ampinit does not implement apex.optimizers.FusedMixedPrecisionLamb. Use FusedLAMB with ampinit's "
            "master weights instead: model, optimizer = ampinit.initialize(model, FusedLAMB(model.parameters(), "
            "...), opt_level=\"O2\") (or \"O5\" for bfloat16)")
