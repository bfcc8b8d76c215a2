"""The planner's cost model: what a stage, a cluster and a ring cost in seconds and bytes.

Per microbatch, per stage: compute time = 3 x forward FLOPs / (compute x REF_FLOPS) (forward +
backward), plus the time to send the activations that cross its downstream cut (and the gradients
back) over the slower of the two links. A cluster's time per batch is the pipeline bound
(m + S - 1) x the slowest stage for m microbatches and S stages. Memory per stage = parameters x
(weights + gradients + optimizer slots) + buffers + activations of the microbatches in flight.
A step (every cluster trains one batch) adds the ring all-reduce of all parameters over k
clusters, 2 (k - 1) / k x parameter bytes at the slowest provider's bandwidth, divided by the
reduce factor.

The search (`planning`) minimises these figures; `planning.estimate` reports them for any
grouping and split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ravnest.plan.partitioning import Profile
from ravnest.plan.plans import GB, ProviderInfo
from ravnest.spec import DataSpec, JobSpec, TrainingSpec

REF_FLOPS = 20e9
"""FLOP/s of a provider with compute 1.0."""
OPTIMIZER_SLOTS = {"Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adagrad": 1,
                   "RMSprop": 2, "SGD": 1, "Adadelta": 2, "ASGD": 2, "Rprop": 2, "LBFGS": 2}
"""Tensors of parameter size each optimizer keeps per parameter (2 for one not listed)."""


@dataclass(frozen=True)
class Workload:
    """How the model is trained: what the cost model needs beyond the profile.

    `from_spec` is the one mapping from a job spec; the defaults are the spec's own, for the seed
    API's `clusterize`, which has no spec.
    """

    batch_size: int = DataSpec.model_fields["batch_size"].default
    """Samples per cluster per batch (`spec.data.batchSize`)."""
    microbatches: int = DataSpec.model_fields["microbatches"].default
    """Microbatches each batch is split into (`spec.data.microbatches`)."""
    max_in_flight: int = TrainingSpec.model_fields["max_in_flight"].default
    """Microbatches a root may have in flight (`spec.training.maxInFlight`)."""
    optimizer: str = TrainingSpec.model_fields["optimizer"].default.name
    """The optimizer's class name, which sets its state per parameter
    (`spec.training.optimizer.name`)."""
    reduce_factor: int = TrainingSpec.model_fields["reduce_factor"].default
    """Optimizer updates between two ring all-reduces (`spec.training.reduceFactor`)."""
    update_frequency: int = TrainingSpec.model_fields["update_frequency"].default
    """Batches accumulated into one optimizer update (`spec.training.updateFrequency`): a cluster
    needs this many batches of the training set for one step."""

    @classmethod
    def from_spec(cls, spec: JobSpec) -> Workload:
        return cls(batch_size=spec.data.batch_size, microbatches=spec.data.microbatches,
                   max_in_flight=spec.training.max_in_flight,
                   optimizer=spec.training.optimizer.name,
                   reduce_factor=spec.training.reduce_factor,
                   update_frequency=spec.training.update_frequency)


class Costs:
    """Prefix sums over a profile, scaled to one microbatch, and the same figures as matrices over
    the allowed cuts (`allowed`), for the vectorised split."""

    def __init__(self, profile: Profile, work: Workload) -> None:
        self.profile = profile
        self.n = len(profile.layers)
        mb = max(1, math.ceil(work.batch_size / work.microbatches))
        scale = mb / profile.example_batch
        slots = OPTIMIZER_SLOTS.get(work.optimizer, 2)
        in_flight = min(work.max_in_flight, work.microbatches)
        self.flops = _prefix(3 * layer.flops * scale for layer in profile.layers)
        self.mem = _prefix(layer.param_bytes * (2 + slots) + layer.buffer_bytes
                           + layer.out_bytes * scale * in_flight for layer in profile.layers)
        self.cut = [b * scale for b in profile.cut_bytes]
        self.params = _prefix(layer.param_bytes for layer in profile.layers)
        self.microbatches = work.microbatches
        self.batch_size = work.batch_size
        self.reduce_factor = work.reduce_factor
        self.mb = mb
        self.allowed = sorted({0, self.n} | {i + 1 for i, ok in enumerate(profile.cut_ok) if ok})
        at = np.array(self.allowed)
        flops, mem = np.array(self.flops)[at], np.array(self.mem)[at]
        ahead = np.triu(np.ones((len(at), len(at)), dtype=bool), 1)
        self.d_seconds = np.where(ahead, (flops[None, :] - flops[:, None]) / REF_FLOPS, math.inf)
        """d_seconds[a, b]: seconds at compute 1.0 of the stage from allowed[a] to allowed[b]
        (infinite unless a < b)."""
        self.d_mem = mem[None, :] - mem[:, None]
        self.cut_at = np.array([self.cut[j - 1] if 0 < j < self.n else 0.0 for j in self.allowed])
        self._stage: dict[tuple[float, float], Any] = {}

    def compute_matrix(self, p: ProviderInfo) -> Any:
        """Compute seconds of every possible stage on provider p, infinite where it does not fit
        p's RAM (cached per compute and RAM)."""
        key = (p.compute, p.ram_gb)
        m = self._stage.get(key)
        if m is None:
            m = self._stage[key] = np.where(self.d_mem <= p.ram_gb * GB,
                                            self.d_seconds / p.compute, math.inf)
        return m

    def stage_memory(self, i: int, j: int) -> float:
        return self.mem[j] - self.mem[i]

    def stage_time(self, i: int, j: int, p: ProviderInfo, nxt: ProviderInfo | None) -> float:
        t = (self.flops[j] - self.flops[i]) / REF_FLOPS / p.compute
        if nxt is not None:
            t += self.cut[j - 1] * (2 / min(p.bytes_per_second, nxt.bytes_per_second))
        return t

    def cluster_seconds(self, stages: int, slowest: float) -> float:
        """Seconds per batch of a pipeline: (m + S - 1) x its slowest stage."""
        return (self.microbatches + stages - 1) * slowest

    def ring_seconds(self, clusters: int, slowest: float) -> float:
        """Ring all-reduce of all parameters per step over `clusters` replicas, at `slowest`
        bytes/s, divided by the reduce factor."""
        if clusters < 2:
            return 0.0
        return 2 * (clusters - 1) / clusters * self.params[-1] / slowest / self.reduce_factor

    @property
    def total_memory(self) -> float:
        return self.mem[-1]


def _prefix(values: Any) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out
