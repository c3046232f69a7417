"""The gradients of one optimizer's parameters through ``scale_loss``.

Each parameter an optimizer updates is a pair ``(model_param, master)``.  With master weights
the master is the FP32 ``nn.Parameter`` in ``param_groups`` and the optimizer reads
``master.grad``; otherwise (O0, O1, O3, O4, and FP32 parameters at O2/O5) the pair is one tensor
and ``param.grad`` is the gradient.  Either way the gradient the optimizer sees is *unscaled* and
is exactly what an FP32 run would hold at that point: several losses before one ``step`` add
up, ``zero_grad`` in any form clears it, and an exception inside ``scale_loss`` leaves what it
would leave without ampinit.

Per ``scale_loss``:

1. :meth:`GradientFlow.prepare_backward` (entry, unless delayed scaled gradients are still
   accumulating) moves every existing gradient out of the backward's way: a same-tensor pair's
   unscaled gradient is stashed, a distinct pair's model gradient (already unscaled into the
   master) is detached.  The new backward then produces only this loss's scaled gradients.
2. :meth:`GradientFlow.unscale` (exit, unless ``delay_unscale``) unscales them into the
   masters or onto the stashed gradients through the ops facade, checking for inf/NaN, and
   puts back the stashed gradient of a parameter this loss did not reach.  An exception in the
   body of ``scale_loss`` changes nothing here: the gradients a backward produced are unscaled
   all the same, as they would stay without ampinit, and if no backward ran everything is put
   back (:meth:`GradientFlow.restore_after_no_backward`).

For a distinct pair the model parameter keeps the (scaled) gradient it got, as a *token* (a
zero tensor if the last loss did not reach it but an earlier one did): if the user clears it
(``p.grad = None``, ``model.zero_grad()``) the master's gradient is cleared too, if it is
zeroed in place (``zero_grad(set_to_none=False)``, ``p.grad.data.zero_()``) or replaced by
zeros the master's is zeroed (through ``.data``: seen at the next ``scale_loss``), and if it
changes otherwise (a ``backward`` outside ``scale_loss``, clipping the model's gradients)
``step`` raises: only the masters' gradients reach the optimizer.  A write through ``.data``
changes no version counter, so only zeroing is seen that way (by the token's norm); other
``.data`` writes to the model's gradients go unseen -- write the masters' gradients
(``amp.master_params``).

With a fused optimizer (``ampinit.optim``) the first backward of a step only *checks* the
model's scaled gradients and leaves them to the optimizer's kernel (``deferred``), which
unscales them itself; anything that needs the masters' gradients (a second backward,
:func:`ampinit.master_params`) unscales them first.  A fused or skipped step drops every
gradient; ``zero_grad(set_to_none=False)`` gives the dropped ones back as zeros, which is what
torch's would leave, so a parameter the next backward does not reach still steps on zero (the
model's at once; a master's at ``step``, only if no backward reached it, so that the fused path
still takes the scaled gradients and allocates no FP32 buffer for them).

Nothing here reads a device value on the host: whether a token changed in place was zeroed or
written is decided on the device and read at ``step`` together with the overflow flag.
"""

from __future__ import annotations

import itertools
import logging
import sys
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from . import ops
from .distributed import local
from .masters import MasterWeights

logger = logging.getLogger("ampinit")

__all__ = ["GradientFlow", "BackwardWatch"]

# What was zero when a token was left tells a token zeroed through ``.data`` (no version counter
# sees that) from one that was zero all along: the master's gradient, where scale_loss wrote it
# from the token alone (``_IMAGE``), else the token's L2 norm then (a device scalar), or nothing.
_IMAGE = "the master's gradient"
_PARKED = "zero from the start"
# ... for a master whose gradient was set by hand (no loss made it): no evidence of a clear
_ASSIGNED = "zero from the start, for a gradient set by hand"
# A token: the model gradient expected on a distinct pair, its version counter then, and the above.
_Token = Tuple[Optional[torch.Tensor], int, object]
# The token of a distinct pair whose model gradient scale_loss detached: none is expected.
_DETACHED: _Token = (None, 0, None)
# Gradients remembered from each end of the parameter list after a backward (see backward_ended)
_SENTINELS_PER_END = 2
_SENTINEL_SEARCH = 16  # parameters looked at from each end to find them


class BackwardWatch:
    """Tells whether a backward reached the scaled loss that ``scale_loss`` yielded, and calls
    ``on_end`` when such a backward is over (after the final callbacks queued during it, such
    as DDP's, which write the gradients)."""

    def __init__(self, scaled_loss: torch.Tensor, on_reach: Callable[[], None] = lambda: None,
                 on_end: Callable[[], None] = lambda: None):
        # A loss without autograd history cannot be backpropagated (backward raises): never reached.
        self.reached = False
        self._on_reach = on_reach
        self._on_end = on_end
        if scaled_loss.requires_grad:
            # Weakly: autograd keeps the hooks of the process's first scaled loss past its graph
            # (in C++, out of the collector's sight), and through on_reach they held that
            # initialization (model, optimizer and all) for good.  scale_loss holds the watch.
            watch = weakref.ref(self)
            scaled_loss.register_hook(lambda grad: _reach(watch))


def _reach(watch: "weakref.ref[BackwardWatch]") -> None:
    live = watch()
    if live is not None:
        live.reached = True
        live._on_reach()
        try:
            # queued from a final callback, so that it runs after those queued during the
            # backward (DDP's reducer copies the reduced gradients in one)
            engine = torch.autograd.Variable._execution_engine
            engine.queue_callback(lambda: engine.queue_callback(lambda: _end(watch)))
        except RuntimeError:  # no final callbacks here (compiled autograd): no check at the exit
            logger.debug("ampinit: no final callback for this backward", exc_info=True)


def _end(watch: "weakref.ref[BackwardWatch]") -> None:
    live = watch()
    if live is not None:
        live._on_end()


class _Pending:
    """Scaled gradients of ``delay_unscale`` backwards, still on the model parameters, and the
    scale they carry: a loss id's, as of its scaler's ``scaler_updates``-th update, or a static
    ``fixed_scale``, which no update changes."""

    def __init__(self, loss_id: int, scaler_updates: int, fixed_scale: Optional[float]):
        self.loss_id = loss_id
        self.scaler_updates = scaler_updates
        self.fixed_scale = fixed_scale


class GradientFlow:
    """The gradient state of one optimizer between two steps (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, masters: Optional[MasterWeights], device: torch.device,
                 fused: bool, name_of: Callable[[torch.Tensor], str]):
        self.optimizer = optimizer
        self.masters = masters
        self.fused = fused
        self._name_of = name_of
        self.found_inf = torch.zeros((1,), dtype=torch.float32, device=device)
        self.unscaled_since_step = False   # a scale_loss exit added gradients since step()
        self.pending: Optional[_Pending] = None
        # model parameters whose gradients drop_all_grads dropped since zero_grad
        self._dropped: List[torch.Tensor] = []
        # ... and those zero_grad(set_to_none=False) gave back as zeros, until a backward adds to them
        self._restored_zeros: set = set()
        # masters whose gradient zero_grad(set_to_none=False) owes as zeros: given at step() to
        # those no backward reached (a zero buffer here would keep the fused path from deferring)
        self._owed_zeros: set = set()
        self.active_scaler: Optional[Any] = None   # the LossScaler of the scale_loss block running, if any
        # In that block: whether a backward reached its scaled loss (its gradients are scaled
        # from then on), and a few of the gradients the last one left, with their versions (see
        # backward_ended)
        self.backward_reached = False
        self._sentinels: List[Tuple[torch.Tensor, torch.Tensor, int]] = []
        self._stash: Dict[torch.Tensor, torch.Tensor] = {}
        # model parameter -> (its gradient, version): left, still scaled, by the backward of a
        # scale_loss for another optimizer of the same initialization (see note_foreign_grads)
        self._foreign: Dict[torch.Tensor, Tuple[weakref.ref, int]] = {}
        # While another optimizer's scale_loss block runs: the gradients at its entry, to tell
        # what its backward left here before the block ends (a step inside that block)
        self.foreign_snapshot: Optional[Dict[torch.Tensor, Tuple[Optional[torch.Tensor], int]]] = None
        self._tokens: Dict[torch.Tensor, _Token] = {}
        # The tokens scale_loss took off the model on entry, until its backward starts: put
        # back if none does (an exception before the backward), so their history survives.
        self._held: Dict[torch.Tensor, _Token] = {}
        # The next scale_loss is the first since step(), zero_grad() or an interrupted scale_loss:
        # there a model gradient that is zero was zeroed (see _carry_data_zeroing).
        self._first_since_step = True
        self.deferred: Dict[torch.Tensor, torch.Tensor] = {}   # master -> scaled model gradient
        self._warned_bf16_sum = False
        # CPU: master gradients that were cleared, to be reused if nothing else holds them
        # (glibc hands large blocks back to the OS, and faulting 4 bytes per parameter in
        # again costs more than the unscale itself).  CUDA's caching allocator needs none.
        self._spares: Dict[torch.Tensor, torch.Tensor] = {}
        self._suspects: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self.deferred_inv_scale: Optional[torch.Tensor] = None
        # Per-tensor inf/NaN flags of this step's checks (fused optimizers only), with the model
        # params they belong to: the skip is decided on the device, its diagnostics read later.
        self.overflow_records: List[Tuple[torch.Tensor, List[torch.Tensor]]] = []

    @property
    def in_scale_loss(self) -> bool:
        """Whether a ``scale_loss`` block for this optimizer is running."""
        return self.active_scaler is not None

    # -- views ---------------------------------------------------------------------------------
    def pairs(self, reverse: bool = False) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        """``(model_param, master)`` for every parameter of the optimizer, in ``param_groups``
        order, or from the last parameter back with ``reverse``."""
        model_of = self.masters.model_of if self.masters is not None else {}
        groups = self.optimizer.param_groups
        for group in reversed(groups) if reverse else groups:
            params = group["params"]
            for param in reversed(params) if reverse else params:
                yield model_of.get(param, param), param

    def distinct_pairs(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        return ((model, master) for model, master in self.pairs() if model is not master)

    def models(self) -> List[torch.Tensor]:
        return [model for model, _ in self.pairs()]

    # -- scale_loss entry ----------------------------------------------------------------------
    def check_can_join(self, loss_id: int, scaler_updates: int, fixed_scale: Optional[float]) -> None:
        """A ``scale_loss`` may add to delayed scaled gradients only with the same scale: that of
        the same loss id, not updated since, or the same static scale (O0, O3, O4 and O5 scale
        every loss by 1), whatever the loss ids."""
        pending = self.pending
        if pending is None:
            return
        if pending.fixed_scale is not None and pending.fixed_scale == fixed_scale:
            self.pending = _Pending(loss_id, scaler_updates, fixed_scale)  # one scale: as one loss id's
            return
        if pending.loss_id != loss_id:
            raise RuntimeError(
                f"scale_loss(..., loss_id={loss_id}) would add its gradients to gradients still scaled by "
                f"loss_id {pending.loss_id}'s scale (that scale_loss used delay_unscale=True).  Use "
                "delay_unscale=False on the last scale_loss of each loss_id before switching to another")
        if pending.scaler_updates != scaler_updates:
            raise RuntimeError(
                f"loss_id {loss_id}'s scale changed (another optimizer's scale_loss unscaled with it, or it was set "
                "by hand or loaded from a checkpoint) while this optimizer's gradients were still scaled by the old "
                "one (delay_unscale=True).  Use delay_unscale=False before the other optimizer's scale_loss, and "
                "change a scale only between steps")

    def prepare_backward(self) -> None:
        """Make room for one loss's scaled gradients (see the module docstring)."""
        if self.pending is not None:
            return
        self.reconcile(at_step=False)
        self._first_since_step = False
        if self.deferred:
            self.materialize_deferred()
        self._held = {}
        for model, master in self.pairs():
            if model is master:
                if model.grad is not None:
                    self._stash[model] = model.grad
                    model.grad = None
            else:
                token = self._tokens.get(model, _DETACHED)
                if token[0] is not None and model.grad is token[0]:
                    self._held[model] = token
                model.grad = None
                self._tokens[model] = _DETACHED

    def backward_started(self) -> None:
        """The backward reached the scaled loss: the held tokens go (their memory with them)."""
        self._held = {}
        self.backward_reached = True

    def backward_ended(self) -> None:
        """A backward through the scaled loss is over: remember the gradients of the first and
        the last parameters that have one, with their version counters.  Clipping or
        normalizing the gradients writes every one of them, so a change to these before the
        block's exit (:meth:`take_written_in_block`) shows the block changed scaled gradients.
        A walk over at most ``_SENTINEL_SEARCH`` parameters from each end (a frozen backbone
        listed first holds no gradients, and must not cost a walk over all of it)."""
        sentinels: Dict[int, Tuple[torch.Tensor, torch.Tensor, int]] = {}
        for pairs in (self.pairs(), self.pairs(reverse=True)):
            found = 0
            for model, _ in itertools.islice(pairs, _SENTINEL_SEARCH):
                grad = model.grad
                if grad is not None:
                    sentinels[id(model)] = (model, grad, grad._version)
                    found += 1
                    if found == _SENTINELS_PER_END:
                        break
        self._sentinels = list(sentinels.values())

    def take_written_in_block(self) -> bool:
        """Whether a gradient :meth:`backward_ended` remembered was changed since, in place or
        replaced; forgets them, and that a backward reached the block.  A gradient cleared to
        ``None`` is not a change: nothing scaled is left to be misread."""
        sentinels, self._sentinels = self._sentinels, []
        self.backward_reached = False
        return any(model.grad is not None and (model.grad is not grad or grad._version != version)
                   for model, grad, version in sentinels)

    def reconcile(self, at_step: bool) -> None:
        """Carry what the user did to distinct pairs' model gradients since the last
        ``scale_loss`` over to the masters (see the module docstring).  Raises if a gradient
        reached a model parameter outside ``scale_loss``.

        A token changed in place was zeroed (``zero_grad(set_to_none=False)``), or written
        otherwise (a backward outside ``scale_loss``, clipping ``model.parameters()``): telling
        which needs its values.  The master's gradient is zeroed on the device where the token
        is all zeros, and the verdict is read at ``step`` (:meth:`take_suspects`), with the
        overflow flag, in the step's one host read."""
        stray, unchanged = [], []
        for model, master in self.distinct_pairs():
            expected, version, before = self._tokens.get(model, _DETACHED)
            grad = model.grad
            if grad is expected:
                if grad is None:
                    continue
                if grad._version == version:
                    if not at_step and before is not None and master.grad is not None and master not in self.deferred:
                        unchanged.append((model, master, grad, before))
                    continue
                self._suspect(model, master, grad)
            elif grad is None:  # cleared: p.grad = None, model.zero_grad()
                self._clear_master_grad(master)
                self._owed_zeros.discard(master)
                self._tokens.pop(model, None)
            elif not grad.is_sparse and grad.shape == model.shape:
                self._suspect(model, master, grad)  # replaced: p.grad = torch.zeros_like(p) zeroes it
            else:
                stray.append(model)
        if stray:
            raise RuntimeError(self._stray_message(stray, at_step))
        if unchanged:
            self._carry_data_zeroing(unchanged, first=self._first_since_step)
        if not at_step:  # at step, after the owed zeros (see check_ready_for_step)
            self._forget_overflow_without_gradients()

    def copy_masters_to_model(self) -> None:
        """Write this optimizer's FP32 masters into their 16-bit model parameters (none without
        masters)."""
        if self.masters is not None:
            self.masters.copy_to_model([master for _, master in self.distinct_pairs()])

    def track_assigned_grads(self) -> None:
        """After a step no ``scale_loss`` came before: its masters' gradients were set by hand
        (``p.grad = g`` through ``amp.master_params``).  A zero token on each such master's model
        parameter makes a later ``model.zero_grad()`` reach it, as on torch's one object (G20's
        R6: the next step applied it again).  Runs only on such steps."""
        for model, master in self.distinct_pairs():
            if master.grad is not None and model.grad is None and master not in self.deferred:
                self._park(model, master, _ASSIGNED)

    def settle_model_clears(self) -> None:
        """Masters whose model parameter's gradient was set to ``None`` since ampinit left it
        there (``model.zero_grad()``, ``p.grad = None``) lose theirs now, as the one tensor of
        plain torch would: before ``optimizer.zero_grad(set_to_none=False)`` zeroes what is
        left (it would bring a cleared gradient back as zeros, which step() applies: weight
        decay, momentum, Adam's step count) and before ``master_params`` shows them.  A Python
        pass over the tokens (0.2 µs each), no device work."""
        cleared = [model for model, (token, _, _) in self._tokens.items() if token is not None and model.grad is None]
        if not cleared:
            return
        master_of = {model: master for model, master in self.distinct_pairs()}
        for model in cleared:
            master = master_of.get(model)
            if master is not None:
                self._clear_master_grad(master)
                self._owed_zeros.discard(master)
                self._tokens.pop(model, None)

    def _forget_overflow_without_gradients(self) -> None:
        # A distinct pair's model gradient is a token once unscaled (no delayed gradients
        # pending): a master cleared through param_groups leaves nothing to step (G20's R1)
        tokens_only = self.pending is None
        if all((model.grad is None or (tokens_only and model is not master)) and master.grad is None
               and master not in self.deferred for model, master in self.pairs()):
            self._forget_overflow()  # every gradient of this step is gone, and its overflow with it

    def _suspect(self, model: torch.Tensor, master: torch.Tensor, grad: torch.Tensor) -> None:
        """A token changed in place or replaced: zero the master's gradient on the device where
        it is all (positive) zeros; whether it holds anything else is read at step.  A negative
        zero is a write: ``zero_()`` and ``fill_(0)`` give ``+0.0``, while multiplying by zero
        keeps the sign, as ``clip_grad_norm_(model.parameters())`` does where the 16-bit norm of
        the scaled gradients overflowed (a coefficient of ``max_norm / inf``)."""
        values = grad.coalesce()._values() if grad.is_sparse else grad
        written = values.ne(0).any() if values.is_complex() else (values.ne(0) | values.signbit()).any()
        if master.grad is not None and master not in self.deferred:
            if master.grad.is_sparse:  # (rare) no masked fill for sparse tensors: one sync here
                if not bool(written):
                    master.grad = torch.zeros_like(master.grad)
            else:
                master.grad.masked_fill_(written.logical_not(), 0.0)
        self._suspects.append((written, model))
        self._token(model, grad)

    def _carry_data_zeroing(self, unchanged: List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor, object]],
                            first: bool) -> None:
        """Tokens zeroed through ``.data`` (``p.grad.data.zero_()``, the pre-1.0 idiom) keep
        their version counter; their values tell.

        At the first scale_loss since step (or zero_grad, or an interrupted scale_loss), where a
        loop clears its gradients, a token that is all zeros was zeroed, and its master's
        gradient is zeroed too -- also one that was zero all along (a loss that did not reach
        the parameter or gave it an exactly-zero gradient), which only differs for a script that
        keeps adding gradients over steps without ever clearing them.  At later scale_loss calls
        of the same step a token was zeroed only if it was not zero when scale_loss left it;
        one that was zero from the start follows the rest of this optimizer's tokens.

        One L2-norm pass over the tokens (and, after the first, over the master gradients that
        stand for them); on the CPU the verdict is read directly, elsewhere it stays on the
        device (a masked fill per master gradient, no sync).  It runs only where master
        gradients are still there at a scale_loss (several losses per step without
        ``delay_unscale``, or no zero_grad), never in a loop that clears them."""
        if first:
            # a token left for a gradient set by hand follows the others: with nothing else
            # zeroed it was not cleared, and torch would keep adding to that gradient (G20 fuzz)
            assigned = [entry for entry in unchanged if entry[3] is _ASSIGNED]
            tokens = [entry for entry in unchanged if entry[3] is not _ASSIGNED]
            if tokens:
                _, now = ops.l2norm([grad for _, _, grad, _ in tokens], per_tensor=True)
                zeroed = now == 0
                if assigned:
                    zeroed = torch.cat([zeroed, zeroed.any().expand(len(assigned))])
                self._zero_master_grads_where(tokens + assigned, zeroed)
            return
        images = [entry for entry in unchanged if entry[3] is _IMAGE]
        normed = [entry for entry in unchanged if isinstance(entry[3], torch.Tensor)]
        parked = [entry for entry in unchanged if entry[3] is _PARKED or entry[3] is _ASSIGNED]
        watched = images + normed
        if not watched:
            return
        thens = []
        if images:
            thens.append(ops.l2norm([master.grad for _, master, _, _ in images], per_tensor=True)[1])
        if normed:
            thens.append(torch.stack([norm.reshape(()) for _, _, _, norm in normed]))
        then = torch.cat(thens)
        _, now = ops.l2norm([grad for _, _, grad, _ in watched], per_tensor=True)
        seen = (then > 0) & (now == 0)
        zeroed = seen | ((then == 0) & seen.any())
        if parked:
            zeroed = torch.cat([zeroed, seen.any().expand(len(parked))])
        self._zero_master_grads_where(watched + parked, zeroed)

    def _zero_master_grads_where(self, entries, zeroed: torch.Tensor) -> None:
        if zeroed.device.type == "cpu":
            for index in zeroed.nonzero().flatten().tolist():
                self._zero_master_grad(entries[index][1])
        else:
            for (_, master, _, _), flag in zip(entries, zeroed):
                master.grad.masked_fill_(flag, 0.0)

    def take_suspects(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """``(written, model_param)`` for every token changed in place since the last step:
        ``written`` (a device flag) says it holds a gradient scale_loss did not put there."""
        suspects, self._suspects = self._suspects, []
        return suspects

    def raise_for_suspects(self, models: List[torch.Tensor]) -> None:
        if models:
            raise RuntimeError(self._stray_message(models, at_step=True))

    def _stray_message(self, models: List[torch.Tensor], at_step: bool) -> str:
        names = ", ".join(self._name_of(m) for m in models[:4]) + (" ..." if len(models) > 4 else "")
        where = "optimizer.step()" if at_step else "scale_loss"
        return (f"{where} found gradients on the model's low-precision parameters ({names}) that scale_loss did "
                "not put there: a backward outside `with ampinit.scale_loss(loss, optimizer) as scaled_loss: "
                "scaled_loss.backward()`, or an in-place change such as clipping model.parameters().  The optimizer "
                "updates the FP32 master weights from their own gradients: run every backward inside scale_loss, "
                "and clip ampinit.master_params(optimizer)")

    def _token(self, model: torch.Tensor, grad: torch.Tensor, before: object = None) -> None:
        self._tokens[model] = (grad, grad._version, before)

    def _park(self, model: torch.Tensor, master: torch.Tensor, marker: str = _PARKED) -> None:
        """Leave a zero token on a model parameter that has no gradient of its own (the last
        loss did not reach it, or the master's was set by hand: ``marker`` ``_ASSIGNED``) but
        whose master has one, so that clearing the model's gradients still reaches the master."""
        if master.grad is None and master not in self.deferred:
            model.grad = None
            self._tokens[model] = _DETACHED
            return
        model.grad = torch.zeros_like(model)
        self._token(model, model.grad, marker)

    def _clear_master_grad(self, master: torch.Tensor) -> None:
        self.keep_spare(master)
        master.grad = None
        self.deferred.pop(master, None)

    def keep_spare(self, master: torch.Tensor) -> None:
        """``master``'s gradient is about to be dropped: keep it (CPU) for :meth:`_new_grad`."""
        grad = master.grad
        if grad is not None and grad.device.type == "cpu" and not grad.is_sparse and master in self.masters_model_of:
            self._spares[master] = grad

    @property
    def masters_model_of(self) -> Dict[torch.Tensor, torch.Tensor]:
        return self.masters.model_of if self.masters is not None else {}

    def _new_grad(self, master: torch.Tensor) -> torch.Tensor:
        """An FP32 gradient buffer for ``master``: a spare if nothing but this method holds it
        (no user reference, no view, no tensor sharing its storage), else a new tensor, so a
        gradient the user kept is never overwritten."""
        spare = self._spares.pop(master, None)
        if spare is not None and _unreferenced(spare):
            return spare
        return torch.empty_like(master)

    def _zero_master_grad(self, master: torch.Tensor) -> None:
        if master in self.deferred:
            return  # the deferred gradient is the token itself, zeroed
        if master.grad is not None:
            master.grad.zero_()

    def _note_bf16_sum(self, model: torch.Tensor) -> None:
        """Once per optimizer: a second loss added its gradient to a remainder master's, which is
        the model's bfloat16 gradient (FP32 masters would sum in FP32)."""
        if self._warned_bf16_sum or self.masters is None or self.masters.remainders_of(model) is None:
            return
        self._warned_bf16_sum = True
        logger.warning("ampinit: several scale_loss blocks before one step() add their gradients in bfloat16 "
                       "with master_weights='remainder' (the masters' gradients are the model's), where FP32 "
                       "masters add them in FP32; pass delay_unscale=True to all but the last scale_loss of the "
                       "step to add them in the backward instead, as FP32 masters would bit for bit")

    def _forget_overflow(self) -> None:
        self.found_inf.zero_()
        self.unscaled_since_step = False
        self.deferred_inv_scale = None
        self.overflow_records = []

    # -- scale_loss exit -----------------------------------------------------------------------
    def delay(self, loss_id: int, scaler_updates: int, fixed_scale: Optional[float]) -> None:
        """The backward of a ``delay_unscale=True`` scale_loss succeeded: its scaled gradients
        stay on the model and the next ``scale_loss`` adds to them."""
        if self.pending is None:
            self.pending = _Pending(loss_id, scaler_updates, fixed_scale)

    def unscale(self, inv_scale: torch.Tensor, found_inf: torch.Tensor) -> None:
        """Unscale the new gradients into the masters (or onto the stashed ones), flagging
        inf/NaN in ``found_inf``; a stashed gradient this loss did not reach is put back."""
        write_in, write_out, write_models, add_in, add_out = [], [], [], [], []
        check_in, check_models, added = [], [], []
        restored, self._restored_zeros = self._restored_zeros, set()
        for model, master in self.pairs():
            grad = model.grad
            if model is master:
                stashed = self._stash.pop(model, None)
                if grad is None:
                    if stashed is not None:
                        model.grad = stashed
                    continue
                if grad.is_sparse:
                    self._unscale_sparse(model, master, local(grad), stashed, inv_scale, found_inf)
                    continue
                if stashed is None:
                    write_in.append(local(grad))
                    write_out.append(local(grad))
                    write_models.append(model)
                else:
                    add_in.append(local(grad))
                    add_out.append(local(stashed))
                    model.grad = stashed
                    if model not in restored:  # adding to zeros loses nothing
                        self._note_bf16_sum(model)
                continue
            if self.masters is not None and not self.masters.settle_requires_grad(model, master):
                # frozen (through the optimizer too: param_groups hold the masters): as in torch,
                # the optimizer must not see a gradient; the model's is dropped, not unscaled
                model.grad = grad = None
            if grad is None:  # not reached by this loss
                self._park(model, master)
                continue
            self._token(model, grad)
            if grad.is_sparse:
                self._unscale_sparse(model, master, grad, master.grad, inv_scale, found_inf)
            elif master.grad is None and self.fused:
                self.deferred[master] = grad
                check_in.append(grad)
                check_models.append(model)
            elif master.grad is None:
                master.grad = self._new_grad(master)
                write_in.append(grad)
                write_out.append(master.grad)
                write_models.append(model)
                self._token(model, grad, _IMAGE)
            else:
                add_in.append(grad)
                add_out.append(master.grad)
                added.append(model)
        self._stash.clear()
        if write_in:
            ops.unscale_(write_in, write_out, inv_scale, found_inf,
                         self._overflow_flags(write_models, found_inf.device))
        if add_in:
            ops.accumulate_unscaled_(add_in, add_out, inv_scale, found_inf)
        if check_in:
            ops.check_finite_(check_in, found_inf, self._overflow_flags(check_models, found_inf.device))
            self.deferred_inv_scale = inv_scale
        if added:  # the master's gradient holds earlier losses too: remember what the token held
            _, norms = ops.l2norm([model.grad for model in added], per_tensor=True)
            for model, norm in zip(added, norms):
                self._token(model, model.grad, norm)
        self.pending = None
        self.unscaled_since_step = True

    def _unscale_sparse(self, model, master, grad, previous, inv_scale, found_inf) -> None:
        unscaled = ops.unscale_sparse(grad, inv_scale, found_inf, master.dtype)
        # For a same-tensor pair ``master`` is ``model``: this sets the model's gradient.
        master.grad = unscaled if previous is None else previous + unscaled

    def _overflow_flags(self, models: List[torch.Tensor], device: torch.device) -> Optional[torch.Tensor]:
        """A per-tensor flag tensor for the check of ``models``' gradients (fused optimizers only:
        the others find the culprits after a skip, when the gradients are still there)."""
        if not self.fused:
            return None
        flags = torch.zeros(len(models), device=device)
        self.overflow_records.append((flags, models))
        return flags

    def restore_after_no_backward(self) -> None:
        """No backward reached the scaled loss (the body of ``scale_loss`` raised first, or
        never ran one): put every gradient back as it was on entry."""
        if self.pending is not None:
            return  # nothing was moved on entry
        for model, master in self.pairs():
            if model is master:
                model.grad = self._stash.pop(model, None)
            elif model in self._held:  # the master's gradient is untouched
                self._tokens[model] = self._held[model]
                model.grad = self._held[model][0]
            # else: no token on entry, none now (a zero token here, on a master given its
            # gradient by hand, was taken for a clear at the next scale_loss: G20's R8)
        self._stash.clear()
        self._held = {}
        self._first_since_step = True  # the batch was abandoned: the next one starts afresh

    # -- the fused optimizers' deferred gradients ----------------------------------------------
    def materialize_deferred(self) -> None:
        """Unscale the deferred gradients into the masters' ``.grad`` (already checked), and
        give the zeros owed to masters no backward reached: code that reads the masters'
        gradients (``amp.master_params``) finds what torch would leave there."""
        self._give_owed_zeros()
        if not self.deferred:
            return
        masters = list(self.deferred)
        for master in masters:
            master.grad = self._new_grad(master)
        scratch = torch.zeros_like(self.found_inf)
        ops.unscale_([self.deferred[m] for m in masters], [m.grad for m in masters], self.deferred_inv_scale, scratch)
        self.deferred.clear()

    # -- step ----------------------------------------------------------------------------------
    # -- gradients from another optimizer's scale_loss -----------------------------------------
    def grad_snapshot(self) -> Dict[torch.Tensor, Tuple[Optional[torch.Tensor], int]]:
        """The model parameters' gradients (object and version) before a backward of a
        ``scale_loss`` that this optimizer is not part of."""
        return {model: (model.grad, -1 if model.grad is None else model.grad._version) for model, _ in self.pairs()}

    def note_foreign_grads(self, before: Dict[torch.Tensor, Tuple[Optional[torch.Tensor], int]]) -> None:
        """After that backward: the gradients it created or changed here stay multiplied by its
        loss scale, which only the optimizers passed to that ``scale_loss`` unscale (a GAN's
        generator loss reaches the discriminator's parameters).  They are harmless if cleared
        before this optimizer uses them (``zero_grad``, the next loop's ``D.zero_grad()``); used,
        :meth:`check_foreign_grads` raises."""
        for model, _ in self.pairs():
            grad = model.grad
            if grad is None:
                continue
            old, version = before.get(model, (None, -1))
            if old is grad and version == grad._version:
                continue
            self._foreign[model] = (weakref.ref(grad), grad._version)

    def check_foreign_grads(self, what: str) -> None:
        """Raise before ``what`` (this optimizer's scale_loss or step) uses a gradient that
        another optimizer's ``scale_loss`` left scaled and nobody cleared since, its block still
        running or not.  Changes nothing the user sees."""
        if self.foreign_snapshot is not None:
            self.note_foreign_grads(self.foreign_snapshot)
        live = [model for model, (ref, version) in self._foreign.items()
                if model.grad is not None and model.grad is ref() and model.grad._version == version]
        if not live:
            self._foreign.clear()
            return
        names = ", ".join(self._name_of(m) for m in live[:4]) + (", ..." if len(live) > 4 else "")
        raise RuntimeError(
            f"{what} would use gradients of {names} that the backward of a scale_loss for another optimizer put "
            "there, still multiplied by that loss's scale (only the optimizers passed to a scale_loss are "
            "unscaled).  Clear them first (this optimizer's zero_grad()), or pass every optimizer whose "
            "parameters the loss reaches: scale_loss(loss, [optimizer_a, optimizer_b])")

    def check_ready_for_step(self) -> None:
        if self.pending is not None:
            raise RuntimeError(
                "optimizer.step() was called while gradients are still scaled: a scale_loss used "
                "delay_unscale=True and no scale_loss with delay_unscale=False has finished a backward since "
                "(one whose body raised before its backward leaves them scaled).  Pass delay_unscale=False to "
                "the last scale_loss before step(), or call optimizer.zero_grad() to drop the scaled gradients")
        self.reconcile(at_step=True)
        # zeros owed to masters no backward reached are gradients of this step: its overflow
        # (found in another optimizer's parameters by the same scale_loss) skips them too
        self._give_owed_zeros()
        self._forget_overflow_without_gradients()

    def _give_owed_zeros(self) -> None:
        """The zeros ``zero_grad(set_to_none=False)`` owes to masters no backward reached since:
        torch's optimizer would step them on a zero gradient (weight decay, momentum)."""
        for master in self._owed_zeros:
            if master.grad is None and master not in self.deferred:
                master.grad = self._new_grad(master).zero_()
        self._owed_zeros = set()

    def drop_all_grads(self) -> None:
        """After a skipped or fused step: no gradient of it may reach the next one."""
        self._dropped = []  # what zero_grad(set_to_none=False) gives back as zeros
        for model, master in self.pairs():
            if model.grad is not None or master.grad is not None or master in self.deferred:
                self._dropped.append(model)
            model.grad = None
            self.keep_spare(master)
            master.grad = None
        self._tokens.clear()
        self._stash.clear()
        self._foreign.clear()
        self.deferred.clear()
        self.pending = None

    def end_step(self) -> None:
        self._forget_overflow()
        self._first_since_step = True



    def zero_grad(self, set_to_none: bool) -> None:
        """After the optimizer cleared the masters' gradients: the model-side gradients of
        distinct pairs, the overflow and pending state go too."""
        if not set_to_none:
            # torch would zero the gradients the step left, and the optimizer would then step a
            # parameter no backward reaches with a zero gradient (weight decay, momentum); the
            # ones drop_all_grads dropped come back as zeros to keep that
            # (a master's zeros are owed until step(), given only where no backward reached it)
            masters = {model: master for model, master in self.distinct_pairs()}
            for model in self._dropped:
                if model.grad is None:
                    model.grad = torch.zeros_like(model)
                    self._restored_zeros.add(model)
                master = masters.get(model)
                if master is not None and master.grad is None:
                    if self.fused:  # owed: a zero buffer would keep the fused path from deferring
                        self._owed_zeros.add(master)
                    else:  # given now, as torch's would be there: a clear through param_groups removes them (R3)
                        master.grad = self._new_grad(master).zero_()
        else:
            self._restored_zeros = set()
            self._owed_zeros = set()
        self._dropped = []
        for model, master in self.distinct_pairs():
            if model.grad is None:
                self._tokens.pop(model, None)
                if not set_to_none and master.grad is not None and master not in self.deferred:
                    self._park(model, master, _ASSIGNED)  # set by hand: model.zero_grad() must reach it
            elif set_to_none:
                model.grad = None
                self._tokens.pop(model, None)
            else:
                if model.grad.grad_fn is not None:
                    model.grad = model.grad.detach()
                model.grad.zero_()
                self._token(model, model.grad)
                if master in self.deferred:  # its gradient (a fused optimizer's, still on the model) goes below
                    self._owed_zeros.add(master)
        self._stash.clear()
        self.deferred.clear()
        self._suspects.clear()
        self.pending = None
        self._forget_overflow()
        self._first_since_step = True


def _unreferenced(tensor: torch.Tensor) -> bool:
    """Whether the caller's one local reference is all that holds ``tensor``: no other Python
    reference (``sys.getrefcount`` counts the argument too), no other C++ owner of the same
    tensor, no other tensor (a view, a ``detach()``) on its storage.  The counts are torch
    internals; where they are missing the answer is "no", which costs only a new buffer."""
    try:
        storage_users = torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)
        return sys.getrefcount(tensor) == 3 and tensor._use_count() == 1 and storage_users == 2
    except (AttributeError, RuntimeError):
        return False
