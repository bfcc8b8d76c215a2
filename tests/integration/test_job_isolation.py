"""Two jobs side by side on 127.0.0.1, with different tokens but the same plan fingerprint (same
model, same providers): a worker of job A cannot feed tensors to job B, and the token is checked
with a constant-time comparison on every call."""

from __future__ import annotations

import hmac
import queue
from collections.abc import Iterator

import grpc
import pytest
import torch

from ravnest.comm import transport
from ravnest.comm.framing import Frame
from ravnest.comm.inboxes import Inbox
from ravnest.comm.transport import Credentials, Peer, Server
from ravnest.errors import PeerTimeout, TransportError

pytestmark = pytest.mark.tools  # (scripts/test runs it once the tools are there)

FINGERPRINT = "plan-shared-0123"
JOB_A = Credentials(token="token-of-job-a", fingerprint=FINGERPRINT)
JOB_B = Credentials(token="token-of-job-b", fingerprint=FINGERPRINT)
TIMEOUT = 10.0


class Job:
    """One job's worker endpoint: a server with its inbox, and that job's peer to it."""

    def __init__(self, creds: Credentials) -> None:
        self.creds = creds
        self.inbox = Inbox()
        self.server = Server("127.0.0.1:0", creds, self.inbox.deliver, threads=4)
        self.address = f"127.0.0.1:{self.server.port}"
        self.server.start()

    def assert_inbox_empty(self) -> None:
        assert self.inbox.pipeline.empty()
        with pytest.raises(PeerTimeout):
            self.inbox.take_ring("ring-0", 1, 0, timeout=0.2)


@pytest.fixture
def jobs() -> Iterator[tuple[Job, Job]]:
    a, b = Job(JOB_A), Job(JOB_B)
    try:
        yield a, b
    finally:
        a.server.stop(grace=0)
        b.server.stop(grace=0)


FRAMES = [
    Frame("forward", {"act": torch.randn(4, 8)}, step=1, sender="node_0"),
    Frame("backward", {"grad": torch.randn(4, 8)}, step=1, sender="node_1"),
    Frame("reduce", {"p": torch.ones(16)}, step=1, version=0, ring="ring-0", sender="node_0"),
    Frame("control", control={"epoch_end": 0}, sender="node_0"),
]


@pytest.mark.parametrize("frame", FRAMES, ids=[f.kind for f in FRAMES])
def test_a_worker_of_job_a_cannot_feed_tensors_to_job_b(jobs: tuple[Job, Job],
                                                       frame: Frame) -> None:
    a, b = jobs
    a_to_b = Peer(b.address, a.creds, timeout=TIMEOUT)
    b_to_a = Peer(a.address, b.creds, timeout=TIMEOUT)
    try:
        for intruder in (a_to_b, b_to_a):
            with pytest.raises(TransportError, match="UNAUTHENTICATED") as err:
                intruder.send(frame)
            assert isinstance(err.value.__cause__, grpc.RpcError)
            assert err.value.__cause__.code() == grpc.StatusCode.UNAUTHENTICATED
            intruder.post(frame)
            with pytest.raises(TransportError, match="missing or wrong job token"):
                intruder.flush(timeout=TIMEOUT)
    finally:
        a_to_b.close()
        b_to_a.close()
    a.assert_inbox_empty()
    b.assert_inbox_empty()
    # each job's own workers still get through, so the refusal was the token's
    for job in (a, b):
        own = Peer(job.address, job.creds, timeout=TIMEOUT)
        try:
            own.send(frame)
        finally:
            own.close()
        if frame.kind == "reduce":
            got = job.inbox.take_ring("ring-0", 1, 0, timeout=TIMEOUT)
        else:
            got = job.inbox.pipeline.get(timeout=TIMEOUT)
        assert got.kind == frame.kind and got.control == frame.control
        for name, tensor in frame.tensors.items():
            assert torch.equal(got.tensors[name], tensor)
        with pytest.raises(queue.Empty):
            job.inbox.pipeline.get_nowait()


def test_the_token_is_compared_in_constant_time(jobs: tuple[Job, Job],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Every Peer call's token goes through hmac.compare_digest (not ==), for right and wrong
    tokens alike."""
    a, _ = jobs
    seen: list[tuple[bytes, bytes]] = []
    compare = hmac.compare_digest

    def spy(x: bytes, y: bytes) -> bool:
        seen.append((x, y))
        return compare(x, y)

    monkeypatch.setattr(transport.hmac, "compare_digest", spy)
    for creds in (JOB_A, JOB_B, Credentials("", FINGERPRINT)):
        peer = Peer(a.address, creds, timeout=TIMEOUT)
        try:
            try:
                peer.send(Frame("forward", {"x": torch.ones(2)}))
            except TransportError:
                assert creds != JOB_A
        finally:
            peer.close()
    expected = b"Bearer token-of-job-a"
    assert seen == [(b"Bearer token-of-job-a", expected), (b"Bearer token-of-job-b", expected),
                    (b"Bearer ", expected)]
    assert a.inbox.pipeline.qsize() == 1
