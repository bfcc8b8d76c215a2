"""The progress scrapes of running jobs, made off the threads that run the jobs' passes.

A pass asks for its job's latest scrape and gets the one the previous pass started (None until
one has ended well): the pass never waits on a tenant's metrics endpoint, which is the tenant's
to make slow. Each scrape is bounded in bytes and total time (`ravnest.run.progress.scrape`),
each job has at most one in flight, and a few threads serve them all, so an endpoint that never
answers costs its own job's progress, not other jobs' passes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from ravnest.run.progress import scrape

Samples = list[dict[str, float]]
KEPT = "ravnest_"
"""The samples kept of a scrape: the workers' own (an endpoint may export any others)."""


def scrape_roots(hosts: tuple[str, ...], port: int, timeout: float) -> Samples:
    """The cluster roots' samples, cluster 0 first; OSError when any cannot be read."""
    return [{k: v for k, v in scrape(port, host=h, timeout=timeout).items()
             if k.startswith(KEPT)} for h in hosts]


class Scrapes:
    """Each job's latest scrape of its roots, by job uid."""

    def __init__(self, port: int, timeout: float = 1.0, threads: int = 4,
                 read: Callable[[tuple[str, ...], int, float], Samples] = scrape_roots) -> None:
        self._port, self._timeout, self._read = port, timeout, read
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="ravnest-scrape")
        self._lock = threading.Lock()
        self._running: dict[str, tuple[tuple[str, ...], Future[Samples]]] = {}
        self._last: dict[str, tuple[tuple[str, ...], Samples | None]] = {}

    def latest(self, uid: str, hosts: tuple[str, ...]) -> Samples | None:
        """The samples of the last scrape of these hosts that ended (None: none has, or it
        failed); a new one is started unless the job's last is still running."""
        with self._lock:
            running = self._running.get(uid)
            if running is not None and running[1].done():
                del self._running[uid]
                try:
                    self._last[uid] = (running[0], running[1].result())
                except OSError:
                    self._last[uid] = (running[0], None)
            if uid not in self._running:
                self._running[uid] = (hosts, self._pool.submit(
                    self._read, hosts, self._port, self._timeout))
            seen, samples = self._last.get(uid, ((), None))
            return samples if seen == hosts else None

    def forget(self, uid: str) -> None:
        """A job that is gone or finished: its scrapes are dropped (one running ends alone)."""
        with self._lock:
            self._running.pop(uid, None)
            self._last.pop(uid, None)
