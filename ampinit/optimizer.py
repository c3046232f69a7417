"""The optimizer that ``initialize`` hands back, and optimizers that wrap another one.

It is the user's own optimizer object, its class swapped for a subclass made once per
optimizer class (``isinstance`` checks, ``state_dict`` layouts, LR schedulers and step hooks
all keep working).  The subclass's ``step`` asks the binding (``ampinit.binding``) whether to
run the update and finishes the step after it; step hooks registered on the instance do the
same for a ``step`` that bypasses the class.  ``zero_grad`` and ``add_param_group`` reach the
masters.  ``AmpHandle.end`` swaps the original class back and removes the hooks.

An object that is not a ``torch.optim.Optimizer`` but wraps one and shares its
``param_groups`` (apex's LARC, or any "LARC-style" wrapper) is accepted wherever an optimizer
is: ampinit binds the optimizer inside.
"""

from __future__ import annotations

import collections
import functools
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

if TYPE_CHECKING:  # pragma: no cover
    from .binding import OptimizerBinding
    from .handle import AmpHandle

__all__ = ["amp_optimizer_class", "binding_of", "inner_optimizer", "attach", "detach", "MasterKeyedState",
           "key_state_by_masters", "plain_state"]

_BINDING_ATTR = "_ampinit_binding"
_ENDED_ATTR = "_ampinit_ended"
_WRAPPED_ATTRS = ("optim", "optimizer", "_optimizer")
_APEX_BACKWARD_HALVES = (
    "apex's private optimizer.{name}() (one half of apex's own scale_loss, which hand-written scale_loss "
    "context managers call) is not provided by ampinit: its gradients, masters and overflow check work "
    "differently.  Replace the hand-written context manager with ampinit's: `with amp.scale_loss(loss, "
    "optimizer, loss_id=...) as scaled_loss: scaled_loss.backward()`")


def inner_optimizer(obj: Any) -> Optional[torch.optim.Optimizer]:
    """The ``torch.optim.Optimizer`` that ``obj`` is, or that ``obj`` wraps while sharing its
    ``param_groups`` (LARC-style); ``None`` for anything else."""
    if isinstance(obj, torch.optim.Optimizer):
        return obj
    for name in _WRAPPED_ATTRS:
        inner = getattr(obj, name, None)
        if isinstance(inner, torch.optim.Optimizer) and getattr(obj, "param_groups", None) is inner.param_groups:
            return inner
    return None


def delegating_optimizer(optimizer: torch.optim.Optimizer) -> Optional[torch.optim.Optimizer]:
    """An optimizer that ``optimizer`` steps with ``param_groups`` of its own
    (``ZeroRedundancyOptimizer``, wrappers that shard or copy the parameters), else ``None``."""
    for name in _WRAPPED_ATTRS:
        inner = getattr(optimizer, name, None)
        if isinstance(inner, torch.optim.Optimizer) and inner is not optimizer \
                and inner.param_groups is not optimizer.param_groups:
            return inner
    return None


def binding_of(obj: Any) -> Optional["OptimizerBinding"]:
    """The ampinit binding of an optimizer (or LARC-style wrapper), or ``None``."""
    optimizer = inner_optimizer(obj)
    return None if optimizer is None else optimizer.__dict__.get(_BINDING_ATTR)


def was_ended(obj: Any) -> bool:
    """Whether ``ampinit.end`` ended the initialization of this optimizer."""
    optimizer = inner_optimizer(obj)
    return optimizer is not None and bool(optimizer.__dict__.get(_ENDED_ATTR))


def _apex_backward_half(name: str) -> property:
    """A property of the swapped class that finds ``name`` where the optimizer defines it (its
    own class after ampinit's in the MRO, or the instance: G21, a subclass's own method stays)
    and otherwise raises the AttributeError that says to use ``amp.scale_loss``.  A property,
    not ``__getattr__``, which would hide the AttributeError any other property raises (G22)."""
    def get(self: Any) -> Any:
        own = self.__dict__.get(name)
        if own is not None:
            return own
        for klass in type(self).__mro__:
            if klass is not _AmpOptimizerMixin and name in klass.__dict__:
                return klass.__dict__[name].__get__(self, type(self))
        raise AttributeError(_APEX_BACKWARD_HALVES.format(name=name))
    return property(get)


class _AmpOptimizerMixin:
    """Methods layered over the user's optimizer class (see the module docstring)."""

    @property
    def amp(self) -> "AmpHandle":
        """The :class:`~ampinit.AmpHandle` of the ``initialize`` call that made this optimizer."""
        return binding_of(self).handle

    def step(self, closure: Optional[Callable[[], Any]] = None):
        """Update the masters, unless a gradient of this step was inf/NaN, then copy them
        into the model.

        Synchronises with the device once: reading the step's ``found_inf`` flag decides
        whether to skip.  Steps after no ``scale_loss`` do not synchronise, and neither do
        the fused optimizers of ``ampinit.optim``, which skip on the device.
        """
        binding = binding_of(self)
        if binding is None:  # ended after an LR scheduler wrapped this bound method
            return type(self).step(self, closure)
        _reject_closure(closure)
        return binding.step_from_class(super().step)

    # Tell torch's Optimizer._patch_step_function (run again by load_state_dict) that this
    # step is already hooked: it calls the base class's hooked step, so step hooks run once.
    step.hooked = True

    # apex's names on the optimizers it processed, for scripts and frameworks that use them:
    # mmengine's ApexOptimWrapper tells from ``_amp_stash`` that initialize ran, DeepLearningExamples'
    # BERT resumes through ``_lazy_init_maybe_master_weights`` and ``all_fp32_from_fp16_params``.
    @property
    def _amp_stash(self) -> "_AmpStash":
        return _AmpStash(binding_of(self))

    def _lazy_init_maybe_master_weights(self) -> None:
        """apex made master weights lazily; ampinit made them in ``initialize``: nothing to do."""

    def _amp_lazy_init(self) -> None:
        """apex's call to finish that lazy setup early (Varuna, pipeline warm-ups): nothing to do."""

    def _master_params_to_model_params(self) -> None:
        """apex's O2 copy of this optimizer's FP32 masters into the model's 16-bit parameters,
        which scripts call after writing the masters through ``.data`` (Adasum's and BMUF's
        optimizers: ``master.data.copy_(value)``, which no version counter sees, so the next
        forward would compute with the old weights).  Without masters (O0, O1, O3, O4) the model's
        parameters are the ones written: nothing to do.  No host sync."""
        binding = binding_of(self)
        if binding is not None:
            binding.flow.copy_masters_to_model()

    # apex's two halves of its scale_loss, which hand-written scale_loss copies call (E13: at
    # least six public files).  Not emulated: ampinit's gradients, masters and overflow check
    # work differently: an AttributeError that says why (hasattr stays False), unless the
    # optimizer has its own (see _apex_backward_half).
    _prepare_amp_backward = _apex_backward_half("_prepare_amp_backward")
    _post_amp_backward = _apex_backward_half("_post_amp_backward")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of the masters and of the model parameters behind them, and
        the overflow flag of the step they belonged to (an abandoned backward must not skip
        the next step)."""
        binding = binding_of(self)
        if binding is not None:
            binding.flow.settle_model_clears()
            if set_to_none:
                for master in binding.flow.masters_model_of:
                    binding.flow.keep_spare(master)
        super().zero_grad(set_to_none=set_to_none)
        if binding is not None:
            binding.flow.zero_grad(set_to_none)
            binding.discard_step()

    def add_param_group(self, param_group: dict) -> None:
        """Add a group; its low-precision parameters get FP32 masters like the others."""
        binding = binding_of(self)
        if binding is None:
            return super().add_param_group(param_group)
        binding.handle.add_param_group(binding, param_group, super().add_param_group)

    def __reduce_ex__(self, protocol: Any) -> Any:
        """A copy (``copy.deepcopy``, ``torch.save`` of the optimizer object) is an optimizer of
        the original class over copies of its parameters, not bound to any model, as a copy of
        an initialized model is not bound either.  With master weights (O2/O5) it is refused:
        the copy would update copies of the masters, which no copy of the model follows."""
        binding = binding_of(self)
        if binding is not None and binding.flow.masters is not None and any(
                model is not master for model, master in binding.flow.pairs()):
            raise TypeError(
                f"an optimizer that ampinit.initialize gave FP32 master weights (opt_level "
                f"{binding.handle.config.opt_level!r}) cannot be copied or pickled: a copy would train copies of the "
                "masters that no copy of the model follows.  Save optimizer.state_dict() and ampinit.state_dict() "
                "(and the model's state_dict) instead, or copy the optimizer before initialize or after ampinit.end")
        reduced = super().__reduce_ex__(protocol)
        if not isinstance(reduced, tuple):
            return reduced
        rest = list(reduced[2:])
        if rest and isinstance(rest[0], dict) and (_BINDING_ATTR in rest[0] or _ENDED_ATTR in rest[0]):
            rest[0] = {k: v for k, v in rest[0].items() if k not in (_BINDING_ATTR, _ENDED_ATTR)}
        # pickle's __newobj__ insists on the object's own class: build the base class's instead
        return (_new_instance, (type(self)._ampinit_base,), *rest)

    def state_dict(self) -> dict:
        """torch's, over the masters (a group rebuilt from the model's parameters gets them back
        first: see ``AmpHandle.put_masters_back``)."""
        binding = binding_of(self)
        if binding is not None and binding.flow.masters is not None:
            binding.handle.put_masters_back(self)
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, which makes ``self.state`` anew: it is keyed by the masters again.  A group
        rebuilt from the model's parameters gets its masters back first, so that torch casts the
        loaded state to theirs (FP32), not to the model's 16 bits."""
        binding = binding_of(self)
        if binding is not None and binding.flow.masters is not None:
            binding.handle.put_masters_back(self)
        super().load_state_dict(state_dict)
        binding = binding_of(self)
        if binding is not None and binding.flow.masters is not None:
            key_state_by_masters(self, binding.flow.masters.master_param)


def _new_instance(cls: type) -> Any:
    """An empty ``cls`` for unpickling (its state is set by ``__setstate__``)."""
    return cls.__new__(cls)


class MasterKeyedState(collections.defaultdict):
    """``optimizer.state`` of an optimizer that updates FP32 masters: keyed by the masters, as the
    optimizer's own ``step`` reads it, and reachable through the model's parameters too.  Code
    that resets or reads the state of a layer by its weight (``del optimizer.state[layer.weight]``,
    ``optimizer.state[p]["exp_avg"].zero_()``) reaches the master's entry, where a plain
    ``defaultdict`` would make a new, empty entry for the model parameter: the reset would change
    nothing, and ``optimizer.state_dict()`` would fail on the stray key.  A key found as it is
    costs nothing extra; only missing keys, membership tests and writes are translated.  Copies
    (``copy()``, ``|``, pickling) translate nothing."""

    def __init__(self, *args: Any, master_param: Optional[Callable[[torch.Tensor], Optional[torch.Tensor]]] = None,
                 **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._master_param = master_param

    def _key(self, key: Any) -> Any:
        if self._master_param is not None and isinstance(key, torch.Tensor):
            master = self._master_param(key)
            if master is not None:
                return master
        return key

    def __missing__(self, key: Any) -> Any:
        master = self._key(key)
        return self[master] if master is not key else super().__missing__(key)

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(self._key(key), value)

    def __delitem__(self, key: Any) -> None:
        super().__delitem__(self._key(key))

    def __contains__(self, key: Any) -> bool:
        return super().__contains__(self._key(key))

    def get(self, key: Any, default: Any = None) -> Any:
        return super().get(self._key(key), default)

    def pop(self, key: Any, *default: Any) -> Any:
        return super().pop(self._key(key), *default)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        return super().setdefault(self._key(key), default)

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def __ior__(self, other: Any) -> "MasterKeyedState":
        self.update(other)
        return self

    def copy(self) -> collections.defaultdict:
        return collections.defaultdict(self.default_factory, dict.items(self))

    __copy__ = copy

    def __or__(self, other: Any) -> collections.defaultdict:
        merged = self.copy()
        merged.update(other)
        return merged

    def __ror__(self, other: Any) -> collections.defaultdict:
        merged = collections.defaultdict(self.default_factory, other)
        merged.update(dict.items(self))
        return merged

    def __reduce__(self) -> tuple:
        # a copy (copy.deepcopy, pickling the optimizer) is a plain defaultdict: it has no masters
        return (collections.defaultdict, (self.default_factory,), None, None, iter(dict.items(self)))


def key_state_by_masters(optimizer: torch.optim.Optimizer,
                         master_param: Callable[[torch.Tensor], Optional[torch.Tensor]]) -> None:
    """Make ``optimizer.state`` a :class:`MasterKeyedState` (the same entries), if it is torch's
    ``defaultdict(dict)``: an optimizer with a state of its own kind (a plain dict whose misses
    raise ``KeyError``, a read-only property) keeps it as it is."""
    state = optimizer.__dict__.get("state")
    if type(state) is not collections.defaultdict or state.default_factory is not dict:
        return
    try:
        optimizer.state = MasterKeyedState(dict, state, master_param=master_param)
    except (AttributeError, TypeError):  # a property on the class without a setter
        pass


def plain_state(optimizer: torch.optim.Optimizer) -> None:
    """Undo :func:`key_state_by_masters` (``ampinit.end``)."""
    if isinstance(optimizer.state, MasterKeyedState):
        optimizer.state = collections.defaultdict(dict, dict.items(optimizer.state))


class _AmpStash:
    """The parts of apex's ``optimizer._amp_stash`` that scripts read (see the mixin)."""

    lazy_init_called = True
    already_patched = False

    def __init__(self, binding: "OptimizerBinding"):
        pairs = list(binding.flow.pairs())
        self.all_fp16_params = [model for model, master in pairs if model is not master]
        self.all_fp32_from_fp16_params = [master for model, master in pairs if model is not master]
        self.all_fp32_from_fp32_params = [master for model, master in pairs if model is master]
        self.params_have_scaled_gradients = binding.flow.pending is not None


def _reject_closure(closure: Any) -> None:
    if closure is not None:
        raise RuntimeError("ampinit does not support optimizer.step(closure): compute the loss and run "
                           "scale_loss(...).backward() before step().  Optimizers that need the closure "
                           "(LBFGS re-evaluates the loss inside its step) can't be initialized; train them "
                           "in FP32 (or under torch.autocast without loss scaling)")


def _step_pre_hook(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    binding = optimizer.__dict__.get(_BINDING_ATTR)
    if binding is None or binding.decided:
        return
    _reject_closure(args[1] if len(args) > 1 else kwargs.get("closure"))  # args[0] is the optimizer
    binding.step_begins_from_hook()


def _step_post_hook(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    binding = optimizer.__dict__.get(_BINDING_ATTR)
    if binding is not None:
        binding.step_ends()


@functools.lru_cache(maxsize=None)
def amp_optimizer_class(base: type) -> type:
    """The subclass of ``base`` that initialized optimizers become (made once per class)."""
    return type(base.__name__, (_AmpOptimizerMixin, base),
                {"__module__": base.__module__, "__qualname__": base.__qualname__,
                 "_ampinit_base": base})


def has_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` has torch's step hooks: not if its class never called
    ``Optimizer.__init__`` (the widely copied ``Lookahead``).  ampinit then runs its step
    through the class only, which a step bound before ``initialize`` (an LR scheduler's
    wrapper) would bypass: see :func:`step_bound_before`."""
    return hasattr(optimizer, "_optimizer_step_pre_hooks") and hasattr(optimizer, "_optimizer_step_post_hooks")


def step_bound_before(optimizer: torch.optim.Optimizer) -> bool:
    """Whether something replaced ``optimizer.step`` on the instance (an LR scheduler does)."""
    return "step" in optimizer.__dict__


def _inner_step_guard(outer: torch.optim.Optimizer, name: str, inner: torch.optim.Optimizer, args: tuple,
                      kwargs: dict) -> None:
    """Step pre-hook of an optimizer that a bound one holds and shares ``param_groups`` with:
    its step must run inside the bound one's (Lookahead's does); SAM's ``second_step`` runs it
    on its own, which would update the masters with no overflow check and no copy into the model."""
    binding = outer.__dict__.get(_BINDING_ATTR)
    if binding is None or binding.decided or binding.step_due:
        return
    outer_name = type(outer).__name__
    raise RuntimeError(
        f"{outer_name}.{name}.step() ran outside {outer_name}.step() (SAM's second_step does that), but "
        f"ampinit.initialize was given the {outer_name}: that update would skip ampinit's overflow check and "
        f"its copy into the model.  Initialize the optimizer that steps instead, and scale its losses: "
        f"model, _ = ampinit.initialize(model, opt.{name}, ...); with ampinit.scale_loss(loss, opt.{name}) ...")


def attach(optimizer: torch.optim.Optimizer, binding: "OptimizerBinding") -> list:
    """Bind ``optimizer``; returns the hook handles that :func:`detach` removes."""
    optimizer.__dict__.pop(_ENDED_ATTR, None)
    optimizer.__dict__[_BINDING_ATTR] = binding
    optimizer.__class__ = amp_optimizer_class(type(optimizer))
    guards = [inner.register_step_pre_hook(functools.partial(_inner_step_guard, optimizer, name))
              for name, inner in list(vars(optimizer).items())
              if isinstance(inner, torch.optim.Optimizer) and inner is not optimizer and has_step_hooks(inner)
              and getattr(inner, "param_groups", None) is getattr(optimizer, "param_groups", ())]
    if not has_step_hooks(optimizer):
        return guards  # its step is only reached through the class (see has_step_hooks)
    pre = optimizer.register_step_pre_hook(_step_pre_hook)
    post = optimizer.register_step_post_hook(_step_post_hook)
    # Ours run before hooks registered earlier: a post hook (an EMA of the model, say) must see
    # the model weights this step wrote.  torch has no prepend= for optimizer hooks.
    optimizer._optimizer_step_pre_hooks.move_to_end(pre.id, last=False)
    optimizer._optimizer_step_post_hooks.move_to_end(post.id, last=False)
    return [pre, post] + guards


def detach(optimizer: torch.optim.Optimizer, hooks: list) -> None:
    for hook in hooks:
        hook.remove()
    optimizer.__dict__.pop(_BINDING_ATTR, None)
    optimizer.__dict__[_ENDED_ATTR] = True
    optimizer.__class__ = optimizer.__class__._ampinit_base
