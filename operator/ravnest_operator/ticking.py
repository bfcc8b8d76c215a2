"""Each job's timed passes, without a finalizer on the job.

kopf's timers put a finalizer on every object they run for (so that kopf can stop them first): a
RavnestJob deleted while no operator ran, or the namespace holding it, then hung in Terminating
until an operator came back. The passes a job needs between its own changes (its pods' and
workers' progress, deadlines, TTL) come from this ticker instead: it queues each job's pass onto
a pool of threads when the job is due, and kopf keeps only change handlers, which need no
finalizer (kopf removes the one an earlier operator left).

Each pass says when its job is due again, counted from when that pass began (a pass of a second
every two seconds is one every two seconds, not every three): a job in progress after `interval`
seconds, a finished one when its ttlSecondsAfterFinished ends, or never (a finished job without a
TTL costs nothing until it changes). A job is tracked, and due at once, from each change handler
(create, resume at start, spec update), and forgotten once a pass finds it gone. A job's pass is
never queued while the last one queued for it has not ended (a slow pass delays only its own job),
`poke` queues one at once (something it must act on happened), and an error in a pass is logged: it
is due again after `interval`.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import kopf

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Tracked:
    """A job the ticker passes over."""
    uid: str
    name: str
    namespace: str


Pass = Callable[[Tracked], float | None]
"""One pass over a job: seconds until its next pass is due (math.inf: none until it changes), or
None when the job is gone (it is forgotten)."""


class Ticker:
    """Queues `run_pass` for every tracked job that is due, every `interval` seconds, on `workers`
    threads, each pass in a copy of the context `start` was called in."""

    def __init__(self, interval: float, run_pass: Pass, workers: int = 8,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self._run_pass = run_pass
        self._clock = clock
        self._jobs: dict[str, Tracked] = {}
        self._due: dict[str, float] = {}
        self._queued: set[str] = set()
        self._guard = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        """(set when a job is tracked or a pass ends: the loop looks again at what is due)"""
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="ravnest-pass")
        """(its threads start as passes are queued)"""
        self._thread: threading.Thread | None = None

    def track(self, job: Tracked) -> None:
        """Pass over this job from now on, the next tick first."""
        with self._guard:
            self._jobs[job.uid] = job
            self._due[job.uid] = self._clock()
        self._wake.set()

    def forget(self, uid: str) -> None:
        with self._guard:
            self._jobs.pop(uid, None)
            self._due.pop(uid, None)

    def tracked(self) -> list[Tracked]:
        with self._guard:
            return list(self._jobs.values())

    def due_in(self, uid: str) -> float | None:
        """Seconds until that job is due (None: not tracked)."""
        with self._guard:
            due = self._due.get(uid)
        return None if due is None else due - self._clock()

    def start(self) -> None:
        """Tick in a thread of its own from now on (once)."""
        if self._thread is not None:
            return
        context = contextvars.copy_context()
        self._thread = threading.Thread(target=context.run, args=(self._loop,),
                                        name="ravnest-ticker", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """No more ticks; the passes under way end (waited for up to `timeout` seconds)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()  # (before the tick: what is tracked or ends after it wakes the wait)
            self.tick()
            self._wake.wait(self._until_due())

    def _until_due(self) -> float:
        """Seconds until the first job that is not queued is due, at most `interval` and at least
        a twentieth of a second (a job due at once again and again is not a busy loop)."""
        now = self._clock()
        with self._guard:
            waiting = [d - now for uid, d in self._due.items() if uid not in self._queued]
        return max(0.05, min([self.interval, *waiting]))

    def tick(self) -> list[Future[None]]:
        """Queue a pass of each tracked job that is due and whose last pass has ended; the
        passes queued."""
        return self._queue(None)

    def poke(self, uid: str) -> list[Future[None]]:
        """Queue a pass of that job now, due or not, unless one is queued or it is not tracked;
        the pass queued."""
        return self._queue(uid)

    def _queue(self, only: str | None) -> list[Future[None]]:
        now = self._clock()
        with self._guard:
            due = [j for uid, j in self._jobs.items() if uid not in self._queued and (
                uid == only if only is not None else self._due.get(uid, now) <= now)]
            self._queued.update(j.uid for j in due)
        # (a context of its own each: one context cannot be entered by two threads at once)
        return [self._pool.submit(contextvars.copy_context().run, self._one, job)
                for job in due]

    def _one(self, job: Tracked) -> None:
        began = self._clock()
        rest: float | None = self.interval
        try:
            rest = self._run_pass(job)
        except kopf.TemporaryError as e:
            logger.warning("job %s/%s: %s; tried again in %.0f s", job.namespace, job.name, e,
                           self.interval)
        except Exception:
            logger.exception("job %s/%s: the pass failed; tried again in %.0f s",
                             job.namespace, job.name, self.interval)
        finally:
            with self._guard:
                self._queued.discard(job.uid)
                if rest is None:
                    self._jobs.pop(job.uid, None)
                    self._due.pop(job.uid, None)
                elif job.uid in self._jobs:
                    self._due[job.uid] = began + rest
            self._wake.set()
