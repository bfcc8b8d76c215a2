"""The seed API's `Trainer`: runs a `Node`'s training with the user's DataLoaders.

As in Ravnest, the loaders decide the batches: every batch the root's train_loader yields is
trained, the last, partial one included (an epoch whose batches do not fill its last update steps
over what it has), and `batch_size` only describes them. The root prints a line per epoch (the
mean training loss, the validation loss and accuracy) and appends the training losses to the
node's `loss_filename` (one per update) and the validation accuracies to `val_accuracies.txt`
beside it; a loss or metric that cannot be computed is printed, not fatal.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ravnest.run.assembling import assemble, save_stage
from ravnest.seed.arguments import Arguments
from ravnest.seed.console import say
from ravnest.spec import TrainingSpec, parse_section
from ravnest.train.runtime import Batch, Batches, NodeRuntime
from ravnest.train.settings import Settings
from ravnest.train.targets import FromLoaders

log = logging.getLogger(__name__)

VAL_ACCURACIES = "val_accuracies.txt"


def _inputs(item: Any) -> tuple[Any, ...]:
    """The model inputs of a root's batch: all but the last element of an `(X, y)` pair (or of
    `(X1, X2, y)`), or the batch itself when it is a lone tensor."""
    if isinstance(item, list | tuple):
        if len(item) >= 2:
            return tuple(item[:-1])
        raise TypeError("the root's train_loader must yield (inputs, labels) batches")
    return (item,)


class Trainer:
    """Ravnest's `ravnest.trainer.Trainer`."""

    def __init__(self, node: Any = None, lr_scheduler: Any = None,
                 lr_scheduler_params: dict[str, Any] | None = None, train_loader: Any = None,
                 val_loader: Any = None, val_freq: int = 1, save: bool = False, epochs: int = 1,
                 batch_size: int = 64, step_size: int = 1, inputs_dtype: Any = None,
                 save_dir: str | Path = "trained") -> None:
        given = Arguments("Trainer")
        given.scheduler("lr_scheduler", lr_scheduler)
        given.mapping("lr_scheduler_params", lr_scheduler_params)
        given.loader("train_loader", train_loader)
        given.loader("val_loader", val_loader)
        given.whole("val_freq", val_freq)
        given.flag("save", save)
        given.whole("epochs", epochs)
        given.whole("batch_size", batch_size)
        given.whole("step_size", step_size)
        if inputs_dtype is not None and not isinstance(inputs_dtype, torch.dtype):
            given.bad("inputs_dtype", inputs_dtype, "a torch dtype such as torch.float32, or None")
        given.path("save_dir", save_dir)
        if not all(hasattr(node, a) for a in ("me", "training", "microbatches")):
            given.bad("node", node, "the provider's ravnest Node, e.g. Node(name='node_0', ...)")
        given.check()
        self.node = node
        if lr_scheduler is not None and node.optimizer is not None:
            node.lr_scheduler = lr_scheduler(node.optimizer, **(lr_scheduler_params or {}))
        self.train_loader, self.val_loader = train_loader, val_loader
        self.val_freq, self.save, self.epochs = val_freq, save, epochs
        self.batch_size, self.step_size, self.inputs_dtype = batch_size, step_size, inputs_dtype
        self.save_dir = Path(save_dir)
        self.runtime: NodeRuntime | None = None
        self._started = 0.0

    # ----------------------------------------------------------------------------- data

    def _reads_own(self, labels: Any, loader: Any) -> bool:
        """A one-node cluster whose `labels` are (or default to) its `loader`: the criterion
        gets the batches the root read (reading the loader twice would shuffle it twice)."""
        node = self.node
        return bool(node.me.is_root and node.me.is_leaf and (labels is None or labels is loader))

    def _own_train_labels(self) -> bool:
        return self._reads_own(self.node.labels, self.train_loader)

    def _own_val_labels(self) -> bool:
        return self._reads_own(self.node.test_labels, self.val_loader)

    def _batches(self) -> Batches | None:
        node = self.node
        if not node.me.is_root:
            return None
        if self.train_loader is None:
            raise ValueError(f"{node.name} is a root: pass train_loader to Trainer")
        train_whole, val_whole = self._own_train_labels(), self._own_val_labels()

        def batch(item: Any, whole: bool) -> Batch:
            xs = _inputs(item)
            if self.inputs_dtype is not None:
                xs = tuple(x.to(self.inputs_dtype) for x in xs)
            return xs, (item if whole else None)

        def train(epoch: int) -> Iterator[Batch]:
            for item in self.train_loader:
                yield batch(item, train_whole)

        def validation() -> Iterator[Batch]:
            for item in self.val_loader or ():
                yield batch(item, val_whole)

        per_epoch = len(self.train_loader) if hasattr(self.train_loader, "__len__") else 2**62
        return Batches(train=train, per_epoch=per_epoch, validation=validation)

    def _targets(self) -> FromLoaders | None:
        node = self.node
        if not node.me.is_leaf:
            return None
        return FromLoaders(node.name, node.labels, node.test_labels,
                           self._own_train_labels(), self._own_val_labels())

    def _settings(self) -> Settings:
        """The node's training options and this trainer's, through the job spec's models. A root
        without a val_loader never validates."""
        node = self.node
        validates = self.val_loader is not None or not node.me.is_root
        training = parse_section(TrainingSpec, {
            **node.training.model_dump(exclude_unset=True), "epochs": self.epochs,
            "validation_frequency": self.val_freq if validates else 2**62,
            "metric": "accuracy" if validates else "none"})
        loader = self.train_loader if node.me.is_root else getattr(node, "labels", None)
        batch_size = getattr(loader, "batch_size", None) or self.batch_size
        return Settings.of(training, batch_size, node.microbatches,
                           scheduler_step_on="epoch" if node.lr_step_on_epoch_change else "step",
                           reduce_each_epoch=getattr(node, "reduce_each_epoch", False),
                           loss_as_given=True,  # (the seed: divide by update_frequency yourself)
                           device=str(getattr(node, "device", "cpu")))

    # ----------------------------------------------------------------------------- training

    def train(self) -> None:
        node = self.node
        settings = self._settings()
        rt = assemble(node.wiring, node.meta, node.stage, settings, node.metrics, node.optimizer,
                      node.lr_scheduler, node.criterion, self._batches(), self._targets())
        self.runtime = rt
        try:
            node.wiring.wait_ready(settings.peer_timeout)
            node.wiring.watch_peers(node.plan, node.name)
            if node.me.is_root:
                for name in (node.loss_filename, self._val_file()):
                    Path(name).write_text("")
                self._started = time.monotonic()
                rt.drive(on_epoch=self._epoch_done)
                say(f"{node.name}: training done in {time.monotonic() - self._started:.1f} s "
                      f"({rt.samples} samples, {rt.updates} updates)")
            else:
                rt.serve()
            node.wiring.stop_watching()
            if self.save:
                save_stage(rt, self.save_dir)
        except BaseException as e:
            node.wiring.abort(node.plan, node.name, e)
            raise
        finally:
            node.close()

    def _val_file(self) -> Path:
        """val_accuracies.txt, beside the node's loss file (Ravnest writes both in the working
        directory, where the default loss_filename is)."""
        return Path(self.node.loss_filename).parent / VAL_ACCURACIES

    def _epoch_done(self, rt: NodeRuntime, epoch: int) -> None:
        """Print the epoch's line and append its losses and validation to the files."""
        rows = [r for r in rt.curve.rows if r["epoch"] == epoch]
        losses = [r["train_loss"] for r in rows if "train_loss" in r]
        vals = [r for r in rows if "val_loss" in r]
        with open(self.node.loss_filename, "a") as f:
            f.writelines(f"{x}\n" for x in losses)
        line = f"Epoch {epoch + 1}/{self.epochs}:"
        if losses:
            line += f" loss {sum(losses) / len(losses):.4f}"
        if vals:
            v = vals[-1]
            acc = v["val_metric"]
            with open(self._val_file(), "a") as f:
                f.write(f"{acc if acc is not None else math.nan}\n")
            line += f", val_loss {v['val_loss']:.4f}"
            if acc is not None:
                line += f", val_accuracy {acc:.4f}"
        line += f" ({rt.samples} samples, {time.monotonic() - self._started:.1f} s)"
        say(line)
        if rt.val_result and rt.val_result.val_error:
            say(f"  validation: {rt.val_result.val_error}")

    def evaluate(self) -> float | None:
        """Validation accuracy of the trained model (measured at the end of `train()`, after the
        final average); None on nodes other than a root, or without a val_loader."""
        if self.runtime is None or not self.node.me.is_root:
            return None
        acc = self.runtime.curve.last_val_metric
        if acc is not None:
            say(f"{self.node.name}: validation accuracy {acc:.4f}")
        return acc
