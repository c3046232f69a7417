"""How an initialization is reached from the objects it set up, and what it hooks on them.

The model holds a :class:`HandleLink` to its :class:`~ampinit.AmpHandle` (a copy or an
unpickled model gets a dead one); each parameter carries weak marks of the initializations
holding it; each module gets ``state_dict``/``load_state_dict``/forward hooks that report and
load FP32 values and refuse ``assign=True``.  A process-wide optimizer step pre-hook checks
optimizers that no ``initialize`` bound.  Nothing here owns an initialization: the user's
model and optimizer do (see :class:`ModuleHook` for the one exception).
"""

from __future__ import annotations

import collections
import gc
import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, Iterator, List, Optional

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from . import optimizer as amp_optimizer

if TYPE_CHECKING:
    from .handle import AmpHandle

__all__ = ["HandleLink", "WeakLink", "handle_of_model", "handles_holding", "handles_holding_parameter",
           "found_after_collecting", "attach_model", "detach_model", "mark_parameters", "unmark_parameters",
           "watch_foreign_steps", "cast_tensors_of", "ModulesMadeLater", "SaveFP32Values", "LoadFP32Values",
           "RefuseAssign", "ReportingWindow", "BeforeForward"]

_MODEL_ATTR = "_ampinit_handle"
_PARAM_ATTR = "_ampinit_held_by"  # on each parameter of an initialized model: its WeakLinks


class DeadWhenCopied:
    """A reference to an initialization that a copy (``copy``, ``deepcopy``, pickling) of its
    holder does not share: the copy gets an empty one of the same class."""

    def __reduce__(self):
        return (type(self), ())

    def __deepcopy__(self, memo: dict) -> "DeadWhenCopied":
        return type(self)()

    def __copy__(self) -> "DeadWhenCopied":
        return type(self)()


class HandleLink(DeadWhenCopied):
    """The model's reference to its handle.  A copy or an unpickled model gets a dead link:
    it is not initialized, and its copy does not hold the optimizer."""

    def __init__(self, handle: Optional["AmpHandle"] = None):
        self.handle = handle


def handle_of_model(model: nn.Module) -> Optional["AmpHandle"]:
    link = model.__dict__.get(_MODEL_ATTR)
    return link.handle if isinstance(link, HandleLink) else None


def handles_holding(module: nn.Module) -> List["AmpHandle"]:
    """The live initializations ``module`` belongs to: as the model itself (first), or as one of
    the modules of their models, which all carry their ``RefuseAssign`` hooks.  Several only
    where a module is shared by initializations that may share it (O0/O1/O4, or a frozen teacher)."""
    own = handle_of_model(module)
    found = [] if own is None else [own]
    dead = []
    for key, hook in module._load_state_dict_pre_hooks.items():
        hook = getattr(hook, "hook", hook)  # torch wraps hooks registered with_module
        if not isinstance(hook, RefuseAssign):
            continue
        if hook.link.handle is None:
            dead.append(key)  # of an initialization that is gone: dropped on the way
        elif hook.link.handle not in found:
            found.append(hook.link.handle)
    for key in dead:
        del module._load_state_dict_pre_hooks[key]
    return found


class WeakLink(DeadWhenCopied):
    """A weak reference to an initialization's link, held by what the initialization does not
    own: a parameter's mark of the initializations that hold it, and the hooks on the modules of
    its model.  A parameter that C++ holds too (DDP's reducer, FSDP) must close no reference cycle
    through the handle, which would then live until the interpreter's shutdown, process group and
    all; a module shared with a model that was dropped (a backbone reused across folds) must not
    keep that model's initialization alive.  The model itself and the optimizers hold the link,
    so it lives while either does.  A copy is dead."""

    def __init__(self, link: Optional[HandleLink] = None):
        self._ref = None if link is None else weakref.ref(link)

    @property
    def link(self) -> Optional[HandleLink]:
        return None if self._ref is None else self._ref()


class ParameterMarks(list):
    """A parameter's :class:`WeakLink` s (under ``_PARAM_ATTR`` in its ``__dict__``, which torch
    pickles with it).  A copy (``deepcopy``, or a pickle: ``torch.save(list(model.parameters()))``,
    ``model.state_dict(keep_vars=True)``) is held by no initialization and gets an empty
    ``OrderedDict``, which ``torch.load(weights_only=True)`` accepts in every torch ampinit
    supports (it refuses ampinit's classes)."""

    def __reduce__(self):
        return (collections.OrderedDict, ())


_DEAD_LINK = HandleLink()  # what a module hook sees once its initialization is gone


class ModuleHook:
    """Base of the hooks an initialization puts on the modules of its model.  Where it cast them
    (O2/O3/O5) they hold it: it keeps their FP32 values, which ``ampinit.end(module)`` gives back
    after the model and optimizer were dropped (an encoder kept from a fold).  Otherwise (O0/O1/
    O4) they reach it through a :class:`WeakLink` and do nothing once it is gone, so that a
    module shared with a dropped model does not keep that model's initialization alive."""

    def __init__(self, link: HandleLink):
        handle = link.handle
        self._strong = link if handle is not None and handle.keeps_copies else None
        self._weak = WeakLink(link)

    @property
    def link(self) -> HandleLink:
        return self._strong or self._weak.link or _DEAD_LINK


def found_after_collecting(look: Callable[[], Any]) -> Any:
    """``look()``; where it finds something, ``look()`` again after the garbage collector ran.
    An initialization whose model and optimizer were dropped lives on in their reference cycle
    (model, link, handle, optimizer) until the collector reaches it, and must not be found.
    ``look`` must return nothing that keeps an initialization alive (a string, a flag): a
    reference held across the collection would defeat it."""
    found = look()
    if found:
        gc.collect()
        found = look()
    return found


def handles_holding_parameter(param: torch.Tensor) -> List["AmpHandle"]:
    """The live initializations whose models or optimizers hold ``param`` (a weight tied into
    another model is found here, where its module is not).  Marks of initializations that are
    gone are dropped on the way (dropped folds sharing a backbone would pile them up)."""
    marks = param.__dict__.get(_PARAM_ATTR)
    if not marks or not isinstance(marks, ParameterMarks):  # (a copy's empty OrderedDict)
        return []
    handles = []
    for mark in marks:
        link = mark.link if isinstance(mark, WeakLink) else None
        if link is not None and link.handle is not None:
            handles.append(link.handle)
    if len(handles) < len(marks):
        marks[:] = [mark for mark in marks if isinstance(mark, WeakLink) and mark.link is not None
                    and mark.link.handle is not None]
    return handles


def _check_foreign_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global step pre-hook (see :func:`watch_foreign_steps`): an optimizer that no ``initialize``
    bound, stepping parameters a live initialization holds (a stage-2 optimizer built over
    ``model.parameters()`` after ``initialize``), is checked once by each such initialization,
    with the parameters of its that the optimizer holds.  One dict lookup per parameter."""
    if torch.compiler.is_compiling() or amp_optimizer.binding_of(optimizer) is not None:
        return  # (a compiled step: dynamo cannot trace parameters' __dict__)
    held: Dict[int, tuple] = {}
    for group in getattr(optimizer, "param_groups", None) or ():
        for param in group["params"]:
            if _PARAM_ATTR in param.__dict__:
                for handle in handles_holding_parameter(param):
                    held.setdefault(id(handle), (handle, []))[1].append(param)
    for handle, params in held.values():
        handle.check_foreign_step(optimizer, params)


_FOREIGN_STEP_HOOK = None  # torch's handle of the hook, registered once (the first initialize)


def watch_foreign_steps() -> None:
    """Register :func:`_check_foreign_step` with torch, once per process.  It costs an optimizer
    that ampinit did not bind one dict lookup per parameter per step."""
    global _FOREIGN_STEP_HOOK
    if _FOREIGN_STEP_HOOK is None:
        _FOREIGN_STEP_HOOK = register_optimizer_step_pre_hook(_check_foreign_step)


def mark_parameters(params: Iterable[torch.Tensor], link: HandleLink) -> None:
    for param in params:
        marks = param.__dict__.get(_PARAM_ATTR)
        if not isinstance(marks, ParameterMarks):  # none yet, or a copy's empty OrderedDict
            marks = param.__dict__[_PARAM_ATTR] = ParameterMarks()
        if all(mark.link is not link for mark in marks):
            marks.append(WeakLink(link))


def unmark_parameters(params: Iterable[torch.Tensor], link: HandleLink) -> None:
    for param in params:
        marks = param.__dict__.get(_PARAM_ATTR)
        if isinstance(marks, ParameterMarks):
            marks[:] = [mark for mark in marks if mark.link is not link and mark.link is not None]
            if not marks:
                del param.__dict__[_PARAM_ATTR]


def attach_model(model: nn.Module, link: HandleLink) -> None:
    """Make ``model`` and its parameters lead to ``link``'s initialization."""
    model.__dict__[_MODEL_ATTR] = link
    mark_parameters(model.parameters(), link)


def detach_model(model: nn.Module, link: HandleLink) -> None:
    """Undo :func:`attach_model` (``ampinit.end``)."""
    if model.__dict__.get(_MODEL_ATTR) is link:
        del model.__dict__[_MODEL_ATTR]
    unmark_parameters(model.parameters(), link)


def cast_tensors_of(module: nn.Module, original: Dict[torch.Tensor, torch.dtype]) -> List[tuple]:
    """``(name, tensor, original dtype)`` of the cast tensors ``module`` holds now, found by
    identity: a parameter renamed since ``initialize`` (pruning's ``weight_orig``) is found too."""
    return [(name, t, original[t]) for name, t in list(module._parameters.items()) + list(module._buffers.items())
            if t is not None and t in original]


class ModulesMadeLater:
    """``(key prefix, module)`` of a model's modules that got no hooks of their own at
    ``initialize``.  A pickled or copied model has a dead link, so a copy keeps no module set."""

    def __init__(self) -> None:
        self.hooked: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()

    def __call__(self, root: nn.Module) -> Iterator[tuple]:
        # every name of a module shared under several: each is a key of the state_dict
        for name, module in root.named_modules(remove_duplicate=False):
            if module not in self.hooked:
                yield (name + "." if name else ""), module

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.hooked = weakref.WeakSet()


class CastTensorHook(ModuleHook):
    """A ``state_dict``/``load_state_dict`` hook of one module that finds its cast tensors when
    called (see :func:`cast_tensors_of`).  With ``later_modules`` (on the model itself) it
    serves the modules made after ``initialize`` instead, which hold cast tensors moved into
    them (a parametrization's ``original``)."""

    def __init__(self, link: HandleLink, later_modules: Optional[Callable[[nn.Module], Iterator[tuple]]] = None):
        super().__init__(link)
        self.later_modules = later_modules

    def owners(self, module: nn.Module, prefix: str) -> List[tuple]:
        """``(key prefix, module)`` of the modules this hook serves."""
        return [(prefix, module)] if self.later_modules is None else \
            [(prefix + sub_prefix, sub) for sub_prefix, sub in self.later_modules(module)]

    def cast_tensors(self, handle: "AmpHandle", module: nn.Module, prefix: str) -> Iterator[tuple]:
        """``(state_dict key, tensor, original dtype)`` of the cast tensors this hook serves."""
        for owner_prefix, owner in self.owners(module, prefix):
            for name, tensor, dtype in cast_tensors_of(owner, handle.reported_dtypes):
                yield owner_prefix + name, tensor, dtype


class SaveFP32Values(CastTensorHook):
    """``model.state_dict()`` hook: cast tensors report their FP32 values (the masters), in
    their original dtypes.  A copy of the model (dead link: an EMA made with ``copy.deepcopy``)
    has no masters and reports its own tensors, as torch does, so in-place updates through its
    state_dict (timm's ``ModelEma``, YOLO's ``ModelEMA``) reach it."""

    def __call__(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
        handle = self.link.handle
        if handle is None:
            return
        for key, tensor, dtype in self.cast_tensors(handle, module, prefix):
            if key not in state_dict:
                continue
            keep_vars = isinstance(state_dict[key], nn.Parameter)  # state_dict(keep_vars=True)
            value = handle.report_fp32_value(tensor, dtype, keep_vars)
            # no master (O3): its value in the original dtype, a copy, as apex reported it
            state_dict[key] = state_dict[key].to(dtype) if value is None else value
        for owner_prefix, owner in self.owners(module, prefix):  # 16-bit parameters made since, logged
            handle.note_unmastered_parameters(owner, owner_prefix, recurse=False)


class ReportingWindow:
    """``model.state_dict()`` pre- and post-hook of an initialized model: one batched sync of
    every cast tensor before the call (one fingerprint pass), which the per-module hooks then
    rely on instead of syncing each tensor on its own."""

    def __init__(self, link: HandleLink, opening: bool):
        self.link = link
        self.opening = opening

    def __call__(self, module: nn.Module, *args: Any) -> None:
        handle = self.link.handle
        if handle is not None and handle.masters is not None:
            handle.masters.set_reporting(self.opening)


class BeforeForward:
    """Forward pre-hook of an initialized model with masters, for what the model and its
    masters must agree on before it computes:

    - values of ``model.state_dict()`` written in place while the dict is still alive (else
      the forward would use the old weights until the dict is dropped or the next step);
    - ``requires_grad`` set on either a parameter or its master (``param_groups``), so the
      forward computes the gradients the optimizer will use, as with torch's one object;
    - masters written outside ``step()`` (SAM's perturbation), copied into the model.

    Python checks of two flags and a version counter per parameter, no tensor work unless
    something changed (see ``MasterWeights.before_forward``).
    Skipped while ``torch.compile`` traces: a compiled forward sees such writes at the next
    sync (the dict dropped, ``step()``, ``model.state_dict()``) and flags at the backward."""

    def __init__(self, link: HandleLink):
        self.link = link

    def __call__(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            return
        handle = self.link.handle
        if handle is None or handle.masters is None:
            return
        if handle.masters.has_reports:  # first: a write into a reported master bumps its version too
            handle.masters.adopt_written_reports()
        handle.masters.before_forward()


class LoadFP32Values(CastTensorHook):
    """``model.load_state_dict()`` hooks: cast tensors load their FP32 values too, so a
    checkpoint's full-precision values are not lost to the model's rounding.  The pre-hook
    only notes the dict; the post-hook (:meth:`after_load`) reads it once every pre-hook of the
    module has run, those registered after ``initialize`` included: a hook that renames legacy
    keys or transforms values in place (F12) is seen, as on the FP32 model.  The model then
    holds the rounding of what the master takes, written by torch's own load before it."""

    def __init__(self, link: HandleLink, later_modules: Optional[Callable[[nn.Module], Iterator[tuple]]] = None):
        super().__init__(link, later_modules)
        self._noted: Optional[tuple] = None

    def __call__(self, module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        # weakly where it can (torch's load works on its own OrderedDict copy): a load that
        # raises before the post-hook must not keep the checkpoint alive until the next one
        try:
            self._noted = (weakref.ref(state_dict), prefix)
        except TypeError:
            self._noted = ((lambda: state_dict), prefix)

    def after_load(self, module: nn.Module, incompatible_keys: Any) -> None:
        noted, self._noted = self._noted, None
        handle = self.link.handle
        if handle is None or noted is None:
            return
        state_dict, prefix = noted[0](), noted[1]
        if state_dict is None:
            return
        for key, tensor, _ in self.cast_tensors(handle, module, prefix):
            value = state_dict.get(key)
            if isinstance(value, torch.Tensor):
                handle.load_fp32_value(tensor, value)


def register_state_dict_hooks(module: nn.Module, save: "SaveFP32Values", load: LoadFP32Values) -> List[Any]:
    """Put ``save`` first among ``module``'s state_dict post-hooks, those registered before
    ``initialize`` (in a module's ``__init__``) included, so that they see the FP32 values as
    they would on the FP32 model: a hook that folds a constant into a weight for export, stores
    it in half or renames keys (F12: ampinit's ran after them, overwrote the fold and skipped
    renamed keys, which stayed 16-bit).  torch offers no ``prepend`` for these hooks; its
    ordered dict of them is reordered the way its own ``prepend=True`` does for forward hooks.
    ``load`` as a pre-hook and as the first post-hook (see :class:`LoadFP32Values`)."""
    first = _first(module, "_state_dict_hooks", module.register_state_dict_post_hook(save))
    return [first, module.register_load_state_dict_pre_hook(load),
            _first(module, "_load_state_dict_post_hooks", module.register_load_state_dict_post_hook(load.after_load))]


def _first(module: nn.Module, hooks_attribute: str, handle: Any) -> Any:
    """Move a just registered hook before the module's others of its kind (those a user's hook
    registered before ``initialize`` included: a load post-hook that raises would otherwise keep
    the masters from the checkpoint's values, G21)."""
    registered = getattr(module, hooks_attribute, None)
    if isinstance(registered, collections.OrderedDict) and handle.id in registered:
        registered.move_to_end(handle.id, last=False)
    return handle


class RefuseAssign(ModuleHook):
    """``load_state_dict()`` pre-hook of every module of the model, run before its other hooks:
    ``assign=True`` would put the checkpoint's tensors in place of cast ones (FP32 tensors in a
    16-bit model, with no master behind them).  The module ``load_state_dict`` was called on
    runs it first and checks its whole subtree, before torch assigns anything."""

    def __call__(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict, *args: Any) -> None:
        handle = self.link.handle
        if handle is None or not local_metadata.get("assign_to_params_buffers"):
            return
        keys = [prefix + sub_prefix + (sub_prefix and ".") + name
                for sub_prefix, sub in module.named_modules(remove_duplicate=False)
                for name, _, _ in cast_tensors_of(sub, handle.reported_dtypes)]
        assigned = [key for key in keys if key in state_dict]
        if assigned:
            raise RuntimeError(
                f"load_state_dict(..., assign=True) would replace {', '.join(assigned[:3])}"
                f"{', ...' if len(assigned) > 3 else ''}, which ampinit cast (and whose FP32 masters the optimizer "
                "updates), by the checkpoint's tensors: the model would run in their dtype and stop training.  "
                "Load without assign=True: ampinit writes the values into the model and its FP32 masters.  "
                "(To load with assign=True, do it before ampinit.initialize.)  Nothing was loaded")
