"""Prometheus metrics of a worker, served over HTTP from the first version.

Names follow the Prometheus conventions: `ravnest_` prefix, base units, `_total` counters,
histograms for durations, and only bounded labels (job, namespace, node, role, cluster, stage,
plus `kind` for bytes and `activity` for where the training loop's time goes).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

_LABELS = ("job", "namespace", "node", "role", "cluster", "stage")
ACTIVITIES = ("compute", "communication", "waiting", "other")
"""Where a worker's training loop spends its wall time (`ravnest_training_seconds_total`):
compute (forward, loss, backward, optimizer step, validation forward), communication (encoding and
queueing frames, ring all-reduce rounds, waiting for frames to be delivered), waiting (idle for a
frame from a neighbour: the pipeline bubble, a slower stage, transfers in flight) and other
(data batching, checkpoints, bookkeeping)."""
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


@dataclass(frozen=True)
class Identity:
    job: str
    namespace: str
    node: str
    role: str
    cluster: int
    stage: int

    def labels(self) -> dict[str, str]:
        return {"job": self.job, "namespace": self.namespace, "node": self.node,
                "role": self.role, "cluster": str(self.cluster), "stage": str(self.stage)}


class _ScrapeWatch(Collector):
    """Exports nothing; notes a scrape that begins after `arm()`. Registered before every other
    metric, so such a scrape reads all of them as they were when it was armed, or later."""

    def __init__(self) -> None:
        self._armed = False
        self.scraped = threading.Event()

    def arm(self) -> None:
        self._armed = True

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> list[Metric]:
        if self._armed:
            self.scraped.set()
        return []


class WorkerMetrics:
    """All metrics of one worker, already bound to its identity labels."""

    def __init__(self, who: Identity, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._watch = _ScrapeWatch()
        self.registry.register(self._watch)
        r, lab = self.registry, who.labels()

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, _LABELS, registry=r).labels(**lab)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, _LABELS, registry=r).labels(**lab)

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, _LABELS, buckets=_BUCKETS, registry=r).labels(**lab)

        self.steps = counter("ravnest_steps", "Optimizer updates done by this node.")
        self.samples = counter("ravnest_samples", "Training samples fed by this cluster's root.")
        self.loss = gauge("ravnest_loss", "Training loss of the last optimizer update.")
        self.val_loss = gauge("ravnest_validation_loss", "Loss of the last validation.")
        self.val_metric = gauge("ravnest_validation_metric",
                                "Metric (accuracy, 0..1) of the last validation.")
        self.epoch = gauge("ravnest_epoch", "Current epoch (0-based).")
        self.step = gauge("ravnest_step", "Optimizer updates done so far, resumed runs included.")
        self.total_steps = gauge("ravnest_total_steps", "Optimizer updates the job will do.")
        self.device_peak = gauge("ravnest_device_memory_peak_bytes",
                                 "Most memory torch held on the stage's GPU (0 on a CPU).")
        self.in_flight = gauge("ravnest_inflight_microbatches",
                               "Microbatches sent forward and not yet back (root).")
        self.finished = gauge("ravnest_finished", "1 once this node finished training.")
        self.checkpoint_step = gauge("ravnest_checkpoint_step", "Step of the last checkpoint.")
        self.step_seconds = hist("ravnest_step_duration_seconds", "Time between optimizer updates.")
        self.forward_seconds = hist("ravnest_forward_duration_seconds",
                                    "Forward pass of a microbatch.")
        self.backward_seconds = hist("ravnest_backward_duration_seconds",
                                     "Backward pass of a microbatch.")
        self.allreduce_seconds = hist("ravnest_allreduce_duration_seconds",
                                      "One ring all-reduce round of this node (all its rings).")
        self.reduce_rounds = counter("ravnest_reduce_rounds", "Ring rounds completed.")
        self.reduce_skipped = counter("ravnest_reduce_rounds_skipped",
                                      "Ring rounds skipped because a peer timed out.")
        self.reduce_partial = counter("ravnest_reduce_rounds_partial",
                                      "Ring rounds completed among the members present, without "
                                      "some lost ones (counted in ravnest_reduce_rounds too).")
        self.ring_missing = gauge("ravnest_ring_members_missing",
                                  "Members this node's rings went without in their last round.")
        self._elastic(counter, gauge)
        self.peer_errors = counter("ravnest_peer_errors", "Failed calls to peers.")
        self._activity = Counter(
            "ravnest_training_seconds",
            "Wall time of the training loop by activity; they add up to the loop's wall time.",
            (*_LABELS, "activity"), registry=r)
        self._activities = {a: self._activity.labels(**lab, activity=a) for a in ACTIVITIES}
        self._stack = ["other"]
        self._mark = time.perf_counter()
        kinds = (*_LABELS, "kind")
        self._sent = Counter("ravnest_sent_bytes", "Tensor bytes sent, by frame kind.", kinds,
                             registry=r)
        self._received = Counter("ravnest_received_bytes", "Tensor bytes received, by frame kind.",
                                 kinds, registry=r)
        self._lab = lab

    def _elastic(self, counter: Callable[[str, str], Counter],
                 gauge: Callable[[str, str], Gauge]) -> None:
        """The metrics of elastic training (train/rejoining.py)."""
        self.clusters_active = gauge("ravnest_clusters_active",
                                     "Clusters this node's last ring round went with (planned "
                                     "clusters less those with a member missing).")
        self.recoveries = counter("ravnest_recoveries",
                                  "Times this node rejoined a running job live, its state taken "
                                  "from the other clusters (elastic training).")
        self.recovery_seconds = gauge("ravnest_recovery_duration_seconds",
                                      "Seconds this node's last rejoin took, from its start to "
                                      "its state loaded.")
        self.recovery_bytes = counter("ravnest_recovery_bytes",
                                      "Bytes of state this node received to rejoin.")

    def start_loop(self) -> None:
        """The training loop starts now: time before it (building, waiting for peers) is not
        charged to any activity."""
        self._mark = time.perf_counter()

    @contextmanager
    def timed(self, activity: str) -> Iterator[None]:
        """Charge the wall time inside the block to `activity` (time outside every block goes to
        the enclosing one, "other" at the top). Only the training loop's thread may use it."""
        self._charge()
        self._stack.append(activity)
        try:
            yield
        finally:
            self._charge()
            self._stack.pop()

    def _charge(self) -> None:
        now = time.perf_counter()
        self._activities[self._stack[-1]].inc(now - self._mark)
        self._mark = now

    def sent(self, kind: str, n: int) -> None:
        self._sent.labels(**self._lab, kind=kind).inc(n)

    def received(self, kind: str, n: int) -> None:
        self._received.labels(**self._lab, kind=kind).inc(n)

    def wait_for_scrape(self, timeout: float) -> bool:
        """Wait until a scrape that began after this call has read the metrics (so a worker
        that is done can stay until its final figures are in Prometheus); False on timeout."""
        self._watch.arm()
        return self._watch.scraped.wait(timeout)

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve /metrics; port 0 picks a free port. Returns the port."""
        server, _ = start_http_server(port, addr=addr, registry=self.registry)
        return int(server.server_port)
