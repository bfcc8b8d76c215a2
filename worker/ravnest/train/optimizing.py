"""Optimizing: a stage's optimizer, its learning-rate scheduler and gradient clipping, stepped
once per update, after `updateFrequency x microbatches` backward passes have accumulated their
gradients on the stage's parameters.

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

    def accumulated(self) -> bool:
        """Count a backward pass; True when it completes an update's gradients."""
        self.backwards += 1
        return self.backwards % self._per_update == 0

    def step(self) -> None:
        """Apply the accumulated gradients, drop them, and step a per-step scheduler."""
        if self.optimizer is not None:
            with self._metrics.timed("compute"):
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
