"""``apex.fp16_utils.loss_scaler`` under ampinit's apex alias: apex's host-side loss scalers.

:class:`LossScaler` (a static scale) and :class:`DynamicLossScaler` keep apex's attributes
(``cur_scale``, ``cur_iter``, ``last_overflow_iter``, ``scale_factor``, ``scale_window``), so
the objects apex pickled into ``FP16_Optimizer`` checkpoints unpickle into them, and code that
drives a scaler by hand (``has_overflow``, ``update_scale``, ``loss_scale``) works unchanged.
:class:`~ampinit.apex.fp16_utils.FP16_Optimizer` itself keeps its scale on the device, with the
same rule (see its docstring).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Tuple

import torch

__all__ = ["to_python_float", "LossScaler", "DynamicLossScaler"]


def to_python_float(t: Any) -> float:
    """A one-element tensor's value as a Python number (a sync on CUDA)."""
    return t.item() if hasattr(t, "item") else t[0]


def _has_inf_or_nan(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds an inf or a NaN (one host read)."""
    return not bool(torch.isfinite(tensor).all())


class LossScaler:
    """A static loss scale, as apex's ``LossScaler(scale=1)``: it never changes and never
    reports an overflow."""

    def __init__(self, scale: float = 1):
        self.cur_scale = scale

    def has_overflow(self, params: Iterable[torch.Tensor]) -> bool:
        return False

    @staticmethod
    def _has_inf_or_nan(tensor: torch.Tensor) -> bool:
        """apex's static scaler never reports an overflow, whatever ``tensor`` holds."""
        return False

    def update_scale(self, overflow: bool) -> None:
        """Nothing to update: the scale is static."""

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def scale_gradient(self, module: Any, grad_in: Tuple[torch.Tensor, ...], grad_out: Any) -> Tuple[Any, ...]:
        """A backward hook that multiplies the incoming gradients by the scale."""
        return tuple(self.loss_scale * g for g in grad_in)

    def backward(self, loss: torch.Tensor) -> None:
        """``(loss * loss_scale).backward()``."""
        (loss * self.loss_scale).backward()


class DynamicLossScaler(LossScaler):
    """apex's dynamic loss scale, on the host.

    ``update_scale(overflow)`` is called once per iteration.  On an overflow the scale becomes
    ``max(cur_scale / scale_factor, 1)``; otherwise it is multiplied by ``scale_factor`` when
    ``scale_window`` iterations have passed since the last overflow (or since the start),
    that is at each iteration where ``(cur_iter - last_overflow_iter) % scale_window == 0``.
    """

    def __init__(self, init_scale: float = 2 ** 32, scale_factor: float = 2.0, scale_window: int = 1000):
        if isinstance(scale_factor, bool) or not isinstance(scale_factor, (int, float)) \
                or not math.isfinite(scale_factor) or scale_factor < 1:
            raise ValueError(f"scale_factor must be a finite number >= 1; got {scale_factor!r}")
        if isinstance(scale_window, bool) or not isinstance(scale_window, int) or scale_window < 1:
            raise ValueError(f"scale_window must be an int >= 1; got {scale_window!r}")
        super().__init__(init_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = scale_factor
        self.scale_window = scale_window

    # apex's staticmethod, called on the class by some scripts (Megatron-era loss checks)
    _has_inf_or_nan = staticmethod(_has_inf_or_nan)

    def has_overflow(self, params: Iterable[torch.Tensor]) -> bool:
        """Whether any param's gradient holds an inf or a NaN (a host read per gradient)."""
        return any(p.grad is not None and _has_inf_or_nan(p.grad) for p in params)

    def update_scale(self, overflow: bool) -> None:
        """Back off on an overflow (not below 1), grow after ``scale_window`` clean iterations."""
        if overflow:
            self.cur_scale = max(self.cur_scale / self.scale_factor, 1)
            self.last_overflow_iter = self.cur_iter
        elif (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
            self.cur_scale *= self.scale_factor
        self.cur_iter += 1
