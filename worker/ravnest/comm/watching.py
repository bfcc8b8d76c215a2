"""Watching a node's peers, so that one whose process is gone, or whose machine fell silent, is
known within seconds.

A peer's frames may be minutes apart (a slow stage, a long epoch), so a failed send is no timely
sign of a dead peer. `PeerWatch` follows each peer's standard health service instead, on a
connection of its own that gRPC pings every second (`transport.Peer.watch_channel`): once the peer
has answered SERVING, one health Watch stream per peer stays open, costing no RPC and no thread of
the peer's server while all is well. The stream ends when the peer's process dies (its kernel
closes the connection at once) or when a ping goes unanswered for 2 s (the peer's machine was cut
off or froze: nothing comes back, not even a refusal), and each stream is renewed every
`RENEW_SECONDS` whatever happens, so that no stream a peer's server failed to end (one was seen
left open, in-process, after its server stopped) hides the peer's end for longer: a stopped
server refuses the new one. The watch then asks Check a few times a
second, and reports the peer lost when it stays unreachable for `lost_after` seconds (connection
refused: nothing listens there any more), or stays silent for `silent_after` seconds (no answer at
all, not even a refusal), or its health service turns NOT_SERVING (its server is shutting down). A
peer that is merely busy is not: pings are answered by gRPC's core and Check by gRPC's own
threads, whatever Python is doing, and its stream stays open. Where a server holds all the Watch
streams it allows, the watch asks Check once a second instead (and a Check that times out then
counts for nothing either way: no broken connection says the peer is gone).

A peer reported lost, the worker's cluster stops (run/assembling.py), and the supervisor (the local
runner or the operator) takes over: a cut-off or frozen neighbour costs seconds, not the 300 s a
frame's delivery may wait.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = logging.getLogger(__name__)

LOST_AFTER = 2.0
"""Seconds a peer must stay unreachable (after its connection broke) to count as lost."""
POLL_SECONDS = 0.5
"""How often a peer whose connection broke is asked whether it answers again."""
FALLBACK_POLL_SECONDS = 1.0
"""How often a peer that refuses a Watch stream (it holds too many) is asked instead."""
SILENT_AFTER = 3.0
"""Seconds a peer whose connection broke must stay silent (every Check timing out, none refused)
to count as lost: its watch stream's pings went unanswered for 2 s before that."""
RENEW_SECONDS = 15.0
"""Lifetime of one health Watch stream: then it ends (DEADLINE_EXCEEDED) and a new one begins."""
CHECK_TIMEOUT = 1.0
"""Deadline of one Check: one that runs out is silence, a loss only after a broken connection."""
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Watchable(Protocol):
    """What a watch needs of a peer: its address (for messages) and a channel to it
    (`transport.Peer` is one, and the watch uses its `watch_channel` where it has one)."""

    @property
    def address(self) -> str: ...

    @property
    def channel(self) -> grpc.Channel: ...


def _health_channel(peer: Watchable) -> grpc.Channel:
    """The peer's watch channel where it has one (transport.Peer does), else its channel."""
    channel = getattr(peer, "watch_channel", None)
    return channel if channel is not None else peer.channel


@dataclass
class _Watched:
    name: str
    address: str
    stub: Any
    seen: bool = False
    """The peer answered SERVING once: from then on, its going away is a loss."""
    watchable: bool = True
    """False once the peer refused a Watch stream: it is asked with Check instead."""
    expected: bool = False
    closed: bool = False
    """The channel was closed (the caller closed its Peer): nothing more to watch."""
    call: Any = None
    ended: str = ""
    """How the last watch stream ended, when it failed ("Stream removed (ping timeout)")."""
    thread: threading.Thread | None = field(default=None, repr=False)


class PeerWatch:
    """Watches peers (name -> Peer) and calls `on_lost(name, reason)`, from a watch thread, when
    a peer that was seen SERVING goes away, unless `expect_exit(name)` or `stop()` came first.
    `reason` says what was seen, e.g. "no answer from 10.0.0.5:8081 for 2.0s since its
    connection broke (... Connection refused ...)". Without `on_back`, a peer is reported once
    and no longer watched; with it, a lost peer is asked on, and `on_back(name)` is called when
    it answers SERVING again (a cut healed, a process restarted at its address), after which it
    is watched as before and may be lost again.

    With `restarted(name)` too (whether the process answering at the peer's address is a new
    one), a peer whose watch broke and that answers again within `lost_after` is asked it: a
    process restarted that fast is reported lost and back all the same (it was seen in a local
    run: the round under way waited out its timeout for the killed process)."""

    def __init__(self, peers: Mapping[str, Watchable], on_lost: Callable[[str, str], None],
                 lost_after: float = LOST_AFTER, poll: float = POLL_SECONDS,
                 silent_after: float = SILENT_AFTER, up: Collection[str] = (),
                 on_back: Callable[[str], None] | None = None,
                 restarted: Callable[[str], bool] | None = None) -> None:
        """`up`: the peers known to have answered SERVING already (a wait for them passed):
        one that is gone before its watch begins is lost too, not awaited as not up yet."""
        self._on_lost = on_lost
        self._on_back = on_back
        self._restarted = restarted if on_back is not None else None
        self._lost_after, self._poll, self._silent_after = lost_after, poll, silent_after
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._lost: dict[str, str] = {}
        self._peers = {name: _Watched(name, peer.address,
                                      health_pb2_grpc.HealthStub(_health_channel(peer)),
                                      seen=name in up)
                       for name, peer in peers.items()}

    @classmethod
    def started(cls, peers: Mapping[str, Watchable], on_lost: Callable[[str, str], None],
                up: Collection[str] = (), on_back: Callable[[str], None] | None = None,
                restarted: Callable[[str], bool] | None = None,
                **options: float) -> PeerWatch:
        """A watch of `peers`, already started."""
        watch = cls(peers, on_lost, up=up, on_back=on_back, restarted=restarted, **options)
        watch.start()
        return watch

    @property
    def lost(self) -> dict[str, str]:
        """The peers reported lost so far, with the reason given."""
        with self._lock:
            return dict(self._lost)

    @property
    def seen(self) -> set[str]:
        """The peers that answered SERVING (from then on, their going away is a loss)."""
        return {w.name for w in self._peers.values() if w.seen}

    def start(self) -> None:
        for w in self._peers.values():
            w.thread = threading.Thread(target=self._run, args=(w,), daemon=True,
                                        name=f"watch-{w.name}")
            w.thread.start()

    def add(self, name: str, peer: Watchable) -> None:
        """Watch `peer` too (a node that joined the job after the watch began), from now on; a
        peer watched already is left as it is (one no longer watched, `expect_exit`, is watched
        again)."""
        with self._lock:
            watched = self._peers.get(name)
            if (watched is not None and not watched.expected) or self._stopping.is_set():
                return
            w = self._peers[name] = _Watched(name, peer.address,
                                             health_pb2_grpc.HealthStub(_health_channel(peer)))
            started = any(x.thread is not None for x in self._peers.values())
        if started:
            w.thread = threading.Thread(target=self._run, args=(w,), daemon=True,
                                        name=f"watch-{name}")
            w.thread.start()

    def expect_exit(self, name: str) -> None:
        """`name` may go away from now on without that being a failure: stop watching it."""
        w = self._peers.get(name)
        if w is None:
            return
        with self._lock:
            w.expected = True
            call = w.call
        if call is not None:
            call.cancel()

    def stop(self, timeout: float = 2.0) -> None:
        """Stop watching every peer (no loss is reported after this returns), waiting up to
        `timeout` seconds in all for the watch threads to end."""
        with self._lock:
            self._stopping.set()
            calls = [w.call for w in self._peers.values() if w.call is not None]
        for call in calls:
            call.cancel()
        deadline = time.monotonic() + timeout
        for w in self._peers.values():
            if w.thread is not None and w.thread is not threading.current_thread():
                w.thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> PeerWatch:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _finished(self, w: _Watched) -> bool:
        return self._stopping.is_set() or w.expected or w.closed

    def _run(self, w: _Watched) -> None:
        while not self._finished(w):
            ended = self._follow(w) if w.watchable else "ended"
            if self._finished(w):
                return
            reason = None
            if ended == "renew":
                continue
            if ended == "not serving":
                reason = (f"{w.address} began shutting down (its health service says "
                          "NOT_SERVING)")
            elif not w.seen and w.watchable:  # not up yet, or gone before it was seen
                self._stopping.wait(self._poll)
                continue
            else:
                reason = self._confirm(w)
                if reason is None and self._restarted is not None and not self._finished(w):
                    try:
                        if self._restarted(w.name):
                            reason = (f"{w.address} answers again as a restarted process "
                                      f"since its connection broke (watch: {w.ended})")
                    except Exception:
                        log.exception("restarted(%r) failed", w.name)
            if reason is not None:
                self._lose(w, reason)
                if self._on_back is None or not self._await_back(w):
                    return

    def _await_back(self, w: _Watched) -> bool:
        """Ask a lost peer until it answers SERVING again (True, reported) or the watch ends."""
        while not self._finished(w):
            status, _ = self._check(w)
            if status == _SERVING:
                with self._lock:
                    if self._finished(w):
                        return False
                    self._lost.pop(w.name, None)
                log.warning("peer %s is back: %s answers again", w.name, w.address)
                try:
                    assert self._on_back is not None
                    self._on_back(w.name)
                except Exception:
                    log.exception("on_back(%r) failed", w.name)
                return True
            self._stopping.wait(self._poll)
        return False

    def _follow(self, w: _Watched) -> Literal["ended", "not serving", "renew"]:
        """Follow the peer's health Watch stream until it ends ("ended"), says NOT_SERVING after
        SERVING ("not serving"), or has lasted RENEW_SECONDS while the peer was seen ("renew": a
        new stream is due). A stream the peer refuses turns this peer over to Check."""
        try:
            # a peer not seen yet is waited for; one seen that cannot be reached fails the call
            # at once, and is asked (`_confirm`) until it answers or counts as lost
            call = w.stub.Watch(health_pb2.HealthCheckRequest(), wait_for_ready=not w.seen,
                                timeout=RENEW_SECONDS)
        except ValueError:  # the channel is closed
            w.closed = True
            return "ended"
        with self._lock:
            w.call = call
            if self._finished(w):
                call.cancel()
        try:
            for response in call:
                if response.status == _SERVING:
                    w.seen = True
                elif w.seen and response.status == _NOT_SERVING:
                    return "not serving"
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and w.seen:
                return "renew"
            w.ended = " ".join(str(e.details() or e.code()).split())[:200]
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                log.info("%s holds too many health watches; asking it once a second", w.name)
                w.watchable = False
        finally:
            with self._lock:
                w.call = None
        return "ended"

    def _confirm(self, w: _Watched) -> str | None:
        """Ask the peer's health Check until it answers SERVING (None: it may be watched again;
        a peer that cannot be watched is asked on) or counts as lost (the reason)."""
        down_since: float | None = None
        silent_since: float | None = None
        while not self._finished(w):
            status, detail = self._check(w)
            now = time.monotonic()
            if status == _SERVING:
                w.seen, down_since, silent_since = True, None, None
                if w.watchable:
                    return None
            elif status == _NOT_SERVING and w.seen:
                return f"{w.address} began shutting down (its health service says NOT_SERVING)"
            elif status == grpc.StatusCode.UNAVAILABLE and w.seen:
                down_since = now if down_since is None else down_since
                if now - down_since >= self._lost_after:
                    return (f"no answer from {w.address} for {now - down_since:.1f}s since its "
                            f"connection broke ({self._how(w, detail)})")
            elif status == grpc.StatusCode.DEADLINE_EXCEEDED and w.seen and w.watchable:
                # silence after a broken watch: no refusal, no answer (a cut-off or frozen
                # machine; a busy one answers its pings and keeps its watch)
                silent_since = now if silent_since is None else silent_since
                if now - silent_since >= self._silent_after:
                    return (f"no answer from {w.address} for "
                            f"{now - silent_since + CHECK_TIMEOUT:.1f}s since its connection "
                            f"broke, not even a refusal ({self._how(w, detail)})")
            busy = down_since is None and not w.watchable
            self._stopping.wait(FALLBACK_POLL_SECONDS if busy else self._poll)
        return None

    @staticmethod
    def _how(w: _Watched, detail: str) -> str:
        """What was seen: how the watch ended (if it failed) and the last Check's failure."""
        return f"watch: {w.ended}; check: {detail}" if w.ended else detail

    def _check(self, w: _Watched) -> tuple[Any, str]:
        """One health Check: (its status, "") or (the failure's code, its details)."""
        try:
            answer = w.stub.Check(health_pb2.HealthCheckRequest(), timeout=CHECK_TIMEOUT)
            return answer.status, ""
        except ValueError:  # the channel is closed
            w.closed = True
            return None, "closed"
        except grpc.RpcError as e:
            return e.code(), " ".join(str(e.details() or "").split())[:300]

    def _lose(self, w: _Watched, reason: str) -> None:
        with self._lock:
            if self._finished(w) or w.name in self._lost:
                return
            self._lost[w.name] = reason
        log.error("peer %s is lost: %s", w.name, reason)
        try:
            self._on_lost(w.name, reason)
        except Exception:
            log.exception("on_lost(%r) failed", w.name)
