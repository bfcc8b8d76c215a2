"""The operator's own Prometheus metrics: jobs by phase, reconcile latency, time to running,
job duration, restarts, cluster recoveries and spare takeovers."""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from ravnest.run.jobstatus import FINISHED, Phase

from .statuses import parse_time

JOBS = Gauge("ravnest_operator_jobs", "RavnestJobs by phase.", ["phase"])
RECONCILE = Histogram("ravnest_operator_reconcile_duration_seconds",
                      "Time of one reconcile pass.",
                      buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
TO_RUNNING = Histogram("ravnest_operator_time_to_running_seconds",
                       "From job creation to all worker pods running.",
                       buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800))
DURATION = Histogram("ravnest_operator_job_duration_seconds",
                     "From start to completion of finished jobs.", ["phase"],
                     buckets=(10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400))
RESTARTS = Counter("ravnest_operator_job_restarts", "Job restarts after worker failures.")
RECOVERIES = Counter("ravnest_operator_cluster_recoveries",
                     "Clusters restarted alone after a worker failure, rejoining the others live "
                     "(elastic training).")
TAKEOVERS = Counter("ravnest_operator_spare_takeovers",
                    "Lost workers' stages taken over by a hot spare provider (spec.plan.spares).")
DRAINS = Counter("ravnest_operator_cluster_drains",
                 "Clusters drained out of running jobs (providers removed from spec.providers).")

_phases: dict[tuple[str, str], str] = {}
_lock = threading.Lock()


def serve(port: int) -> None:
    start_http_server(port)
    for phase in Phase:
        JOBS.labels(phase=phase).set(0)
    # Exported at 0 before the first job ends: a series that appears already at 1 is not an
    # increase to Prometheus, and the dashboards' rates of finished jobs would show nothing.
    for phase in FINISHED:
        DURATION.labels(phase=phase)


@contextmanager
def reconciling() -> Iterator[None]:
    t0 = time.perf_counter()
    try:
        yield
    finally:
        RECONCILE.observe(time.perf_counter() - t0)


def observe_phase(namespace: str, name: str, phase: str | None) -> None:
    with _lock:
        if phase:
            _phases[(namespace, name)] = phase
        _publish()


def forget(namespace: str, name: str) -> None:
    with _lock:
        _phases.pop((namespace, name), None)
        _publish()


def _publish() -> None:
    counts: dict[str, int] = dict.fromkeys(Phase, 0)
    for phase in _phases.values():
        counts[phase] = counts.get(phase, 0) + 1
    for phase, n in counts.items():
        JOBS.labels(phase=phase).set(n)


def running(created: str | None) -> None:
    if created:
        TO_RUNNING.observe(max(0.0, time.time() - parse_time(created).timestamp()))


def finished(previous: str | None, phase: str, started: str | None) -> None:
    if previous in FINISHED:
        return
    if started:
        DURATION.labels(phase=phase).observe(
            max(0.0, (dt.datetime.now(dt.UTC) - parse_time(started)).total_seconds()))


def restarted() -> None:
    RESTARTS.inc()


def recovered() -> None:
    RECOVERIES.inc()


def took_over() -> None:
    TAKEOVERS.inc()


def drained() -> None:
    DRAINS.inc()
