"""Leader election: with several replicas of the operator, one acts at a time.

Every replica runs kopf and watches the jobs and their pods (so that a replica taking over knows
them, their disrupted pods included), but only the one holding the Lease makes a pass
(`handling._reconcile_once` asks `Leadership.leads`). The Lease is the Kubernetes client's
leader election (`kubernetes.leaderelection`, coordination.k8s.io/v1 Leases, as client-go's): a
replica takes it when its holder has not renewed it for `lease_seconds`, and a leader that cannot
renew it within `renew_seconds` stops the whole process at once (`os._exit`), so two replicas never
act together: its pod restarts as a follower. Status writes carry the resourceVersion their pass
read (`handling._write_status`), so even a write of a leader being deposed cannot overwrite a
newer one.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Election:
    """Where the Lease is and how it is held (the chart's operator.leaderElection)."""
    lease: str
    namespace: str
    identity: str
    lease_seconds: int = 15
    renew_seconds: int = 10
    retry_seconds: int = 2


class Leadership:
    """Whether this replica leads: always, without an election (one replica, `--standalone`);
    with one, once it holds the Lease."""

    def __init__(self, election: Election | None = None,
                 stop: Callable[[], None] = lambda: os._exit(3)) -> None:
        self.election = election
        self._leading = threading.Event()
        if election is None:
            self._leading.set()
        self._stop = stop
        self._thread: threading.Thread | None = None

    def leads(self) -> bool:
        return self._leading.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._leading.wait(timeout)

    def start(self, on_leading: Callable[[], object] = lambda: None) -> None:
        """Stand for election in a thread of its own (once); `on_leading` runs once this
        replica leads."""
        if self.election is None or self._thread is not None:
            return
        from kubernetes.leaderelection import electionconfig, leaderelection
        from kubernetes.leaderelection.resourcelock.leaselock import LeaseLock

        e = self.election
        logging.getLogger("leaderelection").setLevel(logging.WARNING)  # (a line per renewal)

        def started() -> None:
            logger.info("%s leads (Lease %s/%s)", e.identity, e.namespace, e.lease)
            self._leading.set()
            on_leading()

        def stopped() -> None:
            logger.error("%s could not renew Lease %s/%s within %d s: it stops, to act no more",
                         e.identity, e.namespace, e.lease, e.renew_seconds)
            self._leading.clear()
            self._stop()

        config = electionconfig.Config(LeaseLock(e.lease, e.namespace, e.identity),
                                       lease_duration=e.lease_seconds,
                                       renew_deadline=e.renew_seconds,
                                       retry_period=e.retry_seconds,
                                       onstarted_leading=started, onstopped_leading=stopped)

        def stand() -> None:
            while True:  # (run returns only once leading stopped, and then the process stops)
                try:
                    leaderelection.LeaderElection(config).run()
                except Exception:
                    logger.exception("leader election failed; standing again in %d s",
                                     e.retry_seconds)
                    time.sleep(e.retry_seconds)

        self._thread = threading.Thread(target=stand, name="ravnest-election", daemon=True)
        self._thread.start()


def election_of(environ: Mapping[str, str], hostname: str, pid: int) -> Election | None:
    """The election the environment asks for (RAVNEST_LEADER_ELECTION: the Lease's name; none:
    no election), in RAVNEST_LEASE_NAMESPACE (else POD_NAMESPACE, else default), as
    RAVNEST_LEADER_IDENTITY (else the pod's name, else the host's, with the process id), with
    RAVNEST_LEASE_SECONDS, RAVNEST_RENEW_SECONDS and RAVNEST_RETRY_SECONDS; ValueError, naming the
    variable, for values the election cannot run with."""
    lease = environ.get("RAVNEST_LEADER_ELECTION", "")
    if not lease:
        return None
    seconds = {}
    for var, default in (("RAVNEST_LEASE_SECONDS", 15), ("RAVNEST_RENEW_SECONDS", 10),
                         ("RAVNEST_RETRY_SECONDS", 2)):
        try:
            seconds[var] = int(environ.get(var) or default)
        except ValueError:
            raise ValueError(f"{var}: must be a whole number of seconds, got "
                             f"{environ.get(var)!r}") from None
        if seconds[var] < 1:
            raise ValueError(f"{var}: must be at least 1, got {seconds[var]}")
    held, renew, retry = seconds.values()
    if not held > renew > 1.2 * retry:
        raise ValueError(f"RAVNEST_LEASE_SECONDS ({held}) must be more than "
                         f"RAVNEST_RENEW_SECONDS ({renew}), and that more than 1.2 x "
                         f"RAVNEST_RETRY_SECONDS ({retry})")
    identity = environ.get("RAVNEST_LEADER_IDENTITY") or (
        f"{environ.get('POD_NAME') or hostname}-{pid}")
    return Election(lease, environ.get("RAVNEST_LEASE_NAMESPACE") or environ.get(
        "POD_NAMESPACE") or "default", identity, held, renew, retry)
