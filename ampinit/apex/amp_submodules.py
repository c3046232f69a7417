"""apex's ``apex.amp`` submodules that code imports from, under ampinit's apex alias.

``apex.amp`` is ``ampinit`` itself; these modules stand in for ``apex.amp.handle``,
``apex.amp.amp``, ``apex.amp._initialize`` and ``apex.amp.scaler`` (see ``ALIASED`` in
:mod:`ampinit.apex`).  Each exposes the names apex code imports from it: ampinit's own
functions where they mean the same thing, and a clear error where apex's internals have no
counterpart.
"""

from __future__ import annotations

from typing import Any

from .. import frontend, registry
from .._amp_state import init

__all__ = ["scale_loss", "disable_casts", "init", "half_function", "float_function", "promote_function",
           "bfloat16_function", "register_half_function", "register_float_function", "register_promote_function",
           "register_bfloat16_function", "_initialize", "LossScaler"]

scale_loss = frontend.scale_loss
disable_casts = registry.disable_casts
half_function = registry.half_function
float_function = registry.float_function
promote_function = registry.promote_function
bfloat16_function = registry.bfloat16_function
register_half_function = registry.register_half_function
register_float_function = registry.register_float_function
register_promote_function = registry.register_promote_function
register_bfloat16_function = registry.register_bfloat16_function


def _initialize(models: Any, optimizers: Any, properties: Any, num_losses: int = 1,
                cast_model_outputs: Any = None) -> Any:
    """apex's private ``apex.amp._initialize._initialize``: raises ``RuntimeError`` (it takes
    apex's internal ``Properties``); call ``apex.amp.initialize`` with the same options."""
    raise RuntimeError("apex.amp._initialize._initialize is apex's private helper and is not provided by ampinit; "
                       "call apex.amp.initialize(models, optimizers, opt_level=..., num_losses=..., "
                       "cast_model_outputs=...) (ampinit.initialize) instead")


class LossScaler:
    """apex's ``apex.amp.scaler.LossScaler``: not constructible under ampinit.

    ampinit keeps each loss's scale in device tensors owned by ``initialize``; apex's object
    (``update_scale``, ``_overflow_buf``, ``unscale``) has no counterpart.  Constructing it
    raises ``RuntimeError`` that names what to use.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        raise RuntimeError(
            "apex.amp.scaler.LossScaler is apex amp's internal scaler and is not provided by ampinit. Pass the "
            "scaling options to apex.amp.initialize (loss_scale=\"dynamic\" or a number, min_loss_scale, "
            "max_loss_scale, init_scale, growth_interval) and read or set the live scale through "
            "apex.amp._amp_state.loss_scalers[i] (loss_scale(), _loss_scale, _scale_seq_len). For FP16_Optimizer's "
            "scalers use apex.fp16_utils.loss_scaler.LossScaler / DynamicLossScaler")
