"""Real gRPC on 127.0.0.1: frames between a Peer and a Server arrive intact, and calls that lack
the token, run another plan or carry malformed frames are refused with a status while the server
keeps serving."""

from __future__ import annotations

import queue
import socket
from collections.abc import Iterator

import grpc
import pytest
import torch
from framing_helpers import encode
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ravnest.comm.framing import Frame
from ravnest.comm.inboxes import Inbox
from ravnest.comm.proto import ravnest_pb2 as pb
from ravnest.comm.proto import ravnest_pb2_grpc as pb_grpc
from ravnest.comm.transport import Credentials, Peer, Server
from ravnest.errors import PeerTimeout, TransportError

CREDS = Credentials(token="s3cret-token", fingerprint="plan-0123abcd")
MAX_FRAME = 4 << 20
TIMEOUT = 10.0


class Served:
    """A started server, its inbox, and what its byte counter saw."""

    def __init__(self) -> None:
        self.inbox = Inbox()
        self.received: list[tuple[str, int]] = []
        self.server = Server("127.0.0.1:0", CREDS, self.inbox.deliver, max_frame_bytes=MAX_FRAME,
                             threads=4, on_bytes=lambda kind, n: self.received.append((kind, n)))
        self.address = f"127.0.0.1:{self.server.port}"

    def next_frame(self) -> Frame:
        return self.inbox.pipeline.get(timeout=TIMEOUT)


@pytest.fixture
def served() -> Iterator[Served]:
    s = Served()
    s.server.start()
    try:
        yield s
    finally:
        s.server.stop(grace=0)


@pytest.fixture
def peer(served: Served) -> Iterator[Peer]:
    p = Peer(served.address, CREDS, timeout=TIMEOUT)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def channel(served: Served) -> Iterator[grpc.Channel]:
    ch = grpc.insecure_channel(served.address)
    try:
        yield ch
    finally:
        ch.close()


@pytest.fixture
def stub(channel: grpc.Channel) -> pb_grpc.PeerStub:
    return pb_grpc.PeerStub(channel)


def raw_send(stub: pb_grpc.PeerStub, chunks: list[pb.Chunk] | Iterator[pb.Chunk],
             metadata: tuple[tuple[str, str], ...] = CREDS.metadata()) -> grpc.RpcError:
    """Send chunks as they are; return the error the server answered with."""
    with pytest.raises(grpc.RpcError) as err:
        stub.Send(iter(chunks), metadata=metadata, timeout=TIMEOUT)
    return err.value


def assert_still_serving(served: Served, peer: Peer) -> None:
    peer.send(Frame("forward", {"x": torch.arange(6.0)}, step=99))
    got = served.next_frame()
    assert got.step == 99 and torch.equal(got.tensors["x"], torch.arange(6.0))
    assert served.inbox.pipeline.empty()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- frames arrive intact


def test_frames_arrive_intact(served: Served, peer: Peer) -> None:
    tensors = {
        "act": torch.randn(8, 3, 16, 16),
        "big": torch.randn((3 << 20) // 4 + 5),
        "ids": torch.randint(0, 1000, (8, 5)),
        "mask": torch.rand(8) > 0.5,
        "empty": torch.empty(0, 7),
        "scalar": torch.tensor(1.5, dtype=torch.float64),
        "half": torch.randn(4, 4).half(),
        "strided": torch.randn(6, 4).t(),
    }
    frame = Frame("forward", tensors, step=3, microbatch=17, version=2, sender="node_0",
                  control={"epoch": 1, "labels": "with microbatch"})
    peer.send(frame)
    got = served.next_frame()
    assert (got.kind, got.step, got.microbatch, got.version, got.sender) == (
        "forward", 3, 17, 2, "node_0")
    assert got.control == {"epoch": 1, "labels": "with microbatch"}
    assert list(got.tensors) == list(tensors)
    for name, tensor in tensors.items():
        assert got.tensors[name].dtype == tensor.dtype
        assert torch.equal(got.tensors[name], tensor), name
    # the server counts wire bytes: the payload with its 64-byte alignment padding
    assert served.received == [("forward", got.wire_bytes)]
    assert frame.nbytes() <= got.wire_bytes < frame.nbytes() + 64 * len(tensors)


def test_large_frames_reuse_receive_buffers_only_once_dropped(served: Served,
                                                                peer: Peer) -> None:
    """Frames of 1 MiB and more land in receive buffers the server hands out again, but only
    once nothing holds the earlier frame: posted back to back over several lanes, with a stage
    still holding some (as it holds its inputs until their backward pass), every frame arrives
    with its own values."""
    numel = (2 << 20) // 4
    held = []
    for wave in range(3):
        for i in range(4 * wave, 4 * wave + 4):
            peer.post(Frame("forward", {"act": torch.full((numel,), float(i))}, microbatch=i))
        peer.flush(timeout=TIMEOUT)
        for i in range(4 * wave, 4 * wave + 4):
            got = served.next_frame()
            assert got.microbatch == i
            assert torch.equal(got.tensors["act"], torch.full((numel,), float(i)))
            if i % 3 == 0:
                held.append((i, got.tensors["act"].view(-1, 4)))
    for i, act in held:
        assert (act == i).all(), f"frame {i} was overwritten"
    assert served.server.buffers.reused > 0
    del held, got, act
    reused = served.server.buffers.reused
    peer.send(Frame("forward", {"act": torch.full((numel,), -1.0)}))
    assert torch.equal(served.next_frame().tensors["act"], torch.full((numel,), -1.0))
    assert served.server.buffers.reused == reused + 1


def test_compressed_frames_arrive_close(served: Served) -> None:
    tensor = torch.randn(1000) * 50
    peer = Peer(served.address, CREDS, compression="bf16", timeout=TIMEOUT)
    try:
        peer.send(Frame("backward", {"grad": tensor}))
        peer.send(Frame("backward", {"grad": tensor}), compression="none")
    finally:
        peer.close()
    compressed, exact = served.next_frame(), served.next_frame()
    torch.testing.assert_close(compressed.tensors["grad"], tensor, rtol=2**-8, atol=0)
    assert torch.equal(exact.tensors["grad"], tensor)


@pytest.mark.parametrize("snapshot", [True, False], ids=["encoded-at-post", "encoded-by-sender"])
def test_posted_frames_keep_their_order(served: Served, peer: Peer, snapshot: bool) -> None:
    sent = []
    for i in range(20):
        sent.append(torch.full((i + 1,), float(i)))
        peer.post(Frame("forward", {"x": sent[-1]}, microbatch=i), snapshot=snapshot)
    peer.flush(timeout=TIMEOUT)
    for i in range(20):
        got = served.next_frame()
        assert got.microbatch == i and torch.equal(got.tensors["x"], sent[i])


def test_small_frames_posted_after_a_large_one_are_taken_after_it() -> None:
    """The small frames go on other sender lanes and reach the server first; the inbox still
    hands them on after the large one."""
    inbox = Inbox(capacity=64)
    arrived: list[int] = []

    def recording(frame: Frame) -> None:
        arrived.append(frame.sequence)
        inbox.deliver(frame)

    server = Server("127.0.0.1:0", CREDS, recording, max_frame_bytes=MAX_FRAME, threads=8)
    server.start()
    peer = Peer(f"127.0.0.1:{server.port}", CREDS, timeout=TIMEOUT)
    try:
        sent = []
        for _ in range(5):
            sent.append(torch.randn(MAX_FRAME // 4 - 4096))
            sent += [torch.full((4,), float(i)) for i in range(4)]
        for i, t in enumerate(sent):
            peer.post(Frame("forward", {"x": t}, microbatch=i), snapshot=False)
        peer.flush(timeout=TIMEOUT)
        for i, t in enumerate(sent):
            got = inbox.pipeline.get(timeout=TIMEOUT)
            assert got.microbatch == i and torch.equal(got.tensors["x"], t)
    finally:
        peer.close()
        server.stop(0)
    assert sorted(arrived) == list(range(1, len(sent) + 1))
    assert arrived != sorted(arrived), "no small frame overtook a large one: nothing was tested"


def test_a_posted_snapshot_is_what_arrives_even_if_the_tensor_changes(served: Served,
                                                                      peer: Peer) -> None:
    x = torch.arange(1000, dtype=torch.float32)
    for i in range(10):
        peer.post(Frame("forward", {"x": x}, microbatch=i))
        x.add_(1000)  # the caller may reuse its tensor as soon as post returns
    peer.flush(timeout=TIMEOUT)
    for i in range(10):
        got = served.next_frame()
        assert torch.equal(got.tensors["x"], torch.arange(1000, dtype=torch.float32) + 1000 * i)


@pytest.mark.parametrize("snapshot", [True, False], ids=["encoded-at-post", "encoded-by-sender"])
def test_a_frame_still_being_filled_is_read_only_once_ready(served: Served, peer: Peer,
                                                            snapshot: bool) -> None:
    """A frame whose tensors and control are still being copied from a device (`Frame.ready`)
    goes out as they are once it returned: the sender waits for it (the sender thread, when not
    encoded at post), once per frame, never the tensors as they were before."""
    calls: list[int] = []
    for i in range(5):
        x = torch.zeros(1000)
        control: dict[str, float] = {}

        def ready(i: int = i, x: torch.Tensor = x, control: dict[str, float] = control) -> None:
            calls.append(i)
            x.fill_(i + 1)  # what the copy from the device would write
            control["loss"] = 0.5 * i

        peer.post(Frame("forward", {"x": x}, microbatch=i, control=control, ready=ready),
                  snapshot=snapshot)
    peer.flush(timeout=TIMEOUT)
    assert calls == list(range(5))
    for i in range(5):
        got = served.next_frame()
        assert torch.equal(got.tensors["x"], torch.full((1000,), float(i + 1)))
        assert got.control == {"loss": 0.5 * i}


@pytest.mark.parametrize("snapshot", [True, False], ids=["encoded-at-post", "encoded-by-sender"])
def test_a_frame_that_cannot_be_sent_is_refused_by_post(served: Served, peer: Peer,
                                                        snapshot: bool) -> None:
    with pytest.raises(TransportError, match=r"'x': dtype torch\.complex64 cannot be sent"):
        peer.post(Frame("forward", {"x": torch.zeros(2, dtype=torch.complex64)}),
                  snapshot=snapshot)
    peer.post(Frame("forward", {"x": torch.ones(2)}), snapshot=snapshot)  # the order still holds
    peer.flush(timeout=TIMEOUT)
    assert torch.equal(served.next_frame().tensors["x"], torch.ones(2))


def test_ring_frames_are_keyed_for_their_step(served: Served, peer: Peer) -> None:
    for phase in (1, 0):
        peer.send(Frame("reduce", {"p": torch.full((3,), float(phase))}, step=5, version=phase,
                        ring="ring-a", sender="node_1"))
    first = served.inbox.take_ring("ring-a", 5, 0, timeout=TIMEOUT)
    second = served.inbox.take_ring("ring-a", 5, 1, timeout=TIMEOUT)
    assert torch.equal(first.tensors["p"], torch.zeros(3))
    assert torch.equal(second.tensors["p"], torch.ones(3))
    assert served.inbox.pipeline.empty()


# --- authentication and plan


@pytest.mark.parametrize("metadata", [
    (),
    (("x-ravnest-plan", CREDS.fingerprint),),
    (("authorization", "Bearer wrong-token"), ("x-ravnest-plan", CREDS.fingerprint)),
    (("authorization", CREDS.token), ("x-ravnest-plan", CREDS.fingerprint)),
    (("authorization", f"Bearer {CREDS.token}x"), ("x-ravnest-plan", CREDS.fingerprint)),
], ids=["nothing", "no-token", "wrong-token", "no-bearer", "token-prefix"])
def test_a_call_without_the_token_is_unauthenticated(served: Served, peer: Peer,
                                                     stub: pb_grpc.PeerStub,
                                                     metadata: tuple[tuple[str, str], ...]) -> None:
    chunks = list(encode(Frame("forward", {"x": torch.ones(3)})))
    err = raw_send(stub, chunks, metadata)
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    assert err.details() == "missing or wrong job token"
    assert served.inbox.pipeline.empty() and served.received == []
    assert_still_serving(served, peer)


@pytest.mark.parametrize("metadata", [
    (("authorization", f"Bearer {CREDS.token}"),),
    (("authorization", f"Bearer {CREDS.token}"), ("x-ravnest-plan", "plan-other")),
], ids=["no-fingerprint", "other-fingerprint"])
def test_a_call_from_another_plan_fails_its_precondition(
        served: Served, peer: Peer, stub: pb_grpc.PeerStub,
        metadata: tuple[tuple[str, str], ...]) -> None:
    err = raw_send(stub, list(encode(Frame("forward", {"x": torch.ones(3)}))), metadata)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.details() == "peer runs a different plan (fingerprint mismatch)"
    assert served.inbox.pipeline.empty()
    assert_still_serving(served, peer)


def test_a_peer_with_the_wrong_token_gets_a_transport_error(served: Served, peer: Peer) -> None:
    intruder = Peer(served.address, Credentials("guess", CREDS.fingerprint), timeout=TIMEOUT)
    try:
        with pytest.raises(TransportError, match="UNAUTHENTICATED") as err:
            intruder.send(Frame("forward", {"x": torch.ones(2)}))
        assert isinstance(err.value.__cause__, grpc.RpcError)
        assert err.value.__cause__.code() == grpc.StatusCode.UNAUTHENTICATED
        intruder.post(Frame("forward", {"x": torch.ones(2)}))
        with pytest.raises(TransportError, match="UNAUTHENTICATED"):
            intruder.flush(timeout=TIMEOUT)
        intruder.flush(timeout=TIMEOUT)
    finally:
        intruder.close()
    assert_still_serving(served, peer)


def test_a_peer_running_another_plan_gets_a_transport_error(served: Served) -> None:
    other = Peer(served.address, Credentials(CREDS.token, "plan-other"), timeout=TIMEOUT)
    try:
        with pytest.raises(TransportError, match="FAILED_PRECONDITION"):
            other.send(Frame("forward", {"x": torch.ones(2)}))
    finally:
        other.close()


# --- malformed frames


def _header(data: bytes = b"", **fields: object) -> pb.Chunk:
    fields.setdefault("kind", "forward")
    return pb.Chunk(header=pb.FrameHeader(**fields), data=data)  # type: ignore[arg-type]


def _meta(**fields: object) -> pb.TensorMeta:
    fields = {"name": "x", "dtype": "float32", "shape": [4], "offset": 0, **fields}
    return pb.TensorMeta(**fields)  # type: ignore[arg-type]


def _valid(n: int = 40) -> list[pb.Chunk]:
    return list(encode(Frame("forward", {"x": torch.arange(float(n))}), chunk_bytes=64))


def _flood() -> Iterator[pb.Chunk]:
    yield _header(bytes(64), payload_bytes=64, tensors=[_meta()])
    for _ in range(64):
        yield pb.Chunk(data=bytes(1 << 20))


MALFORMED = [
    ("empty-stream", lambda: [], "frame has no header"),
    ("no-header", lambda: [pb.Chunk(data=bytes(64))], "frame has no header"),
    ("unknown-dtype", lambda: [_header(bytes(64), payload_bytes=64,
                                       tensors=[_meta(dtype="float128")])],
     "tensor 'x': unknown dtype 'float128'/''"),
    ("negative-dim", lambda: [_header(bytes(64), payload_bytes=64,
                                      tensors=[_meta(shape=[2, -2])])],
     r"tensor 'x': invalid shape [2, -2]"),
    ("offset-out-of-range", lambda: [_header(bytes(64), payload_bytes=64,
                                             tensors=[_meta(offset=128)])],
     "tensor 'x': 16 bytes at offset 128 do not fit a 64-byte payload"),
    ("truncated", lambda: _valid()[:-1], "frame payload truncated: 128 of 192 bytes"),
    ("excess", lambda: [*_valid(), pb.Chunk(data=b"\x01")],
     "frame payload exceeds its declared 192 bytes"),
    ("excess-flood", _flood, "frame payload exceeds its declared 64 bytes"),
    ("non-json-control", lambda: [_header(control="{oops")], "frame control is not JSON"),
    ("control-not-object", lambda: [_header(control="[1]")],
     "frame control must be a JSON object"),
    ("unknown-kind", lambda: [_header(kind="gossip")],
     "frame rejected: unknown frame kind 'gossip'"),
    ("declared-terabyte", lambda: [_header(b"tiny", payload_bytes=1 << 40,
                                           tensors=[_meta(shape=[1 << 38])])],
     f"frame of 1099511627776 bytes refused (limit {MAX_FRAME} bytes)"),
    ("over-server-limit",
     lambda: list(encode(Frame("forward", {"x": torch.ones(MAX_FRAME // 4 + 1)}))),
     f"frame of {MAX_FRAME + 64} bytes refused (limit {MAX_FRAME} bytes)"),
]


@pytest.mark.parametrize(("make", "details"), [m[1:] for m in MALFORMED],
                         ids=[m[0] for m in MALFORMED])
def test_malformed_frames_are_invalid_and_the_server_keeps_serving(
        served: Served, peer: Peer, stub: pb_grpc.PeerStub, make, details: str) -> None:
    err = raw_send(stub, make())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert details in err.details()
    assert served.inbox.pipeline.empty() and served.received == []
    assert_still_serving(served, peer)


def test_many_bad_calls_in_a_row_do_not_wear_the_server_down(served: Served, peer: Peer,
                                                            stub: pb_grpc.PeerStub) -> None:
    for i in range(30):
        chunks = [_header(bytes(64), payload_bytes=64, tensors=[_meta(dtype=f"bad{i}")])]
        assert raw_send(stub, chunks).code() == grpc.StatusCode.INVALID_ARGUMENT
    assert_still_serving(served, peer)


def test_a_valid_raw_stream_is_accepted(served: Served, stub: pb_grpc.PeerStub) -> None:
    ack = stub.Send(iter(_valid()), metadata=CREDS.metadata(), timeout=TIMEOUT)
    assert ack.received_bytes == 192  # 160 bytes of float32 padded to the 64-byte alignment
    assert torch.equal(served.next_frame().tensors["x"], torch.arange(40.0))


# --- health and readiness


def test_health_reports_serving_without_a_token(served: Served, channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    reply = health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_peer_waits_until_the_server_is_ready(served: Served, peer: Peer) -> None:
    peer.wait_ready(timeout=TIMEOUT)


def test_a_peer_with_nobody_listening_times_out() -> None:
    port = free_port()
    lonely = Peer(f"127.0.0.1:{port}", CREDS, timeout=0.5)
    try:
        with pytest.raises(PeerTimeout, match=f"peer 127.0.0.1:{port} did not answer within"):
            lonely.send(Frame("forward", {"x": torch.ones(1)}))
        with pytest.raises(PeerTimeout, match="not ready within"):
            lonely.wait_ready(timeout=0.5)
    finally:
        lonely.close()


def test_a_stopped_server_no_longer_takes_frames() -> None:
    s = Served()
    s.server.start()
    p = Peer(s.address, CREDS, timeout=1.0)
    try:
        p.send(Frame("forward", {"x": torch.ones(1)}))
        assert s.next_frame().tensors["x"].item() == 1.0
        s.server.stop(grace=0)
        with pytest.raises(TransportError):
            p.send(Frame("forward", {"x": torch.ones(1)}))
    finally:
        p.close()
        s.server.stop(grace=0)
    with pytest.raises(queue.Empty):
        s.inbox.pipeline.get_nowait()
