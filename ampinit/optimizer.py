"""The optimizer that ``initialize`` hands back.

It is the user's own optimizer object, its class swapped for a subclass made once per
optimizer class (``isinstance`` checks, ``state_dict`` layouts, LR schedulers and step hooks
all keep working).  The subclass adds the skip-on-overflow decision before ``step`` and the
master -> model copy after it; ``AmpHandle.end`` swaps the original class back.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

if TYPE_CHECKING:  # pragma: no cover
    from .handle import AmpHandle, OptimizerBinding

__all__ = ["amp_optimizer_class", "binding_of"]

_STATE_ATTR = "_ampinit_binding"
logger = logging.getLogger("ampinit")


def binding_of(optimizer: Any) -> Optional["OptimizerBinding"]:
    """The ampinit binding of ``optimizer``, or ``None`` if it was not initialized."""
    return getattr(optimizer, "__dict__", {}).get(_STATE_ATTR)


class _AmpOptimizerMixin:
    """Methods layered over the user's optimizer class (see the module docstring)."""

    @property
    def amp(self) -> "AmpHandle":
        """The :class:`~ampinit.AmpHandle` of the ``initialize`` call that made this optimizer."""
        return binding_of(self).handle

    def step(self, closure: Optional[Callable[[], Any]] = None):
        """Update the masters, unless a gradient of this step was inf/NaN, then copy them
        into the model.

        Synchronises with the device once: reading the step's ``found_inf`` flag decides
        whether to skip.  Steps after no ``scale_loss`` do not synchronise, and neither do
        the fused optimizers of ``ampinit.optim``, which skip on the device.
        """
        binding = binding_of(self)
        if binding is None:  # ended after an LR scheduler wrapped this bound method
            return type(self).step(self, closure)
        if closure is not None:
            raise RuntimeError("ampinit does not support optimizer.step(closure): compute the "
                               "loss and call scale_loss(...).backward() before step()")
        binding.check_ready_for_step()
        if binding.masters.fused:  # ampinit.optim: the skip is decided on the device
            binding.fused_step()
            return None
        if binding.masters.unscaled_since_step and bool(binding.masters.found_inf.item()):
            binding.skip_step()
            return None
        result = super().step()
        binding.after_step()
        return result

    # Tell torch's Optimizer._patch_step_function (run again by load_state_dict) that this
    # step is already hooked: it calls the base class's hooked step, so step hooks run once.
    step.hooked = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of the masters and of the model parameters behind them, and
        the overflow flag of the step they belonged to (an abandoned backward must not skip
        the next step)."""
        super().zero_grad(set_to_none=set_to_none)
        binding = binding_of(self)
        if binding is not None:
            binding.masters.zero_model_grads(set_to_none)
            binding.discard_step()

    def add_param_group(self, param_group: dict) -> None:
        """Add a group; its low-precision parameters get FP32 masters like the others."""
        binding = binding_of(self)
        if binding is None:
            return super().add_param_group(param_group)
        binding.add_param_group(param_group, super().add_param_group)


@functools.lru_cache(maxsize=None)
def amp_optimizer_class(base: type) -> type:
    """The subclass of ``base`` that initialized optimizers become (made once per class)."""
    return type(base.__name__, (_AmpOptimizerMixin, base),
                {"__module__": base.__module__, "__qualname__": base.__qualname__,
                 "_ampinit_base": base})


def attach(optimizer: torch.optim.Optimizer, binding: "OptimizerBinding") -> None:
    optimizer.__dict__[_STATE_ATTR] = binding
    optimizer.__class__ = amp_optimizer_class(type(optimizer))


def detach(optimizer: torch.optim.Optimizer) -> None:
    optimizer.__dict__.pop(_STATE_ATTR, None)
    optimizer.__class__ = optimizer.__class__._ampinit_base
