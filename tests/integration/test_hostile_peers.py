"""What callers without the job's token can take from a worker, on real sockets on 127.0.0.1:
health Watch streams held open occupy none of the threads that carry training's frames (more than
a few are refused), and idle or garbage connections to the ring data plane neither keep a real
ring link out nor flood the log."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ravnest.comm import transport
from ravnest.comm.framing import Frame
from ravnest.comm.inboxes import Inbox
from ravnest.comm.transport import Credentials, Peer, Server

CREDS = Credentials(token="s3cret-token", fingerprint="plan-0123abcd")
GENEROUS = 30.0
"""Seconds a step that takes milliseconds may take on a loaded machine before it counts as stuck."""


class _Watching:
    """`n` health Watch streams without a token, each read in a thread of its own: what each
    first got (a status, or the error code it was refused with)."""

    def __init__(self, address: str, n: int) -> None:
        self._channel = grpc.insecure_channel(address)
        stub = health_pb2_grpc.HealthStub(self._channel)
        self.calls = [stub.Watch(health_pb2.HealthCheckRequest()) for _ in range(n)]
        self.first: list[object] = [None] * n
        self._threads = [threading.Thread(target=self._read, args=(i,), daemon=True)
                         for i in range(n)]
        for thread in self._threads:
            thread.start()

    def _read(self, i: int) -> None:
        try:
            for reply in self.calls[i]:
                if self.first[i] is None:
                    self.first[i] = reply.status
        except grpc.RpcError as e:
            if self.first[i] is None:
                self.first[i] = e.code()

    def wait_answered(self, at_least: int) -> int:
        """Wait (bounded) until `at_least` streams got an answer; return how many did."""
        deadline = time.monotonic() + GENEROUS
        while time.monotonic() < deadline:
            answered = sum(first is not None for first in self.first)
            if answered >= at_least:
                return answered
            time.sleep(0.05)
        return sum(first is not None for first in self.first)

    def close(self) -> None:
        for call in self.calls:
            call.cancel()
        for thread in self._threads:
            thread.join(GENEROUS)
        self._channel.close()


@pytest.fixture
def served() -> Iterator[tuple[Server, Inbox, str]]:
    inbox = Inbox()
    server = Server("127.0.0.1:0", CREDS, inbox.deliver, threads=4)
    server.start()
    try:
        yield server, inbox, f"127.0.0.1:{server.port}"
    finally:
        server.stop(grace=0)


def _check(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return int(health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=GENEROUS).status)


# --- health Watch


def test_held_health_watches_leave_frames_and_checks_flowing(
        served: tuple[Server, Inbox, str]) -> None:
    """40 Watch streams against a server of 4 threads: the first few are served, the rest are
    refused with RESOURCE_EXHAUSTED, and while they are held a peer's frame still arrives and
    Check still answers. Once they close, a new Watch is served again."""
    _, inbox, address = served
    watching = _Watching(address, 40)
    peer = Peer(address, CREDS, timeout=GENEROUS)
    try:
        assert watching.wait_answered(4) >= 4  # as many as the server has threads, at least
        peer.send(Frame("forward", {"x": torch.arange(6.0)}, step=7))
        got = inbox.pipeline.get(timeout=GENEROUS)
        assert got.step == 7 and torch.equal(got.tensors["x"], torch.arange(6.0))
        assert _check(address) == health_pb2.HealthCheckResponse.SERVING
        assert watching.wait_answered(40) == 40
        serving = watching.first.count(health_pb2.HealthCheckResponse.SERVING)
        refused = watching.first.count(grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert (serving, refused) == (transport.MAX_HEALTH_WATCHES,
                                40 - transport.MAX_HEALTH_WATCHES)
    finally:
        watching.close()
        peer.close()
    again = _Watching(address, 1)
    try:
        assert again.wait_answered(1) == 1
        assert again.first == [health_pb2.HealthCheckResponse.SERVING]
    finally:
        again.close()
