"""Loss scaling: the scale and its counters live in device tensors.

A :class:`LossScaler` never reads its own state on the host during training: scaling the
loss, computing ``1/scale`` and advancing the dynamic state machine are all tensor ops.  Only
:meth:`LossScaler.loss_scale` and :meth:`LossScaler.state_dict` synchronise (they return
Python numbers).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Dict, Optional, Union

import torch

from . import ops

__all__ = ["LossScaler"]

logger = logging.getLogger("ampinit")

# The dynamic scale's floor unless min_loss_scale is given: fp16's smallest subnormal.
DEFAULT_MIN_LOSS_SCALE = 2.0 ** -24
# Counters in a checkpoint, with the largest value their device tensors hold.
_INT_STATE = {"unskipped": 2 ** 31 - 1, "hysteresis_left": 2 ** 31 - 1, "overflows": 2 ** 63 - 1}
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


class LossScaler:
    """Static or dynamic loss scale for one loss.

    Args:
        loss_scale: ``"dynamic"`` or a positive number (a static scale).
        device: where the state tensors live (the model's device).
        init_scale: first dynamic scale (apex: 2**16).
        growth_factor, backoff_factor: multipliers on growth and on overflow (2.0, 0.5).
        growth_interval: clean steps between growths (apex: 2000).
        hysteresis: consecutive overflows before the first back-off (1: back off on every
            overflow); every further consecutive overflow backs off too, and a clean backward
            starts over (apex's ``update_scale_hysteresis`` rule).
        min_loss_scale, max_loss_scale: floor and ceiling of the dynamic scale.

    A static scaler keeps its scale but still flags non-finite gradients, so ampinit skips
    those steps instead of writing NaN into the weights.
    """

    def __init__(self, loss_scale: Union[str, float] = "dynamic", *,
                 device: Union[str, torch.device] = "cpu", init_scale: float = 2.0 ** 16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, hysteresis: int = 1,
                 min_loss_scale: Optional[float] = None, max_loss_scale: float = 2.0 ** 24):
        self.dynamic = loss_scale == "dynamic"
        if not self.dynamic:
            if isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float)) \
                    or not math.isfinite(loss_scale) or not 0 < loss_scale <= _FLOAT32_MAX:
                raise ValueError(f"loss_scale must be 'dynamic' or a number in (0, {_FLOAT32_MAX:.4g}] "
                                 f"(float32); got {loss_scale!r}")
            init_scale = float(loss_scale)
        # a static scale's value, kept on the host too (only set_scale changes it): no sync to read
        self._fixed: Optional[float] = None if self.dynamic else float(init_scale)
        if not (growth_factor >= 1.0 and 0.0 < backoff_factor <= 1.0):
            raise ValueError("growth_factor must be >= 1 and backoff_factor in (0, 1]; got "
                             f"{growth_factor} and {backoff_factor}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval must be an int >= 1; got {growth_interval!r}")
        if isinstance(hysteresis, bool) or not isinstance(hysteresis, int) or hysteresis < 1:
            raise ValueError(f"hysteresis must be an int >= 1; got {hysteresis!r}")
        # Below 2**-24 a float32 scale turns fp16 gradients into zeros or denormals; without a
        # floor apex's scale fell to 1e-205 (apex #318).
        self.min_loss_scale = DEFAULT_MIN_LOSS_SCALE if min_loss_scale is None else float(min_loss_scale)
        self.max_loss_scale = float(max_loss_scale)
        if not 0 < self.min_loss_scale <= self.max_loss_scale:
            raise ValueError(f"need 0 < min_loss_scale <= max_loss_scale; got "
                             f"{self.min_loss_scale} and {self.max_loss_scale}")
        if self.dynamic:
            init_scale = min(max(float(init_scale), self.min_loss_scale), self.max_loss_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        device = torch.device(device)
        self._scale = torch.full((1,), float(init_scale), dtype=torch.float32, device=device)
        self._growth_tracker = torch.zeros((1,), dtype=torch.int32, device=device)
        self._hysteresis_tracker = torch.full((1,), hysteresis, dtype=torch.int32, device=device)
        self._overflows = torch.zeros((1,), dtype=torch.int64, device=device)
        self.found_inf = torch.zeros((1,), dtype=torch.float32, device=device)
        # How many times update(), set_scale() or a checkpoint's load changed (or may have changed)
        # the scale: gradients scaled before can't be unscaled with the scale after (delay_unscale
        # across such a change is refused).
        self.updates = 0

    @property
    def device(self) -> torch.device:
        return self._scale.device

    @property
    def scale_tensor(self) -> torch.Tensor:
        """The current scale as a 1-element float32 device tensor (no sync)."""
        return self._scale

    def loss_scale(self) -> float:
        """The current scale as a Python float (apex API).  Synchronises with the device."""
        return float(self._scale.item())

    def at_floor(self) -> bool:
        """True if the scale cannot go lower: static, or at ``min_loss_scale``.  Synchronises."""
        return not self.dynamic or self.loss_scale() <= self.min_loss_scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss.float() * scale`` without leaving the device.  The product keeps a copy of the
        scale: setting it before the backward (by hand) does not break the graph."""
        return loss.float() * self._scale.to(loss.device, copy=True).reshape(())

    def inv_scale(self) -> torch.Tensor:
        """``1/scale`` as a float32 device tensor, rounded once from a float64 reciprocal."""
        return self._scale.double().reciprocal().float()

    def update(self) -> None:
        """Advance the scale from ``found_inf`` (device side; a static scale only counts)."""
        if self.dynamic:
            growth, backoff, interval = self.growth_factor, self.backoff_factor, self.growth_interval
        else:
            growth, backoff, interval = 1.0, 1.0, 2 ** 31 - 1
        self.updates += 1
        ops.update_scale_(self._scale, self._growth_tracker, self._hysteresis_tracker,
                          self._overflows, self.found_inf, growth_factor=growth,
                          backoff_factor=backoff, growth_interval=interval,
                          hysteresis=self.hysteresis, min_scale=self.min_loss_scale,
                          max_scale=self.max_loss_scale if self.dynamic else math.inf)

    # -- apex scripts set these directly (``_amp_state.loss_scalers[i]._loss_scale = ...``) -------
    def set_scale(self, value: float) -> None:
        """Set the current scale (a dynamic one within ``[min_loss_scale, max_loss_scale]``)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or not 0 < value <= _FLOAT32_MAX:
            raise ValueError(f"a loss scale must be a number in (0, {_FLOAT32_MAX:.4g}]; got {value!r}")
        if self.dynamic and not self.min_loss_scale <= value <= self.max_loss_scale:
            raise ValueError(f"loss scale {value:g} is outside [min_loss_scale, max_loss_scale] = "
                             f"[{self.min_loss_scale:g}, {self.max_loss_scale:g}]")
        changed = self._scale.item() != float(value)  # a sync, on this path only
        self._scale.fill_(float(value))
        if changed:  # scaled gradients still waiting (delay_unscale) must not join the new scale
            self.updates += 1
        if not self.dynamic:
            self._fixed = float(value)

    @property
    def fixed_scale(self) -> Optional[float]:
        """A static scale's value (no sync), or ``None`` for a dynamic one."""
        return self._fixed

    def set_growth_interval(self, value: int) -> None:
        """Clean backwards between growths of a dynamic scale (apex's ``_scale_seq_len``)."""
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < 2 ** 31:
            raise ValueError(f"growth_interval must be an int in [1, 2**31); got {value!r}")
        self.growth_interval = value

    def set_bounds(self, min_loss_scale: Optional[float] = None, max_loss_scale: Optional[float] = None) -> None:
        """Change the floor and/or ceiling of a dynamic scale."""
        low = self.min_loss_scale if min_loss_scale is None else float(min_loss_scale)
        high = self.max_loss_scale if max_loss_scale is None else float(max_loss_scale)
        if not (math.isfinite(low) and math.isfinite(high) and 0 < low <= high):
            raise ValueError(f"need 0 < min_loss_scale <= max_loss_scale, both finite; got {low} and {high}")
        self.min_loss_scale, self.max_loss_scale = low, high

    def state_dict(self) -> Dict[str, Any]:
        """apex's ``{"loss_scale", "unskipped"}`` plus the rest of the state.  Synchronises."""
        return {
            "loss_scale": self.loss_scale(),
            "unskipped": int(self._growth_tracker.item()),
            "hysteresis_left": int(self._hysteresis_tracker.item()),
            "overflows": int(self._overflows.item()),
        }

    @staticmethod
    def check_state_dict(state: Any, name: str = "loss scaler state") -> None:
        """Raise ``ValueError`` unless ``state`` is a loadable scaler state (apex's or ours)."""
        if not isinstance(state, dict):
            raise ValueError(f"{name} must be a dict with 'loss_scale' and 'unskipped'; got "
                             f"{type(state).__name__}")
        missing = {"loss_scale", "unskipped"} - state.keys()
        if missing:
            raise ValueError(f"{name} lacks {sorted(missing)}; it is not an apex/ampinit amp state")
        scale = state["loss_scale"]
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"{name}: loss_scale must be a finite number > 0; got {scale!r}")
        for key, largest in _INT_STATE.items():
            value = state.get(key, 0)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= largest:
                raise ValueError(f"{name}: {key} must be an int in [0, {largest}]; got {value!r}")

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore from :meth:`state_dict` output or from an apex checkpoint's scaler entry.

        A dynamic scale outside ``[min_loss_scale, max_loss_scale]`` (apex's scale could fall to
        1e-205, apex #318) is clamped into it, with a warning.  A static scaler keeps the scale
        it was configured with; a different one in the checkpoint is reported and ignored.
        """
        self.check_state_dict(state)
        scale = float(state["loss_scale"])
        if self.dynamic:
            clamped = min(max(scale, self.min_loss_scale), self.max_loss_scale)
            if clamped != scale:
                logger.warning("ampinit: the checkpoint's loss scale %g is outside [min_loss_scale, max_loss_scale] "
                               "= [%g, %g]; continuing from %g", scale, self.min_loss_scale, self.max_loss_scale,
                               clamped)
            self._scale.fill_(clamped)
            self.updates += 1  # as set_scale
        elif scale != self.loss_scale():
            logger.warning("ampinit: the checkpoint's loss scale %g differs from the static loss_scale %g this "
                           "initialization uses; keeping %g", scale, self.loss_scale(), self.loss_scale())
        self._growth_tracker.fill_(int(state["unskipped"]))
        self._hysteresis_tracker.fill_(int(state.get("hysteresis_left", self.hysteresis)))
        self._overflows.fill_(int(state.get("overflows", 0)))

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic else "static"
        return f"LossScaler({kind}, device={self.device})"
