"""What a seed leaf's criterion and accuracy receive (`ravnest.train.targets`): a labels batch cut
into microbatches whatever its structure, class targets from indices, one-hot rows or sequence
labels, and a validation whose loss or metric cannot be computed reported, never fatal."""

from __future__ import annotations

import math
from collections import namedtuple

import pytest
import torch

from ravnest.train.curves import Curve
from ravnest.train.metrics import Identity, WorkerMetrics
from ravnest.train.targets import MetricError, class_targets, correct, split
from ravnest.train.validating import Validation

SIZES = [3, 2]
Pair = namedtuple("Pair", ["x", "y"])


def _rows(n: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(n * 4, dtype=torch.float32).reshape(n, 4), torch.arange(n)


def test_split_a_pair_keeps_pairs() -> None:
    x, y = _rows()
    parts = split((x, y), SIZES)
    assert len(parts) == 2 and all(type(p) is tuple for p in parts)
    assert [p[0].shape[0] for p in parts] == SIZES and [p[1].shape[0] for p in parts] == SIZES
    assert torch.equal(parts[0][1], y[:3]) and torch.equal(parts[1][1], y[3:])
    assert torch.equal(torch.cat([p[0] for p in parts]), x)


def test_split_a_list_stays_a_list() -> None:
    x, y = _rows()
    parts = split([x, y], SIZES)
    assert all(type(p) is list for p in parts)
    assert torch.equal(parts[1][1], y[3:])


def test_split_a_dict() -> None:
    x, y = _rows()
    parts = split({"x": x, "y": y, "scale": torch.tensor(2.0)}, SIZES)
    assert [sorted(p) for p in parts] == [["scale", "x", "y"]] * 2
    assert torch.equal(parts[0]["x"], x[:3]) and torch.equal(parts[1]["y"], y[3:])
    # a tensor whose first dimension is not the batch's is repeated, as it is
    assert all(torch.equal(p["scale"], torch.tensor(2.0)) for p in parts)


def test_split_a_namedtuple_keeps_its_type() -> None:
    x, y = _rows()
    parts = split(Pair(x, y), SIZES)
    assert all(isinstance(p, Pair) for p in parts)
    assert torch.equal(parts[0].x, x[:3]) and torch.equal(parts[1].y, y[3:])


def test_split_repeats_what_is_no_tensor() -> None:
    assert split("text", SIZES) == ["text", "text"]
    x, _ = _rows()
    parts = split((x, "ids", 7), SIZES)
    assert [p[1:] for p in parts] == [("ids", 7), ("ids", 7)]


def test_split_into_one_part_is_the_item() -> None:
    item = _rows()
    assert split(item, [5])[0] is item


def test_class_targets_of_one_hot_rows_is_their_argmax() -> None:
    labels = torch.tensor([2, 0, 1])
    one_hot = torch.nn.functional.one_hot(labels, 3).float()
    pred = torch.randn(3, 3)
    assert torch.equal(class_targets(one_hot, pred), labels)
    # and in an (X, y) pair, the y (Ravnest's targets[1])
    assert torch.equal(class_targets((torch.zeros(3, 8), one_hot), pred), labels)
    # class probabilities too
    probs = torch.tensor([[0.1, 0.2, 0.7], [0.6, 0.3, 0.1], [0.2, 0.5, 0.3]])
    assert torch.equal(class_targets(probs, pred), labels)


def test_accuracy_of_one_hot_targets() -> None:
    labels = torch.tensor([2, 0, 1, 1])
    one_hot = torch.nn.functional.one_hot(labels, 3).float()
    pred = torch.nn.functional.one_hot(torch.tensor([2, 0, 0, 1]), 3).float()
    assert correct(pred, one_hot) == (3, 4)


def test_sequence_targets_use_the_last_dimension_and_ignore_negatives() -> None:
    batch, steps, vocab = 2, 3, 5
    targets = torch.tensor([[1, 4, -100], [0, 2, 3]])
    pred = torch.full((batch, steps, vocab), -1.0)
    guesses = torch.tensor([[1, 0, 2], [0, 2, 1]])  # 3 of the 5 counted targets are right
    pred.scatter_(2, guesses.unsqueeze(-1), 1.0)
    assert torch.equal(class_targets(targets, pred), targets)
    assert correct(pred, targets) == (3, 5)
    # the ignored position's guess does not count, right or wrong
    pred[0, 2] = -1.0
    pred[0, 2, 0] = 1.0
    assert correct(pred, targets) == (3, 5)


def test_class_dimension_one_as_torch_losses_put_it() -> None:
    targets = torch.tensor([[1, 2, 0]])  # [B, T] against [B, C, T]
    pred = torch.zeros(1, 4, 3)
    pred[0, 1, 0] = pred[0, 2, 1] = pred[0, 3, 2] = 1.0
    assert correct(pred, targets) == (2, 3)


def test_a_string_target_is_a_metric_error() -> None:
    with pytest.raises(MetricError, match="str"):
        class_targets("cat", torch.zeros(2, 3))
    with pytest.raises(MetricError):
        correct(torch.zeros(2, 3), (torch.zeros(2, 4), ["cat", "dog"]))


def test_targets_that_are_no_classes_are_metric_errors() -> None:
    with pytest.raises(MetricError):
        class_targets(torch.tensor([0.5, 1.5]), torch.zeros(2, 3))
    with pytest.raises(MetricError):
        class_targets(torch.tensor([0, 1, 2]), torch.zeros(2, 3))


def _metrics() -> WorkerMetrics:
    return WorkerMetrics(Identity("targets", "default", "node_0", "leaf", 0, 0))


def test_a_criterion_that_raises_is_reported_not_fatal() -> None:
    def criterion(pred: torch.Tensor, targets: object) -> torch.Tensor:
        raise ValueError("no loss here")

    v = Validation(criterion, "accuracy", 1.0, _metrics())
    labels = torch.tensor([0, 1, 2])
    pred = torch.nn.functional.one_hot(torch.tensor([0, 1, 1]), 3).float()
    v.add(pred, labels)
    v.add(pred, labels)
    curve = Curve()
    result = v.finish(curve, epoch=0, step=4)
    assert math.isnan(result.val_loss) and not result.best
    assert "ValueError: no loss here" in result.val_error and "loss" in result.val_error
    assert result.val_metric == pytest.approx(4 / 6)
    assert curve.smoothed is None and curve.best_smoothed is None
    # the next validation starts afresh
    v.criterion = torch.nn.functional.cross_entropy
    v.add(pred, labels)
    again = v.finish(curve, epoch=1, step=8)
    assert not math.isnan(again.val_loss) and again.val_error is None and again.best


def test_validation_with_one_hot_targets_gives_the_accuracy() -> None:
    v = Validation(torch.nn.functional.mse_loss, "accuracy", 1.0, _metrics())
    labels = torch.tensor([0, 1, 2, 2, 1])
    one_hot = torch.nn.functional.one_hot(labels, 3).float()
    pred = torch.nn.functional.one_hot(torch.tensor([0, 1, 2, 0, 0]), 3).float()
    v.add(pred[:3], one_hot[:3])
    v.add(pred[3:], one_hot[3:])
    result = v.finish(Curve(), epoch=0, step=1)
    assert result.val_metric == pytest.approx(3 / 5) and result.val_error is None
    expected = (torch.nn.functional.mse_loss(pred[:3], one_hot[:3]) * 3 +
                torch.nn.functional.mse_loss(pred[3:], one_hot[3:]) * 2) / 5
    assert result.val_loss == pytest.approx(float(expected))


def test_a_metric_that_cannot_be_computed_leaves_the_loss() -> None:
    v = Validation(lambda pred, t: pred.sum() * 0, "accuracy", 1.0, _metrics())
    v.add(torch.zeros(2, 3), ["cat", "dog"], n=2)
    result = v.finish(Curve(), epoch=0, step=1)
    assert result.val_loss == 0.0 and result.val_metric is None
    assert result.val_error.startswith("accuracy: MetricError")
