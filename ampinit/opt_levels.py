"""Optimization levels: apex's O0-O3 presets plus the bf16 levels O4/O5.

An :class:`AmpConfig` is a frozen, fully resolved description of what ``initialize`` does:
which dtype the model is cast to, whether forward runs under ``torch.autocast``, whether FP32
master weights are kept, and how the loss is scaled.  :func:`resolve_config` starts from a
preset and applies the user's overrides exactly as apex did (including apex's habit of
passing ``"True"``/``"False"``/``"dynamic"``/``"128.0"`` strings straight from argparse), then
rejects contradictory combinations with an error that says what to change.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Optional, Union

import torch

from .scaler import DEFAULT_MIN_LOSS_SCALE

__all__ = ["AmpConfig", "OPT_LEVELS", "resolve_config"]

logger = logging.getLogger("ampinit")

LossScale = Union[float, str]

_DTYPE_NAMES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}
_LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class AmpConfig:
    """The resolved properties of one ``initialize`` call.

    Attributes mirror apex's ``opt_properties``; ``autocast_dtype`` is the dtype O1-style
    autocast runs in (float16 for O1, bfloat16 for O4) and is ``None`` when
    ``patch_torch_functions`` is off.  ``init_scale``, ``growth_factor``, ``backoff_factor``,
    ``growth_interval`` and ``hysteresis`` drive the dynamic loss scale (torch.amp's
    ``GradScaler`` names; apex's defaults).
    """

    opt_level: str
    enabled: bool = True
    cast_model_type: Optional[torch.dtype] = None
    patch_torch_functions: bool = False
    autocast_dtype: Optional[torch.dtype] = None
    keep_batchnorm_fp32: Optional[bool] = None
    master_weights: bool = False
    # master_weights="remainder": bfloat16 parameters keep their masters as the weight plus an
    # int16 remainder (2 bytes per parameter instead of 4; see ampinit.masters)
    master_remainders: bool = False
    loss_scale: LossScale = 1.0
    cast_model_outputs: Optional[torch.dtype] = None
    num_losses: int = 1
    verbosity: int = 1
    min_loss_scale: Optional[float] = None
    max_loss_scale: float = 2.0 ** 24
    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    hysteresis: int = 1

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.loss_scale == "dynamic"

    @property
    def casts_model(self) -> bool:
        """True when parameters are cast to a low-precision dtype (O2, O3, O5)."""
        return self.cast_model_type in _LOW_PRECISION

    def to_dict(self) -> dict:
        """A plain-Python view (dtypes as strings) for checkpoints and logs."""
        out = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            out[field.name] = str(value).replace("torch.", "") if isinstance(value, torch.dtype) else value
        return out


# apex's table, row for row; O4/O5 are the bf16 levels of ROCm apex.  Dtype-less fields keep
# the dataclass defaults.  One deliberate difference: O1/O4 cast the model's floating-point
# outputs to FP32 (apex left them in fp16), so a loss computed from them outside the model
# runs in FP32, as apex's patched loss functions did.
OPT_LEVELS = {
    "O0": dict(cast_model_type=torch.float32, patch_torch_functions=False,
               keep_batchnorm_fp32=None, master_weights=False, loss_scale=1.0),
    "O1": dict(cast_model_type=None, patch_torch_functions=True, autocast_dtype=torch.float16,
               keep_batchnorm_fp32=None, master_weights=False, loss_scale="dynamic",
               cast_model_outputs=torch.float32),
    "O2": dict(cast_model_type=torch.float16, patch_torch_functions=False,
               keep_batchnorm_fp32=True, master_weights=True, loss_scale="dynamic",
               cast_model_outputs=torch.float32),
    "O3": dict(cast_model_type=torch.float16, patch_torch_functions=False,
               keep_batchnorm_fp32=False, master_weights=False, loss_scale=1.0,
               cast_model_outputs=torch.float32),
    "O4": dict(cast_model_type=None, patch_torch_functions=True, autocast_dtype=torch.bfloat16,
               keep_batchnorm_fp32=None, master_weights=False, loss_scale=1.0,
               cast_model_outputs=torch.float32),
    "O5": dict(cast_model_type=torch.bfloat16, patch_torch_functions=False,
               keep_batchnorm_fp32=True, master_weights=True, loss_scale=1.0,
               cast_model_outputs=torch.float32),
}

# The largest float32: a scale (or a loss times it) beyond it is inf.
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
_UNSET = object()  # an override the caller did not pass
_NO_CAST = object()  # apex's cast_model_type=False: "do not cast"


def _parse_bool(name: str, value: Any) -> Optional[bool]:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str) and value in ("True", "False"):
        return value == "True"
    raise ValueError(f"{name} must be True, False, None or the strings 'True'/'False'; got {value!r}")


def _parse_dtype(name: str, value: Any) -> Any:
    if value is False or value == "False":
        if name == "cast_model_type":
            return _NO_CAST
        raise ValueError(f"{name}=False is not a dtype; pass None to keep the level's default")
    if value is None or isinstance(value, torch.dtype):
        dtype = value
    elif isinstance(value, str) and value.replace("torch.", "") in _DTYPE_NAMES:
        dtype = _DTYPE_NAMES[value.replace("torch.", "")]
    else:
        raise ValueError(f"{name} must be a torch dtype (torch.float16, torch.bfloat16, "
                         f"torch.float32), None or False; got {value!r}")
    if dtype is not None and dtype not in (torch.float32, *_LOW_PRECISION):
        raise ValueError(f"{name} must be torch.float16, torch.bfloat16 or torch.float32; got {dtype}")
    return dtype


def _number(name: str, value: Any, *, minimum: float = 0.0, inclusive: bool = False) -> float:
    """A finite float32-representable number above ``minimum`` (apex's argparse strings too)."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ValueError(f"{name} must be a number; got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number; got {value!r}")
    value = float(value)
    above = value >= minimum if inclusive else value > minimum
    if not (math.isfinite(value) and above):
        raise ValueError(f"{name} must be finite and {'>=' if inclusive else '>'} {minimum:g}; got {value!r}")
    if value > _FLOAT32_MAX:
        raise ValueError(f"{name}={value:g} does not fit in float32 (largest {_FLOAT32_MAX:.4g}), where ampinit "
                         "keeps it; use a smaller value")
    return value


def _parse_loss_scale(value: Any) -> LossScale:
    if value == "dynamic":
        return value
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            raise ValueError(f"loss_scale must be 'dynamic' or a positive number; got {value!r}") from None
    return _number("loss_scale", value)


def _parse_optional_scale(name: str, value: Any) -> Optional[float]:
    return None if value is None else _number(name, value)


def _parse_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value < 2 ** 31:
        raise ValueError(f"{name} must be an int in [{minimum}, 2**31); got {value!r}")
    return value


def _check_opt_level(opt_level: Any) -> str:
    if not isinstance(opt_level, str):
        raise TypeError(f"opt_level must be a string such as 'O1'; got {type(opt_level).__name__}")
    if opt_level in OPT_LEVELS:
        return opt_level
    if len(opt_level) == 2 and opt_level[0] == "0" and "O" + opt_level[1] in OPT_LEVELS:
        raise ValueError(f"opt_level {opt_level!r} starts with the digit zero; optimization levels "
                         f"start with the capital letter O: use 'O{opt_level[1]}'")
    raise ValueError(f"unknown opt_level {opt_level!r}; choose one of {', '.join(OPT_LEVELS)}")


def resolve_config(opt_level: Any = "O1", *, enabled: Any = True, cast_model_type: Any = None,
                   patch_torch_functions: Any = None, keep_batchnorm_fp32: Any = None,
                   master_weights: Any = None, loss_scale: Any = None,
                   cast_model_outputs: Any = None, num_losses: Any = 1, verbosity: Any = 1,
                   min_loss_scale: Any = None, max_loss_scale: Any = 2.0 ** 24, init_scale: Any = None,
                   growth_factor: Any = None, backoff_factor: Any = None, growth_interval: Any = None,
                   hysteresis: Any = None) -> AmpConfig:
    """Build the :class:`AmpConfig` for ``opt_level`` with apex-style overrides.

    ``None`` means "keep the preset's value" for every overridable property, as in apex;
    ``cast_model_type=False`` means "do not cast" (apex's code), which also drops the level's
    master weights and batch-norm rule.  Raises ``TypeError``/``ValueError`` naming the
    offending argument.
    """
    enabled = _parse_bool("enabled", enabled)
    if enabled is None:
        raise ValueError("enabled must be True or False")
    level = _check_opt_level(opt_level)
    props = dict(OPT_LEVELS[level])

    cast = _parse_dtype("cast_model_type", cast_model_type)
    remainders = isinstance(master_weights, str) and master_weights.strip().lower() == "remainder"
    if remainders:
        master_weights = True
    overrides = {
        "cast_model_type": None if cast is _NO_CAST else cast,
        "patch_torch_functions": _parse_bool("patch_torch_functions", patch_torch_functions),
        "keep_batchnorm_fp32": _parse_bool("keep_batchnorm_fp32", keep_batchnorm_fp32),
        "master_weights": _parse_bool("master_weights", master_weights),
        "loss_scale": None if loss_scale is None else _parse_loss_scale(loss_scale),
        "cast_model_outputs": _parse_dtype("cast_model_outputs", cast_model_outputs),
    }
    for key, value in overrides.items():
        if value is not None:
            props[key] = value
    if cast is _NO_CAST:
        props["cast_model_type"] = None
    if props["patch_torch_functions"] and props.get("autocast_dtype") is None:
        props["autocast_dtype"] = torch.float16  # apex's O1 autocasts to fp16
    if not props["patch_torch_functions"]:
        props["autocast_dtype"] = None
    if props["cast_model_type"] not in _LOW_PRECISION:
        # The level's batch-norm rule is moot for a model that is not cast (apex ignored it);
        # asking for it explicitly is an error (_check_consistent).  Master weights are not:
        # as in apex, the low-precision parameters the optimizers hold (cast by the user) get
        # FP32 masters.
        if keep_batchnorm_fp32 is None:
            props["keep_batchnorm_fp32"] = None
        if cast_model_outputs is None and props.get("autocast_dtype") is None:
            props["cast_model_outputs"] = None

    if isinstance(num_losses, bool) or not isinstance(num_losses, int) or num_losses < 1:
        raise ValueError(f"num_losses must be an int >= 1; got {num_losses!r}")
    if isinstance(verbosity, bool) or verbosity not in (0, 1, 2):
        raise ValueError(f"verbosity must be 0, 1 or 2; got {verbosity!r}")
    scaling = {
        "min_loss_scale": _parse_optional_scale("min_loss_scale", min_loss_scale),
        "max_loss_scale": _parse_optional_scale("max_loss_scale", max_loss_scale) or 2.0 ** 24,
    }
    given = {}
    if init_scale is not None:
        given["init_scale"] = _number("init_scale", init_scale)
    if growth_factor is not None:
        given["growth_factor"] = _number("growth_factor", growth_factor, minimum=1.0, inclusive=True)
    if backoff_factor is not None:
        given["backoff_factor"] = _number("backoff_factor", backoff_factor)
        if given["backoff_factor"] > 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1]; got {backoff_factor!r}")
    if growth_interval is not None:
        given["growth_interval"] = _parse_int("growth_interval", growth_interval, 1)
    if hysteresis is not None:
        given["hysteresis"] = _parse_int("hysteresis", hysteresis, 1)

    config = AmpConfig(opt_level=level, enabled=enabled, num_losses=num_losses, verbosity=verbosity,
                       master_remainders=remainders, **scaling, **given, **props)
    _check_consistent(config, given)
    if not config.dynamic_loss_scale and config.min_loss_scale is not None:
        # apex took min_loss_scale (and max_loss_scale) with any scale and used them only when
        # it was dynamic; Jasper/NeMo pass min_loss_scale=1.0 at every level.  A static scale
        # never moves, so the floor is dropped rather than refused.
        logger.debug("ampinit: min_loss_scale=%g is ignored: loss_scale=%s is static",
                     config.min_loss_scale, config.loss_scale)
        config = dataclasses.replace(config, min_loss_scale=None)
    return config


def _check_consistent(config: AmpConfig, dynamic_options: dict) -> None:
    """Reject property combinations that cannot mean what the user wants."""
    where = f"opt_level={config.opt_level!r}"
    if dynamic_options and not config.dynamic_loss_scale:
        raise ValueError(f"{where}: {', '.join(sorted(dynamic_options))} only apply to dynamic loss scaling, but "
                         f"loss_scale={config.loss_scale}; pass loss_scale='dynamic' or drop them")
    floor = config.min_loss_scale if config.min_loss_scale is not None else DEFAULT_MIN_LOSS_SCALE
    if "init_scale" in dynamic_options and not floor <= config.init_scale <= config.max_loss_scale:
        raise ValueError(f"init_scale={config.init_scale:g} is outside [min_loss_scale, max_loss_scale] = "
                         f"[{floor:g}, {config.max_loss_scale:g}]")
    if config.patch_torch_functions and config.casts_model:
        raise ValueError(
            f"{where}: patch_torch_functions=True (O1-style autocast) with cast_model_type="
            f"{config.cast_model_type} would both autocast and cast the model; use O1/O4 for "
            f"autocast or O2/O3/O5 for a cast model, not both")
    if config.master_remainders and config.cast_model_type != torch.bfloat16:
        cast = f"casts it to {config.cast_model_type}" if config.cast_model_type is not None else "does not cast it"
        raise ValueError(
            f"{where}: master_weights='remainder' keeps each FP32 master as its bfloat16 weight plus a 16-bit "
            f"remainder, so the model must be cast to bfloat16 (O5, or cast_model_type=torch.bfloat16); this "
            f"configuration {cast}.  Use O5, or master_weights=True")
    if config.master_weights and config.patch_torch_functions:
        raise ValueError(
            f"{where}: master_weights=True with patch_torch_functions=True (O1-style autocast): autocast keeps the "
            "model's FP32 weights, so there is nothing to keep masters of; drop master_weights or use O2/O5")
    if config.keep_batchnorm_fp32 is not None and not config.casts_model:
        raise ValueError(
            f"{where}: keep_batchnorm_fp32={config.keep_batchnorm_fp32} only applies when the "
            f"model is cast (O2/O3/O5); leave it None here")
    floor_given = config.min_loss_scale is not None
    if config.dynamic_loss_scale and floor_given and config.min_loss_scale > config.max_loss_scale:
        raise ValueError(f"min_loss_scale ({config.min_loss_scale}) is larger than "
                         f"max_loss_scale ({config.max_loss_scale})")
