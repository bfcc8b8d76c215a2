"""Validating: the leaf's side of a validation, from the batches' outputs to the result it sends
back to the root.

The root sends the validation batches down the pipeline (eval frames) at a drained point, then an
`eval_end` control; the leaf sums the loss (and with the accuracy metric, the correct
predictions) over them, smooths the loss across validations and tells whether that makes these
weights the best so far (keeping that bookkeeping in its own curve: the root's curve is the
leaf's only in a one-stage cluster). A loss or metric that cannot be computed on the targets
(the criterion raises on them, labels that are not classes) is reported in the result's
`val_error` and left out, never fatal: training is over or goes on. Every node keeps a
snapshot of its weights at `eval_end` and takes it as its best state when the result says so.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from ravnest.train.curves import Curve
from ravnest.train.messages import ValResult
from ravnest.train.metrics import WorkerMetrics
from ravnest.train.targets import MetricError, correct

log = logging.getLogger(__name__)


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
        self._errors: dict[str, str] = {}

    def add(self, pred: torch.Tensor, targets: Any, n: int | None = None) -> None:
        """Count a batch's predictions against `targets` (a labels tensor, or what a seed
        leaf's test_labels yields); `n`: its samples (default: the targets' rows)."""
        assert self.criterion is not None
        n = int(n if n is not None else targets.shape[0])
        e = self._sums
        e["n"] = e.get("n", 0) + n
        if "loss" not in self._errors:
            try:
                with self._metrics.timed("compute"):
                    e["loss"] = e.get("loss", 0.0) + float(self.criterion(pred, targets)) * n
            except Exception as err:  # the user's criterion: reported, not fatal
                self.fail("loss", err)
        if self.metric == "accuracy" and "accuracy" not in self._errors:
            try:
                good, count = correct(pred, targets)
            except MetricError as err:
                self.fail("accuracy", err)
            else:
                e["correct"] = e.get("correct", 0) + good
                e["count"] = e.get("count", 0) + count

    def fail(self, what: str, error: Exception) -> None:
        """Leave `what` ("loss" or "accuracy") out of this validation, saying why (once)."""
        if what not in self._errors:
            self._errors[what] = f"{type(error).__name__}: {error}"
            log.warning("validation %s cannot be computed: %s", what, self._errors[what])

    def finish(self, curve: Curve, epoch: int, step: int) -> ValResult:
        """The validation's result as the `val_result` control, its loss smoothed into `curve`;
        start the next one."""
        e, self._sums = self._sums, {}
        errors, self._errors = self._errors, {}
        n = max(e.get("n", 0), 1)
        val_loss = e["loss"] / n if "loss" in e and "loss" not in errors else math.nan
        metric = (e["correct"] / max(e["count"], 1)
                  if "count" in e and "accuracy" not in errors else None)
        a = self.smoothing
        if not math.isnan(val_loss):
            curve.smoothed = (val_loss if curve.smoothed is None
                              else a * val_loss + (1 - a) * curve.smoothed)
        best = not math.isnan(val_loss) and curve.smoothed is not None and (
            curve.best_smoothed is None or curve.smoothed < curve.best_smoothed)
        if best:
            curve.best_smoothed, curve.best_step = curve.smoothed, step
        said = {"val_error": "; ".join(f"{k}: {v}" for k, v in sorted(errors.items()))
                } if errors else {}
        return ValResult(epoch=epoch, step=step, val_loss=val_loss, val_metric=metric,
                         smoothed=curve.smoothed, best=best, **said)
