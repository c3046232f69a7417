"""apex's private ``amp._amp_state``, as a view of the most recent ``initialize``.

apex kept everything in one global object, and real scripts reach into it: DeepLearningExamples'
GNMT sets ``loss_scalers[0]._loss_scale`` and ``_scale_seq_len`` (the growth interval), BERT and
many forks set ``_loss_scale`` right after ``initialize``, apex's own tests read
``opt_properties`` and call ``handle._deactivate()``.  ampinit keeps its state in the objects
the user holds; this module gives those scripts the names they use, pointing at the most
recent initialization (as apex's module-level API does).  It is the one module where ampinit
keeps process-wide mutable state, and only what apex compatibility needs.

Reading a scale (``loss_scale()``, ``_loss_scale``) synchronises with the device.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional

import torch

from . import frontend
from .handle import AmpHandle
from .scaler import LossScaler

__all__ = ["_amp_state", "master_params", "init", "AmpState", "LossScalerView", "Properties"]


class LossScalerView:
    """apex's ``LossScaler`` attributes over one of ampinit's :class:`~ampinit.LossScaler`.

    ``_loss_scale`` (the scale), ``_scale_seq_len`` (clean backwards between growths),
    ``_unskipped`` (clean backwards since the last growth or overflow), ``_min_loss_scale`` and
    ``_max_loss_scale`` can be read and set; ``loss_scale()`` and ``dynamic`` as in apex.
    """

    def __init__(self, scaler: LossScaler):
        object.__setattr__(self, "_scaler", scaler)

    def loss_scale(self) -> float:
        return self._scaler.loss_scale()

    @property
    def dynamic(self) -> bool:
        return self._scaler.dynamic

    @property
    def _loss_scale(self) -> float:
        return self._scaler.loss_scale()

    @_loss_scale.setter
    def _loss_scale(self, value: float) -> None:
        self._scaler.set_scale(value)

    @property
    def _scale_seq_len(self) -> int:
        return self._scaler.growth_interval

    @_scale_seq_len.setter
    def _scale_seq_len(self, value: int) -> None:
        self._scaler.set_growth_interval(value)

    @property
    def _unskipped(self) -> int:
        return self._scaler.state_dict()["unskipped"]

    @_unskipped.setter
    def _unskipped(self, value: int) -> None:
        state = self._scaler.state_dict()
        state["unskipped"] = value
        self._scaler.load_state_dict(state)

    @property
    def _min_loss_scale(self) -> float:
        return self._scaler.min_loss_scale

    @_min_loss_scale.setter
    def _min_loss_scale(self, value: float) -> None:
        self._scaler.set_bounds(min_loss_scale=value)

    @property
    def _max_loss_scale(self) -> float:
        return self._scaler.max_loss_scale

    @_max_loss_scale.setter
    def _max_loss_scale(self, value: float) -> None:
        self._scaler.set_bounds(max_loss_scale=value)

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"apex's LossScaler.{name} is not emulated by ampinit's _amp_state view; it offers "
                             "loss_scale(), dynamic, _loss_scale, _scale_seq_len, _unskipped, _min_loss_scale and "
                             "_max_loss_scale (see docs/migrating-from-apex.md)")

    def __setattr__(self, name: str, value: Any) -> None:
        if not isinstance(getattr(type(self), name, None), property):
            raise AttributeError(f"setting apex's LossScaler.{name} has no effect in ampinit; settable: _loss_scale, "
                                 "_scale_seq_len, _unskipped, _min_loss_scale, _max_loss_scale")
        object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        return f"LossScalerView({self._scaler!r})"


class Properties:
    """apex's ``opt_properties``: the resolved options of the most recent ``initialize``,
    read-only (``options`` is a dict of them)."""

    _NAMES = ("enabled", "opt_level", "cast_model_type", "patch_torch_functions", "keep_batchnorm_fp32",
              "master_weights", "loss_scale")

    def __init__(self, config: Optional[Any]):
        self._config = config

    @property
    def options(self) -> Dict[str, Any]:
        if self._config is None:
            return {"enabled": False, "opt_level": None, "cast_model_type": None, "patch_torch_functions": False,
                    "keep_batchnorm_fp32": None, "master_weights": None, "loss_scale": 1.0}
        return {name: getattr(self._config, name) for name in self._NAMES}

    def __getattr__(self, name: str) -> Any:
        options = self.options
        if name in options:
            return options[name]
        raise AttributeError(f"opt_properties has no {name!r}; it has {', '.join(options)}")

    def __repr__(self) -> str:
        return f"Properties({self.options})"


class _HandleView:
    """apex's O1 ``AmpHandle`` names: ampinit patches nothing, so deactivating and clearing
    the cast cache have nothing to undo."""

    def __init__(self, handle: AmpHandle):
        self.amp = handle

    def is_active(self) -> bool:
        return not self.amp.ended

    def _deactivate(self) -> None:
        pass

    def _clear_cache(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"_HandleView(opt_level={self.amp.config.opt_level!r})"


class AmpState:
    """apex's ``_amp_state`` (see the module docstring).  ``hard_override``,
    ``allow_incoming_model_not_fp32`` and ``verbosity`` are accepted for apex's tests and
    scripts and change nothing: ampinit takes models of any dtype."""

    def __init__(self):
        self.hard_override = False
        self.allow_incoming_model_not_fp32 = False
        self.verbosity = 1

    @staticmethod
    def _recent() -> Optional[AmpHandle]:
        recent = frontend._most_recent()
        return recent if isinstance(recent, AmpHandle) else None

    @property
    def loss_scalers(self) -> List[LossScalerView]:
        handle = self._recent()
        return [] if handle is None else [LossScalerView(s) for s in handle.loss_scalers]

    @property
    def opt_properties(self) -> Properties:
        recent = frontend._most_recent()
        return Properties(getattr(recent, "config", None))

    @property
    def handle(self) -> Optional[_HandleView]:
        handle = self._recent()
        return None if handle is None else _HandleView(handle)

    @property
    def min_loss_scale(self) -> Optional[float]:
        handle = self._recent()
        return None if handle is None else handle.config.min_loss_scale

    @property
    def max_loss_scale(self) -> Optional[float]:
        handle = self._recent()
        return None if handle is None else handle.config.max_loss_scale


_amp_state = AmpState()


def master_params(optimizer: torch.optim.Optimizer):
    """apex's ``_amp_state.master_params`` (the same as :func:`ampinit.master_params`)."""
    return frontend.master_params(optimizer)


class NoOpHandle:
    """What apex's legacy ``amp.init(enabled=False)`` returned: a handle that does nothing
    (fp32 runs of scripts written for it, maskrcnn-benchmark's ``test_net.py`` say)."""

    verbose = False

    def is_active(self) -> bool:
        return False

    @contextlib.contextmanager
    def _disable_casts(self) -> Iterator[None]:
        yield

    def wrap_optimizer(self, optimizer: Any, num_loss: int = 1) -> "_NoOpOptimizer":
        return _NoOpOptimizer(optimizer)

    @contextlib.contextmanager
    def scale_loss(self, loss: Any, optimizer: Any) -> Iterator[Any]:
        yield loss

    @property
    def has_cache(self) -> bool:
        return False

    def _clear_cache(self) -> None:
        pass

    def _deactivate(self) -> None:
        pass


class _NoOpOptimizer:
    """``NoOpHandle.wrap_optimizer``: the optimizer, with a ``scale_loss`` that scales nothing."""

    def __init__(self, optimizer: Any):
        self._optimizer = optimizer

    @contextlib.contextmanager
    def scale_loss(self, loss: Any) -> Iterator[Any]:
        yield loss

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_optimizer"], name)


def init(enabled: bool = True, *args: Any, **kwargs: Any) -> NoOpHandle:
    """apex's legacy ``amp.init()``.  ``enabled=False`` returns apex's no-op handle.  Enabled, it
    is not supported: it patched ``torch`` for the whole process, and ampinit patches nothing;
    it raises with the two-line replacement."""
    if not enabled:
        return NoOpHandle()
    raise RuntimeError(
        "amp.init() is apex's legacy API, which patched torch functions for the whole process; ampinit does not "
        "support it.  Replace it with the two lines of the current API:\n"
        "    model, optimizer = amp.initialize(model, optimizer, opt_level=\"O1\")\n"
        "    with amp.scale_loss(loss, optimizer) as scaled_loss: scaled_loss.backward()\n"
        "If the script already calls amp.initialize (some call amp.init(allow_banned=True) first, a leftover of "
        "the legacy API), delete the amp.init line: initialize replaces it.  "
        "(Casting a single function: @amp.half_function / amp.register_half_function still work.)")
