"""A node learns within seconds that a peer's process is gone: a real Server runs in a child
process, the test process watches it through a Peer, and the child is killed (SIGKILL), stopped
after the watch was told to expect it, or kept busy. A Peer to a killed server closes in seconds,
failing what it had in flight, instead of waiting out its 300 s timeout. A frozen child (SIGSTOP:
silence, as a machine cut off from the network) is reported within seconds too.

Timings are measured and printed; the bounds asserted (15 s) are generous against the 300 s the
old PeerTimeout took, so a loaded machine does not fail them."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ravnest.comm import watching
from ravnest.comm.framing import Frame
from ravnest.comm.transport import Credentials, Peer
from ravnest.comm.watching import PeerWatch
from ravnest.errors import TransportError

ROOT = Path(__file__).resolve().parents[2]
CREDS = Credentials(token="s3cret-token", fingerprint="plan-0123abcd")
BOUND = 15.0
"""Seconds within which a loss must be reported (detection takes about 2-3 s)."""

CHILD = """
import sys, time
from ravnest.comm.transport import Credentials, Server
busy = float(sys.argv[1])
server = Server("127.0.0.1:0", Credentials("s3cret-token", "plan-0123abcd"),
                lambda frame: time.sleep(busy), threads=4)
server.start()
print(server.port, flush=True)
sys.stdin.readline()  # until the test says stop
server.stop(grace=1.0)
"""


class Child:
    """A Server in a child process (its deliver sleeping `busy` seconds per frame), a Peer to it
    and what a PeerWatch of it reported."""

    def __init__(self, busy: float = 0.0) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(ROOT / "worker"), *filter(None, [os.environ.get("PYTHONPATH")])])}
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, str(busy)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        port = int(self.proc.stdout.readline())
        self.peer = Peer(f"127.0.0.1:{port}", CREDS, timeout=300.0)
        self.peer.wait_ready(timeout=60)
        self.lost: list[tuple[str, str, float]] = []
        self.reported = threading.Event()

    def on_lost(self, name: str, reason: str) -> None:
        self.lost.append((name, reason, time.monotonic()))
        self.reported.set()

    def watch(self) -> PeerWatch:
        watch = PeerWatch.started({"stage-1": self.peer}, self.on_lost)
        deadline = time.monotonic() + 30
        while "stage-1" not in watch.seen:
            assert time.monotonic() < deadline, "the watch never saw the peer serving"
            time.sleep(0.05)
        return watch

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("stop\n")
        self.proc.stdin.flush()
        assert self.proc.wait(timeout=30) == 0

    def kill(self) -> float:
        self.proc.kill()
        self.proc.wait(timeout=30)
        return time.monotonic()


@pytest.fixture
def child(request: pytest.FixtureRequest) -> Iterator[Child]:
    c = Child(busy=getattr(request, "param", 0.0))
    try:
        yield c
    finally:
        c.peer.close(timeout=0)
        if c.proc.poll() is None:
            c.proc.kill()
        c.proc.wait(timeout=30)
        for pipe in (c.proc.stdin, c.proc.stdout):
            if pipe is not None:
                pipe.close()


def test_a_killed_peer_is_reported_within_seconds(child: Child) -> None:
    watch = child.watch()
    try:
        killed = child.kill()
        assert child.reported.wait(BOUND), f"no loss reported within {BOUND}s"
        [(name, reason, when)] = child.lost
        print(f"a killed peer was reported lost after {when - killed:.2f}s: {reason}")
        assert name == "stage-1"
        assert f"no answer from {child.peer.address} for" in reason
        assert "since its connection broke" in reason
        assert watch.lost == {"stage-1": reason}
        time.sleep(1.0)
        assert len(child.lost) == 1  # once per peer
    finally:
        watch.stop()


def test_a_frozen_peer_is_reported_within_seconds(child: Child) -> None:
    """SIGSTOP: the peer's process neither answers nor closes anything (its kernel still
    accepts connections), as a machine cut off from the network or frozen. Its watch's pings go
    unanswered, and every Check after that times out instead of being refused."""
    watch = child.watch()
    try:
        os.kill(child.proc.pid, signal.SIGSTOP)
        frozen = time.monotonic()
        assert child.reported.wait(BOUND), f"no loss reported within {BOUND}s"
        [(name, reason, when)] = child.lost
        print(f"a frozen peer was reported lost after {when - frozen:.2f}s: {reason}")
        assert name == "stage-1"
        assert f"no answer from {child.peer.address} for" in reason
        assert "since its connection broke" in reason
        assert "ping timeout" in reason  # its watch's pings went unanswered
        assert watch.lost == {"stage-1": reason}
    finally:
        watch.stop()
        os.kill(child.proc.pid, signal.SIGCONT)


@pytest.mark.parametrize("known_up", [True, False], ids=["known-up", "not-known-up"])
def test_a_peer_gone_before_its_watch_begins_is_lost_only_if_known_up(child: Child,
                                                                      known_up: bool) -> None:
    """A worker watches its peers once they answered its wait: one killed in between (before
    its watch saw it serving) is lost all the same. A peer not known to be up is waited for."""
    child.kill()
    watch = PeerWatch.started({"stage-1": child.peer}, child.on_lost,
                              up={"stage-1"} if known_up else set())
    try:
        if known_up:
            assert child.reported.wait(BOUND), f"no loss reported within {BOUND}s"
            [(name, reason, _)] = child.lost
            assert name == "stage-1" and f"no answer from {child.peer.address}" in reason
        else:
            time.sleep(4.0)  # twice the time a loss takes to be reported
            assert child.lost == []
    finally:
        watch.stop()


def test_a_peer_lost_and_back_is_reported_both_times_with_on_back(child: Child) -> None:
    """A ring's watch (on_back): a peer frozen (a cut) is lost, then back once it answers again,
    and watched on: frozen again, it is lost again."""
    back = threading.Event()
    watch = PeerWatch.started({"stage-1": child.peer}, child.on_lost,
                              on_back=lambda name: back.set())
    try:
        deadline = time.monotonic() + 30
        while "stage-1" not in watch.seen:
            assert time.monotonic() < deadline, "the watch never saw the peer serving"
            time.sleep(0.05)
        for times in (1, 2):
            os.kill(child.proc.pid, signal.SIGSTOP)
            assert child.reported.wait(BOUND), f"loss {times}: none reported within {BOUND}s"
            assert len(child.lost) == times and "stage-1" in watch.lost
            child.reported.clear()
            os.kill(child.proc.pid, signal.SIGCONT)
            assert back.wait(BOUND), f"no return reported within {BOUND}s"
            back.clear()
            assert watch.lost == {}
    finally:
        watch.stop()
        os.kill(child.proc.pid, signal.SIGCONT)


def test_a_peer_restarted_at_its_address_before_it_counts_as_lost_is_lost_and_back(
        child: Child) -> None:
    """A ring's watch with `restarted`: the peer's process is killed and a new server answers at
    its address before the loss would count (here within lost_after, 10 s): asked whether that
    is a restarted process, and it is, the peer is reported lost, then back (no round may wait
    for the killed process)."""
    from ravnest.comm.transport import Server

    back = threading.Event()
    asked: list[str] = []

    def restarted(name: str) -> bool:
        asked.append(name)
        return True

    watch = PeerWatch.started({"stage-1": child.peer}, child.on_lost, lost_after=10.0,
                              on_back=lambda name: back.set(), restarted=restarted)
    server = None
    try:
        deadline = time.monotonic() + 30
        while "stage-1" not in watch.seen:
            assert time.monotonic() < deadline, "the watch never saw the peer serving"
            time.sleep(0.05)
        child.kill()
        server = Server(child.peer.address, CREDS, lambda frame: None, threads=2)
        server.start()
        assert child.reported.wait(BOUND), f"no loss reported within {BOUND}s"
        [(name, reason, _)] = child.lost
        assert name == "stage-1" and asked == ["stage-1"], (name, asked)
        assert "answers again as a restarted process since its connection broke" in reason
        assert back.wait(BOUND), f"no return reported within {BOUND}s"
        assert watch.lost == {}
    finally:
        watch.stop()
        if server is not None:
            server.stop(grace=0)


def test_a_peer_that_was_expected_to_exit_is_not_reported(child: Child) -> None:
    watch = child.watch()
    try:
        watch.expect_exit("stage-1")
        child.stop()
        time.sleep(4.0)  # twice the time a loss takes to be reported
        assert child.lost == []
    finally:
        watch.stop()


def test_a_peer_that_shuts_down_unexpectedly_is_reported(child: Child) -> None:
    watch = child.watch()
    try:
        child.stop()
        assert child.reported.wait(BOUND)
        [(name, reason, _)] = child.lost
        assert name == "stage-1" and "began shutting down" in reason
    finally:
        watch.stop()


def test_nothing_is_reported_after_stop(child: Child) -> None:
    watch = child.watch()
    watch.stop()
    child.kill()
    time.sleep(4.0)
    assert child.lost == []


def test_closing_the_peer_ends_its_watch_without_a_report(child: Child) -> None:
    watch = child.watch()
    try:
        child.peer.close()
        child.kill()
        time.sleep(4.0)
        assert child.lost == []
    finally:
        watch.stop()


@pytest.mark.parametrize("child", [30.0], indirect=True)
def test_a_busy_peer_is_not_reported_but_its_death_is(child: Child,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Every thread of the peer's server is held by a frame it takes 30 s to deliver, and more
    frames wait: the watch says nothing for 10 s (longer than a silent peer takes to be
    reported: its pings are answered), though its stream is renewed every 2 s here and no thread
    of the peer's server is free to serve the new one, then reports the peer once it is
    killed."""
    monkeypatch.setattr(watching, "RENEW_SECONDS", 2.0)
    watch = child.watch()
    try:
        for step in range(8):
            child.peer.post(Frame("forward", {"x": torch.ones(4)}, step=step))
        time.sleep(10.0)
        assert child.lost == []
        child.kill()
        assert child.reported.wait(BOUND)
        assert child.lost[0][0] == "stage-1"
    finally:
        watch.stop()


def _until_not_ready(channel: grpc.Channel) -> None:
    """Until the channel saw its connection break. A frame sent before that goes on the broken
    connection and fails at once (UNAVAILABLE: "Stream removed", sendmsg: broken pipe), as it
    did once beside a CPU-bound run that delayed gRPC's poller after the kill; one sent after it
    waits for the peer (wait_for_ready), which is what is tested here."""
    states: queue.Queue[grpc.ChannelConnectivity] = queue.Queue()
    channel.subscribe(states.put)
    try:
        deadline = time.monotonic() + BOUND
        while states.get(timeout=max(0.0, deadline - time.monotonic())) == \
                grpc.ChannelConnectivity.READY:
            pass
    except queue.Empty:
        raise AssertionError(f"the channel to the killed peer still READY after {BOUND} s") \
            from None
    finally:
        channel.unsubscribe(states.put)


def test_closing_a_peer_whose_server_was_killed_does_not_hang(child: Child) -> None:
    """Frames posted or sent to a killed peer wait for it (wait_for_ready, 300 s timeout) until
    the Peer is closed: then they fail at once, with a TransportError saying so."""
    child.kill()
    _until_not_ready(child.peer.channel)
    child.peer.post(Frame("forward", {"x": torch.ones(4)}, step=1))
    failures: list[BaseException] = []

    def send() -> None:
        try:
            child.peer.send(Frame("forward", {"x": torch.ones(4)}, step=2))
        except TransportError as e:
            failures.append(e)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    time.sleep(0.5)
    started = time.monotonic()
    child.peer.close()
    took = time.monotonic() - started
    print(f"closing a Peer to a killed server took {took:.2f}s")
    assert took < BOUND
    sender.join(timeout=BOUND)
    assert not sender.is_alive()
    assert [str(e) for e in failures] == [
        f"peer {child.peer.address}: the link was closed before the frame was delivered"]
    with pytest.raises(TransportError, match="the link was closed before the frame"):
        child.peer.flush(timeout=BOUND)


def test_a_watch_channel_without_calls_keeps_its_connection(child: Child) -> None:
    """A watch's channel pings every second, with or without a call open on it (between the
    Checks of a peer it asks instead of watching, or while a peer that answers again is asked
    whether it restarted). The peer's server must take those pings: one that counted them as
    abuse dropped the connection ("too_many_pings") 3 s into such a pause, and whatever was asked
    on it next had to connect again."""
    channel = child.peer.watch_channel
    stub = health_pb2_grpc.HealthStub(channel)
    assert stub.Check(health_pb2.HealthCheckRequest(), timeout=BOUND).status == \
        health_pb2.HealthCheckResponse.SERVING
    states: list[grpc.ChannelConnectivity] = []
    channel.subscribe(states.append)
    try:
        time.sleep(6.0)  # six pings, no call
    finally:
        channel.unsubscribe(states.append)
    assert states and set(states) == {grpc.ChannelConnectivity.READY}, states
