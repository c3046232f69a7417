"""``apex.fp16_utils``: apex's manual mixed-precision helpers, before ``amp``.

The model helpers (``network_to_half``, ``convert_network``, ``prep_param_lists``, ...) are
small torch functions.  :class:`FP16_Optimizer` is apex's O2-style wrapper, built on ampinit:
FP32 master weights for the model's fp16/bf16 parameters, a static or dynamic loss scale, a
skipped step on overflow, the master -> model copy after each step.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..handle import AmpHandle
from ..opt_levels import resolve_config
from ..optimizer import binding_of
from .loss_scaler import DynamicLossScaler, LossScaler, to_python_float

__all__ = ["to_python_float", "tofp16", "BN_convert_float", "network_to_half", "convert_module", "convert_network",
           "FP16Model", "prep_param_lists", "model_grads_to_master_grads", "master_params_to_model_params",
           "clip_grad_norm", "FP16_Optimizer", "LossScaler", "DynamicLossScaler"]

logger = logging.getLogger("ampinit")
# apex's DynamicLossScaler defaults; it had no ceiling: the largest power of two in float32.
_APEX_INIT_SCALE = 2.0 ** 32
_APEX_SCALE_WINDOW = 1000
_NO_CEILING = 2.0 ** 127
clip_grad_norm = torch.nn.utils.clip_grad_norm_


class tofp16(nn.Module):  # noqa: N801 (apex's name)
    """A module that casts its input to fp16."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return input.half()


def BN_convert_float(module: nn.Module) -> nn.Module:  # noqa: N802 (apex's name)
    """Put affine batch-norm layers back in FP32 (after ``model.half()``)."""
    if isinstance(module, _BatchNorm) and module.affine:
        module.float()
    for child in module.children():
        BN_convert_float(child)
    return module


def network_to_half(network: nn.Module) -> nn.Module:
    """``network`` in fp16 (batch norm in FP32) behind a module that casts its input."""
    return nn.Sequential(tofp16(), BN_convert_float(network.half()))


def convert_module(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast the floating-point parameters (with their gradients) and buffers of ``module``
    itself, not of its children."""
    for param in module.parameters(recurse=False):
        if param is not None and param.is_floating_point():
            param.data = param.data.to(dtype)
            if param.grad is not None:
                param.grad = param.grad.to(dtype)
    for buffer in module.buffers(recurse=False):
        if buffer is not None and buffer.is_floating_point():
            buffer.data = buffer.data.to(dtype)


def convert_network(network: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast every module of ``network`` but affine batch norm to ``dtype``."""
    for module in network.modules():
        if isinstance(module, _BatchNorm) and module.affine:
            continue
        convert_module(module, dtype)
        if isinstance(module, nn.RNNBase):
            module.flatten_parameters()
    return network


class FP16Model(nn.Module):
    """A network converted to fp16 (batch norm in FP32) whose inputs are cast to fp16."""

    def __init__(self, network: nn.Module):
        super().__init__()
        self.network = convert_network(network, dtype=torch.half)

    def forward(self, *inputs: Any) -> Any:
        return self.network(*(t.half() if torch.is_tensor(t) and t.is_floating_point() else t for t in inputs))


def prep_param_lists(model: nn.Module, flat_master: bool = False) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """``(model_params, master_params)``: the model's trainable parameters and FP32 copies of
    them (one flat FP32 parameter with a gradient buffer if ``flat_master``)."""
    model_params = [p for p in model.parameters() if p.requires_grad]
    if flat_master:
        if len({p.dtype for p in model_params}) > 1:
            raise TypeError("flat_master=True needs parameters of one dtype; got "
                            f"{sorted({str(p.dtype) for p in model_params})}")
        flat = torch._utils._flatten_dense_tensors([p.detach() for p in model_params]).float()
        master = nn.Parameter(flat)
        master.grad = torch.zeros_like(master)
        return model_params, [master]
    masters = [nn.Parameter(p.detach().clone().float()) for p in model_params]
    return model_params, masters


def model_grads_to_master_grads(model_params: Sequence[torch.Tensor], master_params: Sequence[torch.Tensor],
                                flat_master: bool = False) -> None:
    """Copy the model's gradients into the masters' (FP32), allocating them as needed."""
    if flat_master:
        master_params[0].grad.copy_(torch._utils._flatten_dense_tensors([p.grad for p in model_params]))
        return
    for model, master in zip(model_params, master_params):
        if model.grad is None:
            master.grad = None
        elif master.grad is None:
            master.grad = model.grad.detach().float()
        else:
            master.grad.copy_(model.grad)


def master_params_to_model_params(model_params: Sequence[torch.Tensor], master_params: Sequence[torch.Tensor],
                                  flat_master: bool = False) -> None:
    """Copy the masters' values into the model's parameters."""
    with torch.no_grad():
        if flat_master:
            for model, value in zip(model_params,
                                    torch._utils._unflatten_dense_tensors(master_params[0].data, model_params)):
                model.copy_(value)
            return
        for model, master in zip(model_params, master_params):
            model.copy_(master)


class _LiveLossScaler:
    """``FP16_Optimizer.loss_scaler``: apex's scaler attributes (``cur_scale``, ``loss_scale``,
    ``cur_iter``, ``last_overflow_iter``, ``scale_factor``, ``scale_window``), read from the
    optimizer's own scaler, which keeps its scale on the device: reading a scale is a host sync.
    Setting ``cur_scale`` (or ``scale_window``) sets that scaler's.  A static scale has no
    ``scale_factor`` or ``scale_window`` (``AttributeError``; apex's ``LossScaler`` had none).  The scale is updated by
    ``step()``, so ``has_overflow``/``update_scale`` by hand are refused."""

    def __init__(self, optimizer: "FP16_Optimizer"):
        self._optimizer = optimizer

    @property
    def _scaler(self) -> Any:
        return self._optimizer._scaler

    @property
    def dynamic(self) -> bool:
        return self._scaler.dynamic

    @property
    def cur_scale(self) -> float:
        return self._scaler.loss_scale()

    @cur_scale.setter
    def cur_scale(self, value: float) -> None:
        self._scaler.set_scale(value)

    @property
    def loss_scale(self) -> float:
        return self._scaler.loss_scale()

    @property
    def cur_iter(self) -> int:
        """Steps taken or skipped, as apex's one ``update_scale`` per ``step()`` counted them."""
        return self._optimizer._binding.steps

    def _dynamic_only(self, name: str) -> None:
        # apex's static LossScaler has no schedule: reading one here (2, 1000) would say it grows
        if not self._scaler.dynamic:
            raise AttributeError(f"FP16_Optimizer.loss_scaler: a static loss scale has no {name} (nor had "
                                 "apex's LossScaler); construct FP16_Optimizer with dynamic_loss_scale=True "
                                 "for a scale that backs off and grows")

    @property
    def last_overflow_iter(self) -> int:
        last = self._optimizer._binding.last_overflow_step
        return -1 if last is None else last

    @property
    def scale_factor(self) -> float:
        self._dynamic_only("scale_factor")
        return self._scaler.growth_factor

    @property
    def scale_window(self) -> int:
        self._dynamic_only("scale_window")
        return self._scaler.growth_interval

    @scale_window.setter
    def scale_window(self, value: int) -> None:
        self._dynamic_only("scale_window")
        self._scaler.set_growth_interval(value)

    def has_overflow(self, params: Any) -> bool:
        raise RuntimeError("FP16_Optimizer checks for overflow itself: read optimizer.overflow after "
                           "optimizer.backward(loss)")

    def update_scale(self, overflow: bool) -> None:
        raise RuntimeError("FP16_Optimizer updates its loss scale in step(); set optimizer.loss_scale "
                           "(or optimizer.loss_scaler.cur_scale) to change it by hand")

    def __repr__(self) -> str:
        return f"FP16_Optimizer.loss_scaler({'dynamic' if self.dynamic else 'static'}, cur_scale={self.cur_scale})"


def _check_scale_factor(factor: Any, where: str) -> None:
    """apex's ``DynamicLossScaler`` ``scale_factor`` (growth, and back-off by its inverse)."""
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 1.0 <= factor < math.inf:
        raise ValueError(f"{where}: scale_factor must be a finite number >= 1; got {factor!r}")


def _checked_schedule(factor: Any, window: Any) -> Tuple[float, int]:
    """A dynamic scale's ``scale_factor`` and ``scale_window`` from a checkpoint (ours, or apex's
    pickled scaler), or ``ValueError``."""
    _check_scale_factor(factor, "FP16_Optimizer checkpoint")
    if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window < 2 ** 31:
        raise ValueError(f"FP16_Optimizer checkpoint: scale_window must be an int in [1, 2**31); got {window!r}")
    return float(factor), window


class FP16_Optimizer:  # noqa: N801 (apex's name)
    """apex's ``FP16_Optimizer`` on ampinit: ``init_optimizer`` over a model you cast yourself
    (``model.half()``, ``network_to_half``) trains FP32 master copies of its fp16/bf16 parameters.

    ``backward(loss)`` scales the loss, backpropagates and unscales into the masters (with
    ``update_master_grads=False`` the gradients stay scaled until :meth:`update_master_grads`,
    for accumulation); ``step()`` skips an overflowing step (and lowers a dynamic scale), else
    updates the masters and copies them into the model.  ``closure`` in ``step`` is not supported.

    ``static_loss_scale``, or ``dynamic_loss_scale=True`` with ``dynamic_loss_args``: the scale
    follows apex's ``DynamicLossScaler`` (``init_scale`` 2**32, ``scale_factor`` 2,
    ``scale_window`` 1000): on an overflow it becomes ``max(scale / scale_factor, 1)``, and it is
    multiplied by ``scale_factor`` after ``scale_window`` clean steps; updated once per ``step()``
    from every backward since the last one, as apex's (amp updates at each backward).  ampinit adds
    ``min_loss_scale`` (default 1, apex's floor) and ``max_loss_scale`` (default 2**127, float32's
    largest power of two; apex had none).  As everywhere in ampinit, ``step()`` raises after 16
    consecutive skipped steps at the floor, where apex skipped forever.

    ``load_state_dict`` takes this class's ``state_dict()`` and apex's: apex pickled its
    ``LossScaler``/``DynamicLossScaler`` object (importable as
    ``apex.fp16_utils.loss_scaler`` under the alias) and saved ``fp32_from_fp16`` as one list
    per param group.  As in apex, the checkpoint's scaler replaces this one: its scale, its
    counters, and a dynamic one's ``scale_factor`` and ``scale_window``.
    """

    def __init__(self, init_optimizer: torch.optim.Optimizer, static_loss_scale: float = 1.0,
                 dynamic_loss_scale: bool = False, dynamic_loss_args: Optional[Dict[str, Any]] = None,
                 verbose: bool = True):
        if not isinstance(init_optimizer, torch.optim.Optimizer):
            raise TypeError(f"FP16_Optimizer wraps a torch.optim.Optimizer; got {type(init_optimizer).__name__}")
        if binding_of(init_optimizer) is not None:
            raise RuntimeError("this optimizer already went through ampinit.initialize, which does what "
                               "FP16_Optimizer does: use one of them")
        params = [p for g in init_optimizer.param_groups for p in g["params"]]
        if not params:
            raise ValueError("FP16_Optimizer needs an optimizer with parameters")
        scaling: Dict[str, Any] = {"loss_scale": "dynamic" if dynamic_loss_scale else static_loss_scale}
        if dynamic_loss_scale:
            scaling.update(self._dynamic_scaling(dynamic_loss_args or {}))
        elif dynamic_loss_args:  # apex ignored them next to a static scale
            logger.debug("ampinit: FP16_Optimizer ignores dynamic_loss_args without dynamic_loss_scale=True")
        config = resolve_config("O2", cast_model_type=False, verbosity=1 if verbose else 0, **scaling)
        self.optimizer = init_optimizer
        self._handle = AmpHandle(config, [], [init_optimizer], params[0].device)
        self._handle.scale_updates_at_step = True  # apex: one update_scale per step(), not per backward
        self._binding = binding_of(init_optimizer)
        self._scaler = self._handle.loss_scalers[0]
        # The overflow flag of the gradients the last step() used (None: no gradient, or no step
        # yet): apex's `overflow` keeps that answer until the next backward unscales new ones.
        self._step_found_inf: Optional[torch.Tensor] = None

    # apex's DynamicLossScaler starts at 2**32 (apex.optimizers.FP16_Optimizer at 2**16)
    _DYNAMIC_INIT_SCALE = _APEX_INIT_SCALE

    @classmethod
    def _dynamic_scaling(cls, dynamic_loss_args: Dict[str, Any]) -> Dict[str, Any]:
        """ampinit's scaler options for apex's ``DynamicLossScaler(**dynamic_loss_args)``."""
        args = dict(dynamic_loss_args)
        unknown = set(args) - {"init_scale", "scale_factor", "scale_window", "min_loss_scale", "max_loss_scale"}
        if unknown:
            raise ValueError(f"unknown dynamic_loss_args {sorted(unknown)}; apex's DynamicLossScaler takes "
                             "init_scale, scale_factor and scale_window (ampinit adds min_loss_scale, max_loss_scale)")
        factor = args.pop("scale_factor", 2.0)
        _check_scale_factor(factor, "dynamic_loss_args")
        return {"init_scale": args.pop("init_scale", cls._DYNAMIC_INIT_SCALE),
                "growth_interval": args.pop("scale_window", _APEX_SCALE_WINDOW),
                "growth_factor": float(factor), "backoff_factor": 1.0 / float(factor),
                "min_loss_scale": args.pop("min_loss_scale", 1.0),
                "max_loss_scale": args.pop("max_loss_scale", _NO_CEILING)}

    # -- apex's API -------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, update_master_grads: bool = True, retain_graph: bool = False) -> None:
        """``(loss * scale).backward()``; the gradients are unscaled into the masters unless
        ``update_master_grads=False`` (then call :meth:`update_master_grads` before ``step``)."""
        with self._handle.scale_loss(loss, [self._binding], 0, not update_master_grads) as scaled:
            scaled.backward(retain_graph=retain_graph)

    def update_master_grads(self) -> None:
        """Unscale gradients left scaled by ``backward(..., update_master_grads=False)``."""
        self._handle.unscale_delayed([self._binding])

    def _master_params_to_model_params(self) -> None:
        """apex's private copy of the FP32 masters into the fp16 model, which scripts call after
        writing the masters through ``.data`` (no version counter sees that).  No host sync."""
        self.optimizer._master_params_to_model_params()

    def step(self, closure: Any = None) -> Any:
        """Update (or skip, on overflow) and copy the masters into the model.  One host sync."""
        if closure is not None:
            raise NotImplementedError("FP16_Optimizer.step(closure) is not supported by ampinit: call backward() "
                                      "and then step()")
        flow = self._binding.flow
        # a device copy, read only if `overflow` is asked: Megatron's loop skips its LR
        # scheduler on `optimizer.overflow` right after a skipped step
        step_found_inf = flow.found_inf.clone() if flow.unscaled_since_step else None
        self._handle.update_scale_at_step(self._binding)
        result = self.optimizer.step()
        self._step_found_inf = step_found_inf
        return result

    def zero_grad(self, set_grads_to_None: bool = False) -> None:  # noqa: N803 (apex's name)
        self.optimizer.zero_grad(set_to_none=set_grads_to_None)

    def clip_master_grads(self, max_norm: float, norm_type: float = 2) -> float:
        """Clip the masters' gradients; returns their total norm, or -1 after an overflow (as
        apex).  Reads the overflow flag and the norm on the host."""
        if self.overflow:
            return -1
        self._materialize_master_grads()
        return float(torch.nn.utils.clip_grad_norm_(self._masters(), max_norm, norm_type))

    def inspect_master_grad_data(self) -> Optional[List[List[Optional[torch.Tensor]]]]:
        if self.overflow:
            return None
        self._materialize_master_grads()
        return [[None if p.grad is None else p.grad.data for p in group["params"]]
                for group in self.optimizer.param_groups]

    @property
    def overflow(self) -> bool:
        """Whether the latest unscaled gradients overflowed: those since the last step, or else
        those the last step used, so it reads True after a skipped step, as in apex (a host sync)."""
        flow = self._binding.flow
        if flow.unscaled_since_step:
            return bool(flow.found_inf.item())
        return self._step_found_inf is not None and bool(self._step_found_inf.item())

    @property
    def loss_scaler(self) -> _LiveLossScaler:
        """apex's ``loss_scaler`` attribute (``optimizer.loss_scaler.cur_scale``), live."""
        return _LiveLossScaler(self)

    @property
    def loss_scale(self) -> float:
        return self._scaler.loss_scale()

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self._scaler.set_scale(value)

    @property
    def param_groups(self) -> List[dict]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Dict[torch.Tensor, Any]:
        return self.optimizer.state

    def _materialize_master_grads(self) -> None:
        """A fused optimizer (``apex.optimizers.FusedAdam``) reads the model's gradients in its
        kernel and leaves the masters' ``.grad`` empty: unscale them there for code that reads
        or clips the masters' gradients, as ``amp.master_params`` does."""
        self._binding.flow.materialize_deferred()

    def _masters(self) -> List[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    @property
    def all_fp16_params(self) -> List[torch.Tensor]:
        return [model for model, master in self._binding.flow.pairs() if model is not master]

    @property
    def all_fp32_from_fp16_params(self) -> List[torch.Tensor]:
        return [master for model, master in self._binding.flow.pairs() if model is not master]

    @property
    def all_fp32_from_fp32_params(self) -> List[torch.Tensor]:
        return [master for model, master in self._binding.flow.pairs() if model is master]

    # apex's per-group lists (its param_groups order), for code that walks them
    def _groups(self, keep: str) -> List[List[torch.Tensor]]:
        model_of = {id(master): model for model, master in self._binding.flow.pairs()}
        groups = []
        for group in self.optimizer.param_groups:
            pairs = [(model_of.get(id(p), p), p) for p in group["params"]]
            if keep == "fp16":
                groups.append([model for model, master in pairs if model is not master])
            elif keep == "fp32_from_fp16":
                groups.append([master for model, master in pairs if model is not master])
            else:
                groups.append([master for model, master in pairs if model is master])
        return groups

    @property
    def fp16_groups(self) -> List[List[torch.Tensor]]:
        return self._groups("fp16")

    @property
    def fp32_from_fp16_groups(self) -> List[List[torch.Tensor]]:
        return self._groups("fp32_from_fp16")

    @property
    def fp32_from_fp32_groups(self) -> List[List[torch.Tensor]]:
        return self._groups("fp32_from_fp32")

    @property
    def dynamic_loss_scale(self) -> bool:
        return self._scaler.dynamic

    @dynamic_loss_scale.setter
    def dynamic_loss_scale(self, value: bool) -> None:
        """apex kept a plain attribute, which resumes set again to what it was (UniLM's
        ``optimizer.dynamic_loss_scale = True`` after ``load_state_dict``).  The scaler is
        chosen at construction: another value is refused, not taken silently."""
        if bool(value) != self._scaler.dynamic:
            mine = "dynamic" if self._scaler.dynamic else "static"
            raise ValueError(f"this FP16_Optimizer's loss scale is {mine}, chosen at construction; build it with "
                             f"dynamic_loss_scale={bool(value)} instead of switching it afterwards")

    def state_dict(self) -> Dict[str, Any]:
        """The optimizer's state, the loss scale's, and the FP32 masters as apex laid them out:
        ``fp32_from_fp16`` holds one list per param group of the live masters (sparse_learning
        masks them in place through it).  A host sync."""
        self._handle.put_masters_back(self.optimizer)  # parameters cast after the wrap (model.half())
        state = {"loss_scaler": self._scaler.state_dict(), "dynamic_loss_scale": self._scaler.dynamic,
                 "overflow": self.overflow, "first_closure_call_this_step": True,
                 "cur_iter": self.loss_scaler.cur_iter, "last_overflow_iter": self.loss_scaler.last_overflow_iter,
                 "optimizer_state_dict": self.optimizer.state_dict(),
                 "fp32_from_fp16": self.fp32_from_fp16_groups}
        if self._scaler.dynamic:  # apex's pickled scaler carried them; a load takes them back, as apex's
            state.update(scale_factor=self.loss_scaler.scale_factor, scale_window=self.loss_scaler.scale_window)
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output, or what apex's ``FP16_Optimizer.state_dict()``
        saved (its pickled ``LossScaler``/``DynamicLossScaler`` object, and ``fp32_from_fp16``
        as one list of masters per param group); the model takes the masters' rounding."""
        if not isinstance(state_dict, dict) or "optimizer_state_dict" not in state_dict:
            raise ValueError("not an FP16_Optimizer state_dict (no 'optimizer_state_dict')")
        scaler_state = state_dict.get("loss_scaler")
        # apex's scaler object (ours from apex.fp16_utils.loss_scaler, or a real apex's class).
        apex_scaler = not isinstance(scaler_state, dict) and hasattr(scaler_state, "cur_scale")
        counters = self._saved_counters(state_dict["loss_scaler"] if apex_scaler else state_dict)
        if apex_scaler:
            scaler_state = self._from_apex_scaler(scaler_state)
        masters = state_dict.get("fp32_from_fp16", [])
        if all(isinstance(group, (list, tuple)) for group in masters):  # apex: one list per param group
            masters = [master for group in masters for master in group]
        self._handle.put_masters_back(self.optimizer)  # parameters cast after the wrap (model.half())
        mine = self.all_fp32_from_fp16_params
        if "fp32_from_fp16" in state_dict and not masters and mine:
            # apex wrapped FP32 parameters and trained them as they were after model.half(): it
            # saved no masters.  Ours take the model's values, loaded before (apex's order).
            logger.info("ampinit: the FP16_Optimizer checkpoint has no FP32 masters (apex wrapped the parameters "
                        "before model.half()): the masters take the model's values")
            masters = [model.detach().float() for model in self.all_fp16_params]
        if len(masters) != len(mine) or any(a.shape != b.shape for a, b in zip(masters, mine)):
            raise ValueError(
                f"the checkpoint's fp32_from_fp16 masters ({len(masters)}) do not match this optimizer's "
                f"({len(mine)} parameters with FP32 masters, in param_groups order): build the optimizer over the "
                "same parameters, in the same order, as the run that saved it")
        if isinstance(scaler_state, dict):
            self._scaler.check_state_dict(scaler_state)
        schedule = None if apex_scaler else self._saved_schedule(state_dict)
        self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
        if apex_scaler:
            self._apply_apex_scaler(state_dict["loss_scaler"])
        elif schedule is not None:
            self._set_schedule(*schedule)
        if counters is not None:  # loss_scaler.cur_iter and last_overflow_iter go on from there
            self._binding.steps, last_overflow = counters
            self._binding.last_overflow_step = None if last_overflow < 0 else last_overflow
        if isinstance(scaler_state, dict):
            self._scaler.load_state_dict(scaler_state)
        else:
            logger.warning("ampinit: FP16_Optimizer checkpoint without a loss scaler state (%s); keeping the current "
                           "loss scale", type(scaler_state).__name__)
        with torch.no_grad():
            for master, value in zip(mine, masters):
                master.copy_(value)
        self._handle.masters.copy_to_model(mine)
        # apex restores `overflow` too (a checkpoint taken right after a skipped step says so)
        self._step_found_inf = torch.full((1,), float(bool(state_dict.get("overflow", False))),
                                          device=self._binding.flow.found_inf.device)

    @staticmethod
    def _saved_counters(saved: Any) -> Optional[Tuple[int, int]]:
        """``(cur_iter, last_overflow_iter)`` of a checkpoint (apex's scaler object holds them,
        ours has them as keys), checked; ``None`` where it has none."""
        read = saved.get if isinstance(saved, dict) else lambda key: getattr(saved, key, None)
        cur_iter, last_overflow = read("cur_iter"), read("last_overflow_iter")
        if cur_iter is None:
            return None
        last_overflow = -1 if last_overflow is None else last_overflow
        for name, value, low in (("cur_iter", cur_iter, 0), ("last_overflow_iter", last_overflow, -1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"FP16_Optimizer checkpoint: {name} must be an int >= {low}; got {value!r}")
        if last_overflow >= cur_iter:
            raise ValueError(f"FP16_Optimizer checkpoint: last_overflow_iter ({last_overflow}) must come before "
                             f"cur_iter ({cur_iter})")
        return cur_iter, last_overflow

    def _saved_schedule(self, state_dict: Dict[str, Any]) -> Optional[Tuple[float, int]]:
        """``(scale_factor, scale_window)`` of a dynamic scale this class's ``state_dict()``
        saved, checked; ``None`` where there is none to take (a static scale on either side,
        where the scale itself is handled as for a checkpoint without them)."""
        if "scale_factor" not in state_dict and "scale_window" not in state_dict:
            return None
        if not (self._scaler.dynamic and state_dict.get("dynamic_loss_scale")):
            return None
        return _checked_schedule(state_dict.get("scale_factor"), state_dict.get("scale_window"))

    @staticmethod
    def _is_dynamic_apex_scaler(scaler: Any) -> bool:
        return all(hasattr(scaler, key) for key in ("cur_iter", "last_overflow_iter", "scale_factor", "scale_window"))

    def _from_apex_scaler(self, scaler: Any) -> Dict[str, Any]:
        """The state dict of ampinit's scaler that continues apex's ``scaler`` object."""
        dynamic = self._is_dynamic_apex_scaler(scaler)
        if dynamic != self._scaler.dynamic:
            saved, mine = ("dynamic" if dynamic else "static"), ("dynamic" if self._scaler.dynamic else "static")
            raise ValueError(f"the checkpoint's loss scale is {saved} but this FP16_Optimizer's is {mine}; construct "
                             f"it with dynamic_loss_scale={dynamic} to load it")
        state: Dict[str, Any] = {"loss_scale": float(scaler.cur_scale), "unskipped": 0}
        if dynamic:
            _checked_schedule(scaler.scale_factor, scaler.scale_window)  # unpickling ran no __init__ checks
            # apex grows at the update where (cur_iter - last_overflow_iter) % scale_window == 0;
            # ampinit when its count of clean steps reaches the window.
            state["unskipped"] = (scaler.cur_iter - scaler.last_overflow_iter - 1) % scaler.scale_window
        return state

    def _apply_apex_scaler(self, scaler: Any) -> None:
        """apex replaced its scaler with the checkpoint's: take its factor and window, or its
        static scale, too."""
        if self._is_dynamic_apex_scaler(scaler):
            self._set_schedule(*_checked_schedule(scaler.scale_factor, scaler.scale_window))
        else:
            self._scaler.set_scale(float(scaler.cur_scale))

    def _set_schedule(self, factor: float, window: int) -> None:
        """A dynamic scale's ``scale_factor`` (growth and back-off) and ``scale_window``."""
        self._scaler.set_growth_interval(window)
        self._scaler.growth_factor = factor
        self._scaler.backoff_factor = 1.0 / factor

    def __getstate__(self) -> dict:
        raise RuntimeError("FP16_Optimizer should be serialized using state_dict().")

    def __repr__(self) -> str:
        return f"FP16_Optimizer({self.optimizer!r}, loss_scale={'dynamic' if self._scaler.dynamic else 'static'})"
