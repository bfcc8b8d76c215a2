"""End to end: the digits example's throughput and where each worker's time goes.

Why it exists: the per-path benchmarks (transfer, ring, pipeline) do not say what a user's job
gains. This runs `examples/digits.yaml` as `ravnest run` does (6 worker processes on 127.0.0.1,
2 clusters of 3 stages, sync schedule, ring all-reduce every 2 updates), scrapes every worker's
Prometheus endpoint while it trains, and prints:

- samples/s of the job as `ravnest run` reports it (summary.json: all samples over the wall time
  from launch to the last worker's exit, so process start-up and model building included), and
  during training only (the roots' `ravnest_samples_total` over the scrapes that saw it move);
- per worker, the share of its training loop's wall time in compute, communication, waiting and
  other, from the worker's own `ravnest_training_seconds_total{activity}` (the last scrape before
  the worker exited, so the final moments may be missing), and its bytes sent.

    python bench/e2e.py [--job examples/digits.yaml] [--repeats 1] [--epochs N] [-v]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from ravnest import parse_job
from ravnest.plan.plans import Plan
from ravnest.run.local import LocalRun
from ravnest.spec import Job

log = logging.getLogger("bench.e2e")

ROOT = Path(__file__).resolve().parents[1]
ACTIVITIES = ("compute", "communication", "waiting", "other")


def _emit(line: str = "") -> None:
    print(line, flush=True)


@dataclass
class Scrape:
    """What one worker's /metrics said last, and the roots' samples over time."""

    labels: dict[str, str] = field(default_factory=dict)
    activity: dict[str, float] = field(default_factory=dict)
    sent_bytes: float = 0.0
    steps: float = 0.0
    samples: list[tuple[float, float]] = field(default_factory=list)
    """(monotonic time, ravnest_samples_total) at every scrape."""
    first_seen: float | None = None
    """When /metrics first answered (the worker has built its stage)."""
    started: float | None = None
    """First scrape with training time on the clock."""
    active: float | None = None
    """Last scrape whose training time had grown since the one before."""
    exited: float | None = None
    device_peak: float = 0.0
    """Most memory torch held on the worker's GPU, as far as seen (0 on a CPU)."""


def _scrape(port: int, into: Scrape, host: str = "127.0.0.1") -> None:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=1.0) as r:
        text = r.read().decode()
    now = time.monotonic()
    activity, sent = {}, 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "ravnest_training_seconds_total":
                activity[s.labels["activity"]] = s.value
            elif s.name == "ravnest_sent_bytes_total":
                sent += s.value
            elif s.name == "ravnest_steps_total":
                into.steps = s.value
                into.labels = {k: s.labels[k] for k in ("node", "role", "cluster", "stage")}
            elif s.name == "ravnest_samples_total":
                into.samples.append((now, s.value))
            elif s.name == "ravnest_device_memory_peak_bytes":
                into.device_peak = max(into.device_peak, s.value)
    if sum(activity.values()) > sum(into.activity.values()):
        into.active = now
        into.started = into.started or now
    into.activity, into.sent_bytes = activity, sent
    into.first_seen = into.first_seen or now


@contextlib.contextmanager
def scraping(run: LocalRun, scrapes: dict[str, Scrape]) -> Iterator[None]:
    """Scrape every worker of `run` (at its host) every 0.2 s while the block runs, into
    `scrapes`, and note when each one exited."""
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(0.2):
            for p in run.procs:
                sc = scrapes[p.node]
                if sc.exited is None and p.popen.poll() is not None:
                    sc.exited = time.monotonic()
                try:
                    _scrape(p.metrics_port, sc, host=p.host)
                except (OSError, ValueError):
                    pass  # not serving yet, or gone

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        yield
    finally:
        stop.set()
        poller.join()


def train_rate(plan: Plan, scrapes: dict[str, Scrape]) -> float:
    """Samples/s while training: each cluster root's `ravnest_samples_total` between the first
    and the last scrape that saw it above 0, summed over the clusters."""
    rate = 0.0
    for c in plan.clusters:
        moving = [(t, v) for t, v in scrapes[c.nodes[0]].samples if v > 0]
        if len(moving) >= 2:
            rate += (moving[-1][1] - moving[0][1]) / (moving[-1][0] - moving[0][0])
    return rate


def run_once(job_path: Path, epochs: int | None, verbose: bool) -> dict[str, Any]:
    doc = yaml.safe_load(job_path.read_text())
    if epochs:
        doc["spec"]["training"]["epochs"] = epochs
    got = run_scraped(parse_job(doc))
    if verbose:
        log.info("run: %s", got["summary"])
    return got


def run_scraped(job: Job, read: Callable[[Path], Any] | None = None) -> dict[str, Any]:
    """`job` run as `ravnest run` runs it, in a folder of its own, every worker scraped: its
    summary, the training rate (`train_rate`), the scrapes, the phases' times, the plan, and what
    `read` took from the run folder before it went."""
    with tempfile.TemporaryDirectory(prefix="ravnest-e2e-") as out:
        run = LocalRun(job, out, progress=False)
        metas = run.prepare()
        scrapes = {m.node: Scrape() for m in metas}
        started, launched = time.time(), time.monotonic()
        try:
            run.start(metas)
            with scraping(run, scrapes):
                decided = run.wait()
            if not decided.done:  # (a bench measures a run that went through, or nothing)
                raise SystemExit(f"the run failed: {decided.down[0].node} ended first; see "
                                 f"the logs in {out}/logs")
        finally:
            run.stop()
        summary = run.finish(time.time() - started)
        finished = time.monotonic()
        kept = read(Path(out)) if read is not None else None
    assert run.plan is not None
    return {"summary": summary, "train_rate": train_rate(run.plan, scrapes), "scrapes": scrapes,
            "phases": _phases(launched, finished, scrapes), "plan": run.plan, "read": kept}


def _phases(launched: float, done: float, scrapes: dict[str, Scrape]) -> dict[str, float]:
    """Seconds from launch to: every worker serving metrics, training on every worker, the last
    training loop seen running, the last worker exited, `ravnest run` done (outputs fused)."""
    def latest(values: list[float | None]) -> float:
        return max(v for v in values if v is not None) - launched if any(
            v is not None for v in values) else float("nan")

    s = list(scrapes.values())
    return {"stage built": latest([x.first_seen for x in s]),
            "training": latest([x.started for x in s]),
            "trained": latest([x.active for x in s]),
            "exited": latest([x.exited for x in s]),
            "outputs": done - launched}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--job", type=Path, default=ROOT / "examples" / "digits.yaml")
    parser.add_argument("--epochs", type=int, default=None, help="override the job's epochs")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=0, help="ignored (runs are whole jobs)")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    _emit(f"End to end: {args.job.name} with `ravnest run` on 127.0.0.1; median of "
          f"{args.repeats} run(s); load average {os.getloadavg()[0]:.1f}")
    started = time.monotonic()
    results = [run_once(args.job, args.epochs, args.verbose) for _ in range(args.repeats)]
    job_rates = [r["summary"]["samples_per_second"] for r in results]
    train_rates = [r["train_rate"] for r in results]
    last = results[-1]["summary"]
    _emit()
    _emit(f"samples/s, whole job (summary.json):  {statistics.median(job_rates):.1f}   "
          f"runs: {' '.join(f'{v:.1f}' for v in job_rates)}")
    _emit(f"samples/s, while training (roots):    {statistics.median(train_rates):.1f}   "
          f"runs: {' '.join(f'{v:.1f}' for v in train_rates)}")
    _emit(f"{last['updates']} updates, {last['samples']} samples, {last['seconds']:.1f} s, "
          f"val accuracy {last['val_metric']:.4f}")
    phases = results[-1]["phases"]
    _emit("timeline, s after launch (last run; scraped every 0.2 s): "
          + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()))
    _emit("  (stage built: every worker serves /metrics; training: every worker's loop runs; "
          "trained: the last loop seen running; exited: the last process gone; outputs: "
          "model fused and evaluated)")
    _emit()
    _emit(f"{'node':<8} {'role':<5} {'cl':>2} {'st':>2} {'loop s':>7} {'compute':>8} "
          f"{'comm':>6} {'waiting':>8} {'other':>6} {'sent MB':>8}   (last run)")
    by_role: dict[str, list[dict[str, float]]] = {}
    for node, s in sorted(results[-1]["scrapes"].items(),
                          key=lambda kv: (kv[1].labels.get("cluster", ""),
                                          int(kv[1].labels.get("stage", "0")))):
        total = sum(s.activity.values())
        if not total:
            _emit(f"{node:<8} (no ravnest_training_seconds_total: a worker without these "
                  f"metrics)")
            continue
        share = {a: s.activity.get(a, 0.0) / total for a in ACTIVITIES}
        by_role.setdefault(s.labels.get("role", "?"), []).append(share)
        _emit(f"{node:<8} {s.labels.get('role', '?'):<5} {s.labels.get('cluster', '?'):>2} "
              f"{s.labels.get('stage', '?'):>2} {total:>7.1f} "
              + " ".join(f"{share[a]:>{w}.1%}" for a, w in zip(ACTIVITIES, (8, 6, 8, 6),
                                                                 strict=True))
              + f" {s.sent_bytes / 1e6:>8.1f}")
    for role, shares in sorted(by_role.items()):
        mean = {a: statistics.fmean(s[a] for s in shares) for a in ACTIVITIES}
        _emit(f"{'mean':<8} {role:<5} {'':>2} {'':>2} {'':>7} "
              + " ".join(f"{mean[a]:>{w}.1%}" for a, w in zip(ACTIVITIES, (8, 6, 8, 6),
                                                                strict=True)))
    _emit(f"({time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
