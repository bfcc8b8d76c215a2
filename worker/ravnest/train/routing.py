"""A node's frames in and out (issue 35 item 4: `NodeRuntime`'s frame routing as a collaborator
it is given): to its pipeline neighbours, in order; from its pipeline queue, with the frames kept
for later while it rejoins; and controls to nodes outside its pipeline (restarted, drained or new
members of its rings), unordered and at their own risk.

It knows links and queues only; what a frame means is the runtime's.
"""

from __future__ import annotations

import logging
import queue
from collections import deque
from collections.abc import Mapping

import torch

from ravnest.comm.framing import Frame
from ravnest.comm.inboxes import Inbox
from ravnest.comm.sending import Sender
from ravnest.errors import PeerTimeout, TransportError
from ravnest.plan.plans import Plan
from ravnest.train.messages import Kind, Op, Payload
from ravnest.train.metrics import WorkerMetrics

log = logging.getLogger(__name__)


class Routes:
    """The links of node `name` (its pipeline neighbours in `plan` among `peers`) and its
    inbox. A send or a wait counts as communication or waiting in `metrics`."""

    def __init__(self, name: str, plan: Plan, peers: Mapping[str, Sender], inbox: Inbox,
                 metrics: WorkerMetrics, peer_timeout: float) -> None:
        self.name = name
        self.peers = peers
        self.inbox = inbox
        self.metrics = metrics
        self.peer_timeout = peer_timeout
        up, down = plan.neighbours(name)
        self.up: Sender | None = peers[up] if up else None
        self.down: Sender | None = peers[down] if down else None
        self.kept: deque[Frame] = deque()
        """Frames that came while the node waited for others (rejoining), handled next."""

    def send_down(self, frame: Frame) -> None:
        assert self.down is not None
        frame.sender = self.name
        with self.metrics.timed("communication"):
            self.down.post(frame, snapshot=False)  # pipeline tensors are never written again

    def send_up(self, frame: Frame) -> None:
        assert self.up is not None
        frame.sender = self.name
        with self.metrics.timed("communication"):
            self.up.post(frame, snapshot=False)

    def control_down(self, c: Payload) -> None:
        """Pass a control on down the pipeline (a leaf has no one to pass it to)."""
        if self.down is not None:
            self.send_down(Frame(Kind.CONTROL, control=c.wire()))

    def next_frame(self) -> Frame:
        """The next frame: one kept for later first, else the pipeline queue's (PeerTimeout
        after the peer timeout)."""
        if self.kept:
            return self.kept.popleft()
        try:
            with self.metrics.timed("waiting"):
                return self.inbox.pipeline.get(timeout=self.peer_timeout)
        except queue.Empty:
            raise PeerTimeout(f"{self.name}: no frame from the pipeline for "
                              f"{self.peer_timeout:.0f}s") from None

    def finish_kept(self) -> bool:
        """Whether a `finish` is among the frames kept for later (an upstream neighbour passed it
        on: training is over)."""
        return any(f.kind == Kind.CONTROL and f.control.get("op") == Op.FINISH for f in self.kept)

    def answer(self, node: str, control: Payload,
               tensors: dict[str, torch.Tensor] | None = None) -> None:
        """A control to a node outside the pipeline (a restarted one): unordered (its process
        may be new to the link), and a failure only logged (it may be gone again)."""
        peer = self.peers.get(node)
        if peer is None:
            log.warning("%s: no link to %s, which asked for %s", self.name, node, control.op)
            return
        try:
            peer.post(Frame(Kind.CONTROL, tensors or {}, sender=self.name,
                            control=control.wire()), ordered=False)
        except TransportError as e:
            log.warning("%s: could not answer %s: %s", self.name, node, e)

    def flush(self) -> None:
        """Wait until the neighbours took every frame sent to them."""
        for peer in (self.up, self.down):
            if peer is not None:
                with self.metrics.timed("communication"):
                    peer.flush(self.peer_timeout)
