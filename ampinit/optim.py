"""Fused optimizers: one pass per parameter reads the gradient, unscales it, updates the param
and its state, and writes the low-precision model copy.

On their own they are drop-in ``torch.optim.Adam`` / ``AdamW`` / ``SGD`` for float32, float16
and bfloat16 params, computing what ``torch.optim.Adam/AdamW/SGD(fused=True)`` computes:
optimizer state (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``) in the param's dtype, all
arithmetic in float32, each stored value rounded once.  16-bit params are updated directly,
as apex's ``FusedAdam``/``FusedSGD`` did (O3, or a ``.half()`` model).

State dicts load both ways: a ``torch.optim.Adam/AdamW/SGD`` checkpoint continues exactly in
these optimizers, and theirs in torch's (``state_dict()`` gives torch's layout: ``step`` a CPU
float32 tensor unless capturable, a momentum buffer that was never applied saved as ``None``).

Under :func:`ampinit.initialize` at O2/O5 they read the model's scaled fp16/bf16 gradients
directly, unscale inside the kernel, skip the step on the device when the gradients
overflowed, and write the model weights in the same pass: with the compiled kernels (and with
the torch fallback), ``step()`` makes no host sync.  ``capturable=True`` keeps the
hyper-parameters in device tensors as well (see :class:`FusedAdam`), so a whole step can be
captured in a CUDA graph and LR schedulers keep working across replays.

Names and defaults follow apex's ``apex.optimizers``: :class:`FusedAdam` is AdamW unless
``adam_w_mode=False``, as in apex.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from . import ops

__all__ = ["FusedAdam", "FusedAdamW", "FusedSGD"]


class _FusedOptimizer(torch.optim.Optimizer):
    """What the fused optimizers share: grouping params per call, the two ways to step,
    state-dict compatibility with torch.optim, and device-resident hyper-parameters."""

    # Tells ampinit's optimizer wrapper that step() takes scaled model gradients and found_inf.
    _ampinit_fused = True
    # Group keys of torch.optim checkpoints that these kernels cannot honour: key -> the only
    # accepted value.
    _REFUSED: Dict[str, Any] = {"maximize": False}
    # Settings kept as attributes rather than in the param groups: pickled (copy.deepcopy,
    # torch.save of the optimizer) along with torch's state, which would leave them out.
    _SETTINGS: Tuple[str, ...] = ()

    def __init__(self, params, defaults: dict):
        super().__init__(params, defaults)
        self._constants: Dict[torch.device, Tuple[torch.Tensor, torch.Tensor]] = {}

    def __getstate__(self) -> Dict[str, Any]:
        state = super().__getstate__()
        state.update({name: self.__dict__[name] for name in self._SETTINGS if name in self.__dict__})
        return state

    # -- loading and saving --------------------------------------------------------------
    def __setstate__(self, state: dict) -> None:
        """Also run by ``load_state_dict``: loaded param groups replace ours, so keys a
        ``torch.optim`` checkpoint lacks come from our defaults, and settings the fused
        kernels cannot follow are refused."""
        super().__setstate__(state)
        self.__dict__.setdefault("_constants", {})
        for index, group in enumerate(self.param_groups):
            for key, value in self.defaults.items():
                group.setdefault(key, value)
            self._check_loaded_group(index, group)

    def _check_loaded_group(self, index: int, group: dict) -> None:
        """A group ``__setstate__`` took (pickled, or loaded): refuse it, or settle it."""
        self._check_group(index, group, saved=True)

    def _check_group(self, index: int, group: dict, saved: bool) -> None:
        """Refuse a param group (every key filled) that the fused kernels cannot step as it asks:
        ``saved`` from a checkpoint, else one ``add_param_group`` got.  Changes nothing."""
        for key, accepted in self._REFUSED.items():
            if bool(group.get(key, accepted)) != accepted:
                raise ValueError(self._refusal(
                    index, saved, f"{key}={group[key]!r}, which the fused kernels do not implement",
                    f"leave {key} out of the group, or train it with a torch.optim optimizer"))

    def _refusal(self, index: int, saved: bool, what: str, instead: str) -> str:
        if saved:
            return (f"{type(self).__name__} cannot continue param group {index}: it was saved with {what}. Load it "
                    "into the torch.optim optimizer that saved it; nothing was loaded")
        return f"{type(self).__name__}.add_param_group: the new group has {what}; {instead}"

    def add_param_group(self, param_group: dict) -> None:
        """``torch.optim``'s, refusing first (before the group is added) settings the fused
        kernels would not follow: a group with ``maximize=True`` would descend, one with
        ``amsgrad=True`` step without it."""
        if isinstance(param_group, dict):
            self._check_group(len(self.param_groups), {**self.defaults, **param_group}, saved=False)
        super().add_param_group(param_group)

    def state_dict(self) -> Dict[str, Any]:
        """``torch.optim``'s layout, loadable by ``torch.optim.Adam/AdamW/SGD`` and by these
        optimizers: ``step`` is a CPU float32 tensor unless the group is capturable (torch
        keeps it on the device only then).  Reads the device steps: one sync, here only."""
        state_dict = super().state_dict()
        capturable = {index: bool(group.get("capturable", False))
                      for group in state_dict["param_groups"] for index in group["params"]}
        packed = {}
        for index, param_state in state_dict["state"].items():
            # Fresh dicts: the ones torch returns are our live per-param state.
            param_state = self._saved_param_state(dict(param_state))
            step = param_state.get("step")
            if isinstance(step, torch.Tensor) and not capturable.get(index, False):
                param_state["step"] = step.detach().to("cpu", torch.float32).reshape(())
            packed[index] = param_state
        state_dict["state"] = packed
        return state_dict

    def _saved_param_state(self, param_state: dict) -> dict:
        return param_state

    # -- stepping -------------------------------------------------------------------------
    def _unit_flags(self, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(inv_scale=1, found_inf=0)`` on ``device``, made once per device."""
        flags = self._constants.get(device)
        if flags is None:
            flags = self._constants[device] = (torch.ones(1, device=device), torch.zeros(1, device=device))
        return flags

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):
        """One update from each param's ``.grad``.  No host sync with the compiled kernels.

        Under ``ampinit.initialize`` the step's scaled gradients, overflow flag and model
        parameters come from ampinit (``_ampinit_step_inputs``, set for this one call)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._amp_update(**self.__dict__.pop("_ampinit_step_inputs", {}))
        return loss

    @torch.no_grad()
    def _amp_update(self, found_inf: Optional[torch.Tensor] = None, inv_scale: Optional[torch.Tensor] = None,
                    scaled_grads: Optional[Dict[torch.Tensor, torch.Tensor]] = None,
                    model_of: Optional[Dict[torch.Tensor, torch.Tensor]] = None,
                    remainders: Optional[Dict[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]] = None) -> None:
        """The update, as ampinit drives it: ``scaled_grads[p]`` (multiplied by ``inv_scale``)
        replaces ``p.grad``; ``model_of[p]`` receives the new value of ``p``; ``remainders[p]``
        (remainder masters) makes bfloat16 ``p`` an FP32 master with them; nothing changes if
        ``found_inf`` is set."""
        scaled_grads = scaled_grads or {}
        model_of = model_of or {}
        remainders = remainders or {}
        work = self._gradients(scaled_grads, set(model_of.values()))  # every check before any update
        for group, rows in zip(self.param_groups, work):
            calls: Dict[tuple, Tuple[List[torch.Tensor], List[torch.Tensor], List[torch.Tensor]]] = {}
            for param, grad, scaled in rows:
                model = model_of.get(param)
                parts = remainders.get(param)
                key = (param.device, scaled, model is not None, parts is not None)
                params, grads, models, rests = calls.setdefault(key, ([], [], [], []))
                params.append(param)
                grads.append(grad)
                if model is not None:
                    models.append(model)
                if parts is not None:
                    rests.append(parts)
            for (device, scaled, _, _), (params, grads, models, rests) in calls.items():
                unit_inv, zero_found = self._unit_flags(device)
                self._update(group, params, grads, models,
                             inv_scale if scaled else unit_inv,
                             found_inf if found_inf is not None else zero_found,
                             [r for r, _ in rests], [t for _, t in rests])

    def _gradients(self, scaled_grads: Dict[torch.Tensor, torch.Tensor], models: set) \
            -> List[List[Tuple[torch.Tensor, torch.Tensor, bool]]]:
        """Per group, ``(param, grad, scaled)`` of each param with a gradient (``scaled_grads[p]``
        before ``p.grad``), every param checked first: a clear error leaves every group as it was.
        ``models``: the model parameters whose masters ampinit put in the groups."""
        work, seen = [], {}
        for g, group in enumerate(self.param_groups):
            rows = []
            for i, param in enumerate(group["params"]):
                if param in models:
                    raise RuntimeError(
                        f"{type(self).__name__}: param_groups[{g}]['params'][{i}] is a 16-bit model parameter whose "
                        "FP32 master this optimizer already updates (ampinit put the master in its place); it would "
                        "be updated twice.  Add parameters with optimizer.add_param_group, which ampinit handles")
                if param in seen:
                    raise RuntimeError(
                        f"{type(self).__name__}: param_groups[{g}]['params'][{i}] is the same parameter as "
                        f"param_groups[{seen[param][0]}]['params'][{seen[param][1]}]; torch.optim would update it "
                        "once per listing, the fused kernels once per step: list each parameter once")
                seen[param] = (g, i)
                grad = scaled_grads.get(param)
                scaled = grad is not None
                if grad is None:
                    grad = param.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients; "
                                       "use torch.optim.SparseAdam for sparse embeddings")
                if param.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                    raise TypeError(f"{type(self).__name__} updates float32, float16 and bfloat16 params; got a "
                                    f"{param.dtype} param. Use the torch.optim optimizer for it")
                for key, value in self.state.get(param, {}).items():
                    if key in _PER_ELEMENT_STATE and isinstance(value, torch.Tensor) and value.shape != param.shape:
                        raise RuntimeError(
                            f"{type(self).__name__}: state {key!r} of param_groups[{g}]['params'][{i}] has shape "
                            f"{tuple(value.shape)}, the param {tuple(param.shape)}: the loaded state_dict belongs "
                            "to other parameters (torch's load_state_dict matches them by position only)")
                rows.append((param, grad, scaled))
            work.append(rows)
        self._check_update([param for rows in work for param, _, _ in rows])
        return work

    def _check_update(self, params: List[torch.Tensor]) -> None:
        """Raise for a param these kernels cannot update, before any param is updated."""

    def _step_tensor(self, param: torch.Tensor) -> torch.Tensor:
        state = self.state[param]
        step = state.get("step")
        if not isinstance(step, torch.Tensor) or step.device != param.device or step.dtype != torch.float32:
            # New, or loaded from a torch.optim checkpoint (which keeps "step" on the CPU).
            # torch.full: a fill kernel, where torch.tensor would copy from pageable memory.
            value = 0.0 if step is None else float(step)
            step = state["step"] = torch.full((), value, dtype=torch.float32, device=param.device)
        return step

    def _state_tensor(self, param: torch.Tensor, key: str, dtype: torch.dtype) -> torch.Tensor:
        """``state[key]`` in ``dtype`` (the param's, float32 or bfloat16: the kernels'
        contract), zeros when new."""
        state = self.state[param]
        value = state.get(key)
        if value is None:
            value = state[key] = torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)
        elif value.dtype != dtype or value.device != param.device:
            value = state[key] = value.to(device=param.device, dtype=dtype)
        return value

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """``torch.optim``'s loading, except that floating-point state keeps the precision it was
        saved in (torch casts it to each param's dtype, which would round a bfloat16 param's FP32
        moments: remainder masters; each step then uses the state dtype it needs), and the state
        is a copy (torch keeps the checkpoint's tensors where no cast is needed, and the kernels
        update them in place: the checkpoint would change as training goes on)."""
        for index, group in enumerate(state_dict.get("param_groups", ())):  # refused before anything changes
            if isinstance(group, dict):
                self._check_group(index, {**self.defaults, **group}, saved=True)
        saved = {}
        for index, param_state in state_dict.get("state", {}).items():
            if isinstance(param_state, dict):
                saved[index] = {key: value for key, value in param_state.items() if isinstance(value, torch.Tensor)}
        super().load_state_dict(state_dict)
        ids = [index for group in state_dict["param_groups"] for index in group["params"]]
        params = [param for group in self.param_groups for param in group["params"]]
        for index, param in zip(ids, params):
            state = self.state.get(param, {})
            for key, value in saved.get(index, {}).items():
                loaded = state.get(key)
                if not isinstance(loaded, torch.Tensor):
                    continue
                if key != "step" and value.is_floating_point() and loaded.dtype != value.dtype and \
                        value.element_size() > loaded.element_size():
                    state[key] = value.to(device=param.device, copy=True)
                elif loaded.data_ptr() == value.data_ptr():
                    state[key] = loaded.clone()

    # -- device-resident hyper-parameters (capturable=True) ----------------------------------
    def _device_scalar(self, group: dict, key: str, value: Any, device: torch.device) -> torch.Tensor:
        """``value`` as a float64 0-dim tensor on ``device``: kept as is when it already is one
        (so in-place updates, like LR schedulers' ``fill_``, reach the kernels), else made once
        (``torch.full``: a fill kernel, no host-to-device copy) and stored back by the caller."""
        if isinstance(value, torch.Tensor):
            if value.device == device and value.dtype == torch.float64 and value.dim() == 0:
                return value
            return value.detach().to(device=device, dtype=torch.float64).reshape(())
        return torch.full((), float(value), dtype=torch.float64, device=device)

    def _hyper(self, group: dict, device: torch.device) -> Optional[torch.Tensor]:
        """The float64 hyper-parameter vector the kernels read on the device (capturable
        groups), else ``None``.  Built by one ``torch.stack`` of the group's tensors: under
        CUDA-graph replay the stack re-reads them."""
        if not group.get("capturable", False):
            return None
        values = []
        for key in self._HYPER_KEYS:
            tensor = self._device_scalar(group, key, _get_hyper(group, key), device)
            _set_hyper(group, key, tensor)
            values.append(tensor)
        return torch.stack(values)

    _HYPER_KEYS: Sequence[str] = ()

    def _update(self, group: dict, params: List[torch.Tensor], grads: List[torch.Tensor],
                models: List[torch.Tensor], inv_scale: torch.Tensor, found_inf: torch.Tensor,
                remainders: List[torch.Tensor], ties: List[torch.Tensor]) -> None:
        raise NotImplementedError

    def _master_state_dtype(self, param: torch.Tensor, remainders: List[torch.Tensor]) -> torch.dtype:
        """The state dtype of the master: float32 for remainder masters (bfloat16 params that
        stand for FP32 masters), else the param's."""
        return torch.float32 if remainders else param.dtype


# The state that holds one value per element of its param (the others are per-param scalars).
_PER_ELEMENT_STATE = ("exp_avg", "exp_avg_sq", "momentum_buffer")


def _get_hyper(group: dict, key: str):
    """``group[key]``, with ``beta1``/``beta2`` inside ``group["betas"]``."""
    if key in ("beta1", "beta2"):
        return group["betas"][0 if key == "beta1" else 1]
    return group[key]


def _set_hyper(group: dict, key: str, value) -> None:
    if key in ("beta1", "beta2"):
        betas = list(group["betas"])
        index = 0 if key == "beta1" else 1
        if betas[index] is not value:
            betas[index] = value
            group["betas"] = tuple(betas)
    elif group[key] is not value:
        group[key] = value


def _host_float(value) -> float:
    """A hyper-parameter as a Python float (reads a device tensor: used on the non-capturable
    path and at construction only)."""
    return float(value)


def _check_hyper(lr: float, eps: Optional[float] = None, weight_decay: float = 0.0,
                 betas: Optional[Tuple[float, float]] = None, momentum: float = 0.0) -> None:
    lr, weight_decay, momentum = _host_float(lr), _host_float(weight_decay), _host_float(momentum)
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if eps is not None and not 0.0 <= _host_float(eps):
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if not 0.0 <= momentum:
        raise ValueError(f"Invalid momentum value: {momentum}")
    if betas is not None and not all(0.0 <= _host_float(beta) < 1.0 for beta in betas):
        raise ValueError(f"Invalid betas: {betas}; each must be in [0, 1)")


class FusedAdam(_FusedOptimizer):
    """Adam/AdamW in one fused pass per parameter (apex's ``FusedAdam``).

    Args:
        params: float32, float16 or bfloat16 parameters (under ``initialize`` at O2/O5: the
            model's, as usual).  16-bit params are updated directly, with 16-bit state.
        lr, betas, eps, weight_decay: as in ``torch.optim.Adam``.
        bias_correction: apply Adam's bias corrections (apex's flag).
        adam_w_mode: decoupled weight decay (AdamW), apex's default; ``False`` gives
            ``torch.optim.Adam``'s L2 penalty.
        amsgrad: not supported (as in apex); raises ``ValueError``.
        state_dtype: ``torch.bfloat16`` keeps ``exp_avg``/``exp_avg_sq`` in bfloat16 (4 bytes per
            parameter instead of 8): each step reads them into float32, computes as usual and
            rounds them once, stochastically (unbiased; the noise is a hash of the step, the
            moment and the element's position in the param's memory order, so a run and its resume
            round the same way, and every backend draws the same noise; a resume with another memory format rounds
            differently from there on).  To nearest, ``0.999 * exp_avg_sq`` would round back to
            itself and never decay.
            ``None`` (default): the master's dtype (float32 under ``initialize`` at O2/O5, the
            param's otherwise).  ``state_dict()`` saves them in bfloat16;
            ``torch.optim.AdamW.load_state_dict`` upcasts them to its params' dtype.
        capturable: keep ``lr``, ``betas``, ``eps`` and ``weight_decay`` as float64 device
            tensors in the param group (made at the first step), which the kernels read on the
            device: a step captured in a CUDA graph sees later in-place changes (LR
            schedulers ``fill_`` a tensor ``lr``).  Replacing a group's value with a Python
            float also works in eager steps, but a graph replay keeps the tensor it captured.

    Loading a ``torch.optim.Adam``/``AdamW`` state dict continues it exactly; one saved with
    ``amsgrad=True``, ``maximize=True``, or (with weight decay) a ``decoupled_weight_decay``
    that contradicts ``adam_w_mode`` raises ``ValueError``.  So does loading one saved by apex's
    ``FusedAdam``, which keeps a single step count per param group (``param_groups[i]['step']``)
    and only ``exp_avg``/``exp_avg_sq`` per param: each param with saved moments but no step of
    its own takes its group's step, so bias correction continues where apex left it.
    """

    _HYPER_KEYS = ("lr", "beta1", "beta2", "eps", "weight_decay")
    _REFUSED = {"maximize": False, "amsgrad": False}

    def __init__(self, params: Iterable, lr: float = 1e-3, bias_correction: bool = True,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True,
                 capturable: bool = False, state_dtype: Optional[torch.dtype] = None):
        if state_dtype not in (None, torch.float32, torch.bfloat16):
            raise ValueError(f"state_dtype must be None (the master's dtype), torch.float32 or torch.bfloat16; "
                             f"got {state_dtype!r}")
        if amsgrad:
            raise ValueError(f"{type(self).__name__} does not support AMSGrad; use torch.optim.Adam(amsgrad=True)")
        _check_hyper(lr, eps, weight_decay, tuple(betas))
        self.adam_w_mode = bool(adam_w_mode)
        # amsgrad/maximize/decoupled_weight_decay: torch.optim.Adam's keys, so that our state
        # dicts continue exactly there too.
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, amsgrad=False, maximize=False,
                        decoupled_weight_decay=self.adam_w_mode, capturable=bool(capturable))
        super().__init__(params, defaults)
        self.set_grad_none = set_grad_none
        self.state_dtype = state_dtype

    _SETTINGS = ("adam_w_mode", "set_grad_none", "state_dtype")

    def __setstate__(self, state: dict) -> None:
        if "adam_w_mode" not in self.__dict__ and "adam_w_mode" not in state:  # pickled without it
            state = {**state, "adam_w_mode": bool(state["defaults"].get("decoupled_weight_decay", True))}
        super().__setstate__(state)
        if "state_dtype" not in self.__dict__:  # pickled without it: bfloat16 moments of FP32 params tell
            self.state_dtype = torch.bfloat16 if any(
                isinstance(entry.get("exp_avg"), torch.Tensor) and entry["exp_avg"].dtype == torch.bfloat16
                and param.dtype == torch.float32 for param, entry in self.state.items()) else None
        self.__dict__.setdefault("set_grad_none", True)

    def _check_loaded_group(self, index: int, group: dict) -> None:
        super()._check_loaded_group(index, group)
        self._adopt_group_step(group)
        group["decoupled_weight_decay"] = self.adam_w_mode

    def _check_group(self, index: int, group: dict, saved: bool) -> None:
        super()._check_group(index, group, saved)
        decoupled = bool(group.get("decoupled_weight_decay", self.adam_w_mode))
        if decoupled != self.adam_w_mode and _host_float(group["weight_decay"]) != 0.0:
            kind = "torch.optim.AdamW or FusedAdam(adam_w_mode=True)" if decoupled else \
                "torch.optim.Adam or FusedAdam(adam_w_mode=False)"
            raise ValueError(self._refusal(
                index, saved, f"decoupled_weight_decay={decoupled} ({kind}) and weight_decay="
                f"{group['weight_decay']}, but this optimizer has adam_w_mode={self.adam_w_mode} for every group",
                f"construct a second optimizer with adam_w_mode={decoupled} for it"))

    def state_dict(self) -> Dict[str, Any]:
        """As :meth:`_FusedOptimizer.state_dict`; a group that keeps apex's ``step`` count (a
        subclass that overrides ``step()``, see :meth:`_adopt_group_step`) but was stepped by
        this class's update (the override calls ``super().step()``) takes its params' count
        first, so that the count saved is not the one loaded."""
        self._catch_up_group_steps()
        return super().state_dict()

    def __getstate__(self) -> Dict[str, Any]:
        self._catch_up_group_steps()  # pickling and deepcopy save the groups too
        return super().__getstate__()

    def _catch_up_group_steps(self) -> None:
        if self.__dict__.get("_group_step_behind"):
            for group in self.param_groups:
                steps = [self.state[param]["step"] for param in group["params"]
                         if isinstance(self.state.get(param, {}).get("step"), torch.Tensor)]
                if "step" in group and steps:
                    count = int(torch.stack([step.to(steps[0].device) for step in steps]).max())  # a sync
                    old = group["step"]  # keeps its type: a tensor, an int (apex's) or a float
                    group["step"] = old.new_tensor(count) if isinstance(old, torch.Tensor) else type(old)(count)
            del self.__dict__["_group_step_behind"]

    def _adopt_group_step(self, group: dict) -> None:
        """An apex ``FusedAdam`` checkpoint counts steps per group: give that count to each of
        the group's params that has saved moments but no ``step`` (torch's per-param layout),
        then drop the group key, which would otherwise go stale as the params step on."""
        if "step" not in group:
            return
        # a subclass written for apex's FusedAdam that steps itself (fairseq's FusedAdamV2) keeps
        # its count in the group, as apex's load (torch's) left it
        own = getattr(type(self), "_ampinit_base", type(self))  # under initialize: the user's class
        step = group["step"] if own.step is not FusedAdam.step else group.pop("step")
        value = float(step.detach().reshape(-1)[0]) if isinstance(step, torch.Tensor) else float(step)
        for param in group["params"]:
            state = self.state.get(param)
            if state and "exp_avg" in state and state.get("step") is None:
                state["step"] = torch.tensor(value, dtype=torch.float32)

    # -- what subclasses written for apex's FusedAdam read (fairseq's FusedAdamV2 overrides step()
    # and calls multi_tensor_applier(self.multi_tensor_adam, self._dummy_overflow_buf, ...)) --
    @property
    def multi_tensor_adam(self) -> Callable[..., None]:
        """apex's ``amp_C.multi_tensor_adam`` (ampinit's emulation), as apex's ``FusedAdam`` has it."""
        from .apex.amp_C import multi_tensor_adam
        return multi_tensor_adam

    @property
    def _dummy_overflow_buf(self) -> torch.Tensor:
        """apex's ``FusedAdam._dummy_overflow_buf``: a 1-element int32 zero on the params' device."""
        buffer = self.__dict__.get("_apex_overflow_buf")
        if buffer is None:
            device = self.param_groups[0]["params"][0].device
            buffer = self.__dict__["_apex_overflow_buf"] = torch.zeros(1, dtype=torch.int32, device=device)
        return buffer

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    def _moment_dtype(self, param: torch.Tensor, remainders: List[torch.Tensor]) -> torch.dtype:
        dtype = self.state_dtype or self._master_state_dtype(param, remainders)
        if param.dtype == torch.float16 and dtype == torch.bfloat16:
            raise TypeError(f"{type(self).__name__}(state_dtype=torch.bfloat16) keeps the moments of float32 and "
                            "bfloat16 params in bfloat16; this param is float16.  Give it float32 masters "
                            "(ampinit O2) or use state_dtype=None")
        return dtype

    def _check_update(self, params: List[torch.Tensor]) -> None:
        for param in params:
            self._moment_dtype(param, [])

    def _update(self, group, params, grads, models, inv_scale, found_inf, remainders, ties) -> None:
        if "step" in group:  # kept for a subclass's own step() (see state_dict); counted per param here
            self.__dict__["_group_step_behind"] = True
        dtypes = [self._moment_dtype(param, remainders) for param in params]
        exp_avgs = [self._state_tensor(param, "exp_avg", dtype) for param, dtype in zip(params, dtypes)]
        exp_avg_sqs = [self._state_tensor(param, "exp_avg_sq", dtype) for param, dtype in zip(params, dtypes)]
        steps = [self._step_tensor(param) for param in params]
        hyper = self._hyper(group, params[0].device)
        if hyper is None:
            beta1, beta2 = (_host_float(beta) for beta in group["betas"])
            lr, eps, weight_decay = (_host_float(group[key]) for key in ("lr", "eps", "weight_decay"))
        else:  # read from `hyper` on the device; the floats are placeholders
            lr = beta1 = beta2 = eps = weight_decay = 0.0
        ops.fused_adam_(params, grads, exp_avgs, exp_avg_sqs, steps, models, lr=lr, beta1=beta1, beta2=beta2,
                        eps=eps, weight_decay=weight_decay, decoupled_weight_decay=self.adam_w_mode,
                        bias_correction=group["bias_correction"], inv_scale=inv_scale, found_inf=found_inf,
                        hyper=hyper, remainders=remainders, ties=ties,
                        stochastic_state_rounding=self.state_dtype == torch.bfloat16)


class FusedAdamW(FusedAdam):
    """AdamW (decoupled weight decay) in one fused pass; matches ``torch.optim.AdamW``."""

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, bias_correction: bool = True,
                 capturable: bool = False, state_dtype: Optional[torch.dtype] = None):
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         adam_w_mode=True, weight_decay=weight_decay, capturable=capturable, state_dtype=state_dtype)


# The state key of FusedSGD's per-param flag (a 1-element float32 device tensor): nonzero while
# the momentum buffer has never been applied.  Never saved: state_dict() writes such a buffer
# as None, torch.optim.SGD's "no buffer yet".
_NEW_BUFFER = "momentum_buffer_is_new"


class FusedSGD(_FusedOptimizer):
    """SGD with momentum, dampening, nesterov and weight decay in one fused pass per parameter;
    matches ``torch.optim.SGD`` (and apex's ``FusedSGD`` with its defaults) for float32,
    float16 and bfloat16 params.

    As in torch, a param without a momentum buffer gets the gradient as its buffer; one loaded
    from a ``torch.optim.SGD`` checkpoint is updated.  Whether a new buffer was applied is
    decided on the device (a skipped step leaves it new), so stepping never syncs.

    ``capturable=True`` keeps ``lr``, ``momentum``, ``dampening`` and ``weight_decay`` as
    float64 device tensors (see :class:`FusedAdam`); whether the group has momentum buffers
    at all is fixed by its momentum when it became a tensor.
    """

    _HYPER_KEYS = ("lr", "momentum", "dampening", "weight_decay")

    def __init__(self, params: Iterable, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, wd_after_momentum: bool = False,
                 materialize_master_grads: bool = True, set_grad_none: bool = False, capturable: bool = False):
        _check_hyper(lr, weight_decay=weight_decay, momentum=momentum)
        if nesterov and (_host_float(momentum) <= 0 or _host_float(dampening) != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        if wd_after_momentum:
            raise ValueError("FusedSGD(wd_after_momentum=True) is not supported; weight decay is added to the "
                             "gradient before momentum, as torch.optim.SGD does")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=False, capturable=bool(capturable))
        # id(momentum tensor) -> (the tensor, whether the group has momentum buffers): decided
        # once per tensor, so a capturable step never reads the momentum on the host.
        self._momentum_structure: Dict[int, Tuple[torch.Tensor, bool]] = {}
        super().__init__(params, defaults)
        self.set_grad_none = set_grad_none

    _SETTINGS = ("set_grad_none",)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_momentum_structure", {})
        self.__dict__.setdefault("set_grad_none", False)

    def _check_group(self, index: int, group: dict, saved: bool) -> None:
        super()._check_group(index, group, saved)
        # a group given at construction or added may differ from the defaults, as torch.optim.SGD
        # allows (it checks only its own arguments: a group with momentum 0 steps as plain SGD)
        if saved and group.get("nesterov") and \
                (_host_float(group["momentum"]) <= 0 or _host_float(group["dampening"]) != 0):
            raise ValueError(f"param group {index}: Nesterov momentum requires a momentum and zero dampening; "
                             "nothing was loaded")

    def _has_momentum(self, group: dict) -> bool:
        momentum = group["momentum"]
        if not isinstance(momentum, torch.Tensor):
            return momentum != 0
        known = self._momentum_structure.get(id(momentum))
        if known is None or known[0] is not momentum:
            known = self._momentum_structure[id(momentum)] = (momentum, bool(momentum != 0))
        return known[1]

    def _hyper(self, group: dict, device: torch.device) -> Optional[torch.Tensor]:
        momentum = group["momentum"]
        if group.get("capturable", False) and not isinstance(momentum, torch.Tensor):
            has_momentum = momentum != 0
            hyper = super()._hyper(group, device)
            self._momentum_structure[id(group["momentum"])] = (group["momentum"], has_momentum)
            return hyper
        return super()._hyper(group, device)

    def _saved_param_state(self, param_state: dict) -> dict:
        """A buffer that was never applied is saved as ``None`` (torch's "no buffer yet");
        reads its device flag."""
        flag = param_state.pop(_NEW_BUFFER, None)
        if flag is not None and bool(flag.item()):
            param_state["momentum_buffer"] = None
        return param_state

    def _buffers(self, params: List[torch.Tensor], remainders: List[torch.Tensor]) \
            -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """Each param's momentum buffer (the master's dtype) and new-buffer flag, made where missing."""
        buffers, flags = [], []
        for param in params:
            state = self.state[param]
            is_new = state.get("momentum_buffer") is None
            buffers.append(self._state_tensor(param, "momentum_buffer", self._master_state_dtype(param, remainders)))
            flag = state.get(_NEW_BUFFER)
            if is_new or flag is None or flag.device != param.device:
                # torch's rule: no buffer yet (or None, as torch saves it) -> the gradient; a
                # buffer without a flag was loaded, so it was applied.
                flag = state[_NEW_BUFFER] = torch.full((1,), float(is_new), device=param.device)
            flags.append(flag)
        return buffers, flags

    def _update(self, group, params, grads, models, inv_scale, found_inf, remainders, ties) -> None:
        steps = [self._step_tensor(param) for param in params]
        hyper = self._hyper(group, params[0].device)
        has_momentum = self._has_momentum(group)
        buffers, flags = self._buffers(params, remainders) if has_momentum else ([], [])
        if hyper is None:
            lr, momentum, dampening, weight_decay = (_host_float(group[key]) for key in self._HYPER_KEYS)
        else:  # read from `hyper` on the device; the floats are placeholders
            lr, momentum, dampening, weight_decay = 0.0, float(has_momentum), 0.0, 0.0
        ops.fused_sgd_(params, grads, buffers, steps, models, lr=lr, momentum=momentum, dampening=dampening,
                       weight_decay=weight_decay, nesterov=group["nesterov"], inv_scale=inv_scale,
                       found_inf=found_inf, new_buffer_flags=flags, hyper=hyper, remainders=remainders, ties=ties)
