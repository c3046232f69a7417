"""One optimizer's step under ampinit: the skip decision, the master -> model copy, counters.

The step must run however ``optimizer.step`` is reached, so it is driven from two places:

- the optimizer's own class: ``initialize`` swaps it for a subclass (``ampinit.optimizer``)
  whose ``step`` decides first and, on an overflow, does not call the real step at all;
- torch's optimizer step hooks, for a ``step`` that bypasses that class: a wrapper stored on the
  instance *before* ``initialize`` (an LR scheduler made first -- the HF Trainer, GNMT,
  Lightning's ``configure_optimizers`` -- or a framework that saved the bound method).  torch
  runs the hooks around the class's real step, whoever calls it.  There an overflowing step
  drops every gradient before the real step runs, so it changes nothing.

Whichever path runs, :meth:`OptimizerBinding.begin_step` and :meth:`OptimizerBinding.finish_step`
do the work once per step.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any, Callable, Iterable, List, Optional, Tuple

import torch

from . import distributed, ops
from .grads import GradientFlow

if TYPE_CHECKING:  # pragma: no cover
    from .handle import AmpHandle

__all__ = ["OptimizerBinding"]


def _capturing() -> bool:
    """Whether the current CUDA stream is being captured into a graph: no host copy, event or
    host read may happen then, and nothing done on the host is replayed."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class OptimizerBinding:
    """One optimizer's link to its :class:`~ampinit.AmpHandle`: gradients, skip decision and
    step counters."""

    def __init__(self, handle: "AmpHandle", optimizer: torch.optim.Optimizer, flow: GradientFlow, index: int):
        self.handle = handle
        self.optimizer = optimizer
        self.flow = flow
        self.index = index
        self.steps = 0
        self._skipped_steps = 0
        self._last_overflow_step: Optional[int] = None
        self._last_overflow_params: List[str] = []
        self.skips_at_floor = 0      # consecutive skips leaving every scaler involved at its floor
        self.loss_ids_since_step: set = set()
        self.decided = False         # the class's step decided this step: the pre-step hook stands aside
        self.step_due = False        # an update is running whose step has not finished
        # Fused optimizers decide the skip on the device.  Each step's flags are copied to the
        # host without waiting; the counters above catch up when the copy has landed (checked
        # at the next step) or when someone reads them (a sync then).
        self._unresolved: collections.deque = collections.deque()

    # -- counters that fused steps may still owe: reading them settles every step so far ---------
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

    # -- the step ---------------------------------------------------------------------------------
    def begin_step(self) -> bool:
        """Everything before the optimizer's update: checks, the user's changes to the model
        (cleared gradients, weights written from outside), and the skip decision.  Returns
        whether the update runs.  Reads the overflow flag on the host (one sync) unless the
        optimizer is fused or no ``scale_loss`` ran since the last step."""
        self.handle.check_not_ended()
        flow = self.flow
        self._check_not_inside_scale_loss()
        if flow.masters is not None:  # before the checks, which read param_groups
            self.handle.put_masters_back(self.optimizer)
        flow.check_foreign_grads("optimizer.step()")
        if flow.pending is not None and flow.masters is None and flow.pending.fixed_scale == 1.0:
            # every backward since the last step was delayed, at a scale of 1 with no masters (O0,
            # O3, O4): the gradients are final; unscaling them by 1 checks them for inf/NaN, as the
            # exit of a last block without delay_unscale would (apex stepped them unchecked)
            self.handle.unscale_delayed([self])
        flow.check_ready_for_step()
        if flow.masters is not None:
            flow.masters.sync(flow.models())
        read_overflow = flow.unscaled_since_step and not flow.fused
        suspects = flow.take_suspects()
        flags = ([flow.found_inf] if read_overflow else []) + [w.float().reshape(1) for w, _ in suspects]
        in_block = flow.in_scale_loss  # (allowed only where the gradients are final there)
        if in_block:
            flags.append(self._nonfinite_grads_flag())
        values = torch.cat(flags).tolist() if flags else []  # the step's one host read
        flow.raise_for_suspects([model for (_, model), written in zip(suspects, values[read_overflow:]) if written])
        if in_block and values[-1]:
            self.skip_step()
            return False
        if flow.fused:
            self.resolve_fused_steps(wait=False)
            return True
        if read_overflow and values[0]:
            self.skip_step()
            return False
        return True

    def _nonfinite_grads_flag(self) -> torch.Tensor:
        """A step inside the ``scale_loss`` block (an optimizer stepped from a hook during the
        backward, at O0/O3/O4) comes before the block's exit checks the gradients: they are
        checked here instead, so that a non-finite one is skipped as at any other step.  A
        device flag, read with the step's other flags."""
        grads = [distributed.local(model.grad) for model in self.flow.models() if model.grad is not None]
        flag = torch.zeros_like(self.flow.found_inf)
        ops.check_finite_([grad._values() if grad.is_sparse else grad for grad in grads], flag)
        return flag

    def _check_not_inside_scale_loss(self) -> None:
        """A step inside the ``scale_loss`` block (or in a hook its backward runs) would update
        with gradients that are still multiplied by the loss scale, or not yet in the masters.
        Only a static scale of 1 without masters (O0, O4) leaves them right there, as in apex:
        reading that scale syncs, but only on this path."""
        if not self.flow.in_scale_loss:
            return
        not_final = self.why_grads_not_final_in_block()
        if not_final is None:
            return
        raise RuntimeError(
            "optimizer.step() ran inside `with ampinit.scale_loss(loss, optimizer) as scaled_loss:` (in the block, "
            "or in a hook run by scaled_loss.backward(), such as a register_post_accumulate_grad_hook that steps "
            f"the optimizer): there the gradients are {not_final}, so the update would be "
            "wrong.  Call optimizer.step() after the with block.  An optimizer stepped during the backward needs "
            "gradients that are final when each is produced, which loss scaling cannot give: use opt_level='O4' "
            "(bf16 autocast, no loss scale) for it")

    def why_grads_not_final_in_block(self) -> Optional[str]:
        """Inside this optimizer's ``scale_loss`` block: why its gradients are not yet what the
        update reads (``None`` if they are: a static scale of 1 and no masters, as at O0, O3,
        O4).  Reading a static scale syncs, on this path only."""
        flow = self.flow
        scaler = flow.active_scaler
        scaled = scaler.dynamic or scaler.loss_scale() != 1.0
        reasons = (["still multiplied by the loss scale"] if scaled else []) + \
            ([] if flow.masters is None else ["not yet in the FP32 master weights"])
        return " and ".join(reasons) or None

    def fused_inputs(self) -> dict:
        """What a fused optimizer's update reads besides ``param.grad`` (``_amp_update``'s
        keyword arguments): the deferred scaled gradients, their inverse scale, the step's
        overflow flag and the model parameters to write."""
        flow = self.flow
        model_of = {master: model for model, master in flow.distinct_pairs()}
        inputs: dict = {"model_of": model_of}
        if flow.masters is not None and flow.masters.has_remainders:
            inputs["remainders"] = {model: parts for model in flow.models()
                                    if (parts := flow.masters.remainders_of(model)) is not None}
            flow.masters.check_remainder_layout(inputs["remainders"])
        if flow.unscaled_since_step:  # else no scale_loss since the last step: plain gradients
            inputs.update(found_inf=flow.found_inf, inv_scale=flow.deferred_inv_scale, scaled_grads=flow.deferred)
        return inputs

    def finish_step(self) -> None:
        """Everything after the optimizer's update."""
        flow = self.flow
        if flow.fused:
            if flow.unscaled_since_step and not _capturing():  # a replayed skip is never counted
                self._unresolved.append(self._flags_on_host())
            elif not flow.unscaled_since_step:
                self.skips_at_floor = 0
            # The step may have been skipped, which only the device knows: no gradient of it may
            # be added to the next one, so they are all dropped, as after a skip.
            flow.drop_all_grads()
            if flow.masters is not None:
                flow.masters.mark(flow.models())  # the kernel wrote them
        else:
            self.skips_at_floor = 0
            flow.copy_masters_to_model()
            if not flow.unscaled_since_step:  # a step on gradients set by hand
                flow.track_assigned_grads()
        self.steps += 1
        self._end_step()

    def skip_step(self) -> None:
        """Skip this step: record which parameters overflowed, drop every gradient, and
        raise if the overflow persists at the scale floor (a NaN bug, not an overflow)."""
        names = self.nonfinite_param_names()
        loss_ids = set(self.loss_ids_since_step)
        step = self.steps
        self.steps += 1
        self.flow.drop_all_grads()
        if self.flow.masters is not None:
            # the masters are as before the step, but the model may not be: see the method
            self.flow.masters.copy_replaced_masters(self.flow.models())
        self._end_step()
        self._count_skip(step, names, loss_ids)

    def _end_step(self) -> None:
        self.flow.end_step()
        self.loss_ids_since_step.clear()

    def discard_step(self) -> None:
        """``zero_grad()`` cleared this step's gradients: their overflow and loss ids go too."""
        self.loss_ids_since_step.clear()

    # -- the two paths (see the module docstring) ---------------------------------------------
    def step_from_class(self, run_update: Callable[[], Any]) -> Any:
        """``optimizer.step()`` through the swapped class: decide, run the update unless the
        step is skipped, finish (in the post-step hook, before the user's, or here)."""
        self.step_due = False
        if not self.begin_step():
            return None
        self.step_due = True
        self.decided = True
        try:
            if self.flow.fused:
                self.optimizer.__dict__["_ampinit_step_inputs"] = self.fused_inputs()
            result = run_update()
        except BaseException:
            self.step_due = False  # no update finished: nothing is inside this step any more
            raise
        finally:
            self.decided = False
            self.optimizer.__dict__.pop("_ampinit_step_inputs", None)
        if self.step_due:  # no post-step hook ran (an optimizer whose step torch does not hook)
            self.step_ends()
        return result

    def step_begins_from_hook(self) -> None:
        """Pre-step hook: the step was reached without the swapped class's ``step``; an
        overflowing step drops every gradient here, so the update that follows changes nothing."""
        if self.decided:
            return
        self.step_due = self.begin_step()
        if self.step_due and self.flow.fused:
            self.optimizer.__dict__["_ampinit_step_inputs"] = self.fused_inputs()

    def step_ends(self) -> None:
        """Post-step hook (the first one), or the end of :meth:`step_from_class`."""
        if not self.step_due:
            return
        self.step_due = False
        self.optimizer.__dict__.pop("_ampinit_step_inputs", None)
        self.finish_step()

    # -- diagnostics ------------------------------------------------------------------------------
    def nonfinite_param_names(self) -> List[str]:
        """Names of the parameters whose (unscaled) gradients hold inf/NaN.  One extra pass
        over the gradients and one sync: called only when a step is skipped."""
        return self._names_of_nonfinite(
            (model, master.grad if master.grad is not None else model.grad) for model, master in self.flow.pairs())

    def nonfinite_weight_names(self) -> List[str]:
        """Names of the parameters whose weights (the masters, where there are masters) hold
        inf/NaN.  One pass and one sync: called only when raising."""
        return self._names_of_nonfinite((model, master.detach()) for model, master in self.flow.pairs())

    def _names_of_nonfinite(self, tensors: Iterable[Tuple[torch.Tensor, Optional[torch.Tensor]]]) -> List[str]:
        """The names of the model parameters whose tensor (``None``: skipped) holds inf/NaN, this
        rank's shard under FSDP2; one flag per tensor on the device, read in one sync."""
        names, flags = [], []
        for model, tensor in tensors:
            if tensor is None:
                continue
            tensor = distributed.local(tensor)
            values = tensor._values() if tensor.is_sparse else tensor
            names.append(self.handle.param_name(model))
            flags.append(torch.logical_not(torch.isfinite(values).all()))
        if not flags:
            return []
        return [name for name, bad in zip(names, torch.stack(flags).tolist()) if bad]

    def _flags_on_host(self):
        """This step's found_inf and per-tensor flags, copied to the host without waiting.  The
        event is recorded on the stream of the flags' device, which the copy is queued on."""
        flow = self.flow
        flags = [flow.found_inf] + [f for f, _ in flow.overflow_records]
        models = [m for _, ms in flow.overflow_records for m in ms]
        packed = torch.cat(flags)
        event = None
        if packed.is_cuda:
            with torch.cuda.device(packed.device):
                host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
                host.copy_(packed, non_blocking=True)
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(packed.device))
        else:
            host = packed
        return self.steps, set(self.loss_ids_since_step), models, host, event

    def resolve_fused_steps(self, wait: bool) -> None:
        """Count the skipped fused steps whose flags have reached the host (all of them, if
        ``wait``: a sync).  Raises like :meth:`skip_step` on persistent inf/NaN."""
        if _capturing():
            return
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
        scalers = [self.handle.loss_scalers[i] for i in sorted(loss_ids)]
        at_floor = all(s.at_floor() for s in scalers)
        self.skips_at_floor = self.skips_at_floor + 1 if at_floor else 0
        self.handle.report_skip(self)
        limit = self.handle.max_skips_at_floor
        if limit is not None and self.skips_at_floor >= limit:
            raise RuntimeError(self._persistent_overflow_message(scalers))

    def _persistent_overflow_message(self, scalers: List[Any]) -> str:
        where = ", ".join(self._last_overflow_params) or "none found"
        static = sorted({s.loss_scale() for s in scalers if not s.dynamic and s.loss_scale() > 1.0})
        # a floor the user set (the default is fp16's smallest subnormal): real overflows there are possible
        floors = sorted({s.min_loss_scale for s in scalers if s.dynamic and s.min_loss_scale >= 2.0 ** -8})
        if static:
            cause = (f"the static loss scale {static[-1]:g} may be too large for these gradients: lower "
                     "loss_scale, or pass loss_scale='dynamic' to initialize.  If they are inf/NaN at any scale, "
                     "look for NaN in the data, the loss or the model")
        elif floors:
            cause = (f"the dynamic scale cannot go below min_loss_scale={floors[-1]:g}: either these gradients "
                     "overflow even at that scale (lower min_loss_scale, or leave it unset, in initialize), or they "
                     "are inf/NaN at any scale, which points at a bug (NaN in the data, the loss or the model)")
        else:
            cause = ("these gradients are not overflowing, they are inf/NaN at any scale, which points at a bug "
                     "(NaN in the data, the loss or the model) or at state that keeps a skipped step's inf/NaN (a "
                     "DDP communication hook with memory, such as PowerSGD's error feedback).  (Gradients made "
                     "finite by hand after the backward, nan_to_num_ say, are skipped all the same: the step "
                     "follows the backward's check, as apex's did)")
        broken = self.nonfinite_weight_names()
        if broken:  # skipped steps never write the weights: an applied step or something else did
            cause = (f"the weights themselves hold inf/NaN ({', '.join(broken[:5])}{' ...' if len(broken) > 5 else ''}"
                     "), so every gradient through them does, at any scale.  Skipped steps leave the weights as they "
                     "were; they were written by an applied step that computed inf/NaN (at O3, an Adam eps that "
                     "float16 rounds to 0: see the warning at initialize), or from outside: an optimizer that was not "
                     "passed to ampinit.initialize stepping on the scaled gradients (pass every optimizer to "
                     "initialize), a write through .data, load_state_dict.  Restore them from a checkpoint")
        return (f"{self.skips_at_floor} consecutive steps of optimizer {self.index} were skipped with the loss scale "
                f"at its floor: {cause}.  Non-finite gradients in: {where}.  To allow more such steps, set "
                "optimizer.amp.max_skips_at_floor (None disables this check)")
