"""Job progress from the cluster roots' metrics, and its one-line rendering.

The local runner, `ravnest status` and the Kubernetes operator all read the workers' metrics and
compute progress here, so the numbers in a terminal and in `kubectl get rj` are the same numbers.
"""

from __future__ import annotations

import http.client
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

SCRAPE_BYTES = 4 * 2**20
"""The most a metrics answer may hold (a worker's is a few KiB): a larger one is refused unread,
not held in memory (a tenant's endpoint is the tenant's to make)."""


TOO_LONG = "the metrics endpoint took too long to answer"


class ScrapeError(OSError):
    """A metrics endpoint that did not answer in time, answered too much, or not metrics."""


class _DeadlineSocket(socket.socket):
    """A socket whose every read and write waits at most until one deadline: a server that
    drips its answer a byte at a time ends the scrape at the deadline, not at the last byte."""

    deadline = 0.0

    def _within(self, op: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise ScrapeError(TOO_LONG)
        self.settimeout(left)
        try:
            return op(*args, **kwargs)
        except TimeoutError as e:
            raise ScrapeError(TOO_LONG) from e

    def recv_into(self, *args: Any, **kwargs: Any) -> int:
        return int(self._within(super().recv_into, *args, **kwargs))

    def recv(self, *args: Any, **kwargs: Any) -> bytes:
        return bytes(self._within(super().recv, *args, **kwargs))

    def sendall(self, *args: Any, **kwargs: Any) -> None:
        self._within(super().sendall, *args, **kwargs)


class _Connection(http.client.HTTPConnection):
    def __init__(self, host: str, port: int, deadline: float) -> None:
        super().__init__(host, port)  # (no timeout of its own: connect bounds each step)
        self.deadline = deadline

    def connect(self) -> None:
        raw = socket.create_connection((self.host, self.port),
                                       timeout=max(0.001, self.deadline - time.monotonic()))
        sock = _DeadlineSocket(raw.family, raw.type, raw.proto, fileno=raw.detach())
        sock.deadline = self.deadline
        self.sock = sock


def scrape(port: int, host: str = "127.0.0.1", timeout: float = 1.0,
           max_bytes: int = SCRAPE_BYTES) -> dict[str, float]:
    """Unlabelled view of a worker's metrics: sample name -> value (first sample wins).

    `timeout` bounds the whole scrape (connect, headers, body), `max_bytes` its answer; either
    exceeded, or an answer that is not Prometheus's text format, raises ScrapeError (an OSError,
    as an endpoint that does not answer does)."""
    conn = _Connection(host, port, time.monotonic() + timeout)
    try:
        conn.request("GET", "/metrics", headers={"Accept": "text/plain"})
        r = conn.getresponse()
        if r.status != 200:
            raise ScrapeError(f"the metrics endpoint answered {r.status} {r.reason}")
        length = r.getheader("Content-Length")
        if length and length.isdigit() and int(length) > max_bytes:
            raise ScrapeError(f"a metrics answer of {int(length)} bytes (at most {max_bytes})")
        body = bytearray()
        while chunk := r.read(min(65536, max_bytes + 1 - len(body))):
            body += chunk
            if len(body) > max_bytes:
                raise ScrapeError(f"a metrics answer of more than {max_bytes} bytes")
    except (http.client.HTTPException, ValueError) as e:
        raise ScrapeError(f"not an HTTP answer: {e}") from e
    finally:
        conn.close()
    out: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(body.decode()):
            for sample in family.samples:
                out.setdefault(sample.name, sample.value)
    except (ValueError, UnicodeDecodeError, TypeError, IndexError) as e:
        raise ScrapeError(f"not Prometheus metrics: {e}") from e
    return out


def progress(samples: list[dict[str, float]], elapsed: float | None) -> dict[str, Any]:
    """Progress from the roots' metrics (one dict per cluster root, cluster 0 first).

    Steps count optimizer updates of the slowest cluster; samples/s and ETA use `elapsed`
    seconds since training started."""
    if not samples:
        return {}
    first = samples[0]
    step = int(min(s.get("ravnest_step", 0) for s in samples))
    total = int(first.get("ravnest_total_steps", 0))
    out: dict[str, Any] = {"epoch": int(first.get("ravnest_epoch", 0)) + 1, "step": step,
                           "totalSteps": total, "display": f"{step}/{total}"}
    if "ravnest_loss" in first:
        out["loss"] = round(first["ravnest_loss"], 6)
    if first.get("ravnest_validation_loss"):
        out["validationLoss"] = round(first["ravnest_validation_loss"], 6)
    if first.get("ravnest_validation_metric"):
        out["validationMetric"] = round(first["ravnest_validation_metric"], 6)
    done = sum(s.get("ravnest_samples_total", 0.0) for s in samples)
    if elapsed and elapsed > 0:
        if done:
            out["samplesPerSecond"] = round(done / elapsed, 2)
        if step and total > step:
            out["etaSeconds"] = int(elapsed / step * (total - step))
    return out


FINAL_FIGURES = (("step", "updates"), ("epoch", "epoch"), ("loss", "train_loss"),
                 ("validationLoss", "val_loss"), ("validationMetric", "val_metric"))
"""Progress fields a finished job takes from its first cluster root's figures (result keys)."""


def final(last: Mapping[str, Any], figures: Mapping[str, Any],
          rate: float | None) -> dict[str, Any]:
    """A succeeded job's progress: the last one scraped (`last`, {} if none was) completed by
    the figures its first cluster's root wrote as it ended, and the job's samples/s (`rate`).
    The steps the root made are its total and it has no ETA, so a job that ended before its
    first scrape shows the same as one scraped often (both supervisors write this)."""
    out = {k: v for k, v in last.items() if k != "etaSeconds"}
    out.update({key: figures[name] for key, name in FINAL_FIGURES
                if figures.get(name) is not None})
    if rate is not None:
        out["samplesPerSecond"] = rate
    if figures.get("updates") is not None:
        out["totalSteps"] = out["step"]
        out["display"] = f"{out['step']}/{out['step']}"
    return out


def render(status: dict[str, Any], width: int = 30) -> str:
    """``Running [#########.....] 66/176 epoch 3 loss 0.0123 val 0.970 412 samples/s eta 40s``"""
    p = status.get("progress") or {}
    parts = [str(status.get("phase", "Unknown"))]
    total, step = p.get("totalSteps") or 0, p.get("step") or 0
    if total:
        filled = int(width * min(step, total) / total)
        parts.append("[" + "#" * filled + "." * (width - filled) + f"] {step}/{total}")
    for key, label, fmt in (("epoch", "epoch", "{}"), ("loss", "loss", "{:.4f}"),
                            ("validationMetric", "val", "{:.3f}"),
                            ("samplesPerSecond", "samples/s", "{:.0f}"),
                            ("etaSeconds", "eta", "{}s")):
        if p.get(key) is not None:
            value = fmt.format(p[key])
            parts.append(f"{value} {label}" if label == "samples/s" else f"{label} {value}")
    return " ".join(parts)
