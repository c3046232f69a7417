"""``AmpHandle``: everything one ``initialize`` call set up, owned by objects the user holds.

The handle is reachable from the optimizer (``optimizer.amp``) and from the model (through a
link that copies and pickles as a dead link, so a deep copy of the model does not drag the
optimizer along; see :mod:`ampinit.links`, with the hooks it puts on the model); module-level
state holds at most a weak reference to the latest one, so any number of initializations
coexist and a dropped model frees its handle.
:meth:`AmpHandle.end` undoes an initialization.

Under the ``apex`` alias ``apex.amp`` is ``ampinit``, so ``amp.handle`` is this module: it
carries apex's module-level ``disable_casts`` (``with amp.handle.disable_casts():``, SwAV-style
code) for that reason alone.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Dict, Iterable, Iterator, List, NamedTuple, Optional, Sequence

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from . import distributed, links
from . import optimizer as amp_optimizer
from .binding import OptimizerBinding
from .casting import ModelCasting
from .grads import BackwardWatch, GradientFlow
from .links import found_after_collecting, handles_holding, handles_holding_parameter
from .masters import MasterWeights
from .opt_levels import AmpConfig
from .registry import disable_casts  # noqa: F401  (apex's apex.amp.handle.disable_casts; see below)
from .scaler import LossScaler

__all__ = ["AmpHandle"]

logger = logging.getLogger("ampinit")

# Models pickled (torch.save(model)) before these moved to .links name them here
_HandleLink, _WeakLink, _ModulesMadeLater = links.HandleLink, links.WeakLink, links.ModulesMadeLater
_SaveFP32Values, _LoadFP32Values, _RefuseAssign = links.SaveFP32Values, links.LoadFP32Values, links.RefuseAssign
_ReportingWindow, _BeforeForward = links.ReportingWindow, links.BeforeForward
_WARNED_FOREIGN = "_ampinit_warned_foreign_step"  # on an optimizer check_foreign_step logged about
STATE_VERSION = 1
_RATE_LIMIT_AFTER = 8  # overflow messages: the first 8, then every power of two
DEFAULT_MAX_SKIPS_AT_FLOOR = 16
_LOW_PRECISION = (torch.float16, torch.bfloat16)


class _ScaleAtEntry(NamedTuple):
    """A loss's scale as ``scale_loss`` multiplied it: its inverse (a device tensor), its
    scaler's count of changes, and a static scale's value."""
    inv_scale: torch.Tensor
    updates: int
    fixed_scale: Optional[float]


class AmpHandle:
    """The state of one ``initialize`` call.

    Attributes:
        config: the resolved :class:`~ampinit.AmpConfig`.
        models, optimizers: what was initialized (the same objects the user holds; a LARC-style
            wrapper appears as the optimizer inside it).
        loss_scalers: one :class:`~ampinit.LossScaler` per loss (``num_losses``).

    Construction validates everything that can fail before it changes the model or the
    optimizers.
    """

    def __init__(self, config: AmpConfig, models: Sequence[nn.Module],
                 optimizers: Sequence[torch.optim.Optimizer], device: torch.device):
        self.config = config
        self.device = device
        self.models = list(models)
        self.optimizers = list(optimizers)
        self._added_params: List[torch.Tensor] = []  # by add_param_group: marked as held (see end)
        # apex's FP16_Optimizer advanced its scale once per step(), from every backward since the
        # last one; amp (and ampinit) at every unscale.  See update_scale_at_step.
        self.scale_updates_at_step = False
        self._reported: Dict[torch.Tensor, torch.dtype] = {}  # see _apply
        # (model, its modules with state_dict hooks of their own): see _hook_modules_holding
        self._module_hooks: List[tuple] = []
        self.ended = False
        self._bindings: List[OptimizerBinding] = []
        self._hooks: list = []
        self._optimizer_hooks: Dict[int, list] = {}
        self.masters: Optional[MasterWeights] = None
        # step() raises after this many consecutive skipped steps that leave every loss scale
        # involved at its floor (a static scale always is): an inf/NaN that survives the
        # smallest scale is a bug, not an overflow.  None disables the check.  Settable:
        # ``optimizer.amp.max_skips_at_floor = 100``.
        self.max_skips_at_floor: Optional[int] = DEFAULT_MAX_SKIPS_AT_FLOOR
        # -- everything that can fail, before anything changes --------------------------------------
        self.loss_scalers = [
            LossScaler(config.loss_scale, device=device, init_scale=config.init_scale,
                       growth_factor=config.growth_factor, backoff_factor=config.backoff_factor,
                       growth_interval=config.growth_interval, hysteresis=config.hysteresis,
                       min_loss_scale=config.min_loss_scale, max_loss_scale=config.max_loss_scale)
            for _ in range(config.num_losses)]
        self._shard_groups = distributed.shard_groups(p for m in self.models for p in m.parameters())
        self._param_names = {p: (f"{name}" if len(models) == 1 else f"models[{i}].{name}")
                             for i, m in enumerate(models) for name, p in m.named_parameters()}
        self._warned_unseen_writes = False  # see scale_loss: masters written where no forward check ran
        self._warned_block_writes = False  # see _end_backward: gradients changed inside the block
        self._warned_unmastered = WeakIdKeyDictionary()  # see note_unmastered_parameters
        self._autocast_checked = False  # see _check_autocast_reached: logged
        self._autocast_window, self._window_entered, self._bare_windows = -1, False, 0
        # scale_loss calls so far (a load_state_dict does not rewind it): see frontend._check_one_live
        self.losses_scaled = 0
        self._castings = [ModelCasting(m, device.type, cast_model_type=config.cast_model_type,
                                       keep_batchnorm_fp32=bool(config.keep_batchnorm_fp32),
                                       autocast_dtype=config.autocast_dtype,
                                       cast_model_outputs=config.cast_model_outputs)
                          for m in self.models]
        # the O1/O4 autocast scoped to each model's forward (none at other levels)
        self._autocast_scopes = [casting.autocast_scope for casting in self._castings
                                 if casting.autocast_scope is not None]
        self._link = links.HandleLink(self)
        try:
            self._apply()
        except BaseException:
            self.end()
            raise
        links.watch_foreign_steps()
        self._warn_of_narrowed_float64()
        self.log(1, f"ampinit: opt_level {config.opt_level} on {device}: {config.to_dict()}")
        self.log(2, f"ampinit: {sum(len(c.original_dtypes) for c in self._castings)} tensors cast, "
                    f"{len(self.masters.tensors()) if self.masters else 0} FP32 masters, "
                    f"{len(self.loss_scalers)} loss scaler(s), "
                    f"{len(self._shard_groups)} shard group(s) for found_inf agreement", logging.DEBUG)

    def _apply(self) -> None:
        config = self.config
        original = {t: d for c in self._castings for t, d in c.original_dtypes.items()}
        if config.master_weights:
            # Casting gives each tensor new storage and leaves the old one untouched, so views of
            # it taken now become the FP32 values: no copy, and no moment with two FP32 copies.
            # ``.data``, not ``.detach()``: a view with a version counter of its own, so that
            # writing a master does not count as modifying the model parameter autograd saved.
            fp32 = {t: (t.data if t.dtype == torch.float32 else t.data.float()) for t in original}
            names = dict(self._param_names)
            names.update({b: n for m in self.models for n, b in m.named_buffers()})
            self.masters = MasterWeights(fp32, {t: config.cast_model_type for t in original}, names)
        for casting in self._castings:
            casting.apply()
        if config.master_remainders:
            self.masters.keep_as_remainders()
        for index, opt in enumerate(self.optimizers):
            flow = GradientFlow(opt, self.masters, self.device, bool(getattr(opt, "_ampinit_fused", False)),
                                self.param_name)
            binding = OptimizerBinding(self, opt, flow, index)
            self._install_masters(opt)
            if self.masters is None:
                self._state_follows_params(opt, original)
            self._optimizer_hooks[id(opt)] = amp_optimizer.attach(opt, binding)
            self._bindings.append(binding)
        left = self.masters.without_remainders if self.masters is not None else []
        if left:
            names = ", ".join(self.param_name(p) for p in left[:5]) + (", ..." if len(left) > 5 else "")
            self.log(1, f"ampinit: master_weights='remainder': {len(left)} bfloat16 parameter(s) are not "
                        f"contiguous (channels_last?) and keep 4-byte FP32 masters instead: {names}", logging.WARNING)
        # model.state_dict() reports (and load_state_dict() loads) the FP32 value of every tensor
        # with a master: the cast ones in their original dtypes, the low-precision parameters the
        # user made (cast_model_type=False, a model cast before initialize) and those that
        # add_param_group brings later in FP32, their masters' dtype
        self._reported = dict(original)
        if self.masters is not None:
            for tensor in self.masters.tensors():
                self._reported.setdefault(tensor, torch.float32)
        for model in self.models:
            self._hooks.extend(self._install_state_dict_hooks(model, self._reported))
            links.attach_model(model, self._link)

    @staticmethod
    def _state_follows_params(optimizer: torch.optim.Optimizer, tensors: Iterable[torch.Tensor]) -> None:
        """The optimizer state of ``tensors`` it updates directly (no masters: O3) takes their
        dtype now, as torch's ``load_state_dict`` gives state its parameter's: state that existed
        before ``initialize`` (a checkpoint loaded first) stayed FP32 next to fp16 parameters,
        and Adam's step failed on the mix; at ``end`` the fp16 state met FP32 parameters."""
        held = {p for group in optimizer.param_groups for p in group["params"]}
        _remap_state(optimizer, {t: t for t in tensors if t in held}, None)

    def _install_masters(self, optimizer: torch.optim.Optimizer) -> None:
        """Put masters into ``param_groups`` and move existing optimizer state onto them."""
        if self.masters is None:
            return
        mapping = {}
        self.masters.check_no_overlap([p for group in optimizer.param_groups for p in group["params"]
                                       if p.dtype in _LOW_PRECISION])
        for group in optimizer.param_groups:
            params = []
            for param in group["params"]:
                if param.dtype in _LOW_PRECISION:
                    mapping[param] = self.masters.take(param)
                params.append(mapping.get(param, param))
            group["params"] = params
        _remap_state(optimizer, mapping, torch.float32)
        amp_optimizer.key_state_by_masters(optimizer, self.masters.master_param)

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

    def _warn_of_narrowed_float64(self) -> None:
        """Casting the model (O0 to float32, as apex's ``model.to(torch.float32)`` did) narrows
        float64 parameters and buffers too: an accumulator loses its precision, and a float64
        layer then fails on its float64 inputs with a dtype error that names no cause."""
        narrowed = {t for casting in self._castings for t, dtype in casting.original_dtypes.items()
                    if dtype == torch.float64}
        if not narrowed:
            return
        names = [name for t, name in self._tensor_names().items() if t in narrowed]
        logger.warning(
            "ampinit: opt_level=%r cast %d float64 tensor(s) to %s, as apex did (%s%s).  At O0, "
            "cast_model_type=False keeps them float64; a buffer that nothing trains can also be cast back after "
            "initialize", self.config.opt_level, len(narrowed), self.config.cast_model_type,
            ", ".join(names[:4]), ", ..." if len(names) > 4 else "")

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
        for binding in self._bindings:
            binding.flow.materialize_deferred()
            for group in binding.optimizer.param_groups:
                yield from group["params"]

    def master_of(self, param: torch.Tensor) -> torch.Tensor:
        """What the optimizers update for the model parameter ``param``: its FP32 master at
        O2/O5 (the tensor in ``param_groups``), else ``param`` itself.  For code that finds a
        layer's parameters in ``param_groups`` by identity (``id(p)``, ``is``)."""
        master = self._master_of(param)
        return param if master is None else master

    def _master_of(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        """The FP32 master of a model parameter, or ``None``."""
        master = self.masters.master_of(param) if self.masters is not None else None
        return master if isinstance(master, nn.Parameter) else None

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
        self.check_not_ended()
        scaler = self.loss_scalers[self._check_loss_id(loss_id)]
        self.losses_scaled += 1
        if self.masters is not None and self.masters.has_remainders:
            self.masters.check_remainder_layout()  # before the backward: the step could not update them
        if self.masters is not None:
            for binding in bindings:
                self.put_masters_back(binding.optimizer)
        flows = [binding.flow for binding in bindings]
        for flow in flows:
            if flow.in_scale_loss:
                raise RuntimeError("scale_loss calls can't be nested: the inner backward's gradients would be "
                                   "unscaled with the outer loss's.  Finish one `with scale_loss(...)` block "
                                   "before the next, or add the losses and scale their sum")
            flow.check_can_join(loss_id, scaler.updates, scaler.fixed_scale)
        for flow in flows:
            flow.check_foreign_grads("this scale_loss")
        if self.masters is not None and not self._warned_unseen_writes and self.masters.masters_written_unseen():
            self._warned_unseen_writes = True
            logger.warning(
                "ampinit: master weights (optimizer.param_groups) were written in place outside step() (SAM's "
                "first_step, say), and the forward since did not see it: it ran under torch.compile or through a "
                "submodule, where ampinit's forward check does not run, so it computed with the old weights.  Run "
                "such forwards through the initialized model itself, uncompiled (this is logged once)")
        self._check_autocast_reached()
        # the other optimizers' gradients, to tell what this backward leaves on them still scaled
        others = [(b.flow, b.flow.grad_snapshot()) for b in self._bindings if b.flow not in flows]
        scaled = scaler.scale(loss)
        # the scale this loss is multiplied by, for the exit: a scale set inside the block (by
        # hand, apex-style) must neither unscale these gradients nor join them later (no sync)
        entry = _ScaleAtEntry(scaler.inv_scale(), scaler.updates, scaler.fixed_scale)
        watch = BackwardWatch(scaled, on_reach=lambda: [flow.backward_started() for flow in flows],
                              on_end=lambda: [flow.backward_ended() for flow in flows])
        if self.masters is not None:
            self.masters.start()
        for flow in flows:
            flow.prepare_backward()
            flow.active_scaler = scaler
        for flow, before in others:
            flow.foreign_snapshot = before
        try:
            yield scaled
        except BaseException:
            # As without ampinit: gradients a backward already produced stay (unscaled); if none
            # reached the scaled loss, everything is as it was on entry.
            self._end_backward(flows, bindings, scaler, loss_id, delay_unscale, watch, entry)
            raise
        finally:
            for flow in flows:
                flow.active_scaler = None
            for flow, before in others:
                flow.foreign_snapshot = None
                flow.note_foreign_grads(before)
        self._end_backward(flows, bindings, scaler, loss_id, delay_unscale, watch, entry, check=True)

    def _end_backward(self, flows: Sequence[GradientFlow], bindings: Sequence[OptimizerBinding], scaler: LossScaler,
                      loss_id: int, delay_unscale: bool, watch: BackwardWatch, entry: "_ScaleAtEntry",
                      check: bool = False) -> None:
        """Unscale (or keep, for ``delay_unscale``) what the backward produced."""
        written = [flow.take_written_in_block() for flow in flows]
        if check and any(written) and not self._warned_block_writes and (scaler.dynamic or scaler.loss_scale() != 1.0):
            self._warned_block_writes = True  # (reading a static scale syncs: once, on this path)
            logger.warning(
                "ampinit: gradients were changed inside `with ampinit.scale_loss(...)`, after the backward, where they "
                "are still multiplied by the loss scale.  A linear change (averaging over processes, dividing by the "
                "accumulation count) comes out right, but clipping or normalizing them there clips the scaled values: "
                "the update comes out about loss-scale times too small, or zero where the norm of the scaled 16-bit "
                "gradients overflowed.  Clip after the with block, on "
                "ampinit.master_params(optimizer).  If it was a second backward, of a loss not multiplied by the "
                "scale (aux_loss.backward()), its gradients are divided by the scale at the exit, about lost: "
                "scale the sum instead, ampinit.scale_loss(loss + aux_loss, optimizer).  (Logged once)")
        if self.masters is not None:  # a group rebuilt inside the block
            for binding in bindings:
                self.put_masters_back(binding.optimizer)
        if not watch.reached:  # no backward through the scaled loss: nothing to unscale
            unscaled = any(flow.pending is None and any(model.grad is not None for model, _ in flow.pairs())
                           for flow in flows)
            for flow in flows:
                flow.restore_after_no_backward()
            if check and unscaled:
                raise RuntimeError(
                    "inside `with ampinit.scale_loss(loss, optimizer) as scaled_loss:` gradients were computed, "
                    "but not through scaled_loss: call scaled_loss.backward(), not loss.backward()")
            return
        if delay_unscale:
            for flow in flows:
                flow.delay(loss_id, entry.updates, entry.fixed_scale)
            return
        self._unscale(bindings, loss_id, entry.inv_scale)

    def _unscale(self, bindings: Sequence[OptimizerBinding], loss_id: int, inv_scale: torch.Tensor) -> None:
        """Unscale the bindings' new gradients with ``inv_scale`` (loss ``loss_id``'s, when the
        loss was scaled), fold the overflow into their flags and advance the scale.  No host sync."""
        scaler = self.loss_scalers[loss_id]
        scaler.found_inf.zero_()
        for binding in bindings:
            binding.flow.unscale(inv_scale, scaler.found_inf)
        if self._shard_groups:  # each rank checked only its shard: agree before deciding
            distributed.all_reduce_found_inf_(scaler.found_inf, self._shard_groups)
        for binding in bindings:
            torch.maximum(binding.flow.found_inf, scaler.found_inf, out=binding.flow.found_inf)
            binding.loss_ids_since_step.add(loss_id)
        if not self.scale_updates_at_step:
            scaler.update()

    def update_scale_at_step(self, binding: OptimizerBinding) -> None:
        """With ``scale_updates_at_step``: advance each scale the step's backwards used, once,
        from the step's overflow flag (apex's ``FP16_Optimizer.step()``).  No host sync."""
        if not binding.flow.unscaled_since_step:
            return
        for loss_id in sorted(binding.loss_ids_since_step):
            scaler = self.loss_scalers[loss_id]
            scaler.found_inf.copy_(binding.flow.found_inf)
            scaler.update()

    def unscale_delayed(self, bindings: Sequence[OptimizerBinding]) -> None:
        """Unscale gradients that ``delay_unscale=True`` backwards left scaled, without another
        backward (apex's ``FP16_Optimizer.update_master_grads()``).  No host sync."""
        for loss_id in sorted({b.flow.pending.loss_id for b in bindings if b.flow.pending is not None}):
            scaler = self.loss_scalers[loss_id]
            delayed = [b for b in bindings if b.flow.pending is not None and b.flow.pending.loss_id == loss_id]
            for binding in delayed:  # a scale set since (FP16_Optimizer.loss_scale = ...) is refused
                binding.flow.check_can_join(loss_id, scaler.updates, scaler.fixed_scale)
            self._unscale(delayed, loss_id, scaler.inv_scale())

    # -- parameters added later -----------------------------------------------------------------
    def add_param_group(self, binding: OptimizerBinding, param_group: Any,
                        base_add: Callable[[dict], None]) -> None:
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict; got {type(param_group).__name__}")
        params = param_group.get("params")
        params = [params] if isinstance(params, torch.Tensor) else list(params or [])
        # torch >= 2.6 takes (name, tensor) pairs, all or none, and keeps the names as param_names
        names = [entry[0] for entry in params if isinstance(entry, tuple) and len(entry) == 2]
        if names:
            if len(names) != len(params):
                raise ValueError("add_param_group: give every parameter a name, as (name, tensor) pairs, or none")
            params = [tensor for _, tensor in params]
        known = {id(model) for b in self._bindings for model, _ in b.flow.pairs()}
        for param in params:
            if not isinstance(param, torch.Tensor):
                raise TypeError(f"optimizer parameters must be tensors; got {type(param).__name__}")
            if id(param) in known:
                raise ValueError("some parameters appear in more than one parameter group")
            if param.device != self.device:
                raise ValueError(f"parameter on {param.device}, but this initialization runs on "
                                 f"{self.device}: move it there first")
        made_since = [p for p in params if p.dtype == torch.float32 and p not in self._param_names]
        if self.config.casts_model and made_since:
            logger.warning(
                "ampinit: add_param_group got %d float32 parameters that the model did not hold at initialize, which "
                "cast it to %s.  If they belong to a module added to the model since, it runs in float32 and its "
                "forward fails with a dtype mismatch: cast the module first (module.to(%s)), and add_param_group "
                "gives its parameters FP32 masters.  (Parameters used outside the model can stay float32.)",
                len(made_since), self.config.cast_model_type, self.config.cast_model_type)
        use_masters = self.masters is not None
        if not use_masters and not self.config.casts_model and \
                any(p.requires_grad and p.dtype in _LOW_PRECISION for p in params):
            logger.warning(
                "ampinit: add_param_group got 16-bit parameters, and opt_level=%r keeps no FP32 master weights: the "
                "optimizer updates them directly, and most small updates round away.  Add the module in FP32 (the "
                "level casts per op), or use O2/O5", self.config.opt_level)
        new = [p for p in params if use_masters and p.dtype in _LOW_PRECISION]
        if new:
            self._check_held_by_no_other(new)
            self.masters.check_no_overlap(new)  # before any master is made
        masters = {p: self.masters.take(p) for p in new}
        try:
            stepped = [masters.get(p, p) for p in params]
            base_add(dict(param_group, params=list(zip(names, stepped)) if names else stepped))
        except BaseException:
            for param in new:
                self.masters.release(param)
            raise
        for param in new:
            self._reported.setdefault(param, torch.float32)  # see _apply
        self._hook_modules_holding(new)
        links.mark_parameters(params, self._link)  # a module added to the model since is held too
        self._added_params.extend(params)

    def put_masters_back(self, optimizer: torch.optim.Optimizer) -> None:
        """Give a param group rebuilt by hand from the model's 16-bit parameters its masters back
        (``group["params"] = list(model.layer.parameters())``, a common way to unfreeze).  Stepped
        as they are, those parameters would train in fp16/bf16 with no master, and most small
        updates would round away; as in ``add_param_group``, each gets its FP32 master, optimizer
        state included.  A walk over the parameters' dtypes, at each ``scale_loss`` and ``step()``."""
        masters = self.masters
        fp32, in_place = torch.float32, masters.stepped_in_place  # identity tests first
        strays = [p for group in optimizer.param_groups for p in group["params"]
                  if p.dtype is not fp32 and id(p) not in in_place]
        strays = [p for p in strays if p.dtype in _LOW_PRECISION]
        if not strays:
            return
        listed = {id(p) for group in optimizer.param_groups for p in group["params"]}
        doubled = [p for p in strays if id(masters.master_param(p)) in listed]
        if doubled or len({id(p) for p in strays}) < len(strays):
            name = self.param_name(doubled[0]) if doubled else "a 16-bit model parameter"
            raise RuntimeError(
                f"{type(optimizer).__name__}.param_groups lists {name} twice: as the 16-bit model parameter, put "
                "there after initialize, and as its FP32 master (or as the model parameter twice); it would be "
                "updated twice per step.  List each parameter once (the masters are what "
                "ampinit.master_params(optimizer) yields)")
        self._check_held_by_no_other(strays)
        masters.check_no_overlap([p for p in strays if p not in masters])  # before any master is made
        mapping = {}
        for param in strays:
            master = masters.master_param(param)
            mapping[param] = masters.take(param) if master is None else master
        for group in optimizer.param_groups:
            group["params"] = [mapping.get(p, p) for p in group["params"]]
        _remap_state(optimizer, {p: m for p, m in mapping.items() if m is not p}, torch.float32)
        self._reported.update((p, torch.float32) for p in strays if p not in self._reported)
        self._hook_modules_holding(strays)
        logger.warning("ampinit: %s.param_groups held %d 16-bit parameter(s) with no master (%s%s), put there "
                       "or cast after initialize: they train through their masters instead, which take their places",
                       type(optimizer).__name__, len(strays), ", ".join(self.param_name(p) for p in strays[:3]),
                       ", ..." if len(strays) > 3 else "")

    @property
    def keeps_copies(self) -> bool:
        """Whether this initialization cast the model or keeps FP32 masters of it (O2/O3/O5)."""
        return self.config.casts_model or self.masters is not None

    @property
    def reported_dtypes(self) -> Dict[torch.Tensor, torch.dtype]:
        """The tensors ``model.state_dict()`` reports the FP32 values of, each with the dtype it
        reports them in (see ``_apply``)."""
        return self._reported

    def _check_autocast_reached(self) -> None:
        """O1/O4, at each ``scale_loss``: log once when this loss and the losses of the step
        before it came with no training forward (one with gradients on) of an initialized model:
        code that calls submodules directly (``model.generator(z)``, a GAN's discriminator step
        through ``model.discriminator``) never enters the autocast these levels scope to the
        model's forward, and computes in FP32.  Two windows, not one: a forward whose losses are
        scaled on either side of a step (one optimizer per head) is fine.  No-grad forwards
        (validation) do not count."""
        if self._autocast_checked or not self._autocast_scopes:
            return
        window = sum(binding.steps for binding in self._bindings)
        if window != self._autocast_window:  # a step since the last scale_loss: a new window
            if self._autocast_window >= 0:  # the window it closes had losses: with a forward or bare
                self._bare_windows = 0 if self._window_entered else self._bare_windows + 1
            self._autocast_window = window
            self._window_entered = False
        for scope in self._autocast_scopes:
            self._window_entered = self._window_entered or scope.entered
            scope.entered = False
        if self._window_entered or self._bare_windows == 0 or torch.is_autocast_enabled(self.device.type):
            return
        self._autocast_checked = True
        logger.warning(
            "ampinit: %s scaled losses in two step windows in a row with no training forward of a model given to "
            "initialize (none since the step before the last): the "
            "training code called their submodules (or other modules) directly, so nothing ran under the %s "
            "autocast that %s enters in the initialized model's forward, and that forward computed in FP32.  Call "
            "the initialized model itself, or initialize the modules the code calls (amp.initialize([gen, disc], "
            "...)).  Code that enters torch.autocast(%r, dtype=%s) around such forwards itself can ignore this "
            "(logged once)",
            self.config.opt_level, self.config.autocast_dtype, self.config.opt_level, self.device.type,
            self.config.autocast_dtype)

    @contextlib.contextmanager
    def autocast_step(self) -> Iterator[None]:
        """The O1/O4 autocast (and the registered-function casts) around a whole training step
        (Lightning's ``forward_context``), for code that calls submodules directly; a no-op at
        other levels."""
        self.check_not_ended()
        scopes = self._autocast_scopes
        if not scopes:
            yield
            return
        scopes[0].enter()  # as the model's forward pre-hook: a forward inside nests in it
        try:
            yield
        finally:
            scopes[0].exit()
        for scope in scopes:  # the losses of this step come from under the autocast
            scope.entered = True

    def note_unmastered_parameters(self, module: nn.Module, prefix: str = "", recurse: bool = True) -> None:
        """Log, once per parameter, the 16-bit parameters of ``module`` that this initialization
        neither cast nor keeps an FP32 master of, at a level with masters: parameters made
        after ``initialize`` from the model's 16-bit values.  torch's ``remove_weight_norm``,
        ``remove_spectral_norm`` and ``remove_parametrizations`` (of a parametrization over
        several tensors) put such a parameter in place of the ones ampinit keeps masters of, and
        a parametrization registered after ``initialize`` makes them too: ``model.state_dict()``
        then holds them in 16-bit precision, and ``amp.end()`` leaves them 16-bit.  A parameter
        another live initialization holds is that one's.  A Python pass over the parameters, at
        ``model.state_dict()`` (each module's own, in its state_dict hook) and ``end()``."""
        if self.masters is None:
            return
        named = module.named_parameters() if recurse else module._parameters.items()  # (no generator per module)
        found = [(prefix + name, param) for name, param in named
                 if param is not None and param.dtype in _LOW_PRECISION and param not in self._reported
                 and param not in self.masters and param not in self._param_names  # (16-bit at initialize)
                 and param not in self._warned_unmastered]
        found = [(name, param) for name, param in found
                 if not any(handle is not self for handle in handles_holding_parameter(param))]
        if not found:
            return
        for _, param in found:
            self._warned_unmastered[param] = True
        names = [name for name, _ in found]
        logger.warning(
            "ampinit: %s: 16-bit parameter(s) made after initialize, which ampinit did not cast, keeps no FP32 "
            "master of, and no optimizer of this initialization holds: model.state_dict() holds them in 16-bit "
            "precision only, and amp.end() leaves them 16-bit.  torch.nn.utils.remove_weight_norm, "
            "remove_spectral_norm and remove_parametrizations make such parameters from the 16-bit values, and so "
            "does a parametrization registered after initialize: register or remove them before initialize, or "
            "after ampinit.end(model) (then the weight is the FP32 one the masters give).  A layer added after "
            "initialize gets masters from optimizer.add_param_group.  Logged once per parameter",
            ", ".join(names[:3]) + (", ..." if len(names) > 3 else ""))

    def check_foreign_step(self, optimizer: torch.optim.Optimizer, params: List[torch.Tensor]) -> None:
        """``optimizer``, which no ``initialize`` bound, is about to step ``params``, which this
        initialization holds.  Where one of them is a 16-bit parameter with an FP32 master (O2/O5)
        and this initialization has optimizers (or one trains that master), that is always wrong:
        it would update the 16-bit weight behind its master, with the scaled gradient O2 leaves on
        it (NaN after one step), so it raises before the update.  (Initialized without optimizers,
        for inference, the model may be adapted by a plain optimizer and backward: ampinit adopts
        the writes.)  Otherwise, where this initialization scales losses (O1, or a static scale
        other than 1), the step skips no overflow, and a gradient no bound optimizer holds stays
        scaled: logged once per optimizer, except for an optimizer stepped while a bound one
        steps (a wrapper's base, ZeroRedundancyOptimizer's local one) or one sharing a bound
        one's ``param_groups`` (SAM, LARC, Lookahead): the bound optimizer's own."""
        name = type(optimizer).__name__
        if self.masters is not None:
            # a 16-bit parameter with a master, where losses are scaled (this initialization has
            # optimizers) or its master trained: never right, nested in a bound step or not (a
            # wrapper's base holds masters, which carry no mark)
            trained = [p for p in params if p in self.masters
                       and (self.optimizers or self.masters.updated_by_an_optimizer(p))]
            if trained:
                raise RuntimeError(
                    f"{name}.step(): this optimizer was not passed to ampinit.initialize, but it updates "
                    f"{self.param_name(trained[0])}, which an initialization at opt_level={self.config.opt_level!r} "
                    "set up and has not ended: there the optimizer initialize returned updates its FP32 master and "
                    "copies it into the 16-bit model, whose gradient is multiplied by the loss scale, and this step "
                    "would update the 16-bit weight directly with it.  To train with a new optimizer (a second "
                    "stage), end the initialization and initialize again: ampinit.end(model); model, optimizer = "
                    "ampinit.initialize(model, optimizer, ...); or add the parameters to the initialized optimizer "
                    "(add_param_group).  Nothing was updated")
        for binding in self._bindings:
            if binding.step_due or binding.decided or binding.optimizer.param_groups is optimizer.param_groups:
                return  # the bound optimizer's own: its step skips overflows for both
        scales = self.config.dynamic_loss_scale or self.config.loss_scale != 1.0
        if scales and self.optimizers and not optimizer.__dict__.get(_WARNED_FOREIGN):
            optimizer.__dict__[_WARNED_FOREIGN] = True
            logger.warning(
                "ampinit: %s.step(): this optimizer was not passed to ampinit.initialize, but it updates parameters "
                "of a model initialized at opt_level=%r, which scales its losses: its steps are not skipped when a "
                "gradient overflows (inf/NaN reach the weights), and a gradient that only it holds stays multiplied "
                "by the loss scale after scale_loss.  Pass it to ampinit.initialize (ampinit.end(model) first to "
                "initialize again).  Logged once", name, self.config.opt_level)

    def _hook_modules_holding(self, tensors: Iterable[torch.Tensor]) -> None:
        """Give the modules of the models that hold ``tensors`` (parameters that got masters after
        ``initialize``: a head added with ``add_param_group``, a layer cast by the user and
        unfrozen later) the state_dict hooks of their own that ``initialize`` gave the others,
        so that ``module.state_dict()`` called on them reports the FP32 values as
        ``model.state_dict()`` does."""
        targets = {id(t) for t in tensors}
        for model, later_modules in self._module_hooks:
            for module in model.modules():
                if module in later_modules.hooked:
                    continue
                held = list(module._parameters.values()) + list(module._buffers.values())
                if any(t is not None and id(t) in targets for t in held):
                    later_modules.hooked.add(module)
                    if self not in handles_holding(module):  # made after initialize: refuse assign=True too
                        self._hooks.append(module.register_load_state_dict_pre_hook(links.RefuseAssign(self._link)))
                    self._hooks.extend(links.register_state_dict_hooks(
                        module, links.SaveFP32Values(self._link), links.LoadFP32Values(self._link)))

    def _check_held_by_no_other(self, params: List[torch.Tensor]) -> None:
        """16-bit parameters that another live initialization holds (cast, or keeps a master of)
        must not get a second master here: each optimizer's updates would reach the other only
        through the rounding (see ``frontend._check_nothing_shared_with_another_initialization``)."""
        def other_level() -> Optional[str]:  # a string: no reference to keep a dropped one alive
            for param in params:
                for handle in handles_holding_parameter(param):
                    if handle is not self:
                        return handle.config.opt_level
            return None

        level = found_after_collecting(other_level)
        if level is not None:
            raise RuntimeError(
                f"a 16-bit parameter given to this optimizer belongs to a model that another ampinit initialization "
                f"(opt_level={level!r}) set up and has not ended: it would get a second FP32 master, and each "
                "optimizer's updates would reach the other only through the 16-bit rounding.  Initialize the models "
                "together, or end the other initialization first (ampinit.end(other_model)).  Nothing was changed")

    # -- checkpoints ----------------------------------------------------------------------------
    def report_fp32_value(self, tensor: Optional[torch.Tensor], dtype: torch.dtype,
                          keep_vars: bool = False) -> Optional[torch.Tensor]:
        """What ``model.state_dict()`` reports for a cast tensor: its FP32 value in ``dtype``
        (see :meth:`MasterWeights.report`: in-place writes to it are adopted), or ``None``."""
        if self.masters is None or tensor is None:
            return None
        return self.masters.report(tensor, dtype, keep_vars)

    def load_fp32_value(self, tensor: torch.Tensor, value: torch.Tensor) -> None:
        if self.masters is not None:
            self.masters.load(tensor, value)

    def _install_state_dict_hooks(self, model: nn.Module, original: Dict[torch.Tensor, torch.dtype]) -> list:
        """``model.state_dict()`` reports the FP32 values of cast tensors in their original
        dtypes; ``model.load_state_dict()`` writes the FP32 values too.  Each module holding
        cast tensors gets its own hooks (a submodule's ``state_dict()`` reports too); the model's
        root serves the modules made later."""
        hooks = [model.register_state_dict_pre_hook(links.ReportingWindow(self._link, opening=True))]
        later_modules = links.ModulesMadeLater()
        self._module_hooks.append((model, later_modules))
        for module in model.modules():
            hooks.append(module.register_load_state_dict_pre_hook(links.RefuseAssign(self._link)))
            if not links.cast_tensors_of(module, original):
                continue
            later_modules.hooked.add(module)
            hooks.extend(links.register_state_dict_hooks(module, links.SaveFP32Values(self._link),
                                                         links.LoadFP32Values(self._link)))
        # the root's serve the modules made later; a root holding cast tensors has both
        hooks.extend(links.register_state_dict_hooks(model, links.SaveFP32Values(self._link, later_modules),
                                                     links.LoadFP32Values(self._link, later_modules)))
        hooks.append(model.register_state_dict_post_hook(links.ReportingWindow(self._link, opening=False)))
        hooks.append(model.register_forward_pre_hook(links.BeforeForward(self._link)))
        return hooks

    def state_dict(self) -> Dict[str, Any]:
        """apex's layout (``loss_scaler0``, ``loss_scaler1``, ...) plus an ``ampinit`` entry
        with the options and step counters, and the FP32 masters of model tensors written since
        the last step and not adopted (``masters_behind_writes``: EMA weights swapped in, which
        ``model.state_dict()`` reports in their place).  Synchronises with the device."""
        state: Dict[str, Any] = {f"loss_scaler{i}": s.state_dict() for i, s in enumerate(self.loss_scalers)}
        state["ampinit"] = {
            "version": STATE_VERSION,
            "config": self.config.to_dict(),
            "optimizers": [{"steps": b.steps, "skipped_steps": b.skipped_steps,
                            "last_overflow_step": b.last_overflow_step,
                            "skips_at_floor": b.skips_at_floor} for b in self._bindings],
        }
        behind = self.masters.masters_behind_writes() if self.masters is not None else {}
        if behind:  # EMA weights swapped in: model.state_dict() holds them, this the masters
            names = self._tensor_names()
            state["ampinit"]["masters_behind_writes"] = {names[t]: v for t, v in behind.items() if t in names}
        return state

    def load_state_dict(self, state_dict: Any) -> None:
        """Restore :meth:`state_dict` output or an apex ``amp.state_dict()``.

        Everything is validated before anything changes: a malformed checkpoint, or one for
        other optimizers, raises ``ValueError`` and leaves this handle as it was.  One with another
        ``num_losses`` loads its first scalers with a warning, as apex.  A dynamic scale outside
        ``[min_loss_scale, max_loss_scale]`` is clamped into it with a warning.
        """
        if not isinstance(state_dict, dict):
            raise TypeError(f"amp state_dict must be a dict; got {type(state_dict).__name__}")
        scaler_keys = sorted((k for k in state_dict if isinstance(k, str) and k.startswith("loss_scaler")),
                             key=lambda k: (len(k), k))
        if not scaler_keys or scaler_keys != [f"loss_scaler{i}" for i in range(len(scaler_keys))]:
            raise ValueError(f"amp state_dict holds {scaler_keys or 'no loss scalers'}; an amp state_dict has "
                             "loss_scaler0 ... loss_scaler{N-1}, one per loss (num_losses=N)")
        for key in scaler_keys:
            LossScaler.check_state_dict(state_dict[key], key)
        # as apex: a checkpoint with another num_losses loads its first scalers, with a warning
        expected = scaler_keys[:len(self.loss_scalers)]
        if len(scaler_keys) != len(self.loss_scalers):
            kept = len(expected)
            self.log(0, f"ampinit: the amp state_dict holds {len(scaler_keys)} loss scalers but this initialization "
                        f"has num_losses={len(self.loss_scalers)}: loaded loss_scaler0..{kept - 1}"
                        + (f", ignored the other {len(scaler_keys) - kept}" if len(scaler_keys) > kept else
                           f"; losses {kept}..{len(self.loss_scalers) - 1} keep their initial scale"),
                     logging.WARNING)
        counters = self._check_counters(state_dict.get("ampinit"))
        behind = self._check_masters_behind_writes(state_dict.get("ampinit"))
        for binding in self._bindings:
            binding.resolve_fused_steps(wait=True)  # settle what earlier steps owe first
        saved_scale = (state_dict.get("ampinit") or {}).get("config", {}).get("loss_scale", "dynamic")
        for index, (key, scaler) in enumerate(zip(expected, self.loss_scalers)):
            if scaler.dynamic and saved_scale != "dynamic":
                # a static scale (1.0 at O0/O4/O5) is not where a dynamic fp16 scale should resume:
                # at 1.0 small fp16 gradients flush to zero for ~16 x growth_interval steps
                self.log(0, f"ampinit: loss_scaler{index} was static ({saved_scale}) in the checkpoint; this "
                            f"initialization's dynamic scale keeps its own ({scaler.loss_scale():g})",
                         logging.WARNING)
                continue
            scaler.load_state_dict(state_dict[key])
        if behind:
            self.masters.load_behind_writes(behind)
        for binding, counts in zip(self._bindings, counters or []):
            binding.steps = counts["steps"]
            binding.skipped_steps = counts["skipped_steps"]
            binding.last_overflow_step = counts["last_overflow_step"]
            binding.skips_at_floor = counts["skips_at_floor"]

    def _tensor_names(self) -> Dict[torch.Tensor, str]:
        """The models' parameters and buffers by their names now (``models[i].`` prefixed with
        several models): a head added after ``initialize`` has one too."""
        names: Dict[torch.Tensor, str] = {}
        for i, model in enumerate(self.models):
            prefix = "" if len(self.models) == 1 else f"models[{i}]."
            for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
                names.setdefault(tensor, prefix + name)
        return names

    def _check_masters_behind_writes(self, extra: Any) -> Dict[torch.Tensor, torch.Tensor]:
        """The checkpoint's masters behind written model values (see ``state_dict``), by tensor,
        validated: each must name a tensor with an FP32 master here, in its shape."""
        saved = (extra or {}).get("masters_behind_writes") if isinstance(extra, dict) else None
        if not saved:
            return {}
        if not isinstance(saved, dict):
            raise ValueError("the checkpoint's ampinit masters_behind_writes must be a dict of tensors by name; got "
                             f"{type(saved).__name__}.  Nothing was loaded")
        by_name = {name: t for t, name in self._tensor_names().items()}
        values, ignored = {}, []
        for name, value in saved.items():
            tensor = by_name.get(name)
            if tensor is None or not isinstance(value, torch.Tensor) or value.shape != tensor.shape:
                raise ValueError(f"the checkpoint's FP32 master of {name!r} (masters_behind_writes) matches no "
                                 "parameter or buffer of this initialization's models, in name and shape.  Nothing "
                                 "was loaded")
            if self.masters is None or tensor not in self.masters or self.masters.remainders_of(tensor) is not None:
                ignored.append(name)  # another level, or a master kept as remainders: the model's value stands
                continue
            values[tensor] = value.to(device=self.masters.master_of(tensor).device, dtype=torch.float32)
        if ignored:
            names = ", ".join(ignored[:3]) + (", ..." if len(ignored) > 3 else "")
            self.log(0, f"ampinit: the checkpoint kept FP32 masters behind written model values ({names}); "
                        "this initialization keeps no FP32 master of them "
                        "(another opt_level, or remainders), so they take the model's loaded values", logging.WARNING)
        return values

    def _check_counters(self, extra: Any) -> Optional[List[Dict[str, Any]]]:
        """The ``ampinit`` section of a checkpoint, validated (``None`` for apex's)."""
        if extra is None:
            return None
        if not isinstance(extra, dict) or extra.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported ampinit state version in checkpoint: {extra!r:.80}")
        config = extra.get("config", {})
        counters = extra.get("optimizers", [])
        if not isinstance(config, dict) or not isinstance(counters, list):
            raise ValueError("the checkpoint's ampinit section is malformed: 'config' must be a dict and "
                             "'optimizers' a list")
        if len(counters) != len(self._bindings):
            raise ValueError(f"checkpoint has state for {len(counters)} optimizer(s), this "
                             f"initialization has {len(self._bindings)}")
        checked = []
        for index, counts in enumerate(counters):
            if not isinstance(counts, dict):
                raise ValueError(f"the checkpoint's ampinit counters of optimizer {index} must be a dict; got "
                                 f"{type(counts).__name__}")
            entry = {}
            for key in ("steps", "skipped_steps", "skips_at_floor", "last_overflow_step"):
                value = counts.get(key, None if key == "last_overflow_step" else 0)
                if key == "last_overflow_step" and value is None:
                    entry[key] = None
                    continue
                if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2 ** 63:
                    raise ValueError(f"the checkpoint's ampinit counter {key} of optimizer {index} must be an "
                                     f"int >= 0; got {value!r}")
                entry[key] = value
            checked.append(entry)
        saved_level = config.get("opt_level")
        if saved_level is not None and saved_level != self.config.opt_level:
            self.log(0, f"ampinit: loading state saved at opt_level {saved_level} into "
                        f"opt_level {self.config.opt_level}", logging.WARNING)
        return checked

    # -- ending -----------------------------------------------------------------------------------
    def check_not_ended(self) -> None:
        if self.ended:
            raise RuntimeError("this ampinit initialization has ended (ampinit.end); call ampinit.initialize again")

    def end(self) -> None:
        """Undo this initialization: hooks removed, optimizers back to their own class with
        the model parameters in ``param_groups``, and every cast tensor back to its original
        dtype (taking its FP32 value, the master's for a parameter).  Idempotent."""
        if self.ended:
            return
        for model in self.models:
            self.note_unmastered_parameters(model)
        if self.masters is not None:
            try:  # the model's writes since the last step (no_grad, .data, prune.remove) first
                self.masters.sync()
            except RuntimeError:
                # the model was cast or moved after initialize (model.float()): its values are no
                # longer what ampinit wrote, and end() is the way out of that, so the masters stand
                logger.debug("ampinit: end() of a model cast or moved after initialize keeps the masters' values")
        self.ended = True
        for binding in self._bindings:
            _uninstall_masters(binding)
            amp_optimizer.detach(binding.optimizer, self._optimizer_hooks.pop(id(binding.optimizer), []))
        for hook in self._hooks:
            hook.remove()
        if self.masters is not None:
            self.masters.restore()
        with torch.no_grad():
            for casting in self._castings:
                casting.remove()
                for tensor, dtype in casting.original_dtypes.items():
                    if tensor.dtype != dtype:
                        tensor.data = tensor.data.to(dtype)
                    if isinstance(tensor, nn.Parameter) and tensor.grad is not None and tensor.grad.dtype != dtype:
                        tensor.grad = tensor.grad.to(dtype)
        if self.masters is None:
            for binding in self._bindings:
                self._state_follows_params(binding.optimizer,
                                           [t for casting in self._castings for t in casting.original_dtypes])
        for model in self.models:
            links.detach_model(model, self._link)
        links.unmark_parameters(self._added_params, self._link)
        self._link.handle = None
        self.log(1, f"ampinit: ended opt_level {self.config.opt_level} initialization")


def _remap_state(optimizer: torch.optim.Optimizer, mapping: Dict[torch.Tensor, torch.Tensor],
                 dtype: Optional[torch.dtype]) -> None:
    """Move optimizer state from ``mapping``'s keys to its values, floating-point entries
    (but ``step``) cast to ``dtype`` (default: the new key's dtype)."""
    state = optimizer.state
    for old, new in mapping.items():
        if dict.__contains__(state, old):  # by the exact keys (see optimizer.MasterKeyedState)
            entry = dict.pop(state, old)
            dict.__setitem__(state, new, {k: v.to(dtype or new.dtype)
                                          if k != "step" and isinstance(v, torch.Tensor) and v.is_floating_point()
                                          else v for k, v in entry.items()})


def _uninstall_masters(binding: OptimizerBinding) -> None:
    """Model parameters take their places back in ``param_groups`` (with their masters' gradients,
    in FP32 until the cast is undone); optimizer state follows them."""
    amp_optimizer.plain_state(binding.optimizer)
    model_of = {master: model for model, master in binding.flow.distinct_pairs()}
    if not model_of:
        return
    binding.flow.materialize_deferred()
    with torch.no_grad():
        for master, model in model_of.items():
            model.grad = None
            model.data = master.data
            model.grad = master.grad
    for group in binding.optimizer.param_groups:
        group["params"] = [model_of.get(p, p) for p in group["params"]]
    _remap_state(binding.optimizer, model_of, None)
