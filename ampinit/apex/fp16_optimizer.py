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

    # apex 0.1 kept its scaler's state on the wrapper itself; scripts log and set it there
    @property
    def cur_scale(self) -> float:
        """The loss scale (a host sync); setting it sets the scale."""
        return self.loss_scaler.cur_scale

    @cur_scale.setter
    def cur_scale(self, value: float) -> None:
        self.loss_scaler.cur_scale = value

    @property
    def cur_iter(self) -> int:
        return self.loss_scaler.cur_iter

    @property
    def last_overflow_iter(self) -> int:
        return self.loss_scaler.last_overflow_iter

    @property
    def scale_factor(self) -> float:
        return self.loss_scaler.scale_factor

    @property
    def scale_window(self) -> int:
        return self.loss_scaler.scale_window

    @scale_window.setter
    def scale_window(self, value: int) -> None:
        self.loss_scaler.scale_window = value

    def __getattr__(self, name: str) -> Any:
        # apex 0.1's flat buffers: the model's parameters were views into fp16_groups_flat and
        # fp32_groups_flat was the optimizer's one parameter per group.  ampinit keeps a master
        # per parameter; a copy handed out under that name would take writes (a hand-written
        # resume's ``current.data.copy_(saved)``) and lose them.
        if name in ("fp16_groups_flat", "fp32_groups_flat"):
            raise AttributeError(f"ampinit's FP16_Optimizer has no {name}: it keeps one FP32 master per parameter "
                                 "(all_fp32_from_fp16_params, in param_groups order), not one flat tensor per "
                                 "group.  Save and restore with state_dict()/load_state_dict(), which also read "
                                 "apex's flat checkpoints")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

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
