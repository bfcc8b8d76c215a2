"""A node's training settings: what the runtime reads from the job spec or the seed API."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Settings:
    """Training settings of a node (from the job spec, or from the seed API's arguments)."""

    epochs: int = 1
    batch_size: int = 64
    microbatches: int = 1
    update_frequency: int = 1
    reduce_factor: int = 1
    average_optimizer: bool = False
    schedule: str = "sync"
    max_in_flight: int = 4
    validation_frequency: int = 1
    validation_smoothing: float = 1.0
    clip_norm: float | None = None
    reduce_timeout: float = 30.0
    peer_timeout: float = 300.0
    metric: str = "accuracy"
    compression: str = "none"
    scheduler_step_on: str = "epoch"
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    checkpoint_keep: int = 2
