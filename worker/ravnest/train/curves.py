"""Curves: a cluster's learning curve, as its root records it and a checkpoint keeps it.

One row per update the root drained at (the mean training loss of the microbatches since the
last row) and one per validation, with the best-model bookkeeping (as in the lamp training loop).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from ravnest.train.messages import ValResult


@dataclass
class Curve:
    """The learning curve and the best-model bookkeeping."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    smoothed: float | None = None
    """The validation loss smoothed across validations (`validationSmoothing`)."""
    best_smoothed: float | None = None
    best_step: int | None = None
    last_val_loss: float | None = None
    last_val_metric: float | None = None

    def state(self) -> dict[str, Any]:
        """What a checkpoint holds (`Curve(**state)` restores it)."""
        return dataclasses.asdict(self)

    def add_training(self, loss: float, epoch: int, step: int, samples: int) -> None:
        self.rows.append({"epoch": epoch, "step": step, "samples": samples, "train_loss": loss,
                          "time": time.time()})

    def add_validation(self, result: ValResult, epoch: int, step: int,
                       samples: int) -> None:
        """Record a validation's result (the leaf's val_result control) at `step`."""
        self.last_val_loss, self.last_val_metric = result.val_loss, result.val_metric
        if result.best:
            self.best_smoothed, self.best_step = result.smoothed, result.step
        self.rows.append({"epoch": epoch, "step": step, "samples": samples,
                          "val_loss": result.val_loss, "val_metric": result.val_metric,
                          "time": time.time()})


class LossMeter:
    """The root's running mean of the training loss over the microbatches come back."""

    def __init__(self) -> None:
        self._sum: Any = 0.0
        self._n = 0

    def add(self, loss: Any, n: int) -> None:
        """Count a microbatch of `n` samples with mean loss `loss` (a float, or a 0-d tensor on
        a device: a root that is its cluster's leaf too sums on the device, and reads the sum
        only when it is taken)."""
        self._sum = self._sum + loss * n
        self._n += n

    def take(self) -> float | None:
        """The mean since the last take (None: nothing came back since)."""
        if not self._n:
            return None
        loss = float(self._sum) / self._n
        self._sum, self._n = 0.0, 0
        return loss
