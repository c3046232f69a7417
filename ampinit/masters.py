"""FP32 master values of the tensors that ``initialize`` casts to 16 bits.

With master weights (O2, O5) every floating-point parameter and buffer that the cast changes
keeps an FP32 value here, in the storage it had before the cast (no copy is made):

- a parameter's value is an ``nn.Parameter``, its *master*.  An optimizer that holds the
  parameter updates the master instead (it takes the parameter's place in ``param_groups``),
  and the model gets the master's rounding after each step.  A parameter no optimizer holds (a
  frozen backbone) keeps its master too, so ``model.state_dict()``, ``ampinit.end`` and a later
  ``add_param_group`` start from the FP32 value, not its rounding;
- a buffer's value is what ``model.state_dict()`` and ``end`` return.

Writes to the model from outside ampinit are adopted, so the model stays the truth for them:
``model.load_state_dict``, DDP's broadcast of rank 0's weights, an in-place update under
``no_grad`` or through ``tensor.data`` (WGAN's weight clipping).  Each time ampinit writes or
reads the model it marks each tensor with its version counter, storage and fingerprint
(``ops.fingerprint``, which any changed element changes; ``.data`` writes change only that).
Before every optimizer update, and whenever an FP32 value is read (``model.state_dict()``,
``end``, ``amp.master_params``, ``add_param_group``), each model tensor whose mark changed
was written: its master takes the model's value element by element wherever the model no
longer holds the master's rounding (``ops.adopt_changes_``), and every other element keeps its
FP32 precision.  A master written by the user (clamping ``amp.master_params``) is left alone,
and the model gets its rounding at the next step.  A tensor written on both sides between two
updates takes the model's values wherever they differ from the master's rounding.  Cost: a
fingerprint pass over the model after each step's copy and before each update (2 bytes per
16-bit parameter each).

With ``master_weights="remainder"`` (bfloat16 models) a parameter's master is not kept in FP32
storage: it is the model's bfloat16 weight (the master's round-to-nearest-even) plus an int16
remainder and a tie bit (``ops.split_masters_``), 2 bytes and 1 bit per parameter instead of 4.
The optimizer holds the model parameter itself; its fused kernel joins, updates and splits the
master.  ``model.state_dict()`` and ``end`` read the joined FP32 value; ``model.load_state_dict``
splits the loaded one.  ``amp.master_params`` yields the bfloat16 parameters themselves (their
``.grad`` is what the kernel reads: clip that).  A write to such a weight from outside ampinit
keeps its remainder where the written weight is finite and still the rounding of weight +
remainder: the master is then within half a bfloat16 ulp of the written value (a sign flip
makes it exactly minus the old master); elsewhere (a weight zeroed or set to inf) the master is
the written value itself.  An FP32 master takes the written value exactly wherever the write
changed the 16-bit weight.

Under ``torch.distributed`` the masters of parameters that an optimizer updates start from the
model's values at the first backward (as apex's did), unless a checkpoint was loaded: ranks
initialized from different seeds then hold identical masters once DDP has broadcast rank 0's
weights.
"""

from __future__ import annotations

import logging
import weakref
from typing import Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

from . import ops

__all__ = ["MasterWeights"]

logger = logging.getLogger("ampinit")


def _byte_span(tensor: torch.Tensor) -> Optional[Tuple[int, int, int]]:
    """``(storage address, first byte, end byte)`` of the memory a tensor's elements lie in, or
    ``None`` for an empty tensor."""
    if tensor.numel() == 0:
        return None
    size = tensor.element_size()
    first = tensor.storage_offset() * size
    last = first + sum((n - 1) * abs(stride) for n, stride in zip(tensor.shape, tensor.stride())) * size
    return tensor.untyped_storage().data_ptr(), first, last + size


def _stamp(tensor: torch.Tensor) -> Tuple[int, int, Tuple[int, ...]]:
    """What an in-place write (version counter), new storage (address) or a re-strided view of
    the same storage (``p.data = p.data.t()``: strides) changes; ``.data`` writes into the same
    storage change none of these, only the fingerprint."""
    return tensor._version, tensor.data_ptr(), tensor.stride()


class _ForwardChecks:
    """The parameters with FP32 masters as lists, for :meth:`MasterWeights.before_forward`:
    the ``requires_grad`` both had and the master's version counter when ampinit last saw them
    agree, and the dtype ``initialize`` cast the parameter to, compared in list comprehensions
    (rebuilt when a master is added or removed, or a flag settles)."""

    def __init__(self, models: List[torch.Tensor], masters: List[torch.Tensor], flags: List[bool],
                 versions: List[int], dtypes: List[torch.dtype]):
        self.models, self.masters, self.flags, self.versions = models, masters, flags, versions
        self.dtypes = dtypes
        self.index = {model: i for i, model in enumerate(models)}


def _unwritten(watch: weakref.finalize) -> bool:
    """Whether the reported value a watch of ``MasterWeights.report`` holds is alive and was not
    written since (its version counter unchanged)."""
    pending = watch.peek()
    return pending is not None and pending[2][1]._version == pending[2][2]


def _joined(weight: torch.Tensor, parts: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The FP32 master of a bfloat16 weight kept with remainders, in the weight's layout.  A
    weight whose memory format changed since ``initialize`` (channels_last) keeps remainders in
    the element order it had then, which its contiguous copy has: read through that copy."""
    joined = ops.join_masters([weight.detach().contiguous()], [parts[0]], [parts[1]])[0]
    return joined if weight.is_contiguous() else torch.empty_like(weight, dtype=joined.dtype).copy_(joined)


def _distributed_world() -> bool:
    dist = getattr(torch, "distributed", None)
    return bool(dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


class MasterWeights:
    """The FP32 values of one initialization's cast tensors (see the module docstring).

    Args:
        fp32_values: each cast tensor and its FP32 value from before the cast.
        cast_dtypes: each cast tensor and the dtype it was cast to.
        names: each cast tensor's name in the model, for error messages.
    """

    def __init__(self, fp32_values: Dict[torch.Tensor, torch.Tensor], cast_dtypes: Dict[torch.Tensor, torch.dtype],
                 names: Dict[torch.Tensor, str]):
        self._value: Dict[torch.Tensor, torch.Tensor] = {}
        self._model_of: Dict[torch.Tensor, torch.Tensor] = {}
        self._cast_dtype = dict(cast_dtypes)
        self._names = names
        self._compared_once = False
        # model tensor -> ((version, data_ptr, strides), fingerprint) when ampinit last wrote or read it
        self._marks: Dict[torch.Tensor, Tuple[Tuple[int, int, Tuple[int, ...]], torch.Tensor]] = {}
        self._loaded = False
        self._behind_writes_loaded: set = set()  # masters load_behind_writes set, until the next sync
        # model parameter -> (int16 remainders, int32 tie words): masters kept as remainders
        self._remainders: Dict[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]] = {}
        self._remainder_mode = False
        # bfloat16 parameters that keep FP32 masters although remainders were asked for (not
        # contiguous); the handle names them in a warning
        self.without_remainders: List[torch.Tensor] = []
        # model tensor -> the watch on the FP32 value model.state_dict() last reported for it
        self._reported: Dict[torch.Tensor, List[weakref.finalize]] = {}
        self._report_views: Optional[Tuple[List[torch.Tensor], List[int]]] = None  # adopt_written_reports
        self._reporting = False  # inside a model.state_dict() that looked at every tensor first
        self._written: Dict[torch.Tensor, tuple] = {}  # and found these written (_written_since_marked)
        # model parameter -> the requires_grad it and its master had when ampinit last looked
        self._requires_grad: Dict[torch.Tensor, bool] = {}
        # model parameter -> its master's version counter when ampinit last made the two agree
        self._master_version: Dict[torch.Tensor, int] = {}
        self._master_storage: Dict[torch.Tensor, int] = {}  # and its address then
        self._flags: Optional[_ForwardChecks] = None  # None: rebuilt at the next forward
        self._updated: set = set()   # model parameters whose masters an optimizer updates
        self._stepped_in_place: set = set()  # ids of those kept as remainders (stepped_in_place)
        self._added: set = set()     # low-precision parameters ampinit did not cast (add_param_group)
        for tensor, value in fp32_values.items():
            self._add(tensor, value)

    def _add(self, tensor: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        # a parameter, or a plain leaf tensor an optimizer trains (torch.zeros(..., requires_grad=True)):
        # its master is a Parameter that the gradients reach; a cast buffer's is a plain value
        if isinstance(tensor, nn.Parameter) or (tensor.requires_grad and tensor.is_leaf):
            value = nn.Parameter(value.data, requires_grad=tensor.requires_grad)
            self._model_of[value] = tensor
            self._requires_grad[tensor] = tensor.requires_grad
            self._master_version[tensor] = value._version
            self._master_storage[tensor] = value.data_ptr()
        self._value[tensor] = value
        self._flags = None
        return value

    def keep_as_remainders(self) -> None:
        """After the cast: every cast bfloat16 parameter that is contiguous keeps its master as
        remainders from now on, and its FP32 storage is let go; so do bfloat16 parameters that
        an optimizer takes later (``take``).  Those that cannot (not contiguous: channels_last)
        keep FP32 masters and are listed in ``without_remainders``."""
        self._remainder_mode = True
        for tensor in list(self._value):
            if not (isinstance(tensor, nn.Parameter) and tensor.dtype == torch.bfloat16):
                continue
            if not tensor.is_contiguous():
                self.without_remainders.append(tensor)
                continue
            value = self._value.pop(tensor)
            self._flags = None
            self._model_of.pop(value, None)
            remainder, ties = ops.new_remainders(tensor)
            with torch.no_grad():
                ops.split_masters_([tensor], [remainder], [ties], [value])
            self._remainders[tensor] = (remainder, ties)

    # -- lookups -------------------------------------------------------------------------------
    def master_param(self, model: torch.Tensor) -> Optional[torch.Tensor]:
        """The FP32 master an optimizer updates in place of the model parameter ``model``, or
        ``None`` (no optimizer took it, or the optimizer updates ``model`` itself)."""
        master = self._value.get(model)
        return master if master is not None and master in self._model_of else None

    def master_of(self, tensor: torch.Tensor) -> Optional[torch.Tensor]:
        """The FP32 value of a cast tensor (the master, for a parameter), or ``None``.  For a
        master kept as remainders: the joined value, a new tensor (writes to it change nothing)."""
        parts = self._remainders.get(tensor)
        if parts is not None:
            return _joined(tensor, parts)
        return self._value.get(tensor)

    def report(self, tensor: torch.Tensor, dtype: torch.dtype, keep_vars: bool = False) -> Optional[torch.Tensor]:
        """The FP32 value of ``tensor`` for ``model.state_dict()``, in ``dtype``, writes to the
        model adopted first; ``None`` for a tensor without a master.

        torch's state_dict aliases the model, and code writes through it
        (``model.state_dict()[k].copy_(w)``, the partial loads of older repos).  The value
        reported here is the master itself or, for remainders, a joined copy; an in-place write
        into it reaches the model (and the master) when the value is dropped or at the next
        :meth:`sync` (every optimizer update, ``amp.master_params``, the next
        ``model.state_dict()``), whichever comes first.  Its version counter tells (no data
        pass), and nothing is kept alive beyond the caller's own reference.  With ``keep_vars``
        (``state_dict(keep_vars=True)``) an FP32 master is reported as the Parameter itself."""
        if tensor not in self:
            return None
        written = self._written if self._reporting else self._written_since_marked([tensor])
        with torch.inference_mode(False):  # an inference tensor has no version counter to watch
            if tensor in written:  # the model's values where written, not adopted (_written_since_marked)
                value = self._as_adopted(tensor).to(dtype)
                if keep_vars:
                    value.requires_grad_(tensor.requires_grad)
            else:
                master = self.master_of(tensor)
                if keep_vars and master.dtype == dtype and isinstance(master, nn.Parameter):
                    value = master  # state_dict(keep_vars=True): the Parameter, requires_grad and all
                else:
                    value = master.detach().to(dtype)
                    if keep_vars:
                        value.requires_grad_(tensor.requires_grad)
        # the model as it is now: a write to it before the value's is adopted wins (see below)
        if tensor in written:
            model_mark = written[tensor]
        elif tensor in self._value:
            model_mark = self._marks[tensor]
        else:
            model_mark = (_stamp(tensor), ops.fingerprint([tensor])[0])
        # A tensor no optimizer updates (a frozen parameter, a cast buffer) has no step to carry a
        # write through .data (no version counter sees it: imaginaire's ModelAverage writes its
        # frozen average as state_dict()[k].data.copy_(...)) into the model: the value's
        # fingerprint, taken now and compared when it is let go, tells (one pass each time, for
        # these tensors only; a trained parameter's master takes such a write into its next step).
        untrained = tensor not in self._updated and (tensor in self._value or tensor in self._remainders)
        value_print = ops.fingerprint([value.detach()])[0] if untrained else None
        # the finalizer holds a view (same storage and version counter), not the value itself
        watch = weakref.finalize(value, self._adopt_report, tensor, value.detach(), value._version, model_mark,
                                 value_print)
        watch.atexit = False
        self._reported.setdefault(tensor, []).append(watch)  # tied weights: one per key
        self._report_views = None
        return value

    def set_reporting(self, opening: bool) -> None:
        """A ``model.state_dict()`` of the whole model starts (``opening``: every tensor is looked
        at once, and :meth:`report` skips its own look) or ends."""
        self._written = self._written_since_marked(None) if opening else {}
        self._reporting = opening

    def _as_adopted(self, tensor: torch.Tensor) -> torch.Tensor:
        """What the master of a written ``tensor`` would be if the write were adopted, as a new
        tensor: the model's value where it no longer holds the master's rounding, the master
        elsewhere (adopt_changes_'s rule), so that elements the write left alone keep their FP32
        bits (WGAN's clamp changes a few)."""
        return torch.where(self._written_elements(tensor), tensor.detach().float(), self._value[tensor].detach())

    def _written_elements(self, tensor: torch.Tensor) -> torch.Tensor:
        """Where the model tensor no longer holds its master's rounding: ``ops.adopt_changes_``'s
        rule for what a write changed."""
        return tensor.detach().ne(self._value[tensor].detach().to(tensor.dtype))

    def _written_since_marked(self, tensors: Optional[List[torch.Tensor]]) -> Dict[torch.Tensor, tuple]:
        """The FP32-master model tensors among ``tensors`` (default: all) written since ampinit
        last marked them, with their marks as they are now: what ``model.state_dict()``
        reports as the model's own values, *without* adopting them into the masters.  Adopting
        there lost the masters' low bits to a swap that is undone after the read (an EMA copied
        into the model for evaluation and a checkpoint, then the training weights copied back:
        the masters would take the backup's 16-bit values); they are adopted at the next
        backward or step if still there.  Before training has started it is the first full
        compare (:meth:`sync`).  One host read of a flag per tensor."""
        if self._reported:  # writes into values reported earlier first
            self._adopt_reported(tensors)
        if not self._compared_once:
            self.sync(tensors)
            return {}
        tensors = [t for t in (self._value if tensors is None else tensors) if t in self._value]
        if not tensors:
            return {}
        self.check_model(tensors)
        now = ops.fingerprint(tensors)
        # the content decides (a write of the same values is no write); a new storage or layout
        # always counts
        changed = now.ne(self._marked_fingerprints(tensors, now, content_only=True)).tolist()
        candidates = [(t, fingerprint) for t, fingerprint, written in zip(tensors, now, changed) if written]
        if not candidates:
            return {}
        # a changed fingerprint may still hold the master's rounding (model.load_state_dict wrote
        # both): written means a value the master does not round to, as adopt_changes_ decides
        differ = torch.stack([self._written_elements(t).any() for t, _ in candidates]).tolist()
        agreeing = [(t, fingerprint) for (t, fingerprint), d in zip(candidates, differ) if not d]
        if agreeing:
            self._set_marks([t for t, _ in agreeing], [fingerprint for _, fingerprint in agreeing])
        return {t: (_stamp(t), fingerprint) for (t, fingerprint), d in zip(candidates, differ) if d}

    def _adopt_report(self, tensor: torch.Tensor, value: torch.Tensor, version: int,
                      model_mark: Tuple[Tuple[int, int, Tuple[int, ...]], torch.Tensor],
                      value_print: Optional[torch.Tensor] = None) -> None:
        """Model and master take a reported ``value`` that was written since (in place, or, for a
        tensor no optimizer updates, through ``.data``: its ``value_print`` changed), unless the
        model tensor was written too: which came last cannot be told, so the model's write is
        kept (as for a tensor written on both sides between two updates), with a warning.  Reads
        fingerprints on the host, the value's where it has one, the model's only for a written
        value."""
        written = value._version != version
        if not written and value_print is not None:
            written = bool(ops.fingerprint([value])[0] != value_print)
        if not written:
            return
        stamp, fingerprint = model_mark
        if _stamp(tensor) != stamp or bool(ops.fingerprint([tensor])[0] != fingerprint):
            if value.shape == tensor.shape and torch.equal(value.to(tensor.dtype), tensor):
                return  # the model holds it already: a tied weight's other key was adopted first
            logger.warning("ampinit: %s was written both through a tensor of model.state_dict() and directly "
                           "while that state dict was alive; ampinit cannot tell which came last and keeps the "
                           "model's value.  Write the parameter itself, or use model.load_state_dict()",
                           self._names.get(tensor, "a parameter"))
            return
        self.load(tensor, value)  # the master (and a remainder master's weight)
        if tensor in self._value:
            with torch.no_grad():
                tensor.copy_(self._value[tensor])
            self.mark([tensor])

    def _adopt_reported(self, tensors: Optional[List[torch.Tensor]] = None) -> None:
        """Adopt the writes into the values :meth:`report` handed out for ``tensors`` (default:
        all) that are still alive, and stop watching them."""
        self._report_views = None
        for tensor in list(self._reported) if tensors is None else tensors:
            for watch in self._reported.pop(tensor, ()):
                pending = watch.detach()  # None: dropped, and adopted then
                if pending is not None:
                    self._adopt_report(*pending[2])

    def settle_requires_grad(self, model: torch.Tensor, master: torch.Tensor) -> bool:
        """One ``requires_grad`` for a parameter and its master, as torch has one for the one
        object that model and optimizer share there: whichever of the two was set since ampinit
        last looked wins (the model's, if both were), and both take it; returns it.  So a layer
        frozen before ``initialize`` and unfrozen through the model trains again, and one
        frozen through ``optimizer.param_groups`` (the masters) stops computing gradients."""
        if model is master:
            return model.requires_grad
        seen = self._requires_grad.get(model)
        value = model.requires_grad if model.requires_grad != seen else master.requires_grad
        if model.requires_grad != value:
            model.requires_grad_(value)
        if master.requires_grad != value:
            master.requires_grad_(value)
        if seen != value:
            self._requires_grad[model] = value
            self._flags = None
        return value

    def _forward_checks(self) -> "_ForwardChecks":
        if self._flags is None:
            models = [model for model in self._requires_grad if model in self._value]
            self._flags = _ForwardChecks(models, [self._value[m] for m in models],
                                         [self._requires_grad[m] for m in models],
                                         [self._master_version.get(m, -1) for m in models],
                                         [self._cast_dtype.get(m, m.dtype) for m in models])
        return self._flags

    def copy_replaced_masters(self, models: List[torch.Tensor]) -> None:
        """After a skipped step: copy into the model the masters whose storage was replaced
        (``p.data = old``) since ampinit last made them agree.  SAM restores its perturbed
        masters that way, which no version counter sees; the forward had copied the perturbation
        into the model, and a skipped step copies nothing back."""
        replaced = [m for m in models if m in self._value and m in self._master_storage
                    and self._value[m].data_ptr() != self._master_storage[m]]
        if replaced:
            self.copy_to_model([self._value[m] for m in replaced])

    def masters_written_unseen(self) -> bool:
        """Whether a master was written outside ``step()`` since ampinit last made it and its
        model parameter agree: at a ``scale_loss``, after the forward, that forward did not see
        the write (it ran under ``torch.compile`` or through a submodule, where
        :meth:`before_forward` does not run).  Python reads of a version counter per parameter."""
        checks = self._forward_checks()
        return [m._version for m in checks.masters] != checks.versions

    def before_forward(self) -> None:
        """What a forward of the model needs of the parameters with FP32 masters, in Python
        checks of two flags and a version counter per parameter:

        - :meth:`settle_requires_grad` where either flag changed;
        - a master written since ampinit last made it and the model agree (through
          ``param_groups`` outside ``step()``: SAM's ``first_step`` perturbation, clamping
          ``amp.master_params``) is copied into the model, as the one object of torch would
          compute with it; a model parameter written too keeps its own value (adopted later).
        """
        checks = self._forward_checks()
        if [m.dtype for m in checks.models] != checks.dtypes:
            # some parameters cast (layer.weight.data = fp32_tensor): say so before torch's dtype
            # error; all of them (model.float() for an FP32 evaluation) run, and raise at the next
            # scale_loss or step unless cast back
            changed = [m for m, dtype in zip(checks.models, checks.dtypes) if m.dtype != dtype]
            if len({m.dtype for m in changed}) > 1 or len(changed) < len(checks.models):
                self.check_model(changed)
        if [m.requires_grad for m in checks.models] != checks.flags or \
                [m.requires_grad for m in checks.masters] != checks.flags:
            for model, master in zip(checks.models, checks.masters):
                self.settle_requires_grad(model, master)
            checks = self._forward_checks()
        versions = [m._version for m in checks.masters]
        if versions == checks.versions:
            return
        written = [model for model, now, then in zip(checks.models, versions, checks.versions)
                   if now != then and self._stamp_holds(model)]
        if written:
            with torch.no_grad():
                ops.copy_(written, [self._value[m] for m in written])
            self.mark(written)

    @property
    def has_reports(self) -> bool:
        """Whether values :meth:`report` handed out are still watched."""
        return bool(self._reported)

    def adopt_written_reports(self) -> None:
        """Adopt the reported values written in place since they were handed out, and keep
        watching the others: the model's forward calls it, so that a forward made while a
        written ``state_dict()`` is still alive computes with the written values.  Reads version
        counters only (one host fingerprint read per written value, see :meth:`_adopt_report`),
        in one list comprehension while nothing was written or dropped."""
        if self._report_views is not None and [v._version for v in self._report_views[0]] == self._report_views[1]:
            return
        self._report_views = None
        for tensor in list(self._reported):
            watches = self._reported[tensor]
            done = [watch for watch in watches if not _unwritten(watch)]
            if not done:
                continue
            # load() (in _adopt_report) stops every watch of its tensor: set the unwritten ones aside
            kept = [watch for watch in watches if watch not in done]
            del self._reported[tensor]
            for watch in done:
                pending = watch.detach()  # None: dropped, and adopted then
                if pending is not None:
                    self._adopt_report(*pending[2])
            if kept:
                self._reported.setdefault(tensor, []).extend(kept)
        views = [watch.peek() for watches in self._reported.values() for watch in watches]
        if all(view is not None for view in views):  # a dropped value stays until the next pass
            self._report_views = ([v[2][1] for v in views], [v[2][2] for v in views])

    def remainders_of(self, tensor: torch.Tensor) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """``(remainders, tie words)`` of a parameter whose master is kept as remainders."""
        return self._remainders.get(tensor)

    @property
    def has_remainders(self) -> bool:
        return bool(self._remainders)

    @property
    def model_of(self) -> Dict[torch.Tensor, torch.Tensor]:
        """master -> the model parameter it drives (read-only use)."""
        return self._model_of

    def __contains__(self, tensor: torch.Tensor) -> bool:
        return tensor in self._value or tensor in self._remainders

    def tensors(self) -> List[torch.Tensor]:
        return list(self._value) + list(self._remainders)

    def take(self, param: torch.Tensor) -> torch.Tensor:
        """The master of ``param`` for an optimizer that starts to update it: its kept FP32 value
        if ampinit cast it, else (a low-precision parameter added later) a new FP32 copy."""
        if param in self._remainders:  # the optimizer updates the model parameter and its remainders
            if self._compared_once and _distributed_world():
                self._reset_remainders([param])
            self._updated.add(param)
            self._stepped_in_place.add(id(param))
            return param
        master = self._value.get(param)
        if master is None and self._remainder_mode and param.dtype == torch.bfloat16:
            if param.is_contiguous():
                # bfloat16 already (cast by the user): its master is the weight, with zero remainders
                self._cast_dtype[param] = param.dtype
                self._added.add(param)
                self._remainders[param] = ops.new_remainders(param)
                self._updated.add(param)
                self._stepped_in_place.add(id(param))
                return param
            self.without_remainders.append(param)
        if master is None:
            self._cast_dtype[param] = param.dtype
            self._added.add(param)
            master = self._add(param, param.detach().to(torch.float32, copy=True))
        elif self._compared_once:  # training has started: this is add_param_group
            self.sync([param])
            if _distributed_world():  # identical on every rank: DDP broadcast the model, not the masters
                with torch.no_grad():
                    master.copy_(param)
        self._updated.add(param)
        return master

    def updated_by_an_optimizer(self, param: torch.Tensor) -> bool:
        """Whether an optimizer of this initialization updates ``param``'s master (or, kept as
        remainders, ``param`` itself)."""
        return param in self._updated

    @property
    def stepped_in_place(self) -> set:
        """The ids of the low-precision parameters an optimizer updates itself, legitimately:
        bfloat16 weights whose masters are kept as remainders.  By id: a tensor's ``__hash__``
        is a Python call, and this is tested for every parameter at every step."""
        return self._stepped_in_place

    def check_no_overlap(self, params: List[torch.Tensor]) -> None:
        """Parameters added later must not share memory with one ampinit keeps a master for, or
        with each other: both masters would be copied into that memory at every step, in an
        order the parallel kernels do not fix (a parametrization such as ``weight_norm``
        registered after ``initialize`` makes its ``original`` from the old weight's memory,
        which the optimizer still holds).  Raises before anything changes."""
        known = list(self._value) + list(self._remainders)
        for index, param in enumerate(params):
            span = _byte_span(param)
            if span is None or param in self:
                continue
            for tensor in known + params[:index]:
                other = _byte_span(tensor)
                if tensor is param or other is None or other[0] != span[0] or \
                        not (other[1] < span[2] and span[1] < other[2]):
                    continue
                raise ValueError(
                    f"a parameter added to the optimizer shares memory with "
                    f"{self._names.get(tensor, 'another parameter added with it')}, and both would keep an FP32 "
                    "master: both masters would be written into it at every step.  A parametrization (weight_norm, "
                    "spectral_norm, ...) registered after ampinit.initialize does this: register it before "
                    "ampinit.initialize")

    def release(self, param: torch.Tensor) -> None:
        """An optimizer no longer updates ``param`` (a failed ``add_param_group``)."""
        self._updated.discard(param)
        self._stepped_in_place.discard(id(param))
        if param in self._added:
            self._added.discard(param)
            self._remainders.pop(param, None)
            master = self._value.pop(param, None)
            self._flags = None
            self._model_of.pop(master, None)
            self._marks.pop(param, None)
            self._cast_dtype.pop(param, None)

    # -- model -> masters ------------------------------------------------------------------------
    def check_model(self, tensors: Iterable[torch.Tensor]) -> None:
        """Raise a clear error if a cast tensor was cast again or moved (``model.float()``,
        ``model.to("cuda")``) after ``initialize``."""
        for tensor in tensors:
            dtype = self._cast_dtype.get(tensor)
            if dtype is None:
                continue
            master = self._value[tensor] if tensor in self._value else self._remainders[tensor][0]
            if tensor.dtype != dtype or tensor.device != master.device:
                raise RuntimeError(
                    f"{self._names.get(tensor, 'a parameter')} is {tensor.dtype} on {tensor.device}, but "
                    f"ampinit.initialize made it {dtype} on {master.device} and keeps its FP32 master there: "
                    "the model was cast or moved after initialize (model.float(), model.half(), model.to(...)), or the "
                    "parameter's .data was replaced by a tensor of another dtype or device (p.data = value). Cast and "
                    "move the model before ampinit.initialize, or call ampinit.end(model) first; write new values in "
                    "place (p.data.copy_(value), or p.copy_(value) under torch.no_grad()), which the masters adopt")

    def sync(self, tensors: Optional[Iterable[torch.Tensor]] = None) -> None:
        """Adopt writes to the model made since ampinit last marked it (see the module
        docstring) for ``tensors`` (default: all).  The first call, at the first backward,
        compares every cast tensor; under ``torch.distributed`` it sets the masters that
        optimizers update to the model's values instead (unless a checkpoint was loaded).
        No host sync, except one fingerprint read per written value that :meth:`report` handed
        out: those writes are adopted first (see :meth:`_adopt_report`)."""
        self._reporting = False  # a state_dict() that raised midway must not leave it set
        self._behind_writes_loaded = set()
        if self._reported:
            self._adopt_reported(None if tensors is None else list(tensors))
        if not self._compared_once:
            self._compared_once = True
            tensors = list(self._value)
            self.check_model(tensors)
            from_model = self._updated if _distributed_world() and not self._loaded else set()
            self._adopt([t for t in tensors if t not in from_model])
            with torch.no_grad():
                for tensor in tensors:
                    if tensor in from_model:
                        self._value[tensor].copy_(tensor)
            self._reset_remainders([t for t in self._remainders if t in from_model])
            self.check_model(list(self._remainders))
            self.mark(tensors)
            return
        # model.float() at O5 with remainder masters: a clear error here, not the kernels'
        self.check_model(list(self._remainders) if tensors is None else [t for t in tensors if t in self._remainders])
        tensors = list(self._value) if tensors is None else [t for t in tensors if t in self._value]
        self.check_model(tensors)
        self._adopt_written(tensors)

    def check_remainder_layout(self, tensors: Optional[Iterable[torch.Tensor]] = None) -> None:
        """Raise a clear error if a parameter kept with remainders (these ``tensors``, default:
        all) stopped being contiguous (``model.to(memory_format=torch.channels_last)`` after
        ``initialize``): the kernels update it in place, in the element order it had then."""
        for tensor in self._remainders if tensors is None else tensors:
            if not tensor.is_contiguous():
                raise RuntimeError(
                    f"{self._names.get(tensor, 'a parameter')} keeps its FP32 master as bfloat16 weight + "
                    "remainders in the contiguous layout it had at ampinit.initialize, but it is no longer "
                    "contiguous: the model's memory format was changed after initialize (channels_last?).  "
                    "Change it before ampinit.initialize (such parameters then keep FP32 masters)")

    def _reset_remainders(self, tensors: List[torch.Tensor]) -> None:
        """These masters become their model weights exactly (remainders and tie bits zeroed)."""
        for tensor in tensors:
            for part in self._remainders[tensor]:
                part.zero_()

    def load(self, tensor: torch.Tensor, value: torch.Tensor) -> None:
        """A checkpoint's FP32 ``value`` of ``tensor`` (``model.load_state_dict``): the master
        takes it (a master kept as remainders is split, its weight written too); under
        ``torch.distributed`` the masters then keep it rather than start from the model.
        Nothing happens for a tensor without a master or a value of another shape.  A write
        into a reported value of ``tensor`` not adopted yet is dropped: this value is newer."""
        self._report_views = None
        for watch in self._reported.pop(tensor, ()):
            watch.detach()
        if tensor in self._behind_writes_loaded:
            self._behind_writes_loaded = set()
            logger.warning(
                "ampinit: model.load_state_dict() replaced FP32 masters that the amp.load_state_dict() before it had "
                "put back (its checkpoint kept them behind model values written when it was saved: EMA weights "
                "swapped in).  If both come from one checkpoint, load the model first, then the optimizer, then amp "
                "(apex's order), for a bit-for-bit resume")
        parts = self._remainders.get(tensor)
        master = self._value.get(tensor)
        if value.shape != tensor.shape or (parts is None and master is None):
            return
        with torch.no_grad():
            if parts is not None:
                self.check_remainder_layout([tensor])
                ops.split_masters_([tensor], [parts[0]], [parts[1]], [value.to(tensor.device)])
            else:
                master.copy_(value)
                self._note_agreed([tensor])  # the model takes the value in its own load
        self._loaded = True

    def masters_behind_writes(self) -> Dict[torch.Tensor, torch.Tensor]:
        """The FP32 masters (copies) of the model tensors written since ampinit last marked them
        and not adopted: what ``model.state_dict()`` now reports as the model's values in their
        place (EMA weights swapped in to evaluate and save).  A checkpoint that holds them
        resumes like the run that goes on, once the training weights are copied back from a
        16-bit backup (see :meth:`load_behind_writes`).  One fingerprint pass and one read."""
        written = self._written_since_marked(None)
        return {tensor: self._value[tensor].detach().clone() for tensor in written}

    def load_behind_writes(self, values: Dict[torch.Tensor, torch.Tensor]) -> None:
        """Put back masters a checkpoint kept behind written model values (after
        ``model.load_state_dict`` gave model and masters the written values): the model keeps
        them, and they are adopted at the next backward or step if still there, as in the run
        that saved them; copied back to the masters' rounding first, they are not."""
        with torch.no_grad():
            for tensor, value in values.items():
                self._value[tensor].copy_(value)
        self._note_agreed(list(values))  # no write outside step() to copy into the model
        self._loaded = True
        self._behind_writes_loaded = set(values)  # until the next sync: see load()

    def start(self) -> None:
        """At every backward: the first one compares every value (see :meth:`sync`); later
        ones cost nothing, since writes are adopted before each update."""
        if not self._compared_once:
            self.sync()

    def _adopt_written(self, tensors: List[torch.Tensor]) -> None:
        """Adopt the model's values into the masters of the tensors whose mark changed: one
        fingerprint pass, and one adopt pass limited to the written tensors on the device."""
        if not tensors:
            return
        now = ops.fingerprint(tensors)
        then = self._marked_fingerprints(tensors, now, content_only=False)
        # masters that agreed with their models still do after the adoption (whose in-place op
        # bumps every version counter); one written or replaced on its own side does not
        agreed = [t for t in tensors if self._value[t]._version == self._master_version.get(t)
                  and self._value[t].data_ptr() == self._master_storage.get(t)]
        with torch.no_grad():
            ops.adopt_changes_([self._value[t] for t in tensors], tensors, only=now.ne(then).float())
        self._set_marks(tensors, now, agreed=False)
        self._note_agreed(agreed)

    def _marked_fingerprints(self, tensors: List[torch.Tensor], like: torch.Tensor, content_only: bool) -> torch.Tensor:
        """The fingerprints the tensors were marked with, -1 (no fingerprint is negative) where
        the mark no longer holds: any change of the stamp, or (``content_only``) of storage or
        strides only, a version bump alone leaving the content to decide."""
        never = torch.full((), -1, dtype=like.dtype, device=like.device)
        if content_only:
            holds = [t in self._marks and self._marks[t][0][1:] == _stamp(t)[1:] for t in tensors]
        else:
            holds = [self._stamp_holds(t) for t in tensors]
        return torch.stack([self._marks[t][1] if held else never for t, held in zip(tensors, holds)])

    def _stamp_holds(self, tensor: torch.Tensor) -> bool:
        """Marked, with the version counter, storage and strides it had then (see ``_stamp``)."""
        mark = self._marks.get(tensor)
        return mark is not None and mark[0] == _stamp(tensor)

    def _adopt(self, tensors: List[torch.Tensor]) -> None:
        if tensors:
            with torch.no_grad():
                ops.adopt_changes_([self._value[t] for t in tensors], tensors)

    def mark(self, tensors: List[torch.Tensor]) -> None:
        """These model tensors are as ampinit last wrote or read them (one fingerprint pass)."""
        tensors = [t for t in tensors if t in self._value]
        if tensors:
            self._set_marks(tensors, ops.fingerprint(tensors))

    def _set_marks(self, tensors: List[torch.Tensor], fingerprints: torch.Tensor, agreed: bool = True) -> None:
        """Mark the model tensors; ``agreed``: their masters round to them now (else, adopting
        the model's writes, a master written or replaced on its own side may still differ)."""
        for tensor, fingerprint in zip(tensors, fingerprints):
            self._marks[tensor] = (_stamp(tensor), fingerprint)
        if agreed:
            self._note_agreed(tensors)

    def _note_agreed(self, tensors: List[torch.Tensor]) -> None:
        """The masters of these model tensors agree with them now (see :meth:`before_forward`)."""
        checks = self._flags
        for tensor in tensors:
            master = self._value.get(tensor)
            if master is None:
                continue
            self._master_version[tensor] = master._version
            self._master_storage[tensor] = master.data_ptr()
            index = checks.index.get(tensor) if checks is not None else None
            if index is not None:
                checks.versions[index] = master._version

    # -- masters -> model ------------------------------------------------------------------------
    def copy_to_model(self, masters: List[torch.Tensor]) -> None:
        """Write updated masters into their model parameters (round to nearest even)."""
        models = [self._model_of[m] for m in masters]
        if models:
            with torch.no_grad():
                ops.copy_(models, masters)
            self.mark(models)

    def restore(self) -> None:
        """``end()``: every cast tensor takes its FP32 value back, adopting writes to the model
        first where it still has the dtype and device ampinit gave it."""
        self._adopt_reported()
        kept = [t for t in self._value if t.dtype == self._cast_dtype[t] and t.device == self._value[t].device]
        if self._compared_once:
            self._adopt_written(kept)
        else:
            self._adopt(kept)
        with torch.no_grad():
            for tensor, value in self._value.items():
                tensor.data = value.data
            for tensor, parts in self._remainders.items():
                if tensor.dtype == torch.bfloat16 and tensor.device == parts[0].device:
                    tensor.data = _joined(tensor.data, parts)
        self._value.clear()
        self._remainders.clear()
        self._model_of.clear()
        self._marks.clear()
