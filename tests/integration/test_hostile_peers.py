"""What callers without the job's token can take from a worker, on real sockets on 127.0.0.1:
health Watch streams held open occupy none of the threads that carry training's frames (more than
a few are refused), and idle or garbage connections to the ring data plane neither keep a real
ring link out nor flood the log."""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ravnest.comm import dataplane, transport
from ravnest.comm.dataplane import RingLink, RingServer
from ravnest.comm.framing import Frame
from ravnest.comm.inboxes import Inbox
from ravnest.comm.transport import Credentials, Peer, Server

CREDS = Credentials(token="s3cret-token", fingerprint="plan-0123abcd")
TOKEN, PLAN = CREDS.token, CREDS.fingerprint
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


# --- the ring data plane


class _Hostile:
    """`n` connections to a ring server from another address (127.0.0.2) that never authenticate:
    of every five, two stay silent, two send the start of an HTTP request and wait, and one sends
    a whole garbage greeting. Each the server closes is opened again at once, for as long as this
    runs."""

    def __init__(self, address: str, n: int) -> None:
        host, port = address.rsplit(":", 1)
        self._target = (host, int(port))
        self.opened = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(n,), daemon=True)
        self._thread.start()

    def _open(self, i: int) -> socket.socket:
        sock = socket.create_connection(self._target, timeout=GENEROUS,
                                        source_address=("127.0.0.2", 0))
        sock.sendall([b"", b"GET / HTTP/1.1\r\n", b"", b"GET / HTTP/1.1\r\n", bytes(200)][i % 5])
        sock.setblocking(False)
        self.opened += 1
        return sock

    def _run(self, n: int) -> None:
        with selectors.DefaultSelector() as selector:
            for i in range(n):
                selector.register(self._open(i), selectors.EVENT_READ, i)
            while not self._stop.is_set():
                for key, _ in selector.select(timeout=0.05):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    try:
                        closed = sock.recv(4096) == b""
                    except OSError:
                        closed = True
                    if closed:
                        selector.unregister(sock)
                        sock.close()
                        selector.register(self._open(key.data), selectors.EVENT_READ, key.data)
            for key in list(selector.get_map().values()):
                key.fileobj.close()  # type: ignore[union-attr]

    def wait_opened(self, at_least: int) -> None:
        deadline = time.monotonic() + GENEROUS
        while self.opened < at_least and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.opened >= at_least, f"only {self.opened} hostile connections opened"

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(GENEROUS)


def test_idle_and_garbage_connections_keep_neither_a_ring_link_out_nor_flood_the_log(
        caplog: pytest.LogCaptureFixture) -> None:
    """100 connections without the token, held and reopened as the server drops them: a real ring
    link still authenticates and its piece arrives, and the server's warnings about them stay a
    line per interval, the last one counting what it did not log."""
    inbox = Inbox()
    server = RingServer("127.0.0.1:0", TOKEN, PLAN, inbox.deliver, inbox=inbox)
    server.start()
    address = f"127.0.0.1:{server.port}"
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="ravnest.comm.dataplane"):
        hostile = _Hostile(address, 100)
        link = RingLink(address, TOKEN, PLAN, "node_1", timeout=GENEROUS)
        try:
            hostile.wait_opened(200)  # all 100 held, and as many dropped and opened again
            link.post(Frame("reduce", {"x": torch.arange(6.0)}, step=1, version=0,
                            ring="ring-a"))
            link.flush(GENEROUS)
            got = inbox.take_ring("ring-a", 1, 0, timeout=GENEROUS)
            assert torch.equal(got.tensors["x"], torch.arange(6.0))
        finally:
            link.close()
            hostile.stop()
            server.stop()
    elapsed = time.monotonic() - started
    lines = [r.getMessage() for r in caplog.records if r.name == "ravnest.comm.dataplane"]
    assert 0 < len(lines) <= 2 + elapsed / dataplane.LOG_SECONDS, lines
    assert "not logged" in lines[-1], lines


def test_a_greeting_dribbled_a_byte_at_a_time_is_cut_at_the_handshake_deadline() -> None:
    """A byte a second never lets a read wait long, but the greeting as a whole has
    HANDSHAKE_SECONDS: the server closes the connection (checked for GENEROUS seconds)."""
    inbox = Inbox()
    server = RingServer("127.0.0.1:0", TOKEN, PLAN, inbox.deliver, inbox=inbox)
    server.start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=GENEROUS) as sock:
            sock.recv(4096)  # the server's greeting
            sock.settimeout(1.0)
            closed, deadline = False, time.monotonic() + GENEROUS
            while not closed and time.monotonic() < deadline:
                try:
                    sock.sendall(b"R")
                    closed = sock.recv(1) == b""
                except TimeoutError:
                    pass
                except OSError:
                    closed = True
            assert closed, f"a dribbled greeting kept its connection for {GENEROUS:.0f}s"
    finally:
        server.stop()
