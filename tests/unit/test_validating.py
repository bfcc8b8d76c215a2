"""The leaf judges whether a validation makes the current weights the best so far; every node of
the cluster keeps its snapshot as its best state when the leaf says so (`best_model.pt`)."""

from __future__ import annotations

import pytest
import torch

from ravnest.train.curves import Curve
from ravnest.train.metrics import Identity, WorkerMetrics
from ravnest.train.validating import Validation


def _validate(validation: Validation, curve: Curve, loss: float, step: int) -> bool:
    # the criterion here is the mean of the predictions, so the batch's loss is `loss`
    validation.add(torch.full((4, 1), loss), torch.zeros(4, dtype=torch.long))
    return validation.finish(curve, epoch=0, step=step).best


def test_a_leaf_that_is_not_its_clusters_root_remembers_its_best() -> None:
    # a leaf's curve is never given the root's bookkeeping (add_validation runs on the root), so
    # the leaf must keep its own best: otherwise every validation is "best" and best_model.pt is
    # simply the last validated weights
    metrics = WorkerMetrics(Identity(job="t", namespace="n", node="node_1", role="leaf",
                                     cluster=0, stage=1))
    validation = Validation(lambda pred, labels: pred.mean(), "none", smoothing=1.0,
                            metrics=metrics)
    curve = Curve()
    assert [_validate(validation, curve, loss, step)
            for step, loss in enumerate([0.9, 0.5, 0.7, 0.4, 0.6])] == [
        True, True, False, True, False]
    assert curve.best_smoothed == pytest.approx(0.4) and curve.best_step == 3
