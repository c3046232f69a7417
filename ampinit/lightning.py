"""A Lightning precision plugin: ``Trainer(plugins=[AmpinitPrecision("O2")])``.

Needs the optional ``lightning`` package (``pip install 'ampinit[lightning]'``).  The plugin
calls :func:`ampinit.initialize` on the LightningModule and its optimizers when the strategy
connects them, wraps every backward in :func:`ampinit.scale_loss`, skips optimizer steps
whose gradients hold inf/NaN (Lightning's gradient clipping sees the unscaled FP32 masters),
and checkpoints the amp state with the trainer's checkpoint.

Supported: single-device strategies at every level; under DDP, O1/O4 (the casting levels
must be initialized before DDP wraps the model, which Lightning does first).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Generator, List, Optional

import torch
from lightning.pytorch.plugins.precision import Precision
from torch import nn

from ._tree import cast_floating
from .frontend import handle_of, initialize, master_params, scale_loss
from .handle import AmpHandle
from .opt_levels import resolve_config

__all__ = ["AmpinitPrecision"]

_LIGHTNING_NAME = {"O0": "32-true", "O1": "16-mixed", "O2": "16-mixed", "O3": "16-true",
                   "O4": "bf16-mixed", "O5": "bf16-mixed"}


class AmpinitPrecision(Precision):
    """Mixed precision by ampinit inside Lightning.

    Args:
        opt_level: ``"O0"`` .. ``"O5"``, as for :func:`ampinit.initialize`.
        **initialize_kwargs: any other :func:`ampinit.initialize` argument
            (``loss_scale``, ``keep_batchnorm_fp32``, ``num_losses``, ...).
    """

    def __init__(self, opt_level: str = "O2", **initialize_kwargs: Any):
        super().__init__()
        initialize_kwargs.setdefault("verbosity", 0)
        self.config = resolve_config(opt_level, **initialize_kwargs)  # bad options fail here
        self.opt_level = opt_level
        self.precision = _LIGHTNING_NAME[opt_level]
        self._initialize_kwargs = initialize_kwargs
        self._handle: Optional[AmpHandle] = None
        self._optimizers: List[torch.optim.Optimizer] = []
        self._pending_state: Optional[Dict[str, Any]] = None

    @property
    def handle(self) -> AmpHandle:
        if self._handle is None:
            raise RuntimeError("AmpinitPrecision is not connected to a model yet (Trainer.fit does that)")
        return self._handle

    def connect(self, model: nn.Module, optimizers: List[torch.optim.Optimizer], lr_schedulers: List[Any]):
        module = model
        if isinstance(model, nn.parallel.DistributedDataParallel):
            if self.config.casts_model:
                raise ValueError(
                    f"AmpinitPrecision({self.opt_level!r}) casts the model, but Lightning wrapped it in "
                    "DDP before the precision plugin could: use O1/O4 with DDP strategies")
            module = model.module
        if optimizers:
            _, optimizers = initialize(module, list(optimizers), opt_level=self.opt_level,
                                       **self._initialize_kwargs)
        else:
            initialize(module, opt_level=self.opt_level, **self._initialize_kwargs)
        self._handle = handle_of(module)
        self._optimizers = list(optimizers)
        if self._pending_state is not None:
            self._handle.load_state_dict(self._pending_state)
            self._pending_state = None
        return model, optimizers, lr_schedulers

    def convert_input(self, data: Any) -> Any:
        """Cast the batch's floating-point tensors to the model's dtype at O2/O3/O5."""
        return cast_floating(data, self.config.cast_model_type, batch_objects=True) if self.config.casts_model else data

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """O1/O4: autocast around the whole training/validation step, so submodules called
        directly from ``training_step`` are covered too."""
        if self._handle is None:
            yield
            return
        with self._handle.autocast_step():
            yield

    def backward(self, tensor: torch.Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        optimizers = [optimizer] if optimizer is not None else self._optimizers
        with scale_loss(tensor, optimizers) as scaled_loss:
            model.backward(scaled_loss, *args, **kwargs)

    def main_params(self, optimizer: Any) -> Generator[torch.Tensor, None, None]:
        """What Lightning clips (``gradient_clip_val``): the FP32 masters, with their unscaled
        gradients (also for ampinit's fused optimizers, which would read them from the model)."""
        yield from master_params(optimizer)

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError("ampinit does not support LBFGS: its step() re-evaluates the loss")
        closure_result = closure()  # training_step + backward (through scale_loss)
        skip = closure_result is None and model.automatic_optimization
        self._after_closure(model, optimizer)  # hooks and gradient clipping, on the masters
        if skip:
            return None
        return optimizer.step(**kwargs)  # skipped by ampinit if a gradient was inf/NaN

    def state_dict(self) -> Dict[str, Any]:
        return self.handle.state_dict() if self._handle is not None else {}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if not state_dict:
            return
        if self._handle is None:  # restored before connect(): apply once initialized
            self._pending_state = state_dict
        else:
            self._handle.load_state_dict(state_dict)
