"""Checks of optimizer hyper-parameters shared by the apex optimizers: a bad value raises a
``ValueError`` that names it, before the optimizer exists."""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional, Tuple

__all__ = ["check_number", "check_betas"]


def check_number(name: str, value: Any, low: float = 0.0, high: Optional[float] = None,
                   high_open: bool = True) -> None:
    """``ValueError`` unless ``value`` is a real number in ``[low, high)`` (or ``[low, high]``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        raise ValueError(f"Invalid {name}: {value!r}; expected a number")
    if value < low:
        raise ValueError(f"Invalid {name}: {value}; must be >= {low}")
    if high is not None and (value >= high if high_open else value > high):
        raise ValueError(f"Invalid {name}: {value}; must be {'<' if high_open else '<='} {high}")


def check_betas(betas: Any) -> Tuple[float, float]:
    """``(beta1, beta2)`` as floats; ``ValueError`` unless it is a pair of numbers in ``[0, 1)``."""
    try:
        beta1, beta2 = betas
    except (TypeError, ValueError):
        raise ValueError(f"Invalid betas: {betas!r}; expected a pair (beta1, beta2)") from None
    check_number("beta1 (betas[0])", beta1, 0.0, 1.0)
    check_number("beta2 (betas[1])", beta2, 0.0, 1.0)
    return float(beta1), float(beta2)
