"""apex's ``amp`` API: ``initialize``, ``scale_loss``, ``master_params``, ``state_dict``,
``load_state_dict``, plus ``end`` and ``handle_of``.

The only module that wires the others together.  Each ``initialize`` makes an independent
:class:`~ampinit.AmpHandle` owned by the returned optimizer (``optimizer.amp``) and model.
For apex compatibility the module-level ``state_dict``/``load_state_dict``/``end`` act on the
*most recent* ``initialize`` call, remembered by a weak reference (so it never keeps a model
alive); with several live initializations, call the handle's own methods instead.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections import OrderedDict
from typing import Any, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parameter import is_lazy

from . import distributed
from . import optimizer as amp_optimizer
from .handle import AmpHandle
from .links import found_after_collecting, handle_of_model, handles_holding, handles_holding_parameter
from .opt_levels import AmpConfig, resolve_config

__all__ = ["initialize", "scale_loss", "master_params", "state_dict", "load_state_dict", "end",
           "handle_of"]

logger = logging.getLogger("ampinit")


class _DisabledInitialization:
    """What ``initialize(..., enabled=False)`` leaves behind: nothing but the fact."""

    def __init__(self, config: AmpConfig):
        self.config = config


# The most recent initialize call, which apex's module-level API refers to: a weak reference
# to an AmpHandle (it never keeps a model alive), or the stand-in of a disabled call.
_most_recent_slot: Any = None
# Every initialization still alive, weakly: apex's module-level state_dict()/load_state_dict()
# saved and loaded the one loss scaler all of them shared; ampinit's act on the most recent
# only, and say so where another could be the one whose scale matters (see _check_one_live).
_live: "weakref.WeakSet[AmpHandle]" = weakref.WeakSet()


def _most_recent() -> Any:
    slot = _most_recent_slot
    return slot() if isinstance(slot, weakref.ref) else slot


def _remember(handle: Any) -> None:
    global _most_recent_slot
    _most_recent_slot = weakref.ref(handle) if isinstance(handle, AmpHandle) else handle
    # the others' scaled losses so far: one that scales a loss after this initialize trains beside it
    handle.__dict__["_losses_of_others"] = {id(h): h.losses_scaled for h in list(_live)}
    if isinstance(handle, AmpHandle):
        _live.add(handle)


def _check_one_live(recent: Any, call: str) -> None:
    """Log once per initialization where apex's module-level ``call`` meets another live
    initialization that scaled a loss since the most recent one was made: apex's acted on the
    one loss scaler they all shared, this acts on the most recent's.  CMC (MoCo) initializes its
    EMA model last with an optimizer that never steps, so the trained model's scale was never
    saved.  (A fold loop's earlier folds stop training: not logged.)"""
    if recent.__dict__.get("_warned_module_level"):
        return
    then = recent.__dict__.get("_losses_of_others", {})
    others = [h for h in list(_live) if h is not recent and not h.ended and h.losses_scaled > then.get(id(h), 0)]
    if not others:
        return
    recent.__dict__["_warned_module_level"] = True
    if isinstance(recent, AmpHandle):
        what = f"opt_level={recent.config.opt_level!r}, optimizers: " + \
            (", ".join(type(o).__name__ for o in recent.optimizers) or "none")
    else:
        what = "enabled=False: nothing to save or load"
    logger.warning(
        "ampinit: amp.%s acts on the most recent initialize (%s), but %d other initialization(s) trained since "
        "it was made (optimizers: %s).  apex shared one loss scaler between them; ampinit keeps one per "
        "initialization, so the other's scale is not saved or loaded here.  Save and load each with "
        "optimizer.amp.state_dict() and optimizer.amp.load_state_dict() (its own optimizer's).  Logged once",
        call, what, len(others), ", ".join(type(o).__name__ for h in others for o in h.optimizers))


def _as_list(value: Any, name: str, check: Any) -> Tuple[List[Any], Optional[type]]:
    """``value`` as a list, and the container type it came in (``None`` for a single item)."""
    container = type(value) if isinstance(value, (list, tuple)) else None
    items = list(value) if container is not None else [value]
    if not items:
        raise ValueError(f"{name} is an empty list")
    for item in items:
        check(item)
    if len({id(item) for item in items}) != len(items):
        raise ValueError(f"the same object appears twice in {name}")
    return items, container


def _check_model_type(item: Any) -> None:
    if not isinstance(item, nn.Module):
        raise TypeError(f"models must be a torch.nn.Module or a list of them; got {type(item).__name__}")


def _check_optimizer_type(item: Any) -> None:
    if amp_optimizer.inner_optimizer(item) is None:
        raise TypeError(f"optimizers must be a torch.optim.Optimizer (or a LARC-style wrapper of one that "
                        f"shares its param_groups), or a list of them; got {type(item).__name__}")


def _shaped(items: List[Any], container: Optional[type]) -> Any:
    """``items`` in the shape they were passed in: one item, a list or a tuple."""
    if container is None:
        return items[0]
    return tuple(items) if issubclass(container, tuple) else items


def _model_device(models: Sequence[nn.Module]) -> torch.device:
    devices = {t.device for m in models for t in list(m.parameters()) + list(m.buffers())
               if t.is_floating_point()}
    if len(devices) > 1:
        raise ValueError(f"the model's tensors are on several devices ({sorted(map(str, devices))}); "
                         "ampinit needs one device per initialize: move the model with .to(device)")
    return devices.pop() if devices else torch.device("cpu")


def _check_models(models: Sequence[nn.Module], config: AmpConfig) -> None:
    wrappers = (nn.parallel.DistributedDataParallel, nn.DataParallel)
    for model in models:
        if config.casts_model and any(distributed.is_sharded(p) for p in model.parameters()):
            raise ValueError(
                f"opt_level={config.opt_level!r} casts the model, but its parameters are sharded "
                "by FSDP2 (DTensor), which keeps its own FP32 storage and casts for compute "
                "itself.  Let FSDP2 do the casting and ampinit the loss scaling: "
                "fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16, "
                "reduce_dtype=torch.float32)) and then ampinit.initialize(model, optimizer, "
                "opt_level='O0', loss_scale='dynamic'); FSDP2's sharded FP32 parameters are the "
                "master weights.  O1/O4 (autocast) also work on a sharded model")
        if isinstance(model, wrappers):
            raise TypeError(f"the model is wrapped in {type(model).__name__}: call "
                            "ampinit.initialize on the plain model first, then wrap the "
                            "model it returns")
        if handle_of_model(model) is not None:
            raise RuntimeError("this model is already initialized by ampinit; call "
                               "ampinit.end(model) before initializing it again")
        if config.casts_model or config.master_weights:
            _check_no_lazy_tensors(model, config)
        if config.casts_model and config.keep_batchnorm_fp32:
            _check_no_float64_batchnorm(model, config)


def _check_nothing_shared_with_another_initialization(model: nn.Module, trained: set, config: AmpConfig) -> None:
    """A module or parameter shared with a model that another live ``initialize`` set up
    (sentence-transformers wraps one encoder in a loss model per objective and initializes each)
    would get two sets of FP32 masters, or be cast under the other's optimizer: each optimizer's
    updates would reach the other only through the 16-bit rounding, and ending one would write
    its stale values back.  Allowed where neither casts the model nor keeps masters (O0, O1, O4),
    and where the other initialization has no optimizer and this one trains none of the shared
    parameters (a frozen teacher initialized for inference, inside a student).  ``trained``:
    the ids of the parameters this initialization's optimizers hold."""
    conflict = found_after_collecting(lambda: _first_conflict(model, trained, config))
    if conflict is not None:
        what, opt_level = conflict
        raise RuntimeError(
            f"this model shares {what} with a model that an earlier ampinit.initialize (opt_level="
            f"{opt_level!r}) set up and has not ended: initialize them in one call, "
            "ampinit.initialize([model_a, model_b], [optimizer_a, optimizer_b]), so that shared parameters "
            "have one FP32 master and one owner; or end the earlier initialization first, "
            "ampinit.end(earlier_model) (a module of it will do).  A model initialized without an "
            "optimizer may be shared if this initialization's optimizers do not train it")


def _first_conflict(model: nn.Module, trained: set, config: AmpConfig) -> Optional[Tuple[str, str]]:
    """``(what is shared, the other's opt_level)`` of the first conflict, or ``None``.  Returns
    no handle: the caller collects garbage between two calls, which a reference would defeat."""
    def keeps_copies(of: AmpConfig) -> bool:
        return of.casts_model or bool(of.master_weights)

    def conflicts(other: AmpHandle, params: Iterable[torch.Tensor]) -> bool:
        if not (keeps_copies(config) or keeps_copies(other.config)):
            return False
        return bool(other.optimizers) or any(id(p) in trained for p in params)

    # a module's parameters are listed only where another initialization holds it
    for name, module in model.named_modules():
        for other in handles_holding(module):
            if conflicts(other, module.parameters()):
                return (f"its submodule {name!r}" if name else "it"), other.config.opt_level
    for name, param in model.named_parameters():
        for other in handles_holding_parameter(param):
            if conflicts(other, [param]):
                return f"its parameter {name!r}", other.config.opt_level
    return None


def _warn_of_16_bit_training_without_masters(models: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer],
                                             config: AmpConfig) -> None:
    """A model cast to fp16/bf16 before ``initialize`` at a level that neither casts nor keeps
    masters (O1, O4; O0 casts it to FP32) has its optimizers update the 16-bit weights directly, where most small
    updates round away (48 % of an embedding never moved in 100 SGD steps).  apex refused fp16
    parameters at every level unless told otherwise; pure-bf16 training is a choice some make,
    so this is logged (at any verbosity), not refused."""
    if config.master_weights or config.casts_model:
        return
    names = {id(p): name for model in models for name, p in model.named_parameters()}
    low = [p for opt in optimizers for group in opt.param_groups for p in group["params"]
           if p.requires_grad and p.dtype in (torch.float16, torch.bfloat16)]
    if low:
        logger.warning(
            "ampinit: %s is %s (%d trained parameter(s) are 16-bit), and opt_level=%r keeps no FP32 master weights: "
            "the optimizer updates the 16-bit weights directly, and most small updates round away.  Pass the model "
            "in FP32 (ampinit casts what the level casts: no model.half() needed), or use O2 (O5 for bfloat16), "
            "whose FP32 masters cover parameters you cast yourself", names.get(id(low[0]), "a parameter"),
            low[0].dtype, len(low), config.opt_level)


def _check_no_lazy_tensors(model: nn.Module, config: AmpConfig) -> None:
    """A lazy module's parameters have no shape until its first forward: they can be neither
    cast nor given an FP32 master, and finding that out half-way would leave the model cast."""
    named = list(model.named_parameters()) + list(model.named_buffers())
    lazy = [name for name, tensor in named if is_lazy(tensor)]
    if lazy:
        raise ValueError(
            f"{', '.join(lazy[:3])}{' ...' if len(lazy) > 3 else ''} {'is' if len(lazy) == 1 else 'are'} "
            f"uninitialized (a lazy module such as nn.LazyLinear that has not run a forward yet), so "
            f"opt_level={config.opt_level!r} can neither cast {'it' if len(lazy) == 1 else 'them'} nor keep an "
            "FP32 master: run one forward with a dummy batch before ampinit.initialize")


def _check_no_float64_batchnorm(model: nn.Module, config: AmpConfig) -> None:
    """``keep_batchnorm_fp32`` leaves batch norms as they are, as apex did: a float64 one would
    then meet the cast layers' outputs and fail in the forward, with torch's "mixed dtype"
    error naming no cause."""
    wide = [name for name, module in model.named_modules() if isinstance(module, _BatchNorm)
            and any(t.dtype == torch.float64 for t in list(module.parameters(recurse=False)) +
                    list(module.buffers(recurse=False)))]
    if wide:
        raise ValueError(
            f"{', '.join(wide[:3])}{' ...' if len(wide) > 3 else ''}: float64 batch norm, which opt_level="
            f"{config.opt_level!r} keeps as it is (keep_batchnorm_fp32): its forward would fail on the "
            f"{config.cast_model_type} layers' outputs.  Make it float32 before ampinit.initialize "
            "(module.float()), or pass keep_batchnorm_fp32=False to cast it too.  Nothing was changed")


def _check_optimizers(optimizers: Sequence[torch.optim.Optimizer], device: torch.device, config: AmpConfig) -> None:
    seen = set()
    for opt in optimizers:
        if amp_optimizer.binding_of(opt) is not None:
            raise RuntimeError("this optimizer is already initialized by ampinit; call "
                               "ampinit.end(optimizer) before initializing it again")
        if not amp_optimizer.has_step_hooks(opt) and amp_optimizer.step_bound_before(opt):
            raise RuntimeError(
                f"{type(opt).__name__} never called torch.optim.Optimizer.__init__, so it has no step hooks, and "
                "its step was replaced on the instance before initialize (an LR scheduler does that): that step "
                "would bypass ampinit's, and the model would not train.  Create the LR scheduler after "
                f"ampinit.initialize, or call super().__init__ in {type(opt).__name__}.__init__")
        if isinstance(amp_optimizer.inner_optimizer(opt), torch.optim.LBFGS):
            raise TypeError(
                "LBFGS re-evaluates the loss inside step(closure), which ampinit does not support (the loss "
                "scale, the overflow skip and the FP32 masters all sit between backward() and step()).  Train "
                "it in FP32, or under torch.autocast(device_type, dtype=torch.bfloat16) without ampinit")
        delegate = amp_optimizer.delegating_optimizer(opt)
        if delegate is not None and config.master_weights:
            raise ValueError(
                f"{type(opt).__name__} steps an optimizer of its own ({type(delegate).__name__}) over parameters "
                f"it keeps itself, so it would never update the FP32 master weights that opt_level="
                f"{config.opt_level!r} puts in its param_groups.  Use O1 (or O4) with it, or shard with FSDP2 "
                "(fully_shard with MixedPrecisionPolicy) and ampinit's O0 + loss_scale='dynamic'")
        if config.master_remainders and not getattr(opt, "_ampinit_fused", False):
            raise ValueError(
                f"master_weights='remainder' keeps FP32 masters as bfloat16 weights plus remainders, which only "
                f"ampinit's fused optimizers update (ampinit.optim.FusedAdam, FusedAdamW, FusedSGD, or apex's "
                f"names for them); got {type(opt).__name__}.  Use one of those, or master_weights=True")
        mine = set()
        for group in opt.param_groups:
            for param in group["params"]:
                if id(param) in mine:
                    raise ValueError(f"{type(opt).__name__} lists a parameter twice in its param_groups (torch.optim "
                                     "only warns, and updates it once per listing); list each parameter once")
                if id(param) in seen:
                    raise ValueError("a parameter is in two of the optimizers passed to "
                                     "initialize; give each parameter to one optimizer")
                mine.add(id(param))
                seen.add(id(param))
                if param.device != device:
                    raise ValueError(f"an optimizer parameter is on {param.device} but the model "
                                     f"is on {device}: build the optimizer from the model's "
                                     "parameters after moving the model")
        _warn_eps_zero_in_fp16(opt, config)


def _warn_eps_zero_in_fp16(opt: torch.optim.Optimizer, config: AmpConfig) -> None:
    """Pure fp16 (O3-like: fp16 model, no masters) with an ``eps`` that fp16 rounds to 0: a
    parameter whose gradient is exactly 0 gets 0/0 = NaN (the README's O3 + Adam trap)."""
    if config.cast_model_type != torch.float16 or config.master_weights:
        return
    tiny = [group["eps"] for group in opt.param_groups
            if isinstance(group.get("eps"), float) and 0 < group["eps"] and torch.tensor(group["eps"]).half() == 0]
    if tiny:
        logger.warning("ampinit: %s has eps=%g, which is 0 in fp16: with an fp16 model and no master weights "
                       "(opt_level=%r) a parameter whose gradient is 0 becomes NaN.  Use eps>=1e-4, or O2",
                       type(opt).__name__, tiny[0], config.opt_level)


def initialize(models: Union[nn.Module, Sequence[nn.Module]],
               optimizers: Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer], None] = None,
               enabled: Union[bool, str] = True, opt_level: str = "O1",
               cast_model_type: Union[torch.dtype, str, None] = None,
               patch_torch_functions: Union[bool, str, None] = None,
               keep_batchnorm_fp32: Union[bool, str, None] = None,
               master_weights: Union[bool, str, None] = None,
               loss_scale: Union[float, str, None] = None,
               cast_model_outputs: Union[torch.dtype, str, None] = None,
               num_losses: int = 1, verbosity: int = 1,
               min_loss_scale: Optional[float] = None, max_loss_scale: float = 2. ** 24, *,
               init_scale: Optional[float] = None, growth_interval: Optional[int] = None,
               growth_factor: Optional[float] = None, backoff_factor: Optional[float] = None,
               hysteresis: Optional[int] = None) -> Any:
    """Prepare models and optimizers for mixed precision (apex's signature and levels).

    Args:
        models: an ``nn.Module`` or a list of them; returned in the same shape.
        optimizers: an optimizer, a list of them, or ``None`` (then only models are returned).
        enabled: ``False`` returns everything untouched and makes ``scale_loss`` a no-op.
        opt_level: ``"O0"`` fp32; ``"O1"`` fp16 autocast in forward; ``"O2"`` fp16 model with
            FP32 masters; ``"O3"`` pure fp16; ``"O4"``/``"O5"`` the bf16 versions of O1/O2.
        cast_model_type, patch_torch_functions, keep_batchnorm_fp32, master_weights,
        loss_scale, cast_model_outputs: override the level's properties (apex's strings such
            as ``"True"`` or ``"128.0"`` are accepted).  ``master_weights="remainder"`` (bfloat16
            models, fused optimizers) keeps each FP32 master as the model's bfloat16 weight plus
            an int16 remainder: 2 bytes per parameter less, the same training bit for bit.
        num_losses: independent loss scalers, picked with ``scale_loss(..., loss_id=i)``.
        verbosity: 0 silent, 1 level and overflow messages, 2 more (through ``logging``).
        min_loss_scale, max_loss_scale: floor and ceiling of the dynamic loss scale.
        init_scale, growth_interval, growth_factor, backoff_factor, hysteresis: the dynamic loss
            scale's first value (2**16), clean backwards between growths (2000), its growth and
            back-off factors (2, 0.5) and the overflows tolerated before a back-off (1), as
            torch.amp's ``GradScaler`` names them (apex's defaults).

    Returns:
        ``models`` or ``(models, optimizers)``: the same objects, set up in place, in the shape
        they were passed (one object, a list or a tuple).  The optimizer's ``amp`` attribute is
        this initialization's :class:`~ampinit.AmpHandle`.

    Raises ``TypeError``/``ValueError``/``RuntimeError`` on bad input before changing anything.
    """
    config = resolve_config(opt_level, enabled=enabled, cast_model_type=cast_model_type,
                            patch_torch_functions=patch_torch_functions,
                            keep_batchnorm_fp32=keep_batchnorm_fp32, master_weights=master_weights,
                            loss_scale=loss_scale, cast_model_outputs=cast_model_outputs,
                            num_losses=num_losses, verbosity=verbosity,
                            min_loss_scale=min_loss_scale, max_loss_scale=max_loss_scale,
                            init_scale=init_scale, growth_interval=growth_interval, growth_factor=growth_factor,
                            backoff_factor=backoff_factor, hysteresis=hysteresis)
    model_list, model_shape = _as_list(models, "models", _check_model_type)
    opt_list, opt_shape = ([], None) if optimizers is None else \
        _as_list(optimizers, "optimizers", _check_optimizer_type)
    if not config.enabled:
        _remember(_DisabledInitialization(config))
        return models if optimizers is None else (models, optimizers)
    _check_models(model_list, config)
    device = _model_device(model_list)
    inner = [amp_optimizer.inner_optimizer(opt) for opt in opt_list]
    _check_optimizers(inner, device, config)
    trained = {id(p) for opt in inner for group in opt.param_groups for p in group["params"]}
    for model in model_list:
        _check_nothing_shared_with_another_initialization(model, trained, config)

    handle = AmpHandle(config, model_list, inner, device)
    _warn_of_16_bit_training_without_masters(model_list, inner, config)
    _remember(handle)
    if optimizers is None:
        return _shaped(model_list, model_shape)
    return _shaped(model_list, model_shape), _shaped(opt_list, opt_shape)


@contextlib.contextmanager
def scale_loss(loss: torch.Tensor, optimizers, loss_id: int = 0, model: Optional[nn.Module] = None,
               delay_unscale: bool = False, delay_overflow_check: bool = False) -> Iterator[torch.Tensor]:
    """Yield ``loss.float() * loss_scale`` for ``backward()``; on exit unscale the gradients
    into the master weights and check them for inf/NaN.

    An inf/NaN makes the next ``optimizer.step()`` a no-op and backs the loss scale off.
    ``delay_unscale=True`` leaves the gradients scaled so the next micro-batch accumulates
    onto them (gradient accumulation); the last ``scale_loss`` before ``step()`` must use
    ``delay_unscale=False``.  ``model`` and ``delay_overflow_check`` are accepted for apex
    compatibility: the overflow check is always deferred to ``step()``.

    No host synchronisation happens here; ``optimizer.step()`` reads the flag once.
    """
    if not isinstance(loss, torch.Tensor) or not loss.is_floating_point():
        raise TypeError(f"scale_loss needs the loss as a floating-point tensor; got "
                        f"{type(loss).__name__ if not isinstance(loss, torch.Tensor) else loss.dtype}")
    opt_list, _ = _as_list(optimizers, "optimizers", _check_optimizer_type)
    if not isinstance(delay_unscale, bool):
        raise TypeError(f"delay_unscale must be a bool; got {type(delay_unscale).__name__}")
    bindings = [amp_optimizer.binding_of(opt) for opt in opt_list]
    if all(b is None for b in bindings) and isinstance(_most_recent(), _DisabledInitialization):
        yield loss
        return
    if any(b is None and amp_optimizer.was_ended(opt) for b, opt in zip(bindings, opt_list)):
        raise RuntimeError("scale_loss got an optimizer whose ampinit initialization was ended by "
                           "ampinit.end(); call ampinit.initialize again to train it with ampinit")
    if any(b is None for b in bindings):
        raise RuntimeError("scale_loss got an optimizer that ampinit.initialize did not return: "
                           "call `model, optimizer = ampinit.initialize(model, optimizer, "
                           "opt_level=...)` first and pass that optimizer")
    handle = bindings[0].handle
    if any(b.handle is not handle for b in bindings):
        raise ValueError("scale_loss got optimizers from different initialize calls; scale "
                         "each loss with the optimizers of one initialization")
    with handle.scale_loss(loss, bindings, loss_id, delay_unscale) as scaled_loss:
        yield scaled_loss


def handle_of(obj: Any = None) -> AmpHandle:
    """The :class:`~ampinit.AmpHandle` of a model (or any module of one), an optimizer, or
    (``None``) of the most recent ``initialize`` call."""
    if isinstance(obj, AmpHandle):
        return obj
    if obj is None:
        handle = _most_recent()
        if handle is None:
            raise RuntimeError("no live ampinit initialization: call ampinit.initialize first")
        if isinstance(handle, _DisabledInitialization):
            raise RuntimeError("the most recent ampinit.initialize had enabled=False")
        return handle
    if amp_optimizer.inner_optimizer(obj) is not None:
        binding = amp_optimizer.binding_of(obj)
        if binding is not None:
            return binding.handle
    elif isinstance(obj, nn.Module):
        # the model (its own initialization comes first), or any module of it
        shared = handle_of_model(obj) is None and found_after_collecting(lambda: len(handles_holding(obj)) > 1)
        holding = handles_holding(obj)
        if shared:
            raise RuntimeError(
                f"this {type(obj).__name__} belongs to {len(holding)} live ampinit initializations (a module "
                "shared by models initialized separately): pass the model or the optimizer of the one you mean")
        if holding:
            return holding[0]
    else:
        raise TypeError(f"handle_of takes a model, an optimizer, an AmpHandle or None; got "
                        f"{type(obj).__name__}")
    raise RuntimeError(f"this {type(obj).__name__} was not initialized by ampinit (or its "
                       "initialization has ended)")


def master_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """The parameters ``optimizer`` updates: FP32 masters where there are any (apex API).
    Clip these, not the model's parameters: their ``.grad`` is the unscaled gradient.  Writes
    to the model since the last step (``p.data.clamp_()``) are adopted first.  With a
    fused optimizer (``ampinit.optim``) this unscales the gradients the kernel would otherwise
    read scaled from the model, into the masters' ``.grad``.  Raises inside the ``scale_loss``
    block after its backward where the gradients are not final there (still scaled, or not yet
    in the masters): call it after the block."""
    inner = amp_optimizer.inner_optimizer(optimizer)
    if inner is None:
        raise TypeError(f"master_params takes an optimizer; got {type(optimizer).__name__}")
    binding = amp_optimizer.binding_of(inner)
    if binding is not None and binding.flow.in_scale_loss and binding.flow.backward_reached:
        not_final = binding.why_grads_not_final_in_block()
        if not_final is not None:
            raise RuntimeError(
                "ampinit.master_params(optimizer) was called inside `with ampinit.scale_loss(loss, optimizer) as "
                f"scaled_loss:`, after the backward: there the gradients are {not_final}, so clipping them (or "
                "taking their norm) would act on the wrong values.  Call it after the with block, before "
                "optimizer.step(): the gradients are unscaled into the masters when the block ends.  Nothing was "
                "changed")
    if binding is not None:
        binding.flow.settle_model_clears()  # model.zero_grad() since: no stale master gradients
        binding.flow.materialize_deferred()
        if binding.flow.masters is not None:  # writes to the model since the last step, adopted
            binding.flow.masters.sync(binding.flow.models())
    for group in inner.param_groups:
        yield from group["params"]


def state_dict(destination: Optional[dict] = None) -> dict:
    """The most recent initialization's amp state (apex's ``loss_scaler<i>`` layout plus an
    ``ampinit`` entry).  Synchronises with the device.  Empty after ``enabled=False``."""
    recent = _most_recent()
    if destination is not None and not isinstance(destination, dict):
        raise TypeError(f"destination must be a dict; got {type(destination).__name__}")
    out = OrderedDict() if destination is None else destination
    if recent is not None:
        _check_one_live(recent, "state_dict()")
    if isinstance(recent, _DisabledInitialization):
        return out
    out.update(handle_of(None).state_dict())
    return out


def load_state_dict(state_dict: dict) -> None:
    """Load an amp state (ours or apex's) into the most recent initialization.  Call it after
    ``initialize`` and after loading the model and optimizer state, as apex documents."""
    recent = _most_recent()
    if recent is not None:
        _check_one_live(recent, "load_state_dict()")
    if isinstance(recent, _DisabledInitialization):
        logger.info("ampinit: load_state_dict ignored: the most recent initialize had enabled=False")
        return
    handle_of(None).load_state_dict(state_dict)


def end(obj: Union[nn.Module, torch.optim.Optimizer, AmpHandle, None] = None) -> None:
    """End the initialization of ``obj`` (a model, optimizer or handle; ``None``: the most
    recent): hooks removed, the model back in its original dtypes with the master values,
    the optimizer back to its own class updating the model's parameters."""
    handle_of(obj).end()
