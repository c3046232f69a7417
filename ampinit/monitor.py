"""A training monitor for examples and scripts: a progress bar showing loss, loss scale and
skipped steps, a history of them, and a PNG plot with the skipped steps marked.

tqdm and matplotlib are optional (``pip install ampinit[examples]``): without tqdm the
monitor logs a line every ``log_every`` steps; without matplotlib :meth:`save_plot` raises a
``RuntimeError`` that says what to install.

Each :meth:`TrainingMonitor.update` reads the loss and the loss scale on the host, so it
synchronises with the device once per call; call it every few steps on a GPU.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional

import torch

from .frontend import handle_of
from .handle import AmpHandle

__all__ = ["TrainingMonitor"]

logger = logging.getLogger("ampinit")


class TrainingMonitor:
    """Records ``(step, loss, loss scale, skipped)`` after each optimizer step.

    Args:
        amp_state: an initialized optimizer, model, or :class:`~ampinit.AmpHandle`; ``None``
            for a run without ampinit (scale 1, no skips), such as an fp32 baseline.
        total: number of steps, for the bar.
        desc: label of the bar and the plot.
        log_every: without tqdm, log a line every this many steps.
        show: draw the bar (False: record only).
    """

    def __init__(self, amp_state: Any = None, total: Optional[int] = None, desc: str = "train",
                 log_every: int = 50, show: bool = True):
        self.handle: Optional[AmpHandle] = None if amp_state is None else handle_of(amp_state)
        self.desc = desc
        self.log_every = log_every
        self.history: Dict[str, List[float]] = {"step": [], "loss": [], "scale": [], "skipped": []}
        self._skipped_before = 0
        self._bar = None
        self._log_lines = False
        if show:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total, desc=desc, dynamic_ncols=True, leave=True)
            else:
                self._log_lines = True

    def update(self, loss: torch.Tensor, **extra: Any) -> None:
        """Record one optimizer step (after ``optimizer.step()``).  Synchronises."""
        loss_value = float(loss.detach().float().item()) if torch.is_tensor(loss) else float(loss)
        scale = self.handle.loss_scale() if self.handle is not None else 1.0
        skipped_total = self.handle.skipped_steps if self.handle is not None else 0
        skipped = skipped_total > self._skipped_before
        self._skipped_before = skipped_total
        step = len(self.history["step"]) + 1
        for key, value in (("step", step), ("loss", loss_value), ("scale", scale), ("skipped", skipped)):
            self.history[key].append(value)
        fields = {"loss": f"{loss_value:.4f}", "scale": f"{scale:g}", "skipped": skipped_total}
        fields.update({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in extra.items()})
        if self._bar is not None:
            self._bar.set_postfix(fields, refresh=False)
            self._bar.update(1)
        elif self._log_lines and step % self.log_every == 0:
            logger.info("%s step %d: %s", self.desc, step, ", ".join(f"{k} {v}" for k, v in fields.items()))

    @property
    def skipped_steps(self) -> List[int]:
        return [s for s, skipped in zip(self.history["step"], self.history["skipped"]) if skipped]

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def save_plot(self, path: str, others: Optional[List["TrainingMonitor"]] = None) -> str:
        """Write a PNG: loss (top) and loss scale (bottom, log scale) over steps, skipped steps
        marked with red crosses; ``others`` are drawn alongside (e.g. other opt levels)."""
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as error:
            raise RuntimeError("save_plot needs matplotlib: pip install 'ampinit[examples]'") from error
        runs = [self] + list(others or [])
        fig, (ax_loss, ax_scale) = plt.subplots(2, 1, figsize=(8, 6), sharex=True,
                                                gridspec_kw={"height_ratios": [2, 1]})
        for run in runs:
            steps, losses = run.history["step"], run.history["loss"]
            finite = [(s, v) for s, v in zip(steps, losses) if v == v and abs(v) != float("inf")]
            line, = ax_loss.plot(*zip(*finite), label=run.desc, linewidth=1) if finite else (None,)
            color = line.get_color() if line is not None else None
            ax_scale.plot(steps, run.history["scale"], color=color, linewidth=1, label=run.desc)
            skipped = run.skipped_steps
            if skipped:
                scales = [run.history["scale"][s - 1] for s in skipped]
                ax_scale.scatter(skipped, scales, marker="x", color="red", zorder=3,
                                 label=f"{run.desc}: skipped step" if len(runs) > 1 else "skipped step")
        ax_loss.set_ylabel("loss")
        ax_loss.set_yscale("log")
        ax_loss.legend(loc="upper right")
        ax_loss.grid(alpha=0.3)
        ax_scale.set_yscale("log", base=2)
        ax_scale.set_ylabel("loss scale")
        ax_scale.set_xlabel("optimizer step")
        ax_scale.grid(alpha=0.3)
        ax_scale.legend(loc="lower right", fontsize="small")
        fig.suptitle(f"ampinit: {', '.join(run.desc for run in runs)}")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path
