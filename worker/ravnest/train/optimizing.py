"""Optimizing: a stage's optimizer, its learning-rate scheduler and gradient clipping, stepped
once per update, after `updateFrequency x microbatches` backward passes have accumulated their
gradients on the stage's parameters (or, at the end of an epoch whose batches do not fill the
last update, after fewer: `pending`/`step`).

The leaf scales each microbatch's loss by its share of a full update's samples (batch size x
update frequency); an update over another number of samples (a loader's last, partial batch,
an epoch's last, short update) has its gradients corrected when it steps, so that every update
applies the gradient of the mean loss over the samples it saw, as single-process training does.

Clipping (`clipNorm`) bounds the norm of this stage's gradients, not the whole model's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ravnest.train.metrics import WorkerMetrics
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

    def accumulated(self, samples: int = 0, nominal: int = 0) -> bool:
        """Count a backward pass (over `samples` samples, its loss scaled for updates of
        `nominal` samples); True when it completes an update's gradients."""
        self.backwards += 1
        self._samples += samples
        self._nominal = nominal or self._nominal
        return self.backwards % self._per_update == 0

    def pending(self) -> bool:
        """Whether backward passes have accumulated gradients that no step applied yet."""
        return self.backwards % self._per_update != 0

    def step(self) -> None:
        """Apply the accumulated gradients (a partial update's too), drop them, and step a
        per-step scheduler."""
        self.backwards += -self.backwards % self._per_update
        samples, nominal, self._samples = self._samples, self._nominal, 0
        if self.optimizer is not None:
            with self._metrics.timed("compute"):
                if samples and nominal and samples != nominal:
                    for p in self._params:
                        if p.grad is not None:
                            p.grad.mul_(nominal / samples)
                if self._clip_norm is not None:
                    torch.nn.utils.clip_grad_norm_(self._params, self._clip_norm)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None and self._scheduler_step_on == "step":
            self.scheduler.step()

    def epoch_end(self) -> None:
        """Step a per-epoch scheduler."""
        if self.scheduler is not None and self._scheduler_step_on == "epoch":
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
