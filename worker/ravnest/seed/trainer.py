"""The seed API's `Trainer`: runs a `Node`'s training with the user's DataLoaders."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ravnest.run.assembling import assemble, save_stage
from ravnest.spec import TrainingSpec, parse_section
from ravnest.train.runtime import Batch, Batches, NodeRuntime
from ravnest.train.settings import Settings

log = logging.getLogger(__name__)


def _as_batch(item: Any) -> Batch:
    if isinstance(item, list | tuple) and len(item) >= 2:
        *xs, y = item
        return tuple(xs), y
    raise TypeError("the root's train_loader must yield (inputs, labels) batches so labels "
                    "travel with the microbatches to the leaf")


class Trainer:
    """Ravnest's `ravnest.trainer.Trainer`."""

    def __init__(self, node: Any = None, lr_scheduler: Any = None,
                 lr_scheduler_params: dict[str, Any] | None = None, train_loader: Any = None,
                 val_loader: Any = None, val_freq: int = 1, save: bool = False, epochs: int = 1,
                 batch_size: int = 64, step_size: int = 1, inputs_dtype: Any = None,
                 save_dir: str | Path = "trained") -> None:
        self.node = node
        if lr_scheduler is not None and node.optimizer is not None:
            node.lr_scheduler = lr_scheduler(node.optimizer, **(lr_scheduler_params or {}))
        self.train_loader, self.val_loader = train_loader, val_loader
        self.val_freq, self.save, self.epochs = val_freq, save, epochs
        self.batch_size, self.step_size, self.inputs_dtype = batch_size, step_size, inputs_dtype
        self.save_dir = Path(save_dir)
        self.runtime: NodeRuntime | None = None

    def _batches(self) -> Batches | None:
        node = self.node
        if not node.me.is_root:
            return None
        if self.train_loader is None:
            raise ValueError(f"{node.name} is a root: pass train_loader to Trainer")
        full = len(self.train_loader.dataset) // self.batch_size
        per_epoch = min(len(self.train_loader), full) // node.training.update_frequency * \
            node.training.update_frequency

        def cast(b: Batch) -> Batch:
            xs, y = b
            if self.inputs_dtype is not None:
                xs = tuple(x.to(self.inputs_dtype) for x in xs)
            return xs, y

        def train(epoch: int) -> Iterator[Batch]:
            for item in self.train_loader:
                yield cast(_as_batch(item))

        def validation() -> Iterator[Batch]:
            for item in self.val_loader or ():
                yield cast(_as_batch(item))

        return Batches(train=train, per_epoch=per_epoch, validation=validation)

    def _settings(self) -> Settings:
        """The node's training options and this trainer's, through the job spec's models. A root
        without a val_loader never validates."""
        node = self.node
        validates = self.val_loader is not None or not node.me.is_root
        training = parse_section(TrainingSpec, {
            **node.training.model_dump(exclude_unset=True), "epochs": self.epochs,
            "validation_frequency": self.val_freq if validates else 2**62,
            "metric": "accuracy" if validates else "none"})
        return Settings.of(training, self.batch_size, node.microbatches,
                           scheduler_step_on="epoch" if node.lr_step_on_epoch_change else "step")

    def train(self) -> None:
        node = self.node
        settings = self._settings()
        rt = assemble(node.wiring, node.meta, node.stage, settings, node.metrics, node.optimizer,
                      node.lr_scheduler, node.criterion, self._batches())
        self.runtime = rt
        try:
            node.wiring.wait_ready(settings.peer_timeout)
            if node.me.is_root:
                rt.drive()
                Path(node.loss_filename).write_text("".join(
                    f"{r['train_loss']}\n" for r in rt.curve.rows if "train_loss" in r))
            else:
                rt.serve()
            if self.save:
                save_stage(rt, self.save_dir / f"{node.name}.pt")
        finally:
            node.close()

    def evaluate(self) -> float | None:
        """Validation accuracy of the trained model (measured at the end of `train()`, after the
        final average); None on nodes other than a root, or without a val_loader."""
        if self.runtime is None or not self.node.me.is_root:
            return None
        acc = self.runtime.curve.last_val_metric
        log.info("%s: validation accuracy %s", self.node.name, acc)
        return acc
