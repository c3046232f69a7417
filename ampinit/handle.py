"""``AmpHandle``: everything one ``initialize`` call set up, owned by objects the user holds.

The handle is reachable from the optimizer (``optimizer.amp``) and from the model (through
its hooks); module-level state holds at most a weak reference to the latest one, so any
number of initializations coexist and a dropped model frees its handle.  :meth:`AmpHandle.end` undoes an initialization.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch
from torch import nn

from . import distributed
from . import optimizer as amp_optimizer
from .casting import ModelCasting
from .master import OptimizerMasters
from .opt_levels import AmpConfig
from .scaler import LossScaler

__all__ = ["AmpHandle"]

logger = logging.getLogger("ampinit")
_MODEL_ATTR = "_ampinit_handle"
STATE_VERSION = 1
_RATE_LIMIT_AFTER = 8  # overflow messages: the first 8, then every power of two
DEFAULT_MAX_SKIPS_AT_FLOOR = 16


def handle_of_model(model: nn.Module) -> Optional["AmpHandle"]:
    return model.__dict__.get(_MODEL_ATTR)


class OptimizerBinding:
    """One optimizer's link to its handle: masters, found-inf flag, step counters."""

    def __init__(self, handle: "AmpHandle", optimizer: torch.optim.Optimizer, masters: OptimizerMasters,
                 index: int):
        self.handle = handle
        self.optimizer = optimizer
        self.masters = masters
        self.index = index
        self.steps = 0
        self._skipped_steps = 0
        self._last_overflow_step: Optional[int] = None
        self._last_overflow_params: List[str] = []
        self.skips_at_floor = 0      # consecutive skips leaving every scaler involved at its floor
        self.loss_ids_since_step: set = set()
        # Fused optimizers decide the skip on the device.  Each step's flags are copied to the
        # host without waiting; the counters above catch up when the copy has landed (checked
        # at the next step) or when someone reads them (a sync then).
        self._unresolved: collections.deque = collections.deque()

    # Counters that fused steps may still owe: reading them settles every step so far.
    @property
    def skipped_steps(self) -> int:
        self.resolve_fused_steps(wait=True)
        return self._skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._skipped_steps = value

    @property
    def last_overflow_step(self) -> Optional[int]:
        self.resolve_fused_steps(wait=True)
        return self._last_overflow_step

    @last_overflow_step.setter
    def last_overflow_step(self, value: Optional[int]) -> None:
        self._last_overflow_step = value

    @property
    def last_overflow_params(self) -> List[str]:
        self.resolve_fused_steps(wait=True)
        return self._last_overflow_params

    @last_overflow_params.setter
    def last_overflow_params(self, value: List[str]) -> None:
        self._last_overflow_params = value

    def check_ready_for_step(self) -> None:
        if self.masters.pending_scaled:
            raise RuntimeError(
                "optimizer.step() was called while gradients are still scaled: the last "
                "scale_loss used delay_unscale=True.  Pass delay_unscale=False to the last "
                "scale_loss before step()")
        if not self.masters.unscaled_since_step:
            for model, master in self.masters.pairs():
                if model is not master and model.grad is not None and master.grad is None:
                    raise RuntimeError(
                        "optimizer.step() found gradients on the model's low-precision "
                        "parameters but none on the FP32 master weights it updates: run the "
                        "backward inside `with ampinit.scale_loss(loss, optimizer) as "
                        "scaled_loss: scaled_loss.backward()`")

    def nonfinite_param_names(self) -> List[str]:
        """Names of the parameters whose (unscaled) gradients hold inf/NaN.  One extra pass
        over the gradients and one sync: called only when a step is skipped."""
        names, flags = [], []
        for model, master in self.masters.pairs():
            grad = master.grad if master.grad is not None else model.grad
            if grad is None:
                continue
            grad = distributed.local(grad)  # FSDP2: this rank's shard
            values = grad._values() if grad.is_sparse else grad
            names.append(self.handle.param_name(model))
            flags.append(torch.logical_not(torch.isfinite(values).all()))
        if not flags:
            return []
        return [name for name, bad in zip(names, torch.stack(flags).tolist()) if bad]

    def skip_step(self) -> None:
        """Skip this step: record which parameters overflowed, drop every gradient, and
        raise if the overflow persists at the scale floor (a NaN bug, not an overflow)."""
        names = self.nonfinite_param_names()
        loss_ids = set(self.loss_ids_since_step)
        step = self.steps
        self.steps += 1
        self.masters.drop_all_grads()
        self._end_step()
        self._count_skip(step, names, loss_ids)

    def fused_step(self) -> None:
        """step() of a fused optimizer: the kernel reads the scaled model gradients, skips on
        found_inf by itself and writes the model weights.  No host sync; the skip is counted
        once its flag reaches the host (:meth:`resolve_fused_steps`)."""
        self.resolve_fused_steps(wait=False)
        masters = self.masters
        if masters.unscaled_since_step:
            self.optimizer._amp_update(masters.found_inf, masters.deferred_inv_scale, masters.deferred,
                                       masters._model_of)
            self._unresolved.append(self._flags_on_host())
        else:  # no scale_loss since the last step: plain gradients, nothing to skip
            self.optimizer._amp_update(model_of=masters._model_of)
            self.skips_at_floor = 0
        self.steps += 1
        # The step may have been skipped, which only the device knows: no gradient of it may
        # be added to the next one, so they are all dropped, as after a skip.
        masters.drop_all_grads()
        self._end_step()

    def _flags_on_host(self):
        """This step's found_inf and per-tensor flags, copied to the host without waiting."""
        flags = [self.masters.found_inf] + [f for f, _ in self.masters.overflow_records]
        models = [m for _, ms in self.masters.overflow_records for m in ms]
        packed = torch.cat(flags)
        event = None
        if packed.is_cuda:
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host = packed
        return self.steps, set(self.loss_ids_since_step), models, host, event

    def resolve_fused_steps(self, wait: bool) -> None:
        """Count the skipped fused steps whose flags have reached the host (all of them, if
        ``wait``: a sync).  Raises like :meth:`skip_step` on persistent inf/NaN."""
        while self._unresolved:
            step, loss_ids, models, host, event = self._unresolved[0]
            if event is not None and not event.query():
                if not wait:
                    return
                event.synchronize()
            self._unresolved.popleft()
            values = host.tolist()
            if values[0] == 0.0:
                self.skips_at_floor = 0
                continue
            names = [self.handle.param_name(m) for m, bad in zip(models, values[1:]) if bad]
            self._count_skip(step, names, loss_ids)

    def _count_skip(self, step: int, names: List[str], loss_ids: set) -> None:
        self._last_overflow_step = step
        self._last_overflow_params = names
        self._skipped_steps += 1
        at_floor = all(self.handle.loss_scalers[i].at_floor() for i in loss_ids)
        self.skips_at_floor = self.skips_at_floor + 1 if at_floor else 0
        self.handle.report_skip(self)
        limit = self.handle.max_skips_at_floor
        if limit is not None and self.skips_at_floor >= limit:
            raise RuntimeError(
                f"{self.skips_at_floor} consecutive steps of optimizer {self.index} were skipped "
                "with the loss scale at its floor: these gradients are not overflowing, they "
                "are inf/NaN at any scale, which points at a bug (NaN in the data, the loss or "
                f"the model).  Non-finite gradients in: {', '.join(self._last_overflow_params) or 'none found'}. "
                "To allow more such steps, set optimizer.amp.max_skips_at_floor (None disables this check)")

    def after_step(self) -> None:
        self.steps += 1
        self.skips_at_floor = 0
        self.masters.copy_masters_to_model()
        self._end_step()

    def _end_step(self) -> None:
        self.masters.end_step()
        self.loss_ids_since_step.clear()

    def discard_step(self) -> None:
        """Forget the overflow state of gradients that zero_grad() just discarded."""
        self._end_step()

    def add_param_group(self, param_group: dict, base_add: Callable[[dict], None]) -> None:
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict; got {type(param_group).__name__}")
        params = param_group.get("params")
        params = [params] if isinstance(params, torch.Tensor) else list(params or [])
        known = {id(model) for model, _ in self.masters.pairs()}
        for param in params:
            if id(param) in known:
                raise ValueError("some parameters appear in more than one parameter group")
            self.handle.check_param_device(param)
        wrapped = dict(param_group, params=self.masters.wrap_params(params))
        try:
            base_add(wrapped)
        except Exception:
            for param in params:
                self.masters.forget(param)
            raise


class AmpHandle:
    """The state of one ``initialize`` call.

    Attributes:
        config: the resolved :class:`~ampinit.AmpConfig`.
        models, optimizers: what was initialized (the same objects the user holds).
        loss_scalers: one :class:`~ampinit.LossScaler` per loss (``num_losses``).
    """

    def __init__(self, config: AmpConfig, models: Sequence[nn.Module],
                 optimizers: Sequence[torch.optim.Optimizer], device: torch.device):
        self.config = config
        self.device = device
        self.models = list(models)
        self.optimizers = list(optimizers)
        self.ended = False
        # step() raises after this many consecutive skipped steps that leave every loss scale
        # involved at its floor (a static scale always is): an inf/NaN that survives the
        # smallest scale is a bug, not an overflow.  None disables the check.  Settable:
        # ``optimizer.amp.max_skips_at_floor = 100``.
        self.max_skips_at_floor: Optional[int] = DEFAULT_MAX_SKIPS_AT_FLOOR
        self._shard_groups = distributed.shard_groups(
            p for m in self.models for p in m.parameters())
        self._param_names = {p: (f"{name}" if len(models) == 1 else f"models[{i}].{name}")
                             for i, m in enumerate(models) for name, p in m.named_parameters()}
        self._castings = [ModelCasting(m, device.type, cast_model_type=config.cast_model_type,
                                       keep_batchnorm_fp32=bool(config.keep_batchnorm_fp32),
                                       autocast_dtype=config.autocast_dtype,
                                       cast_model_outputs=config.cast_model_outputs)
                          for m in self.models]
        # Masters start from the FP32 values.  Casting gives each parameter new storage and
        # leaves the old FP32 storage untouched, so views of it taken now become the masters:
        # no copy, and no moment with two FP32 copies of the model in memory.
        fp32_values = {t: t.detach() for c in self._castings for t in c.original_dtypes
                       if isinstance(t, nn.Parameter) and t.dtype == torch.float32} \
            if config.master_weights else {}
        for casting in self._castings:
            casting.apply()
        self._bindings: List[OptimizerBinding] = []
        for index, opt in enumerate(self.optimizers):
            masters = OptimizerMasters(opt, config.master_weights, device, fp32_values)
            masters.install()
            binding = OptimizerBinding(self, opt, masters, index)
            amp_optimizer.attach(opt, binding)
            self._bindings.append(binding)
        del fp32_values
        self.loss_scalers = [LossScaler(config.loss_scale, device=device,
                                        min_loss_scale=config.min_loss_scale,
                                        max_loss_scale=config.max_loss_scale)
                             for _ in range(config.num_losses)]
        self._state_dict_hooks = [h for m in self.models for h in self._install_state_dict_hooks(m)]
        for model in self.models:
            model.__dict__[_MODEL_ATTR] = self
        self.log(1, f"ampinit: opt_level {config.opt_level} on {device}: {config.to_dict()}")
        self.log(2, f"ampinit: {sum(len(c.original_dtypes) for c in self._castings)} tensors cast, "
                    f"{sum(len(b.masters.master_of) for b in self._bindings)} FP32 masters, "
                    f"{len(self.loss_scalers)} loss scaler(s), "
                    f"{len(self._shard_groups)} shard group(s) for found_inf agreement", logging.DEBUG)

    # -- logging --------------------------------------------------------------------------------
    def log(self, min_verbosity: int, message: str, level: int = logging.INFO) -> None:
        """Log ``message`` if this handle's verbosity is at least ``min_verbosity``."""
        if self.config.verbosity >= min_verbosity:
            logger.log(level, message)

    def report_skip(self, binding: OptimizerBinding) -> None:
        """Rate-limited overflow message.  Reads the new scales (a sync, only on a skip)."""
        n = binding._skipped_steps
        if n > _RATE_LIMIT_AFTER and n & (n - 1):
            return
        scales = ", ".join(f"{s.loss_scale():g}" for s in self.loss_scalers)
        tail = " (further messages only at powers of two)" if n == _RATE_LIMIT_AFTER else ""
        names = binding._last_overflow_params
        where = ", ".join(names[:8]) or "no parameter"
        if len(names) > 8:
            where += f" and {len(names) - 8} more"
        self.log(1, f"Gradient overflow: skipped step {binding._last_overflow_step} of optimizer "
                    f"{binding.index} ({n} skipped so far; inf/NaN in {where}); loss scale now "
                    f"{scales}{tail}", logging.WARNING)

    # -- introspection ----------------------------------------------------------------------------
    @property
    def skipped_steps(self) -> int:
        """Steps skipped for inf/NaN gradients, over all optimizers of this handle."""
        return sum(b.skipped_steps for b in self._bindings)

    @property
    def last_overflow_step(self) -> Optional[int]:
        """Index (0-based, counting skipped steps) of the most recent skipped step, or None."""
        steps = [b.last_overflow_step for b in self._bindings if b.last_overflow_step is not None]
        return max(steps) if steps else None

    @property
    def last_overflow_params(self) -> List[str]:
        """Names of the parameters with inf/NaN gradients at the most recent skipped step."""
        latest = max(self._bindings, key=lambda b: -1 if b.last_overflow_step is None else b.last_overflow_step,
                     default=None)
        return list(latest.last_overflow_params) if latest is not None else []

    def param_name(self, param: torch.Tensor) -> str:
        """The model's name for ``param`` (``models[i].`` prefixed with several models)."""
        return self._param_names.get(param, f"<unnamed {tuple(param.shape)}>")

    def loss_scale(self, loss_id: int = 0) -> float:
        """Current scale of loss ``loss_id``.  Synchronises with the device."""
        return self.loss_scalers[self._check_loss_id(loss_id)].loss_scale()

    def binding(self, optimizer: Any) -> OptimizerBinding:
        binding = amp_optimizer.binding_of(optimizer)
        if binding is None or binding.handle is not self:
            raise RuntimeError("this optimizer was not initialized by this ampinit handle")
        return binding

    def master_params(self) -> Iterator[torch.Tensor]:
        for opt in self.optimizers:
            for group in opt.param_groups:
                yield from group["params"]

    def check_param_device(self, param: torch.Tensor) -> None:
        if not isinstance(param, torch.Tensor):
            raise TypeError(f"optimizer parameters must be tensors; got {type(param).__name__}")
        if param.device != self.device:
            raise ValueError(f"parameter on {param.device}, but this initialization runs on "
                             f"{self.device}: move it there first")

    def _check_loss_id(self, loss_id: Any) -> int:
        if isinstance(loss_id, bool) or not isinstance(loss_id, int) \
                or not 0 <= loss_id < len(self.loss_scalers):
            raise ValueError(f"loss_id must be an int in [0, {len(self.loss_scalers)}) "
                             f"(initialize(..., num_losses={len(self.loss_scalers)})); got {loss_id!r}")
        return loss_id

    # -- the backward ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def scale_loss(self, loss: torch.Tensor, bindings: Sequence[OptimizerBinding], loss_id: int,
                   delay_unscale: bool) -> Iterator[torch.Tensor]:
        """See :func:`ampinit.scale_loss`.  No host synchronisation."""
        self._check_not_ended()
        scaler = self.loss_scalers[self._check_loss_id(loss_id)]
        for binding in bindings:
            binding.masters.prepare_backward()
        try:
            yield scaler.scale(loss)
        except BaseException:
            for binding in bindings:
                binding.masters.restore_after_failed_backward()
            raise
        if delay_unscale:
            for binding in bindings:
                binding.masters.pending_scaled = True
            return
        scaler.found_inf.zero_()
        inv_scale = scaler.inv_scale()
        for binding in bindings:
            binding.masters.unscale_grads(inv_scale, scaler.found_inf)
        if self._shard_groups:  # each rank checked only its shard: agree before deciding
            distributed.all_reduce_found_inf_(scaler.found_inf, self._shard_groups)
        for binding in bindings:
            torch.maximum(binding.masters.found_inf, scaler.found_inf, out=binding.masters.found_inf)
            binding.loss_ids_since_step.add(loss_id)
        scaler.update()

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """apex's layout (``loss_scaler0``, ``loss_scaler1``, ...) plus an ``ampinit`` entry
        with the options and step counters.  Synchronises with the device."""
        state: Dict[str, Any] = {f"loss_scaler{i}": s.state_dict() for i, s in enumerate(self.loss_scalers)}
        state["ampinit"] = {
            "version": STATE_VERSION,
            "config": self.config.to_dict(),
            "optimizers": [{"steps": b.steps, "skipped_steps": b.skipped_steps,
                            "last_overflow_step": b.last_overflow_step,
                            "skips_at_floor": b.skips_at_floor} for b in self._bindings],
        }
        return state

    def load_state_dict(self, state_dict: Any) -> None:
        """Restore :meth:`state_dict` output or an apex ``amp.state_dict()``.

        Everything is validated before anything changes: a mismatched checkpoint raises
        ``ValueError`` and leaves this handle as it was.
        """
        if not isinstance(state_dict, dict):
            raise TypeError(f"amp state_dict must be a dict; got {type(state_dict).__name__}")
        scaler_keys = sorted((k for k in state_dict if k.startswith("loss_scaler")),
                             key=lambda k: (len(k), k))
        expected = [f"loss_scaler{i}" for i in range(len(self.loss_scalers))]
        if scaler_keys != expected:
            raise ValueError(f"amp state_dict holds {scaler_keys or 'no loss scalers'}, but this "
                             f"initialization has num_losses={len(self.loss_scalers)} ({expected}); "
                             "initialize with the num_losses the checkpoint was saved with")
        for key in expected:
            LossScaler.check_state_dict(state_dict[key], key)
        extra = state_dict.get("ampinit")
        counters = None
        if extra is not None:
            if not isinstance(extra, dict) or extra.get("version") != STATE_VERSION:
                raise ValueError(f"unsupported ampinit state version in checkpoint: {extra!r:.80}")
            counters = extra.get("optimizers", [])
            if len(counters) != len(self._bindings):
                raise ValueError(f"checkpoint has state for {len(counters)} optimizer(s), this "
                                 f"initialization has {len(self._bindings)}")
            saved_level = extra.get("config", {}).get("opt_level")
            if saved_level != self.config.opt_level:
                self.log(0, f"ampinit: loading state saved at opt_level {saved_level} into "
                            f"opt_level {self.config.opt_level}", logging.WARNING)
        for binding in self._bindings:
            binding.resolve_fused_steps(wait=True)  # settle what earlier steps owe first
        for key, scaler in zip(expected, self.loss_scalers):
            scaler.load_state_dict(state_dict[key])
        for binding, counts in zip(self._bindings, counters or []):
            binding.steps = int(counts.get("steps", 0))
            binding.skipped_steps = int(counts.get("skipped_steps", 0))
            binding.last_overflow_step = counts.get("last_overflow_step")
            binding.skips_at_floor = int(counts.get("skips_at_floor", 0))

    def _master_of(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        for binding in self._bindings:
            master = binding.masters.master_of.get(param)
            if master is not None:
                return master
        return None

    def _install_state_dict_hooks(self, model: nn.Module):
        """``model.state_dict()`` reports the FP32 masters (and the original dtypes of cast
        tensors); ``model.load_state_dict()`` writes the masters too."""
        original = {}
        for casting in self._castings:
            original.update(casting.original_dtypes)
        master_of = self._master_of

        def save_hook(module, state_dict, prefix, local_metadata):
            for name, tensor in list(module._parameters.items()) + list(module._buffers.items()):
                key = prefix + name
                if tensor is None or key not in state_dict:
                    continue
                master = master_of(tensor)
                if master is not None:
                    state_dict[key] = master.detach()
                elif tensor in original:
                    state_dict[key] = state_dict[key].to(original[tensor])

        def load_hook(module, state_dict, prefix, *args):
            with torch.no_grad():
                for name, param in module._parameters.items():
                    master = master_of(param)
                    value = state_dict.get(prefix + name)
                    if master is not None and isinstance(value, torch.Tensor) and value.shape == master.shape:
                        master.copy_(value)

        hooks = []
        for module in model.modules():
            owned = list(module._parameters.values()) + list(module._buffers.values())
            if any(t is not None and (t in original or master_of(t) is not None) for t in owned):
                hooks.append(module.register_state_dict_post_hook(save_hook))
                hooks.append(module.register_load_state_dict_pre_hook(load_hook))
        return hooks

    # -- ending -----------------------------------------------------------------------------------
    def _check_not_ended(self) -> None:
        if self.ended:
            raise RuntimeError("this ampinit initialization has ended; call ampinit.initialize again")

    def end(self) -> None:
        """Undo this initialization: hooks removed, optimizers back to their own class with
        the model parameters in ``param_groups``, and every cast tensor back to its original
        dtype (parameters take their FP32 master values).  Idempotent."""
        if self.ended:
            return
        for binding in self._bindings:
            binding.masters.uninstall()
            amp_optimizer.detach(binding.optimizer)
        for hook in self._state_dict_hooks:
            hook.remove()
        with torch.no_grad():
            for casting in self._castings:
                casting.remove()
                for tensor, dtype in casting.original_dtypes.items():
                    if tensor.dtype != dtype:
                        tensor.data = tensor.data.to(dtype)
                        if isinstance(tensor, nn.Parameter) and tensor.grad is not None:
                            tensor.grad = tensor.grad.to(dtype)
        for model in self.models:
            model.__dict__.pop(_MODEL_ATTR, None)
        self.ended = True
        self.log(1, f"ampinit: ended opt_level {self.config.opt_level} initialization")
