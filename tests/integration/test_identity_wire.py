"""Node identities on real gRPC and the real ring data plane on 127.0.0.1, without TLS (issue 40,
item 1): a server with an identity hears only calls that prove their node, and only frames whose
sender is that node; the job's token alone, another node's name, a proof made for another
recipient or another job's identity gets nothing delivered."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator

import pytest
import torch

from ravnest.comm.dataplane import RingLink, RingServer
from ravnest.comm.framing import Frame
from ravnest.comm.identity import Authority, NodeIdentity
from ravnest.comm.inboxes import Inbox
from ravnest.comm.transport import Credentials, Peer, Server
from ravnest.errors import TransportError

TOKEN, PLAN = "s3cret-token", "plan-0123abcd"
JOB, OTHER_JOB = Authority.fresh(), Authority.fresh()
TIMEOUT = 10.0


class Served:
    def __init__(self) -> None:
        self.inbox = Inbox()
        me = JOB.issue("node_0")
        self.server = Server("127.0.0.1:0", Credentials(TOKEN, PLAN, me), self.inbox.deliver,
                             threads=4)
        self.ring = RingServer("127.0.0.1:0", TOKEN, PLAN, self.inbox.deliver, inbox=self.inbox,
                               identity=me)
        self.address = f"127.0.0.1:{self.server.port}"
        self.ring_address = f"127.0.0.1:{self.ring.port}"

    def frames(self) -> list[Frame]:
        """The pipeline frames delivered so far."""
        out = []
        while True:
            try:
                out.append(self.inbox.pipeline.get(timeout=0.2))
            except queue.Empty:
                return out


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    s = Served()
    s.server.start()
    s.ring.start()
    try:
        yield s
    finally:
        s.ring.stop()
        s.server.stop(grace=0)


def _call(served: Served, identity: NodeIdentity | None, sender: str,
          recipient: str = "node_0") -> None:
    peer = Peer(served.address, Credentials(TOKEN, PLAN, identity), timeout=TIMEOUT,
                node=recipient)
    try:
        peer.send(Frame("forward", {"x": torch.ones(3)}, sender=sender, step=1))
    finally:
        peer.close()


def test_a_node_that_proves_itself_is_heard(served: Served) -> None:
    _call(served, JOB.issue("node_1"), "node_1")
    (frame,) = served.frames()
    assert frame.sender == "node_1" and torch.equal(frame.tensors["x"], torch.ones(3))


@pytest.mark.parametrize(("identity", "sender", "recipient", "code"), [
    (None, "node_1", "node_0", "UNAUTHENTICATED.*the job's token alone is not enough"),
    (JOB.issue("node_1"), "node_2", "node_0", "PERMISSION_DENIED"),  # in another's name
    (JOB.issue("node_1"), "node_1", "node_3", "UNAUTHENTICATED"),  # a proof made for node_3
    (OTHER_JOB.issue("node_1"), "node_1", "node_0", "UNAUTHENTICATED"),  # another job's
])
def test_nothing_else_is_delivered(served: Served, identity, sender, recipient, code) -> None:
    with pytest.raises(TransportError, match=code):
        _call(served, identity, sender, recipient)
    assert served.frames() == []


def _ring(served: Served, identity: NodeIdentity | None, sender: str,
          recipient: str = "node_0") -> None:
    link = RingLink(served.ring_address, TOKEN, PLAN, sender, timeout=TIMEOUT,
                    identity=identity, recipient=recipient)
    try:
        link.post(Frame("reduce", {"x": torch.arange(4.0)}, step=1, version=0, ring="ring-a"))
        link.flush(TIMEOUT)
    finally:
        link.close()


def test_a_ring_neighbour_proves_itself_in_the_handshake(served: Served) -> None:
    _ring(served, JOB.issue("node_1"), "node_1")
    frame = served.inbox.take_ring("ring-a", 1, 0, timeout=TIMEOUT)
    assert frame.sender == "node_1"


@pytest.mark.parametrize(("identity", "sender", "recipient", "why"), [
    (None, "node_1", "node_0", "gave no proof"),
    (JOB.issue("node_1"), "node_2", "node_0", "no identity from this job"),
    (JOB.issue("node_1"), "node_1", "node_3", "not signed by its key"),
    (OTHER_JOB.issue("node_1"), "node_1", "node_0", "no identity from this job"),
])
def test_no_other_ring_connection_is_heard(served: Served, identity, sender, recipient,
                                           why) -> None:
    with pytest.raises(TransportError, match=why):
        _ring(served, identity, sender, recipient)
    time.sleep(0.2)
    assert not served.inbox._ring
