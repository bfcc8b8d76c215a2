"""A node's training settings: the runtime's flat view of a job's training, data and checkpoint.

The spec models (`ravnest.spec`) own every option's meaning, validation and default; `Settings.of`
is the one mapping from them, used by the worker (through `from_spec`) and by the seed API (which
builds a `TrainingSpec` from its arguments). The defaults below are read from those models, so a
`Settings()` is that of a default job.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from ravnest.spec import CheckpointSpec, DataSpec, JobSpec, OuterSpec, SchedulerSpec, TrainingSpec
from ravnest.storing import Location
from ravnest.train.devices import Placement

_TRAINING = TrainingSpec()
_CHECKPOINT = CheckpointSpec()


def _default(model: Any, field: str) -> Any:
    """A field's default as the spec model declares it."""
    return model.model_fields[field].default


@dataclass(frozen=True)
class Settings:
    """Training settings of a node (see `TrainingSpec` for each option's meaning)."""

    epochs: int = _TRAINING.epochs
    batch_size: int = _default(DataSpec, "batch_size")
    microbatches: int = _default(DataSpec, "microbatches")
    update_frequency: int = _TRAINING.update_frequency
    reduce_factor: int = _TRAINING.reduce_factor
    reduce_each_epoch: bool = False
    """Average at the end of every epoch (the seed API's reduce_factor=None), not by updates."""
    loss_as_given: bool = False
    """The leaf's loss counts once per batch, as the criterion gives it (the seed API: Ravnest's
    providers divide it by update_frequency themselves when they want an update's mean); False
    (job files): the engine takes the update's mean over its samples."""
    average_optimizer: bool = _TRAINING.average_optimizer
    outer: OuterSpec | None = _TRAINING.outer
    """training.outer: the rings' outer optimizer (None: the plain mean)."""
    schedule: str = _TRAINING.schedule
    max_in_flight: int = _TRAINING.max_in_flight
    validation_frequency: int = _TRAINING.validation_frequency
    validation_smoothing: float = _TRAINING.validation_smoothing
    clip_norm: float | None = None
    """training.gradientClipping.maxNorm; None: no clipping."""
    reduce_timeout: float = _TRAINING.reduce_timeout_seconds
    peer_timeout: float = 300.0
    """Seconds to wait for a peer to come up or to answer (not a job option)."""
    metric: str = _TRAINING.metric
    compression: str = _TRAINING.compression
    scheduler_step_on: str = _default(SchedulerSpec, "step_on")
    checkpoint_dir: str | Location | None = None
    """Where checkpoints go (spec.checkpoint.path resolved by the caller: a path, or a location
    opened with the job's storage options); None: no checkpoints."""
    checkpoint_every: int = _CHECKPOINT.every_steps
    checkpoint_keep: int = _CHECKPOINT.keep
    precision: str = _TRAINING.precision
    device: str = "cpu"
    """Where the stage trains (the provider's device as `devices.resolve` checked it; not a
    job-wide option: each provider has its own)."""

    @classmethod
    def of(cls, training: TrainingSpec, batch_size: int, microbatches: int,
           checkpoint: CheckpointSpec = _CHECKPOINT,
           checkpoint_dir: str | Location | None = None,
           **extra: Any) -> Settings:
        """The settings of `training` with batches of `batch_size` samples in `microbatches`;
        `extra` sets what no spec model holds (`peer_timeout`, or the seed API's
        `scheduler_step_on`, whose scheduler is a Python object rather than a spec)."""
        t = training
        settings = cls(
            epochs=t.epochs, batch_size=batch_size, microbatches=microbatches,
            update_frequency=t.update_frequency, reduce_factor=t.reduce_factor,
            average_optimizer=t.average_optimizer, outer=t.outer, schedule=t.schedule,
            max_in_flight=t.max_in_flight, validation_frequency=t.validation_frequency,
            validation_smoothing=t.validation_smoothing,
            clip_norm=t.gradient_clipping.max_norm if t.gradient_clipping else None,
            reduce_timeout=t.reduce_timeout_seconds, metric=t.metric, compression=t.compression,
            scheduler_step_on=(t.lr_scheduler.step_on if t.lr_scheduler
                               else _default(SchedulerSpec, "step_on")),
            checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint.every_steps,
            checkpoint_keep=checkpoint.keep, precision=t.precision)
        return replace(settings, **extra)

    @property
    def placement(self) -> Placement:
        """Where the stage trains and in what precision."""
        return Placement(torch.device(self.device), self.precision)

    @classmethod
    def from_spec(cls, spec: JobSpec, checkpoint_dir: str | Location | None,
                  device: str = "cpu") -> Settings:
        """A job's settings; `checkpoint_dir` is its checkpoint.path resolved for this node,
        `device` where its stage trains."""
        return cls.of(spec.training, spec.data.batch_size, spec.data.microbatches,
                      spec.checkpoint, checkpoint_dir, device=device)
