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
import math
from typing import Any, Optional, Union

import torch

__all__ = ["AmpConfig", "OPT_LEVELS", "resolve_config"]

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
    ``patch_torch_functions`` is off.
    """

    opt_level: str
    enabled: bool = True
    cast_model_type: Optional[torch.dtype] = None
    patch_torch_functions: bool = False
    autocast_dtype: Optional[torch.dtype] = None
    keep_batchnorm_fp32: Optional[bool] = None
    master_weights: bool = False
    loss_scale: LossScale = 1.0
    cast_model_outputs: Optional[torch.dtype] = None
    num_losses: int = 1
    verbosity: int = 1
    min_loss_scale: Optional[float] = None
    max_loss_scale: float = 2.0 ** 24

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
# the dataclass defaults.
OPT_LEVELS = {
    "O0": dict(cast_model_type=torch.float32, patch_torch_functions=False,
               keep_batchnorm_fp32=None, master_weights=False, loss_scale=1.0),
    "O1": dict(cast_model_type=None, patch_torch_functions=True, autocast_dtype=torch.float16,
               keep_batchnorm_fp32=None, master_weights=False, loss_scale="dynamic"),
    "O2": dict(cast_model_type=torch.float16, patch_torch_functions=False,
               keep_batchnorm_fp32=True, master_weights=True, loss_scale="dynamic"),
    "O3": dict(cast_model_type=torch.float16, patch_torch_functions=False,
               keep_batchnorm_fp32=False, master_weights=False, loss_scale=1.0),
    "O4": dict(cast_model_type=None, patch_torch_functions=True, autocast_dtype=torch.bfloat16,
               keep_batchnorm_fp32=None, master_weights=False, loss_scale=1.0),
    "O5": dict(cast_model_type=torch.bfloat16, patch_torch_functions=False,
               keep_batchnorm_fp32=True, master_weights=True, loss_scale=1.0),
}


def _parse_bool(name: str, value: Any) -> Optional[bool]:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str) and value in ("True", "False"):
        return value == "True"
    raise ValueError(f"{name} must be True, False, None or the strings 'True'/'False'; got {value!r}")


def _parse_dtype(name: str, value: Any) -> Optional[torch.dtype]:
    if value is None or isinstance(value, torch.dtype):
        dtype = value
    elif isinstance(value, str) and value.replace("torch.", "") in _DTYPE_NAMES:
        dtype = _DTYPE_NAMES[value.replace("torch.", "")]
    else:
        raise ValueError(f"{name} must be a torch dtype (torch.float16, torch.bfloat16, "
                         f"torch.float32) or None; got {value!r}")
    if dtype is not None and dtype not in (torch.float32, *_LOW_PRECISION):
        raise ValueError(f"{name} must be torch.float16, torch.bfloat16 or torch.float32; got {dtype}")
    return dtype


def _parse_loss_scale(value: Any) -> LossScale:
    if isinstance(value, str):
        if value == "dynamic":
            return value
        try:
            value = float(value)
        except ValueError:
            raise ValueError(f"loss_scale must be 'dynamic' or a positive number; got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"loss_scale must be 'dynamic' or a positive number; got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"loss_scale must be finite and > 0; got {value!r}")
    return float(value)


def _parse_optional_scale(name: str, value: Any) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ValueError(f"{name} must be a positive number or None; got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isnan(value):
        raise ValueError(f"{name} must be a positive number or None; got {value!r}")
    return float(value)


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
                   min_loss_scale: Any = None, max_loss_scale: Any = 2.0 ** 24) -> AmpConfig:
    """Build the :class:`AmpConfig` for ``opt_level`` with apex-style overrides.

    ``None`` means "keep the preset's value" for every overridable property, as in apex.
    Raises ``TypeError``/``ValueError`` naming the offending argument.
    """
    enabled = _parse_bool("enabled", enabled)
    if enabled is None:
        raise ValueError("enabled must be True or False")
    level = _check_opt_level(opt_level)
    props = dict(OPT_LEVELS[level])

    overrides = {
        "cast_model_type": _parse_dtype("cast_model_type", cast_model_type),
        "patch_torch_functions": _parse_bool("patch_torch_functions", patch_torch_functions),
        "keep_batchnorm_fp32": _parse_bool("keep_batchnorm_fp32", keep_batchnorm_fp32),
        "master_weights": _parse_bool("master_weights", master_weights),
        "loss_scale": None if loss_scale is None else _parse_loss_scale(loss_scale),
    }
    for key, value in overrides.items():
        if value is not None:
            props[key] = value
    if props["patch_torch_functions"] and props.get("autocast_dtype") is None:
        props["autocast_dtype"] = torch.float16  # apex's O1 autocasts to fp16
    if not props["patch_torch_functions"]:
        props["autocast_dtype"] = None

    if isinstance(num_losses, bool) or not isinstance(num_losses, int) or num_losses < 1:
        raise ValueError(f"num_losses must be an int >= 1; got {num_losses!r}")
    if isinstance(verbosity, bool) or verbosity not in (0, 1, 2):
        raise ValueError(f"verbosity must be 0, 1 or 2; got {verbosity!r}")

    config = AmpConfig(
        opt_level=level, enabled=enabled,
        cast_model_outputs=_parse_dtype("cast_model_outputs", cast_model_outputs),
        num_losses=num_losses, verbosity=verbosity,
        min_loss_scale=_parse_optional_scale("min_loss_scale", min_loss_scale),
        max_loss_scale=_parse_optional_scale("max_loss_scale", max_loss_scale) or 2.0 ** 24,
        **props,
    )
    _check_consistent(config)
    return config


def _check_consistent(config: AmpConfig) -> None:
    """Reject property combinations that cannot mean what the user wants."""
    where = f"opt_level={config.opt_level!r}"
    if config.patch_torch_functions and config.casts_model:
        raise ValueError(
            f"{where}: patch_torch_functions=True (O1-style autocast) with cast_model_type="
            f"{config.cast_model_type} would both autocast and cast the model; use O1/O4 for "
            f"autocast or O2/O3/O5 for a cast model, not both")
    if config.master_weights and not config.casts_model:
        raise ValueError(
            f"{where}: master_weights=True needs a low-precision model "
            f"(cast_model_type=torch.float16 or torch.bfloat16), but the model stays "
            f"{config.cast_model_type or 'as it is'}; drop master_weights or use O2/O5")
    if config.keep_batchnorm_fp32 is not None and not config.casts_model:
        raise ValueError(
            f"{where}: keep_batchnorm_fp32={config.keep_batchnorm_fp32} only applies when the "
            f"model is cast (O2/O3/O5); leave it None here")
    if config.min_loss_scale is not None and config.min_loss_scale > config.max_loss_scale:
        raise ValueError(f"min_loss_scale ({config.min_loss_scale}) is larger than "
                         f"max_loss_scale ({config.max_loss_scale})")
    if not config.dynamic_loss_scale and config.min_loss_scale is not None:
        raise ValueError(f"{where}: min_loss_scale only applies to dynamic loss scaling, but "
                         f"loss_scale={config.loss_scale}; pass loss_scale='dynamic' or drop it")
