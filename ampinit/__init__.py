"""ampinit: apex-compatible mixed precision for current PyTorch (``import ampinit as amp``)."""

from . import optim  # ampinit.optim.FusedAdam(...) after a bare `import ampinit`
from ._amp_state import _amp_state, init
from ._version import __version__
from .apex import install_apex_alias, uninstall_apex_alias
from .frontend import end, handle_of, initialize, load_state_dict, master_params, scale_loss, state_dict
from .handle import AmpHandle
from .opt_levels import OPT_LEVELS, AmpConfig
from .registry import (
                       bfloat16_function,
                       disable_casts,
                       float_function,
                       half_function,
                       promote_function,
                       register_bfloat16_function,
                       register_float_function,
                       register_half_function,
                       register_promote_function,
)
from .scaler import LossScaler

__all__ = [
    "__version__", "initialize", "scale_loss", "master_params", "state_dict", "load_state_dict",
    "end", "handle_of", "AmpHandle", "AmpConfig", "OPT_LEVELS", "LossScaler", "disable_casts",
    "half_function", "bfloat16_function", "float_function", "promote_function", "register_half_function",
    "register_bfloat16_function", "register_float_function", "register_promote_function", "init",
    "install_apex_alias", "uninstall_apex_alias", "_amp_state", "optim",
]
