"""Sending: what a node's training loop and its ring reducers need of a link to another node.

They only post frames and wait until those were delivered; typed against these protocols instead
of a transport, they run over gRPC (`transport.Peer`), over the ring data plane
(`dataplane.RingLink`, ring pieces only) or within one process (`loopback.Loopback`).
"""

from __future__ import annotations

import secrets
import threading
from typing import Protocol

from ravnest.comm.framing import Frame
from ravnest.errors import PeerTimeout, TransportError


class RingSender(Protocol):
    """A link that ring pieces go out on: posted in any order, then flushed at a round's end."""

    def post(self, frame: Frame, ordered: bool = ...) -> None:
        """Queue `frame` and return; a failure surfaces on a later post or flush."""

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every posted frame was delivered; raise TransportError (PeerTimeout after
        `timeout` seconds) for one that was not."""


class Sender(RingSender, Protocol):
    """A link to a pipeline neighbour (or a ring successor over gRPC)."""

    def post(self, frame: Frame, ordered: bool = True, snapshot: bool = True) -> None:
        """Queue `frame` and return; a failure surfaces on a later post or flush. Ordered frames
        are handed on by the receiving Inbox in the order they were posted, others may overtake
        them. With `snapshot` the caller may change the frame's tensors as soon as this returns;
        without, it must leave them as they are."""


class Deliveries:
    """A link's bookkeeping of what it posted: ordered frames numbered in one random stream,
    frames in flight counted until delivered, and the first failure kept for the next post or
    flush (shared by `transport.Peer` and `loopback.Loopback`)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self._pending = 0
        self._error: TransportError | None = None
        self._stream = secrets.randbits(63) + 1
        self._sequence = 0

    def number(self, frame: Frame) -> None:
        """Give an ordered frame its place in this link's stream."""
        with self._lock:
            self._sequence += 1
            frame.stream, frame.sequence = self._stream, self._sequence

    def started(self) -> None:
        """A frame was queued."""
        with self._lock:
            self._pending += 1
            self._idle.clear()

    def finished(self, error: TransportError | None = None) -> None:
        """A queued frame was delivered, or failed with `error`."""
        if error is not None:
            self._error = error
        with self._lock:
            self._pending -= 1
            if self._pending == 0:
                self._idle.set()

    def wait(self, timeout: float | None = None) -> None:
        """Wait until every queued frame was delivered; raise the failure of one that was not."""
        if not self._idle.wait(timeout):
            raise PeerTimeout(f"frames to {self.address} not delivered within {timeout}s")
        self.raise_error()

    def raise_error(self) -> None:
        """Raise (once) the failure of a frame that could not be delivered."""
        error, self._error = self._error, None
        if error is not None:
            raise error
