"""Loads the compiled extension ``ampinit._C`` once, remembering why it could not.

Importing ampinit never fails because of the extension: ``ops`` falls back to the
pure-PyTorch implementations in ``_fallback`` and :func:`ampinit.ops.backend` reports why.
"""

from __future__ import annotations

import importlib
import os
from typing import Optional, Tuple


def _load() -> Tuple[Optional[object], str]:
    if os.environ.get("AMPINIT_DISABLE_EXT", "0") not in ("", "0"):
        return None, "disabled by AMPINIT_DISABLE_EXT"
    try:
        module = importlib.import_module("ampinit._C")
    except ImportError as error:
        return None, f"compiled extension not available ({error})"
    return module, "compiled extension loaded"


# Set once at import; never reassigned.
EXTENSION, REASON = _load()
