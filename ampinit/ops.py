"""The ops facade: one function per hot-path op, backed by the pure-PyTorch implementations.

Every op follows one contract, shared with the compiled kernels that will sit behind this
facade: ``inv_scale`` and ``found_inf`` are 1-element float32 tensors on the gradients'
device; nothing reads them on the host, so no op synchronises with the device.  The caller
zeroes ``found_inf``; an op only ever sets it to 1.0.
"""

from __future__ import annotations

from typing import Tuple

from . import _ext, _fallback

__all__ = ["backend", "unscale_", "accumulate_unscaled_", "unscale_sparse", "copy_",
           "update_scale_"]


def backend() -> Tuple[str, str]:
    """``(name, reason)`` of the live implementation: ``("torch", why)`` for the fallback."""
    return "torch", _ext.REASON


# The compiled extension is not part of this build yet, so every op is the fallback's.
unscale_ = _fallback.unscale_
accumulate_unscaled_ = _fallback.accumulate_unscaled_
unscale_sparse = _fallback.unscale_sparse
copy_ = _fallback.copy_
update_scale_ = _fallback.update_scale_
