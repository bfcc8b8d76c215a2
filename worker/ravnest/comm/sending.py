"""Sending: what a node's training loop and its ring reducers need of a link to another node.

They only post frames and wait until those were delivered; typed against these protocols instead
of a transport, they run over gRPC (`transport.Peer`), over the ring data plane
(`dataplane.RingLink`, ring pieces only) or within one process (`loopback.Loopback`).
"""

from __future__ import annotations

from typing import Protocol

from ravnest.comm.framing import Frame


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
