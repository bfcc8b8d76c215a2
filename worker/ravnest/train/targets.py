"""Targets: what the leaf's criterion and accuracy receive for each microbatch.

- A job's leaf gets the labels tensor the root sends down with the activations (`Labels`).
- The seed API's leaf reads its own `labels` and `test_labels` (Ravnest's `Node(labels=...)`)
  in step with the root's loaders, and the criterion receives each batch whole, as the loader
  yields it: a `(X, y)` pair stays a pair, so `targets[1]` works as in Ravnest's examples
  (`FromLoaders`). A loader is any re-iterable (a DataLoader); a tensor is read in consecutive
  slices of the root's batch sizes. With microbatches, a batch is cut along its first dimension
  into the root's microbatch sizes (`split`).

The root names each microbatch's place in the frame's control (`epoch`, `batch`, its `part` of
the batch's microbatch `sizes`), so the leaf reads the batch the root read.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch

from ravnest.errors import RavnestError


class MetricError(ValueError):
    """A validation metric that cannot be computed on these targets (reported, never fatal)."""


def split(item: Any, sizes: Sequence[int]) -> list[Any]:
    """`item` cut into len(sizes) parts along the first dimension of every tensor in it whose
    first dimension is sum(sizes) (nested in tuples, lists and dicts); anything else is repeated
    as it is. One part is `item` itself."""
    if len(sizes) == 1:
        return [item]
    total = sum(sizes)
    if isinstance(item, torch.Tensor):
        if item.dim() and item.shape[0] == total:
            return list(item.split(list(sizes)))
        return [item] * len(sizes)
    if isinstance(item, tuple | list):
        columns = [split(x, sizes) for x in item]
        rows = [[c[i] for c in columns] for i in range(len(sizes))]
        if hasattr(item, "_fields"):  # a namedtuple
            return [type(item)(*row) for row in rows]
        return [type(item)(row) for row in rows]
    if isinstance(item, Mapping):
        parts = {k: split(v, sizes) for k, v in item.items()}
        return [{k: v[i] for k, v in parts.items()} for i in range(len(sizes))]
    return [item] * len(sizes)


def target_of(item: Any) -> Any:
    """The class targets in what a labels loader yields: the item itself, or the last element of
    an `(X, y)` pair (Ravnest's examples' `targets[1]`)."""
    if isinstance(item, tuple | list) and item:
        return item[-1]
    return item


def class_targets(item: Any, pred: torch.Tensor) -> torch.Tensor:
    """Class indices comparable with `pred.argmax(class_dim)`: indices as they are, one-hot or
    probability rows by their argmax. Raises MetricError when `item` holds no such targets."""
    t = target_of(item)
    if not isinstance(t, torch.Tensor):
        raise MetricError(f"the targets are a {type(t).__name__}, not a tensor of class "
                          f"indices or one-hot rows")
    if t.shape == pred.shape and pred.dim() >= 2:
        t = t.argmax(1)  # one-hot or class probabilities
    elif t.is_floating_point():
        if torch.all(t == t.round()):
            t = t.long()
        else:
            raise MetricError(f"targets of dtype {t.dtype} and shape {list(t.shape)} are neither "
                              f"class indices nor rows shaped like the predictions "
                              f"{list(pred.shape)}")
    if class_dim(pred, t) is None:
        raise MetricError(f"targets of shape {list(t.shape)} do not match predictions of shape "
                          f"{list(pred.shape)}")
    return t


def class_dim(pred: torch.Tensor, targets: torch.Tensor) -> int | None:
    """Which dimension of `pred` holds the classes for `targets` (1 as in torch's losses, or the
    last, as sequence models put it); None when neither fits."""
    if pred.dim() != targets.dim() + 1:
        return None
    if pred.shape[:1] + pred.shape[2:] == targets.shape:
        return 1
    if pred.shape[:-1] == targets.shape:
        return pred.dim() - 1
    return None


def correct(pred: torch.Tensor, item: Any) -> tuple[int, int]:
    """(correct predictions, targets counted) of a batch; negative targets (ignore indices such
    as -100 or -1) are not counted."""
    t = class_targets(item, pred)
    dim = class_dim(pred, t)
    assert dim is not None
    mask = t >= 0
    return int((pred.argmax(dim) == t)[mask].sum()), int(mask.sum())


class Targets(Protocol):
    """Where the leaf's targets come from."""

    def train(self, control: Mapping[str, Any], labels: Any) -> Any:
        """The targets of a training microbatch (`labels`: what came with it from the root)."""

    def validation(self, control: Mapping[str, Any], labels: Any) -> Any:
        """The targets of a validation batch."""


class Labels:
    """A job's targets: the labels the root sent down."""

    def __init__(self, name: str) -> None:
        self.name = name

    def train(self, control: Mapping[str, Any], labels: Any) -> Any:
        if labels is None:
            raise RavnestError(f"{self.name}: leaf got a microbatch without labels")
        return labels

    def validation(self, control: Mapping[str, Any], labels: Any) -> Any:
        return self.train(control, labels)


class _Reader:
    """One labels source read in step with the root: a fresh pass per `round` (an epoch, or a
    validation), batch by batch."""

    def __init__(self, node: str, what: str, source: Any) -> None:
        self.node, self.what, self.source = node, what, source
        self._round: Any = object()
        self._it: Iterator[Any] | None = None
        self._next = 0
        self._offset = 0
        self._item: Any = None

    def item(self, round_: Any, index: int, n: int) -> Any:
        """Batch `index` of pass `round_` (batches are read in order; `n`: its sample count)."""
        if round_ != self._round:
            if self._it is not None:
                # read the last pass to its end, as the root's loop does: a shuffling loader's
                # sampler draws from its generator once more when it is exhausted, and the next
                # pass's order depends on it
                for _ in self._it:
                    pass
            self._round, self._next, self._offset = round_, 0, 0
            self._it = None if isinstance(self.source, torch.Tensor) else iter(self.source)
        if index == self._next - 1:
            return self._item
        if index < self._next:
            raise RavnestError(f"{self.node}: {self.what}: batch {index} asked after batch "
                               f"{self._next - 1}")
        while self._next <= index:
            self._item = self._read(n)
            self._next += 1
        return self._item

    def _read(self, n: int) -> Any:
        if self._it is None:
            source: torch.Tensor = self.source
            if self._offset + n > source.shape[0]:
                raise RavnestError(f"{self.node}: {self.what} holds {source.shape[0]} rows, "
                                   f"fewer than the root's batches ask for")
            self._offset += n
            return source[self._offset - n:self._offset]
        try:
            return next(self._it)
        except StopIteration:
            raise RavnestError(
                f"{self.node}: {self.what} ran out after {self._next} batches while the "
                f"root's loader had more: the leaf's {self.what} must yield the root's batches "
                f"(same dataset, batch size and seed)") from None


class FromLoaders:
    """The seed API's targets: the leaf's own `labels` and `test_labels`, or with `train_whole`
    / `val_whole` (a one-node cluster whose labels are its train_loader / val_loader) the batches
    the root read itself, which come with the microbatch."""

    def __init__(self, name: str, labels: Any, test_labels: Any, train_whole: bool,
                 val_whole: bool) -> None:
        self.name = name
        self.train_whole, self.val_whole = train_whole, val_whole
        self._train = _Reader(name, "labels", labels)
        self._val = _Reader(name, "test_labels", test_labels) if test_labels is not None else None

    def train(self, control: Mapping[str, Any], labels: Any) -> Any:
        sizes = control["sizes"]
        if self.train_whole:
            return labels
        n = sum(sizes)
        item = self._train.item(int(control["epoch"]), int(control["batch"]), n)
        _check_size(self.name, "labels", item, n, control)
        return split(item, sizes)[int(control["part"])]

    def validation(self, control: Mapping[str, Any], labels: Any) -> Any:
        if self.val_whole:
            return labels
        if self._val is None:
            raise MetricError(f"{self.name} was given no test_labels")
        n = int(control["n"])
        item = self._val.item(control["validation"], int(control["batch"]), n)
        _check_size(self.name, "test_labels", item, n, control)
        return item


def _check_size(node: str, what: str, item: Any, n: int, control: Mapping[str, Any]) -> None:
    """Refuse a labels batch whose targets are not the root's batch's size (the loaders are out
    of step: training on them would pair samples with other samples' labels)."""
    t = target_of(item)
    if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] != n:
        raise RavnestError(
            f"{node}: batch {control['batch']} of {what} has {t.shape[0]} samples but the "
            f"root's batch has {n}: the leaf's {what} must yield the root's batches (same "
            f"dataset, batch size and seed)")
