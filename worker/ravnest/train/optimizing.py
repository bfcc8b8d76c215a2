"""Optimizing: a stage's optimizer, its learning-rate scheduler and gradient clipping, stepped
once per update, after `updateFrequency x microbatches` backward passes have accumulated their
gradients on the stage's parameters (or, at the end of an epoch whose batches do not fill the
last update, after fewer: `pending`/`step`).

The leaf scales each microbatch's loss by its share of a full update's samples (batch size x
update frequency); an update over another number of samples (a loader's last, partial batch,
an epoch's last, short update) has its gradients corrected when it steps, so that every update
applies the gradient of the mean loss over the samples it saw, as single-process training does.

Clipping (`clipNorm`) bounds the norm of this stage's gradients, not the whole model's. In fp16
the gradients come scaled by the leaf's loss scale, and are unscaled first (train/scaling.py).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from ravnest.train.metrics import WorkerMetrics
from ravnest.train.scaling import unscale
from ravnest.train.settings import Settings


class Optimization:
    """The optimizer side of one node (without an optimizer: a stage with no trainable
    parameters, whose updates are only counted)."""

    def __init__(self, optimizer: torch.optim.Optimizer | None, scheduler: Any,
                 params: Sequence[torch.Tensor], settings: Settings,
                 metrics: WorkerMetrics) -> None:
        self.optimizer = optimizer
        self.scheduler = scheduler
        self._params = list(params)
        self._per_update = settings.update_frequency * settings.microbatches
        self._clip_norm = settings.clip_norm
        self._scheduler_step_on = settings.scheduler_step_on
        self._metrics = metrics
        self.backwards = 0
        """Backward passes done (resumed runs: since the resume)."""
        self._samples = 0
        self._nominal = 0
        self._scale: float | None = None
        self._finite: bool | None = None
        """This update's gradients are all finite (None: not checked yet)."""
        self.overflows = 0
        """Steps skipped for gradients that were not finite (fp16)."""
        self.own_finite = True
        """The last step's gradients were all finite here (fp16: False, the overflow began in
        this stage or before it, whatever `skip` said)."""

    def accumulated(self, samples: int = 0, nominal: int = 0,
                    scale: float | None = None) -> bool:
        """Count a backward pass (over `samples` samples, its loss scaled for updates of
        `nominal` samples, and by the loss scale `scale` in fp16); True when it completes an
        update's gradients."""
        self.backwards += 1
        self._samples += samples
        self._nominal = nominal or self._nominal
        self._scale = scale
        return self.backwards % self._per_update == 0

    def pending(self) -> bool:
        """Whether backward passes have accumulated gradients that no step applied yet."""
        return self.backwards % self._per_update != 0

    def check(self) -> bool:
        """Unscale this update's gradients (fp16: by the loss scale they were made with) and
        say whether they are all finite; `step` then applies them or drops them. Without a
        loss scale: True."""
        if self._finite is None:
            scale, self._scale = self._scale, None
            self._finite = (scale is None or self.optimizer is None
                            or unscale(self._params, scale))
        return self._finite

    def step(self, skip: bool = False) -> bool:
        """Apply the accumulated gradients (a partial update's too), drop them, and step a
        per-step scheduler. False: they were not finite (fp16), or `skip` (a later stage's
        were not), and they were only dropped."""
        self.backwards += -self.backwards % self._per_update
        samples, nominal, self._samples = self._samples, self._nominal, 0
        self.own_finite = self.check()
        finite = self.own_finite and not skip
        self._finite = None
        if self.optimizer is not None:
            with self._metrics.timed("compute"):
                if samples and nominal and samples != nominal:
                    for p in self._params:
                        if p.grad is not None:
                            p.grad.mul_(nominal / samples)
                if self._clip_norm is not None and finite:
                    torch.nn.utils.clip_grad_norm_(self._params, self._clip_norm)
                if finite:
                    self.optimizer.step()
                else:
                    self.overflows += 1
                self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None and self._scheduler_step_on == "step" and not plateau(
                self.scheduler):
            with warnings.catch_warnings():
                # (a skipped step still moves the schedule on, as a loop with GradScaler does;
                # torch warns when that happens to the first step)
                warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step",
                                        UserWarning)
                self.scheduler.step()
        return finite

    def epoch_end(self, val_loss: float | None = None) -> None:
        """Step a per-epoch scheduler; a ReduceLROnPlateau one (whatever it was told to step on)
        on the epoch's validation loss `val_loss`, only when there was one."""
        if self.scheduler is None:
            return
        if plateau(self.scheduler):
            if val_loss is not None and math.isfinite(val_loss):
                self.scheduler.step(val_loss)
        elif self._scheduler_step_on == "epoch":
            self.scheduler.step()

    def state_of(self, param: torch.Tensor | None) -> dict[str, Any]:
        """The optimizer's state of one parameter (empty: none yet, or no optimizer)."""
        if param is None or self.optimizer is None:
            return {}
        state: dict[str, Any] = self.optimizer.state.get(param, {})
        return state

    def state(self) -> dict[str, Any]:
        """What a checkpoint holds of the optimizer and the scheduler."""
        return {
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
        }

    def load(self, state: dict[str, Any]) -> None:
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])


def plateau(scheduler: Any) -> bool:
    """Whether `scheduler` steps on a metric (torch's ReduceLROnPlateau, or a subclass): after a
    validation, with its loss, rather than by updates or epochs."""
    return isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
