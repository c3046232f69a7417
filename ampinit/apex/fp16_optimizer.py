"""apex 0.1's ``apex.optimizers.FP16_Optimizer``: the cut-down wrapper that scripts of the
pytorch-pretrained-BERT era put around ``apex.optimizers.FusedAdam(..., max_grad_norm=1.0)``.

It is ``apex.fp16_utils.FP16_Optimizer`` (on ampinit's O2 machinery) with that wrapper's
defaults: a dynamic scale starts at 2**16, and ``zero_grad()`` sets the gradients to ``None``.
The clipping that apex fused into this wrapper's step is done by the optimizer it wraps
(:class:`~ampinit.apex.fused_adam_v1.FusedAdamV1` clips each param group by its
``max_grad_norm``), from the masters' unscaled gradients.  Unlike apex, it wraps any
``torch.optim.Optimizer``.

``load_state_dict`` also takes what apex's wrapper saved: flat FP32 masters per param group
(``fp32_groups_flat``), and the wrapped optimizer's state with one flat tensor per group, which
is split back into per-parameter state.
"""

from __future__ import annotations

import types
from typing import Any, Dict, List

import torch

from .fp16_utils import FP16_Optimizer as _FP16UtilsOptimizer

__all__ = ["FP16_Optimizer"]


# Why apex 0.1's attributes are read-only here, and its flat buffers absent.  Its own
# state_dict()/load_state_dict() (copied into subclasses such as UniLM's) set them one by one
# and copy into fp32_groups_flat: refusing the first write leaves the optimizer untouched.
_OWN_STATE = ("ampinit's FP16_Optimizer keeps the loss scale's state in its scaler (set the scale with "
              "optimizer.loss_scale = s, the window with optimizer.loss_scaler.scale_window = n) and one FP32 master "
              "per parameter (all_fp32_from_fp16_params), not apex 0.1's flat buffers.  A state_dict() or "
              "load_state_dict() written as apex 0.1's (UniLM's FP16_Optimizer_State) cannot run on it: drop the "
              "override; FP16_Optimizer's own restore training exactly, and load apex 0.1's checkpoints")


def _apex_0_1_attribute(name: str, dynamic_only: bool = False) -> property:
    """apex 0.1's scaler attribute ``name`` on the wrapper: the live scaler's, read-only.  A
    static scale has no ``dynamic_only`` one, as in apex 0.1."""
    def read(self: "FP16_Optimizer") -> Any:
        if dynamic_only and not self.dynamic_loss_scale:
            raise AttributeError(f"FP16_Optimizer with a static loss scale has no {name} (nor had apex 0.1's)")
        return getattr(self.loss_scaler, name)

    def refuse(self: "FP16_Optimizer", value: Any) -> None:
        raise AttributeError(f"FP16_Optimizer.{name} is read-only: {_OWN_STATE}")

    return property(read, refuse, doc=f"apex 0.1's ``{name}``: the loss scaler's, live (a host read); read-only.")


def _flat_buffer(name: str) -> property:
    """apex 0.1's flat buffer ``name``, refused: a copy would take writes (a hand-written
    resume's ``current.data.copy_(saved)``) and lose them."""
    def refuse(self: "FP16_Optimizer", *value: Any) -> None:
        raise AttributeError(f"FP16_Optimizer has no {name}: {_OWN_STATE}")

    return property(refuse, refuse, doc=f"apex 0.1's ``{name}``: not kept (see the module docstring).")


class FP16_Optimizer(_FP16UtilsOptimizer):  # noqa: N801 (apex's name)
    """apex's cut-down ``apex.optimizers.FP16_Optimizer``; see the module docstring.

    Example (apex 0.1)::

        model = BertForSequenceClassification(...).half()
        optimizer = FusedAdam(grouped_params, lr=5e-5, bias_correction=False, max_grad_norm=1.0)
        optimizer = FP16_Optimizer(optimizer, dynamic_loss_scale=True)
        optimizer.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    """

    _DYNAMIC_INIT_SCALE = 2.0 ** 16

    def zero_grad(self, set_grads_to_None: bool = True) -> None:  # noqa: N803 (apex's name)
        super().zero_grad(set_grads_to_None)

    # apex 0.1 kept its scaler's state, and its flat buffers, on the wrapper itself
    cur_scale = _apex_0_1_attribute("cur_scale")
    cur_iter = _apex_0_1_attribute("cur_iter")
    last_overflow_iter = _apex_0_1_attribute("last_overflow_iter", dynamic_only=True)
    scale_factor = _apex_0_1_attribute("scale_factor", dynamic_only=True)
    scale_window = _apex_0_1_attribute("scale_window", dynamic_only=True)
    fp16_groups_flat = _flat_buffer("fp16_groups_flat")
    fp32_groups_flat = _flat_buffer("fp32_groups_flat")

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output, or what apex's cut-down wrapper saved."""
        if isinstance(state_dict, dict) and "fp32_groups_flat" in state_dict:
            converted, fp32_params = self._from_flat_checkpoint(state_dict)
            super().load_state_dict(converted)
            with torch.no_grad():  # parameters kept FP32 (their model tensor is the master)
                for param, value in fp32_params:
                    param.copy_(value)
            return
        super().load_state_dict(state_dict)

    def _from_flat_checkpoint(self, state_dict: Dict[str, Any]) -> tuple:
        """The ``apex.fp16_utils`` layout of apex's flat checkpoint, and the values of the
        parameters kept FP32 (which that layout does not hold).  Changes nothing."""
        required = ["cur_scale", "optimizer_state_dict"]
        if state_dict.get("dynamic_loss_scale"):
            required += ["last_overflow_iter", "scale_factor", "scale_window"]
        missing = [key for key in required if key not in state_dict]
        saved = state_dict.get("optimizer_state_dict")
        if missing or not isinstance(saved, dict) or not {"state", "param_groups"} <= saved.keys():
            raise ValueError("not a complete apex FP16_Optimizer checkpoint: it lacks "
                             f"{missing or ['the state and param_groups of optimizer_state_dict']}")
        flats = state_dict["fp32_groups_flat"]
        groups = self.optimizer.param_groups
        if len(saved["param_groups"]) != len(groups) or not isinstance(flats, (list, tuple)) \
                or len(flats) != len(groups):
            raise ValueError("apex FP16_Optimizer checkpoint: it has another number of param groups than this "
                             "optimizer; build the optimizer with the param groups it was saved with")
        value_of: Dict[int, torch.Tensor] = {}
        state: Dict[int, Dict[str, Any]] = {}
        param_groups: List[Dict[str, Any]] = []
        index = 0
        for number, (group, flat, saved_group) in enumerate(zip(groups, flats, saved["param_groups"])):
            params = group["params"]
            sizes = [p.numel() for p in params]
            if not torch.is_tensor(flat) or flat.numel() != sum(sizes):
                raise ValueError(f"apex FP16_Optimizer checkpoint: param group {number} holds "
                                 f"{getattr(flat, 'numel', lambda: '?')()} values, this optimizer's {sum(sizes)}")
            for param, value in zip(params, flat.detach().split(sizes)):
                value_of[id(param)] = value.view_as(param)
            flat_state = saved["state"].get(saved_group["params"][0], {}) if saved_group["params"] else {}
            for position, param in enumerate(params):
                entry: Dict[str, Any] = {}
                for key, value in flat_state.items():
                    if torch.is_tensor(value) and value.dim() > 0 and value.numel() == sum(sizes):
                        entry[key] = value.detach().split(sizes)[position].view_as(param).clone()
                    elif torch.is_tensor(value) and value.dim() > 0:
                        raise ValueError(f"apex FP16_Optimizer checkpoint: state {key!r} of param group {number} "
                                         f"holds {value.numel()} values, this optimizer's group {sum(sizes)}")
                    else:
                        entry[key] = value
                if entry:
                    state[index + position] = entry
            param_groups.append({**saved_group, "params": list(range(index, index + len(params)))})
            index += len(params)
        scaler = types.SimpleNamespace(cur_scale=state_dict["cur_scale"], cur_iter=state_dict.get("cur_iter", 0))
        if state_dict.get("dynamic_loss_scale"):
            for key in ("last_overflow_iter", "scale_factor", "scale_window"):
                setattr(scaler, key, state_dict[key])
        fp16_masters = self.all_fp32_from_fp16_params
        fp16_master_ids = {id(master) for master in fp16_masters}
        kept_fp32 = [p for group in groups for p in group["params"] if id(p) not in fp16_master_ids]
        converted = {"loss_scaler": scaler, "dynamic_loss_scale": bool(state_dict.get("dynamic_loss_scale")),
                     "optimizer_state_dict": {"state": state, "param_groups": param_groups},
                     "fp32_from_fp16": [value_of[id(master)] for master in fp16_masters]}
        return converted, [(param, value_of[id(param)]) for param in kept_fp32]
