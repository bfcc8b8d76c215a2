"""The ring's bulk data plane (``training.ringTransport: tcp``): ring pieces as raw bytes on one
authenticated TCP connection per ring neighbour, beside the gRPC server that keeps everything else.

Why: on a few CPU cores the ring over grpc-python is bound by its per-byte work (a copy into a
message, a copy into the C core's slices, a copy out into Python bytes and one more into the
frame) and runs at a third of gloo's speed; a socket written straight from the tensor and read
with ``recv_into`` straight into the receiving tensor does two kernel copies and nothing else.

Security is the gRPC transport's: nothing is read from a connection before it proves the job's
token, and the server proves it back. Connections that have not proved it yet get a small budget
(`MAX_UNAUTHENTICATED`, a newcomer beyond it displacing the oldest of the address holding the
most) and `HANDSHAKE_SECONDS` in all, and what they do is logged a line per `LOG_SECONDS`.

1. server → client: ``RVNH``, protocol version, a 32-byte random nonce;
2. client → server: ``RVNH``, version, its own nonce, HMAC-SHA256(token, "client" ‖ both nonces ‖
   plan fingerprint ‖ sender ‖ link id), its link's random id, then the fingerprint, its node
   name and its proof of being that node (identity.py: its key and certificate and its signature
   over both nonces, the fingerprint, its name, the server's node and the link id; a server
   with an identity refuses a connection without a good one). A link that connects again
   replaces its older connection, which a cut may have left looking open here;
3. server → client: status 0 and HMAC-SHA256(token, "server" ‖ both nonces ‖ fingerprint), or a
   non-zero status and a reason (a wrong plan fingerprint and a wrong token are told apart, as
   FAILED_PRECONDITION and UNAUTHENTICATED are on gRPC), after which the server closes.

With TLS material the socket is wrapped in mutual TLS first (the same CA and node certificates as
gRPC), so the token never meets an unencrypted byte. After the handshake every piece is a fixed
header (``RVNP``, kind, wire dtype, ring id length, round, phase step, element count), the ring id
and the raw bytes. Every field is checked before anything is allocated; a connection that breaks
the protocol is logged and closed, and the server goes on serving. Pieces are delivered to the
worker's Inbox exactly like the gRPC ones, so timeouts, skipped rounds and late pieces behave the
same on both transports.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import queue
import secrets
import socket
import ssl
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ravnest.comm.buffers import BufferPool
from ravnest.comm.framing import COMPRESSIONS, DEFAULT_MAX_FRAME_BYTES, Frame, to_wire
from ravnest.comm.identity import PROOF_BYTES, NodeIdentity
from ravnest.comm.inboxes import Inbox
from ravnest.comm.tls import TlsMaterial
from ravnest.comm.transport import listen_error, sender_problem
from ravnest.errors import PeerTimeout, TransportError, shown

log = logging.getLogger(__name__)

PROTOCOL = 2
_HELLO = struct.Struct("<4sB32s")
"""Server's greeting: magic, protocol version, server nonce."""
_AUTH = struct.Struct("<4sB32s32sQHHH")
"""Client's answer: magic, version, client nonce, MAC, link id, fingerprint and sender lengths."""
_PIECE = struct.Struct("<4sBBHQQQ")
"""A piece: magic, kind, wire dtype, ring id length, round, phase step, element count."""
_HELLO_MAGIC, _PIECE_MAGIC = b"RVNH", b"RVNP"
KINDS = {1: "reduce", 2: "gather"}
_KIND_CODES = {v: k for k, v in KINDS.items()}
WIRE_DTYPES = {1: torch.float32, 2: torch.bfloat16, 3: torch.float16, 4: torch.uint8}
"""What a piece may be (uint8: an int8 ring's pieces, train/allreducing.py)."""
_DTYPE_CODES = {v: k for k, v in WIRE_DTYPES.items()}
MAX_NAME = 256
"""Longest ring id, node name or fingerprint (bytes) a peer may send."""
HANDSHAKE_SECONDS = 5.0
"""A connection that has not authenticated within this (in all, however it dribbles) is closed;
a ring neighbour needs one round trip."""
MAX_CONNECTIONS = 64
"""Connections a server holds at once (authenticated or not); more are closed at once."""
MAX_UNAUTHENTICATED = 16
"""Connections a server holds at once that have not authenticated yet. A new one beyond this
closes the oldest of the address that holds the most, so strangers holding connections open only
displace each other, never a ring neighbour connecting from an address of its own."""
LOG_SECONDS = 10.0
"""Unauthenticated connections refused, dropped or failing their greeting are logged at most once
in this many seconds; the next line (or the server's stop) says how many were not."""
POOL_BYTES = 32 << 20
"""Bytes of receive buffers a server keeps for reuse (a `BufferPool`): a fresh 4 MiB buffer costs
~1.5 ms of page faults here, more than receiving into it, so pieces land in recycled buffers."""
OK, UNAUTHENTICATED, WRONG_PLAN, BAD_HELLO = 0, 1, 2, 3


class ProtocolError(TransportError):
    """A peer broke the data plane's protocol (or failed to authenticate)."""


class _Throttled:
    """A warning at most once per `interval` seconds, each saying how many were not logged since
    the one before: what strangers do to a server costs a few lines a minute, not a line each."""

    def __init__(self, interval: float) -> None:
        self._interval = interval
        self._last = -interval
        self._unlogged = 0
        self._lock = threading.Lock()

    def warning(self, message: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last < self._interval:
                self._unlogged += 1
                return
            unlogged, self._unlogged, self._last = self._unlogged, 0, now
        if unlogged:
            log.warning(message + " (and %d more like it, not logged)", *args, unlogged)
        else:
            log.warning(message, *args)

    def flush(self) -> None:
        """Log how many were not logged since the last line, if any."""
        with self._lock:
            unlogged, self._unlogged = self._unlogged, 0
        if unlogged:
            log.warning("ring data: %d more connections that did not authenticate were "
                        "dropped or refused, not logged", unlogged)


@dataclass
class _Pending:
    """A connection that has not authenticated yet: its socket (the TLS one once wrapped), the
    address it came from and when it was accepted."""

    sock: socket.socket
    source: str
    since: float
    dropped: bool = False


def _mac(token: str, role: bytes, *parts: bytes) -> bytes:
    h = hmac.new(token.encode(), role, hashlib.sha256)
    for part in parts:
        h.update(struct.pack("<I", len(part)))
        h.update(part)
    return h.digest()


def _ring_parts(server_nonce: bytes, client_nonce: bytes, fingerprint: bytes, sender: bytes,
                recipient: str, link: int) -> tuple[bytes, ...]:
    """What a connecting node signs (identity.py): this connection's handshake, to this server."""
    return (b"ravnest-ring", server_nonce, client_nonce, fingerprint, sender, recipient.encode(),
            struct.pack("<Q", link))


def _raw(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous tensor, without a copy (numpy has no bfloat16: go via uint8)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """`n` bytes; with a `deadline` (time.monotonic) all of them by then, or TimeoutError."""
    buf = bytearray(n)
    if deadline is None:
        _recv_into(sock, memoryview(buf))
        return bytes(buf)
    view, got = memoryview(buf), 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        sock.settimeout(left)
        got += _recv_some(sock, view[got:])
    return bytes(buf)


def _recv_some(sock: socket.socket, view: memoryview) -> int:
    n = sock.recv_into(view)
    if n == 0:
        raise ConnectionError("connection closed")
    return n


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        got += _recv_some(sock, view[got:])


def _cut(sock: socket.socket) -> None:
    """Make every blocked read and write on `sock` fail at once (the owner closes it)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _keepalive(sock: socket.socket) -> None:
    """Probe an idle connection after 30 s, 3 times 10 s apart: a peer gone without a word (a
    cut, a killed pod) is noticed in about a minute instead of the kernel's two hours."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def _common_name(cert: Any) -> str:
    """The common name of a peer's certificate as `ssl` gives it (its node's identity)."""
    for rdn in (cert or {}).get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return ""


def _tls_context(tls: TlsMaterial, server: bool) -> ssl.SSLContext:
    """Mutual TLS with the job's CA: each side shows its node certificate and checks the other's."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_verify_locations(cadata=tls.ca.decode())
    ctx.verify_mode = ssl.CERT_REQUIRED
    # ssl loads a key pair only from files: a private folder, removed at once
    with tempfile.TemporaryDirectory(prefix="ravnest-tls-") as d:
        cert, key = os.path.join(d, "tls.crt"), os.path.join(d, "tls.key")
        with open(cert, "wb") as f:
            f.write(tls.cert)
        with open(os.open(key, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
            f.write(tls.key)
        ctx.load_cert_chain(cert, key)
    return ctx


class RingServer:
    """Accepts ring neighbours' connections and delivers their pieces (see the module doc).

    Given `inbox` (the one `deliver` feeds), a piece whose tensor a ring step offered there
    (`Inbox.expect`: the all-gather's pieces) is received straight into that tensor."""

    def __init__(self, address: str, token: str, fingerprint: str,
                 deliver: Callable[[Frame], None],
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 on_bytes: Callable[[str, int], None] | None = None,
                 tls: TlsMaterial | None = None, max_connections: int = MAX_CONNECTIONS,
                 inbox: Inbox | None = None,
                 max_unauthenticated: int = MAX_UNAUTHENTICATED,
                 identity: NodeIdentity | None = None) -> None:
        """`identity`: this node's; a connecting node must then prove it is the node it names."""
        host, _, port = address.rpartition(":")
        self._token, self._fingerprint = token, fingerprint
        self._me = identity.node if identity else ""
        self._verifier = identity.verifier() if identity else None
        self._deliver, self._max, self._on_bytes = deliver, max_frame_bytes, on_bytes
        self._inbox = inbox
        self._tls = _tls_context(tls, server=True) if tls else None
        self._max_connections, self._max_unauthenticated = max_connections, max_unauthenticated
        self._conns: set[socket.socket] = set()
        self._pending: list[_Pending] = []
        """Connections not authenticated yet, oldest first."""
        self._strangers = _Throttled(LOG_SECONDS)
        self._lock = threading.Lock()
        self._by_link: dict[tuple[str, int], socket.socket] = {}
        self._buffers = BufferPool(max_bytes=POOL_BYTES, min_bytes=1)
        """Receive buffers of pieces, given back by the frame's `release`."""
        self._closed = False
        try:
            self._sock = socket.create_server((host.strip("[]") or "0.0.0.0", int(port)),
                                              reuse_port=False, backlog=64)
        except OSError as e:
            raise listen_error(address, e, " for ring data") from e
        except ValueError as e:
            raise TransportError(f"cannot listen on {address} for ring data: {e}") from e
        self.port = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, daemon=True, name="ring-accept")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        _cut(self._sock)  # wakes the accept (close alone does not)
        self._sock.close()
        for conn in conns:
            _cut(conn)
        if self._thread.ident is not None:  # started
            self._thread.join(timeout=5)
        self._strangers.flush()

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed or len(self._conns) >= self._max_connections:
                    self._strangers.warning("ring data: refusing a connection from %s (%d open)",
                                            peer[0], len(self._conns))
                    conn.close()
                    continue
                dropped = self._make_room()
                pending = _Pending(conn, peer[0], time.monotonic())
                self._pending.append(pending)
                self._conns.add(conn)
            if dropped is not None:
                _cut(dropped.sock)
                self._strangers.warning(
                    "ring data: dropped a connection from %s that had not authenticated in "
                    "%.1fs, to make room (%d unauthenticated at most)", dropped.source,
                    pending.since - dropped.since, self._max_unauthenticated)
            threading.Thread(target=self._serve, args=(pending, f"{peer[0]}:{peer[1]}"),
                             daemon=True, name="ring-conn").start()

    def _make_room(self) -> _Pending | None:
        """With the lock held and the unauthenticated budget spent: take out (to be cut) the
        oldest pending connection of the address that holds the most."""
        if len(self._pending) < self._max_unauthenticated:
            return None
        held: dict[str, int] = {}
        for p in self._pending:
            held[p.source] = held.get(p.source, 0) + 1
        most = max(held.values())
        dropped = next(p for p in self._pending if held[p.source] == most)
        self._pending.remove(dropped)
        dropped.dropped = True
        return dropped

    def _serve(self, pending: _Pending, peer: str) -> None:
        conn = sock = pending.sock
        sender, link = "", 0
        try:
            sock, sender, link = self._authenticate(pending)
            with self._lock:
                # a sender reconnects after a failure (a cut, a timeout): its old connection may
                # still look open here, with a reader waiting on it forever; close it
                stale, self._by_link[sender, link] = self._by_link.get((sender, link)), sock
            if stale is not None:
                _cut(stale)
            while True:
                self._receive(sock, sender)
        except ConnectionError:
            pass  # the peer closed (between pieces, or mid-piece: that piece is lost)
        except (ProtocolError, ssl.SSLError, OSError) as e:
            if self._closed or pending.dropped:
                pass
            elif not sender:
                self._strangers.warning("ring data from %s refused: %s", peer, e)
            else:
                log.warning("ring data from %s (%s) refused: %s", peer, sender, e)
        finally:
            sock = pending.sock  # the TLS one, where a failed handshake left it wrapped
            with self._lock:
                if pending in self._pending:
                    self._pending.remove(pending)
                self._conns.discard(conn)
                self._conns.discard(sock)
                if self._by_link.get((sender, link)) is sock:
                    del self._by_link[sender, link]
            sock.close()

    def _authenticate(self, pending: _Pending) -> tuple[socket.socket, str, int]:
        """The handshake of a pending connection, all of it within HANDSHAKE_SECONDS: its socket
        (wrapped in TLS where the server has it), the sender's node name and link id. It leaves
        the pending ones before it is told OK, or fails if it was dropped to make room."""
        deadline = pending.since + HANDSHAKE_SECONDS
        conn = sock = pending.sock
        _keepalive(conn)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.settimeout(HANDSHAKE_SECONDS)
        if self._tls is not None:
            sock = self._tls.wrap_socket(conn, server_side=True,  # takes over conn's fd
                                         do_handshake_on_connect=False)
            with self._lock:
                self._conns.discard(conn)
                self._conns.add(sock)
                pending.sock = sock  # what a drop cuts from now on
            if pending.dropped:
                raise ConnectionError("dropped to make room")
            sock.do_handshake()
        sender, link = self._handshake(sock, deadline, lambda: self._admit(pending))
        sock.settimeout(None)
        return sock, sender, link

    def _admit(self, pending: _Pending) -> None:
        """A connection proved the token: it no longer counts against the unauthenticated."""
        with self._lock:
            if pending.dropped:
                raise ConnectionError("dropped to make room")
            self._pending.remove(pending)

    def _handshake(self, sock: socket.socket, deadline: float,
                   admit: Callable[[], None]) -> tuple[str, int]:
        """Authenticate a new connection by `deadline`: the sender's node name and link id.
        `admit` is called once it proved the token and plan, before it is told so."""
        nonce = secrets.token_bytes(32)
        sock.sendall(_HELLO.pack(_HELLO_MAGIC, PROTOCOL, nonce))
        magic, version, their_nonce, mac, link, fp_len, name_len, proof_len = _AUTH.unpack(
            _recv_exact(sock, _AUTH.size, deadline))

        def refuse(status: int, reason: str) -> ProtocolError:
            text = reason.encode()[:1024]
            try:
                sock.sendall(struct.pack("<BH", status, len(text)) + text)
            except OSError:
                pass
            return ProtocolError(reason)

        if magic != _HELLO_MAGIC or version != PROTOCOL:
            raise refuse(BAD_HELLO, f"not a ravnest ring connection (protocol {version})")
        if fp_len > MAX_NAME or name_len > MAX_NAME or proof_len > PROOF_BYTES:
            raise refuse(BAD_HELLO, "fingerprint, node name or proof too long")
        fingerprint = _recv_exact(sock, fp_len, deadline)
        sender = _recv_exact(sock, name_len, deadline)
        proof = _recv_exact(sock, proof_len, deadline)
        want = _mac(self._token, b"client", nonce, their_nonce, fingerprint, sender,
                    struct.pack("<Q", link))
        if not hmac.compare_digest(mac, want):
            raise refuse(UNAUTHENTICATED, "missing or wrong job token")
        if fingerprint != self._fingerprint.encode():
            theirs = shown(fingerprint.decode(errors="replace"))
            raise refuse(WRONG_PLAN, f"plan fingerprint {theirs} is not this job's "
                                     f"({self._fingerprint})")
        try:
            name = sender.decode()
        except UnicodeDecodeError as e:
            raise refuse(BAD_HELLO, "node name is not UTF-8") from e
        if self._verifier is not None:
            problem = self._verifier.check(
                name, proof, *_ring_parts(nonce, their_nonce, fingerprint, sender, self._me,
                                          link))
            if problem:
                raise refuse(UNAUTHENTICATED, problem)
        if isinstance(sock, ssl.SSLSocket):
            problem = sender_problem(name, _common_name(sock.getpeercert()))
            if problem:
                raise refuse(UNAUTHENTICATED, problem)
        admit()
        sock.sendall(struct.pack("<BH", OK, 0) +
                     _mac(self._token, b"server", nonce, their_nonce, fingerprint))
        return name, link

    def _receive(self, sock: socket.socket, sender: str) -> None:
        head = bytearray(_PIECE.size)
        view = memoryview(head)
        got = sock.recv_into(view)  # waiting between pieces (and rounds) is not an error
        if got == 0:
            raise ConnectionError("connection closed")
        _recv_into(sock, view[got:])
        magic, kind, dtype, ring_len, round_, phase, numel = _PIECE.unpack(head)
        if magic != _PIECE_MAGIC:
            raise ProtocolError("bad piece header")
        if kind not in KINDS or dtype not in WIRE_DTYPES:
            raise ProtocolError(f"unknown piece kind {kind} or wire dtype {dtype}")
        if not 0 < ring_len <= MAX_NAME:
            raise ProtocolError(f"ring id of {ring_len} bytes")
        wire = WIRE_DTYPES[dtype]
        nbytes = numel * wire.itemsize
        if nbytes > self._max:
            raise ProtocolError(f"piece of {nbytes} bytes is over the limit of {self._max}")
        try:
            ring = _recv_exact(sock, ring_len).decode()
        except UnicodeDecodeError as e:
            raise ProtocolError("ring id is not UTF-8") from e
        inbox, landing = self._inbox, None
        if inbox is not None:
            landing = inbox.claim(ring, round_, phase, wire, numel, lambda: _cut(sock))
        release: Callable[[], None] | None = None
        if inbox is not None and landing is not None:
            tensor = landing  # straight into the ring's own tensor: no buffer, no copy
            try:
                if numel:
                    _recv_into(sock, _raw(tensor))
            finally:
                inbox.landed(ring, round_, phase)
        else:
            tensor = self._buffers.take(nbytes).view(wire)
            if numel:
                _recv_into(sock, _raw(tensor))
            released = False

            def release() -> None:
                nonlocal released
                if not released:
                    released = True
                    self._buffers.give_back(tensor)

        frame = Frame(kind=KINDS[kind], tensors={"x": tensor}, step=round_, version=phase,
                      ring=ring, sender=sender, wire_bytes=nbytes, release=release)
        try:
            self._deliver(frame)
        except (KeyError, ValueError) as e:
            raise ProtocolError(f"piece rejected: {e}") from e
        if self._on_bytes:
            self._on_bytes(frame.kind, nbytes)


class RingLink:
    """The sending side: one connection to a ring successor, opened (and re-opened after a
    failure) by a sender thread, so that the compute thread never waits on the network.

    A posted tensor is read by the sender thread while the caller goes on: the caller must not
    write it before `flush` returns, or before data that depends on it has come back around the
    ring (which a ring guarantees), and must call `abort` before reusing it after a failure."""

    def __init__(self, address: str, token: str, fingerprint: str, sender: str,
                 compression: str = "none", timeout: float = 30.0,
                 on_bytes: Callable[[str, int], None] | None = None,
                 tls: TlsMaterial | None = None, server_name: str = "",
                 identity: NodeIdentity | None = None, recipient: str = "") -> None:
        """`identity`: this node's, by which it proves to the server's node `recipient` that it
        is `sender`."""
        self.address = address
        self._identity, self._recipient = identity, recipient
        host, _, port = address.rpartition(":")
        self._host, self._port = host.strip("[]"), int(port)
        self._token, self._fingerprint, self._sender = token, fingerprint, sender
        self._wire = COMPRESSIONS[compression]
        self._timeout = timeout
        self._on_bytes = on_bytes
        self._tls = _tls_context(tls, server=False) if tls else None
        self._server_name = server_name or self._host
        self._sock: socket.socket | None = None
        self._scratch: dict[int, torch.Tensor] = {}
        self._link = secrets.randbits(64)
        self._queue: queue.Queue[Frame | None] = queue.Queue()
        self._error: TransportError | None = None
        self._lock = threading.Lock()
        self._pending = 0
        self._idle = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"ring-{address}")
        self._thread.start()

    def post(self, frame: Frame, ordered: bool = False) -> None:
        """Queue a ring piece (a frame with one tensor, "x"); errors surface on the next call."""
        if frame.kind not in _KIND_CODES or set(frame.tensors) != {"x"}:
            raise TransportError(f"ring data carries one reduce or gather tensor, not "
                                 f"{frame.kind} with {sorted(frame.tensors)}")
        self.raise_error()
        with self._lock:
            self._pending += 1
        self._queue.put(frame)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every posted piece was written to the connection."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._idle.wait(left)
            stuck = self._pending > 0
        if stuck:
            self.abort()
            raise PeerTimeout(f"ring data to {self.address} not written within {timeout}s")
        self.raise_error()

    def raise_error(self) -> None:
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def abort(self) -> None:
        """Drop queued pieces and the connection (a blocked write fails at once) and wait until
        the sender thread holds no posted tensor; the next post connects again."""
        dropped = 0
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:
                self._queue.put(None)
                break
            dropped += 1
        with self._idle:
            self._pending -= dropped
            sock = self._sock
        if sock is not None:
            _cut(sock)
        with self._idle:
            while self._pending:
                self._idle.wait(1.0)
            self._error = None
        self._disconnect()  # shut down above; the next piece opens a new connection

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
        if self._sock is not None:
            self._sock.close()

    def _run(self) -> None:
        while (frame := self._queue.get()) is not None:
            try:
                with self._lock:
                    failed = self._error is not None
                if not failed:  # after a failure the rest of the round is dropped, not sent
                    self._write(frame)
            except (OSError, ssl.SSLError, TransportError) as e:
                reason = self._reason(e)
                log.error("ring data to %s failed: %s", self.address, reason)
                self._disconnect()
                with self._lock:
                    self._error = reason
            finally:
                with self._idle:
                    self._pending -= 1
                    if self._pending <= 0:
                        self._idle.notify_all()

    def _reason(self, e: Exception) -> TransportError:
        """A failed write, as the caller's next call raises it."""
        if isinstance(e, TransportError):
            return e
        if isinstance(e, TimeoutError):
            return PeerTimeout(f"ring peer {self.address} did not take data within "
                               f"{self._timeout:.0f}s")
        return TransportError(f"ring peer {self.address}: {e}")

    def _disconnect(self) -> None:
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def _write(self, frame: Frame) -> None:
        sock = self._sock or self._connect()
        x = frame.tensors["x"]
        out = None
        if self._wire is not None and x.dtype == torch.float32:
            # one conversion buffer per piece size, reused (this thread sends one at a time)
            out = self._scratch.get(x.numel())
            if out is None:
                out = self._scratch[x.numel()] = torch.empty(x.numel(), dtype=self._wire)
        tensor = to_wire(x, self._wire, out).reshape(-1)
        if tensor.dtype not in _DTYPE_CODES:
            raise TransportError(f"ring data cannot carry {tensor.dtype}")
        ring = frame.ring.encode()
        sock.sendall(_PIECE.pack(_PIECE_MAGIC, _KIND_CODES[frame.kind], _DTYPE_CODES[tensor.dtype],
                                 len(ring), frame.step, frame.version, tensor.numel()) + ring)
        if tensor.numel():
            sock.sendall(_raw(tensor))
        if self._on_bytes:
            self._on_bytes(frame.kind, tensor.numel() * tensor.element_size())

    def _connect(self) -> socket.socket:
        try:
            raw = socket.create_connection((self._host, self._port), timeout=self._timeout)
        except OSError as e:
            raise TransportError(f"ring peer {self.address}: cannot connect: {e}") from e
        sock: socket.socket = raw
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _keepalive(raw)
            if self._tls is not None:
                sock = self._tls.wrap_socket(raw, server_hostname=self._server_name)
            self._authenticate(sock)
        except BaseException:
            sock.close()
            raise
        with self._lock:
            self._sock = sock
        return sock

    def _authenticate(self, sock: socket.socket) -> None:
        try:
            magic, version, nonce = _HELLO.unpack(_recv_exact(sock, _HELLO.size))
        except (ConnectionError, struct.error) as e:
            raise ProtocolError(f"ring peer {self.address} closed before its greeting") from e
        if magic != _HELLO_MAGIC or version != PROTOCOL:
            raise ProtocolError(f"ring peer {self.address} is not a ravnest ring server "
                                f"(protocol {version})")
        mine = secrets.token_bytes(32)
        fingerprint, sender = self._fingerprint.encode(), self._sender.encode()
        proof = b"" if self._identity is None else self._identity.sign(
            *_ring_parts(nonce, mine, fingerprint, sender, self._recipient, self._link))
        sock.sendall(_AUTH.pack(_HELLO_MAGIC, PROTOCOL, mine,
                                _mac(self._token, b"client", nonce, mine, fingerprint, sender,
                                     struct.pack("<Q", self._link)), self._link,
                                len(fingerprint), len(sender), len(proof))
                     + fingerprint + sender + proof)
        try:
            status, length = struct.unpack("<BH", _recv_exact(sock, 3))
            if status != OK:
                reason = _recv_exact(sock, length).decode(errors="replace")
                raise ProtocolError(f"ring peer {self.address} refused us: {reason}")
            proof = _recv_exact(sock, 32)
        except ConnectionError as e:
            raise ProtocolError(f"ring peer {self.address} closed during the handshake") from e
        if not hmac.compare_digest(proof, _mac(self._token, b"server", nonce, mine, fingerprint)):
            raise ProtocolError(f"ring peer {self.address} did not prove the job token")
        sock.settimeout(self._timeout)
