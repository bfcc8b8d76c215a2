"""Prometheus metrics of a worker, served over HTTP from the first version.

Names follow the Prometheus conventions: `ravnest_` prefix, base units, `_total` counters,
histograms for durations, and only bounded labels (job, namespace, node, role, cluster, stage,
plus `kind` for bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LABELS = ("job", "namespace", "node", "role", "cluster", "stage")
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


class WorkerMetrics:
    """All metrics of one worker, already bound to its identity labels."""

    def __init__(self, who: Identity, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
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
        self.peer_errors = counter("ravnest_peer_errors", "Failed calls to peers.")
        kinds = (*_LABELS, "kind")
        self._sent = Counter("ravnest_sent_bytes", "Tensor bytes sent, by frame kind.", kinds,
                             registry=r)
        self._received = Counter("ravnest_received_bytes", "Tensor bytes received, by frame kind.",
                                 kinds, registry=r)
        self._lab = lab

    def sent(self, kind: str, n: int) -> None:
        self._sent.labels(**self._lab, kind=kind).inc(n)

    def received(self, kind: str, n: int) -> None:
        self._received.labels(**self._lab, kind=kind).inc(n)

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve /metrics; port 0 picks a free port. Returns the port."""
        server, _ = start_http_server(port, addr=addr, registry=self.registry)
        return int(server.server_port)
