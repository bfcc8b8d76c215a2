"""The ring's TCP data plane (training.ringTransport: tcp) on real sockets on 127.0.0.1: only a
peer that proves the job's token and plan is heard, and it must prove the token back; every
malformed connection is dropped without delivering anything, allocating what it declares, or
stopping the server; a lost peer costs a skipped round, not a hang, and the next round connects
again; mutual TLS works and refuses strangers; and a local digits job trains with it, ending
bit-identical to the same job over gRPC."""

from __future__ import annotations

import random
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from ravnest import parse_job
from ravnest.comm.dataplane import (
    _AUTH,
    _HELLO,
    _PIECE,
    MAX_NAME,
    PROTOCOL,
    RingLink,
    RingServer,
    _mac,
)
from ravnest.comm.framing import Frame
from ravnest.comm.identity import PROOF_BYTES
from ravnest.comm.inboxes import Inbox
from ravnest.comm.tls import issue, make_authority
from ravnest.comm.transport import Peer
from ravnest.errors import RavnestError, TransportError
from ravnest.plan.plans import RingPlan
from ravnest.run.local import LocalRun, run_job
from ravnest.run.worker import Worker
from ravnest.train.allreducing import RingReducer

TOKEN, PLAN = "ring-s3cret", "plan-0123abcd"
MAX = 1 << 20


class Served:
    def __init__(self, **kw: object) -> None:
        self.inbox = Inbox()
        self.server = RingServer("127.0.0.1:0", TOKEN, PLAN, self.inbox.deliver,
                                 max_frame_bytes=MAX, inbox=self.inbox,
                                 **kw)  # type: ignore[arg-type]
        self.address = f"127.0.0.1:{self.server.port}"

    def pieces(self) -> list[tuple[str, int, int]]:
        return sorted(self.inbox._ring)


@pytest.fixture
def served() -> Iterator[Served]:
    s = Served()
    s.server.start()
    try:
        yield s
    finally:
        s.server.stop()


def _piece(step: int = 1, phase: int = 0, n: int = 6) -> Frame:
    return Frame("reduce", {"x": torch.arange(float(n))}, step=step, version=phase, ring="ring-a")


def _send(address: str, token: str = TOKEN, plan: str = PLAN, step: int = 1,
          **kw: object) -> None:
    link = RingLink(address, token, plan, "node_1", timeout=10, **kw)  # type: ignore[arg-type]
    try:
        link.post(_piece(step))
        link.flush(10)
    finally:
        link.close()


def test_a_piece_passes_with_the_job_token(served: Served) -> None:
    _send(served.address)
    frame = served.inbox.take_ring("ring-a", 1, 0, timeout=10)
    assert frame.kind == "reduce" and frame.sender == "node_1"
    assert torch.equal(frame.tensors["x"], torch.arange(6.0))


@pytest.mark.parametrize(("token", "plan", "message"), [
    ("wrong-token", PLAN, "missing or wrong job token"),
    (TOKEN, "plan-of-another-job", "plan fingerprint"),
])
def test_a_wrong_token_or_plan_is_refused_and_nothing_is_delivered(served: Served, token: str,
                                                                   plan: str, message: str) -> None:
    with pytest.raises(TransportError, match=message):
        _send(served.address, token=token, plan=plan)
    time.sleep(0.2)
    assert served.pieces() == []
    _send(served.address)  # the server goes on serving the job's peers
    assert served.inbox.take_ring("ring-a", 1, 0, timeout=10)


def test_a_server_that_cannot_prove_the_token_is_not_sent_data() -> None:
    """A listener that greets like a ring server but does not know the token: the link refuses
    to send it anything (it could be anyone on the network)."""
    listener = socket.create_server(("127.0.0.1", 0))
    received = bytearray()

    def impostor() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.sendall(_HELLO.pack(b"RVNH", PROTOCOL, bytes(32)))
            conn.settimeout(5)
            auth = conn.recv(_AUTH.size + 2 * MAX_NAME + PROOF_BYTES)
            conn.sendall(struct.pack("<BH", 0, 0) + bytes(32))  # "ok", with a made-up proof
            try:
                while chunk := conn.recv(1 << 16):
                    received.extend(chunk)
            except OSError:
                pass
            assert auth

    thread = threading.Thread(target=impostor)
    thread.start()
    try:
        with pytest.raises(TransportError, match="did not prove the job token"):
            _send(f"127.0.0.1:{listener.getsockname()[1]}")
    finally:
        thread.join(10)
        listener.close()
    assert bytes(received) == b""


def _handshake(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=10)
    _, _, nonce = _HELLO.unpack(_recv(sock, _HELLO.size))
    mine, fp, name = bytes(range(32)), PLAN.encode(), b"node_9"
    link = struct.pack("<Q", 7)
    sock.sendall(_AUTH.pack(b"RVNH", PROTOCOL, mine,
                            _mac(TOKEN, b"client", nonce, mine, fp, name, link), 7,
                            len(fp), len(name), 0) + fp + name)
    status, _ = struct.unpack("<BH", _recv(sock, 3))
    assert status == 0
    _recv(sock, 32)
    return sock


def _recv(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("closed")
        out += chunk
    return out


def _closed(sock: socket.socket, timeout: float = 10.0) -> bool:
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _valid(head: bytes, ring: bytes) -> bool:
    """The protocol, written out independently of the server's parser."""
    magic, kind, dtype, ring_len, _, _, numel = _PIECE.unpack(head)
    size = {1: 4, 2: 2, 3: 2, 4: 1}.get(dtype, 0)  # (4: uint8, an int8 ring's pieces)
    try:
        ring.decode()
    except UnicodeDecodeError:
        return False
    return (magic == b"RVNP" and kind in (1, 2) and size > 0 and 0 < ring_len <= MAX_NAME
            and numel * size <= MAX)


def test_malformed_pieces_drop_the_connection_and_deliver_nothing(served: Served) -> None:
    """300 seeded cases after a valid handshake: valid pieces with random header fields changed,
    and random bytes. Each is delivered exactly when the protocol says it is valid, with its
    bytes intact; any other closes the connection; the server keeps serving throughout."""
    rng = random.Random(6)
    delivered = refused = 0
    for case in range(300):
        sock = _handshake(served.address)
        try:
            ring = rng.choice([b"ring-a", b"\xff\xfe", b"r" * 300, b"ring-b"])
            fields: list[object] = [b"RVNP", 1, 1, len(ring), case + 1, rng.randrange(9),
                                    rng.choice([0, 1, 5, MAX // 4, MAX // 4 + 1, 2**40, 2**63])]
            field_ = rng.randrange(6)  # the step stays increasing: it is the round
            if field_ < 4:
                fields[field_] = rng.choice([[b"RVNX", b"\0\0\0\0", b"RVNP"], [0, 1, 2, 3, 255],
                                             [0, 1, 2, 3, 4, 5, 255],
                                             [0, 1, 6, 256, 257, 65535]][field_])
            head = _PIECE.pack(*fields) if field_ != 5 else \
                rng.randbytes(4) + _PIECE.pack(*fields)[4:]  # random magic
            ring_len = _PIECE.unpack(head)[3]
            sent_ring = (ring + bytes(ring_len))[:ring_len]
            good = _valid(head, sent_ring)
            _, _, dtype, _, step, phase, numel = _PIECE.unpack(head)
            payload = rng.randbytes(numel * {1: 4, 2: 2, 3: 2, 4: 1}[dtype]) if good else b""
            sock.sendall(head + sent_ring + payload)
            if good:
                frame = served.inbox.take_ring(sent_ring.decode(), step, phase, timeout=10)
                assert frame.tensors["x"].reshape(-1).view(torch.uint8).numpy().tobytes() == \
                    payload
                assert frame.release is not None
                frame.release()
                delivered += 1
            else:
                assert _closed(sock), f"case {case}: a malformed piece left the connection open"
                refused += 1
        finally:
            sock.close()
    assert served.pieces() == []
    assert delivered > 20 and refused > 150  # both outcomes are exercised
    _send(served.address, step=1000)
    assert served.inbox.take_ring("ring-a", 1000, 0, timeout=10)


@pytest.mark.parametrize("junk", [b"", b"GET / HTTP/1.1\r\n\r\n", bytes(200),
                                  b"RVNH\x01" + bytes(78),
                                  b"RVNH\x01" + bytes(72) + b"\xff\xff\xff\xff"])
def test_clients_that_do_not_authenticate_are_dropped(served: Served, junk: bytes) -> None:
    host, port = served.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        _recv(sock, _HELLO.size)
        sock.sendall(junk)
        if len(junk) >= _AUTH.size:  # a whole answer: refused (status, or a reset), closed
            answer = b""
            try:
                while chunk := sock.recv(4096):
                    answer += chunk
            except ConnectionResetError:  # the server closed with junk unread
                answer = answer or b"\x03"
            assert answer[:1] in (b"\x01", b"\x03"), answer
    _send(served.address)
    assert served.inbox.take_ring("ring-a", 1, 0, timeout=10)


def test_a_declared_size_beyond_the_limit_is_refused_without_allocating(served: Served) -> None:
    sock = _handshake(served.address)
    with sock:
        sock.sendall(_PIECE.pack(b"RVNP", 1, 1, 1, 1, 0, 2**62) + b"r")
        assert _closed(sock)
    assert served.pieces() == []


def _ring_of_two(address_of: list[str], inboxes: list[Inbox], timeout: float,
                 tensors: list[torch.Tensor], round_: int, movable: int = 0) -> list[bool]:
    members = ("a", "b")
    ring = RingPlan(id="ring-a", members=members, state=())
    links = [RingLink(address_of[(i + 1) % 2], TOKEN, PLAN, members[i], timeout=timeout)
             for i in range(2)]
    outcome = [False, False]

    def rank(i: int) -> None:
        reducer = RingReducer(ring, members[i], {members[(i + 1) % 2]: links[i]}, inboxes[i],
                              timeout=timeout, piece_bytes=64)
        outcome[i] = reducer.average([tensors[i]], round_, movable)

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank hangs on a lost peer"
    for link in links:
        link.close()
    return outcome


def test_after_an_aborted_round_the_next_one_goes_on_a_new_connection(served: Served) -> None:
    link = RingLink(served.address, TOKEN, PLAN, "node_1", timeout=10)
    try:
        link.post(_piece(step=1))
        link.flush(10)
        link.abort()  # what a skipped round does
        link.post(_piece(step=2))
        link.flush(10)
    finally:
        link.close()
    assert served.inbox.take_ring("ring-a", 2, 0, timeout=10)


def test_an_offered_piece_is_received_into_its_tensor_and_others_into_buffers(
        served: Served) -> None:
    """What the all-gather offers (Inbox.expect) is filled in place, once; a piece of another
    key, or of another dtype (bf16 on the wire), goes to a buffer of its own."""
    offered = torch.full((6,), -1.0)
    served.inbox.expect("ring-a", 1, {0: offered, 2: torch.full((6,), -1.0)})
    link = RingLink(served.address, TOKEN, PLAN, "node_1", timeout=10)
    bf16 = RingLink(served.address, TOKEN, PLAN, "node_1", timeout=10, compression="bf16")
    try:
        for phase in (0, 1):
            link.post(_piece(phase=phase))
        bf16.post(_piece(phase=2))
        link.flush(10)
        bf16.flush(10)
    finally:
        link.close()
        bf16.close()
    landed = served.inbox.take_ring("ring-a", 1, 0, timeout=10)
    assert landed.tensors["x"] is offered and landed.release is None
    assert torch.equal(offered, torch.arange(6.0))
    for phase in (1, 2):
        frame = served.inbox.take_ring("ring-a", 1, phase, timeout=10)
        assert frame.tensors["x"] is not offered and frame.release is not None
        assert torch.equal(frame.tensors["x"].float(), torch.arange(6.0))


def test_a_given_up_round_stops_a_reception_into_its_tensor(served: Served) -> None:
    """A peer stalls halfway through a piece that is being received in place. Giving the round
    up cuts that connection and returns; what the peer sends after that never reaches the
    tensor (the next round may be using it), and the server goes on serving."""
    offered = torch.zeros(1000)
    served.inbox.expect("ring-a", 1, {0: offered})
    sock = _handshake(served.address)
    try:
        payload = torch.ones(1000).numpy().tobytes()
        sock.sendall(_PIECE.pack(b"RVNP", 2, 1, 6, 1, 0, 1000) + b"ring-a" + payload[:2000])
        deadline = time.monotonic() + 10
        while not served.inbox._receiving and time.monotonic() < deadline:
            time.sleep(0.01)
        assert served.inbox._receiving, "the piece was not claimed for its offered tensor"
        started = time.monotonic()
        served.inbox.forget_rounds_before("ring-a", 2)
        assert time.monotonic() - started < 5
        assert not served.inbox._receiving
        snapshot = offered.clone()
        try:
            sock.sendall(payload[2000:])
        except OSError:
            pass  # the server has shut the connection
        assert _closed(sock)
        assert torch.equal(offered, snapshot)
        assert torch.equal(offered[500:], torch.zeros(500))
    finally:
        sock.close()
    assert served.pieces() == []
    with pytest.raises(TransportError, match="no data"):
        served.inbox.take_ring("ring-a", 1, 0, timeout=0.2)
    _send(served.address, step=2)
    assert served.inbox.take_ring("ring-a", 2, 0, timeout=10)


def test_two_links_of_one_node_keep_their_own_connections(served: Served) -> None:
    """Connections are replaced per link, not per node: a second link from the same node (two
    rings to the same successor) leaves the first one's connection alone."""
    links = [RingLink(served.address, TOKEN, PLAN, "node_1", timeout=10) for _ in range(2)]
    try:
        for step in (1, 2, 3):
            for i, link in enumerate(links):
                link.post(_piece(step=step, phase=i))
                link.flush(10)
    finally:
        for link in links:
            link.close()
    assert len([served.inbox.take_ring("ring-a", 3, i, timeout=10) for i in range(2)]) == 2


@pytest.mark.parametrize("movable", [0, 1], ids=["copied", "moved"])
def test_a_lost_peer_skips_the_round_and_the_next_round_completes(movable: int) -> None:
    inboxes = [Inbox(), Inbox()]
    servers = [RingServer("127.0.0.1:0", TOKEN, PLAN, inbox.deliver) for inbox in inboxes]
    for s in servers:
        s.start()
    addresses = [f"127.0.0.1:{s.port}" for s in servers]
    x = [torch.full((100,), 1.0), torch.full((100,), 3.0)]
    try:
        servers[1].stop()  # b's data server is gone: a cannot send, b waits in vain
        start = time.monotonic()
        assert _ring_of_two(addresses, inboxes, 2.0, x, round_=1, movable=movable) == \
            [False, False]
        assert time.monotonic() - start < 30
        assert torch.equal(x[0], torch.full((100,), 1.0))  # a skipped round changes nothing
        assert torch.equal(x[1], torch.full((100,), 3.0))
        port = servers[1].port
        servers[1] = RingServer(f"127.0.0.1:{port}", TOKEN, PLAN, inboxes[1].deliver)
        servers[1].start()  # b is back on the same address
        assert _ring_of_two(addresses, inboxes, 10.0, x, round_=2, movable=movable) == \
            [True, True]
        assert torch.equal(x[0], torch.full((100,), 2.0)) and torch.equal(x[1], x[0])
    finally:
        for s in servers:
            s.stop()


CA, OTHER_CA = make_authority("job-a"), make_authority("job-b")


def test_mutual_tls_carries_pieces_and_refuses_strangers() -> None:
    served = Served(tls=issue(CA, "node_0"))
    served.server.start()
    try:
        _send(served.address, tls=issue(CA, "node_1"), server_name="node-0")
        assert served.inbox.take_ring("ring-a", 1, 0, timeout=10)
        for kw in ({}, {"tls": issue(OTHER_CA, "node_1"), "server_name": "node-0"},
                   {"tls": issue(CA, "node_1"), "server_name": "node-5"}):
            with pytest.raises(TransportError):  # plaintext, another job's CA, the wrong node
                _send(served.address, **kw)
        # a node of the job speaks for itself only: node_2's certificate, naming node_1
        with pytest.raises(TransportError, match="says it is from 'node_1' came over the "
                                                 "connection of 'node-2''s certificate"):
            _send(served.address, tls=issue(CA, "node_2"), server_name="node-0")
        time.sleep(0.2)
        assert served.pieces() == []
    finally:
        served.server.stop()


def test_a_local_job_trains_over_the_data_plane_like_over_grpc(tmp_path, digits_doc) -> None:
    """Digits, 2 clusters x 2 stages, sync, 2 epochs, averaging every update, with TLS: over
    the data plane the job reaches the accuracy and ends bit-identical to the same job over
    gRPC (the ring carries the same values; only the transport differs)."""
    digits_doc["spec"]["providers"] = [{"ram": 2, "bandwidth": 1000, "replicas": 4}]
    digits_doc["spec"]["training"].update(epochs=2, reduceFactor=1)
    digits_doc["spec"]["security"] = {"tls": True}
    models = {}
    for transport in ("grpc", "tcp"):
        digits_doc["spec"]["training"]["ringTransport"] = transport
        out = tmp_path / transport
        summary = run_job(parse_job(digits_doc), out, progress=False)
        assert summary["clusters"] == 2 and summary["nodes"] == 4
        assert summary["val_metric"] >= 0.9, summary
        assert summary["rounds_skipped"] == 0
        models[transport] = torch.load(out / "model.pt", weights_only=True)
        metas = list((out / "nodes").glob("*.json"))
        assert all(("ringAddresses" in m.read_text()) == (transport == "tcp") for m in metas)
    assert models["grpc"].keys() == models["tcp"].keys()
    for name, value in models["grpc"].items():
        assert torch.equal(value, models["tcp"][name]), name


def test_a_worker_of_a_tcp_ring_job_sends_ring_pieces_on_the_data_plane(tmp_path,
                                                                       digits_doc) -> None:
    """The worker wiring: each ring's successor is reached through a RingLink to the address
    the node metadata names, the worker serves its own ring port, and pipeline neighbours stay
    on gRPC."""
    digits_doc["spec"]["providers"] = [{"ram": 2, "bandwidth": 1000, "replicas": 4}]
    digits_doc["spec"]["training"]["ringTransport"] = "tcp"
    run = LocalRun(parse_job(digits_doc), tmp_path, progress=False)
    metas = run.prepare()
    worker = Worker(metas[0], "tok")
    try:
        assert worker.ring_server is not None
        assert f"127.0.0.1:{worker.ring_server.port}" == metas[0].ring_addresses[metas[0].node]
        assert worker.runtime.reducers
        for reducer, _ in worker.runtime.reducers:
            nxt = reducer._next
            assert isinstance(nxt, RingLink)
            successor = reducer.ring.members[(reducer.rank + 1) % reducer.size]
            assert nxt.address == metas[0].ring_addresses[successor]
        assert worker.runtime.up is None or isinstance(worker.runtime.up, Peer)
        assert worker.runtime.down is None or isinstance(worker.runtime.down, Peer)
    finally:
        for link in worker.ring_links.values():
            link.close()
        worker.ring_server.stop()
        for peer in worker.peers.values():
            peer.close()
        worker.server.stop(0)
    bad = replace(metas[0], ring_addresses=None)
    with pytest.raises(RavnestError, match="ringAddresses"):
        Worker(bad, "tok")
