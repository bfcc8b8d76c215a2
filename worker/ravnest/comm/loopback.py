"""Loopback: a `Sender` that hands frames to another node's inbox in the same process.

With it several nodes run as threads of one process (tests of the pipeline's schedules against
single-process training) through the same runtime code as over gRPC, with the same guarantees a
`Peer` gives: posting never waits for the receiver (one thread per link delivers), ordered frames
are numbered and the receiving Inbox hands them on in that order, a failed delivery surfaces on
the next post or flush, and `flush` waits until everything posted was delivered.

Tensors are handed over, not encoded: a frame posted with `snapshot` is delivered with copies of
them (its sender may change them at once), one without with tensors sharing their storage (its
sender leaves them alone). Its control object goes through JSON, as on the wire. No compression.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import threading
from collections.abc import Callable

from ravnest.comm.framing import Frame, check_sendable
from ravnest.comm.sending import Deliveries
from ravnest.errors import TransportError

log = logging.getLogger(__name__)


class Loopback:
    """A link to the node whose inbox `deliver` feeds (its `Inbox.deliver`)."""

    def __init__(self, deliver: Callable[[Frame], None], address: str = "loopback") -> None:
        self.address = address
        self._deliver = deliver
        self._queue: queue.Queue[Frame | None] = queue.Queue()
        self._deliveries = Deliveries(address)
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"send-{address}")
        self._thread.start()

    def post(self, frame: Frame, ordered: bool = True, snapshot: bool = True) -> None:
        self.raise_error()
        check_sendable(frame)
        if frame.ready is not None:  # (its control is copied here)
            frame.ready()
        tensors = {k: t.detach().clone() if snapshot else t.detach()
                   for k, t in frame.tensors.items()}
        copy = dataclasses.replace(frame, tensors=tensors,
                                   control=json.loads(json.dumps(frame.control)),
                                   wire_bytes=frame.nbytes(), release=None, ready=None)
        if ordered:
            self._deliveries.number(frame)
            copy.stream, copy.sequence = frame.stream, frame.sequence
        self._deliveries.started()
        self._queue.put(copy)

    def flush(self, timeout: float | None = None) -> None:
        self._deliveries.wait(timeout)

    def raise_error(self) -> None:
        """Raise (once) the error of a frame that could not be delivered."""
        self._deliveries.raise_error()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while (frame := self._queue.get()) is not None:
            error: TransportError | None = None
            try:
                self._deliver(frame)
            except Exception as e:  # refused by the inbox, as a server would refuse it
                log.error("delivering %s frame to %s failed: %s", frame.kind, self.address, e)
                error = TransportError(f"{frame.kind} frame to {self.address}: {e}")
                error.__cause__ = e
            finally:
                self._deliveries.finished(error)
