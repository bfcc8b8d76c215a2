"""Validating: the leaf's side of a validation, from the batches' outputs to the result it sends
back to the root.

The root sends the validation batches down the pipeline (eval frames) at a drained point, then an
`eval_end` control; the leaf sums the loss (and with the accuracy metric, the correct
predictions) over them, smooths the loss across validations and tells whether that makes these
weights the best so far (keeping that bookkeeping in its own curve: the root's curve is the
leaf's only in a one-stage cluster). Every node keeps a snapshot of its weights at `eval_end` and
takes it as its best state when the result says so.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ravnest.train.curves import Curve
from ravnest.train.messages import Op
from ravnest.train.metrics import WorkerMetrics


class Validation:
    """The leaf's sums over the current validation's batches."""

    def __init__(self, criterion: Callable[..., torch.Tensor] | None, metric: str,
                 smoothing: float, metrics: WorkerMetrics) -> None:
        """`metric`: "accuracy" or "none"; `smoothing`: the weight of the newest loss in the
        smoothed one (1: no smoothing)."""
        self.criterion = criterion
        self.metric = metric
        self.smoothing = smoothing
        self._metrics = metrics
        self._sums: dict[str, float] = {}

    def add(self, pred: torch.Tensor, labels: torch.Tensor) -> None:
        """Count a batch's predictions."""
        assert self.criterion is not None
        n = int(labels.shape[0])
        e = self._sums
        with self._metrics.timed("compute"):
            e["loss"] = e.get("loss", 0.0) + float(self.criterion(pred, labels)) * n
        e["n"] = e.get("n", 0) + n
        if self.metric == "accuracy":
            mask = labels != -100
            e["correct"] = e.get("correct", 0) + int((pred.argmax(1) == labels)[mask].sum())
            e["count"] = e.get("count", 0) + int(mask.sum())

    def finish(self, curve: Curve, epoch: int, step: int) -> dict[str, Any]:
        """The validation's result as the `val_result` control, its loss smoothed into `curve`;
        start the next one."""
        e, self._sums = self._sums, {}
        n = max(e.get("n", 0), 1)
        val_loss = e.get("loss", math.nan) / n
        metric = e["correct"] / max(e["count"], 1) if "count" in e else None
        a = self.smoothing
        curve.smoothed = (val_loss if curve.smoothed is None
                          else a * val_loss + (1 - a) * curve.smoothed)
        best = curve.best_smoothed is None or curve.smoothed < curve.best_smoothed
        if best:
            curve.best_smoothed, curve.best_step = curve.smoothed, step
        return {"op": Op.VAL_RESULT, "epoch": epoch, "step": step, "val_loss": val_loss,
                "val_metric": metric, "smoothed": curve.smoothed, "best": best}
