"""gRPC transport between workers: an authenticated server and reused client channels.

Every call carries the job's token (``authorization: Bearer …``, compared in constant time), the
plan fingerprint and, between workers, a proof of the calling node (identity.py); the server rejects
anything else with UNAUTHENTICATED or FAILED_PRECONDITION before reading a byte of payload, and a
frame whose sender is not the node its call proved to be with PERMISSION_DENIED. With TLS material
(see tls.py) the server also requires a client certificate from the job's CA and clients verify the
server's. Malformed frames get INVALID_ARGUMENT and the server keeps serving. Outgoing frames go
through a few sender threads per peer, so compute never waits on the network and several calls are
in flight at once (each waits a round trip for its Ack); frames that must stay in order (the
pipeline's) are numbered by the sending Peer and the receiving Inbox (inboxes.py) hands them on in
that order. Small frames go as one unary call, larger ones streamed. The standard health service
answers without a token (peers and probes Check readiness); its Watch streams hold none of the
server's threads, which carry training's frames, and only a few may be open at once
(watching.PeerWatch holds one per peer, on a connection of its own pinged every second, to learn in
seconds that a peer's process is gone or its machine fell silent). A server listens on the address
it is given and never shares a port; one it cannot take fails at once, saying why (`listen_error`).
Closing a Peer fails, within its timeout, what it still had in flight to a peer that is gone.
"""

from __future__ import annotations

import errno
import hmac
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ravnest.comm.buffers import BufferPool
from ravnest.comm.framing import (
    CHUNK_BYTES,
    DEFAULT_MAX_FRAME_BYTES,
    Frame,
    FrameError,
    check_sendable,
    decode_wire,
    encode_one,
    encode_wire,
    iter_wire,
)
from ravnest.comm.identity import NODE_HEADER, PROOF_HEADER, NodeIdentity
from ravnest.comm.proto import ravnest_pb2 as pb
from ravnest.comm.sending import Deliveries
from ravnest.comm.tls import TlsMaterial, identity
from ravnest.errors import PeerTimeout, TransportError, shown

log = logging.getLogger(__name__)

_GRPC_OPTIONS = [
    ("grpc.max_send_message_length", CHUNK_BYTES + (1 << 20)),
    ("grpc.max_receive_message_length", CHUNK_BYTES + (1 << 20)),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
]
PEER_CONNECT_TIMEOUT_MS = 5_000
"""How long a peer's channel tries one address before it looks the name up again (below)."""
_PEER_OPTIONS = [
    *_GRPC_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    ("grpc.min_reconnect_backoff_ms", PEER_CONNECT_TIMEOUT_MS),
    ("grpc.dns_min_time_between_resolutions_ms", 2_000),
]
"""A peer's channel: a peer that is restarted (its cluster recovered, on a new pod and address)
is connected to again within about 2 s of answering, not after gRPC's backoff of up to 120 s
or its 30 s between DNS lookups. Measured once (a server down for 20 s, a `Peer.wait_ready`
waiting): answered 6.5 s after the server was back with gRPC's defaults, 2.1 s with the backoff
bound to 5 s and 2 s between lookups. The answer to a restarted cluster's `where` comes over such
a link (`rejoining.join_round`).

gRPC gives a connection attempt at least its min_reconnect_backoff_ms (its MIN_CONNECT_TIMEOUT, 20
s by default). On Kubernetes a restarted pod has a new address, and an attempt to the lost pod's
address gets no answer at all (no refusal): the channel stayed on it for up to 20 s before it
looked the name up again, so that on kind the answer to `where` took 8.5-10 s to reach the
restarted node, and its ring state 10 s after it was sent. PEER_CONNECT_TIMEOUT_MS bounds that."""
WATCH_KEEPALIVE_MS = 1_000
WATCH_KEEPALIVE_TIMEOUT_MS = 2_000
_WATCH_OPTIONS = [
    ("grpc.keepalive_time_ms", WATCH_KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", WATCH_KEEPALIVE_TIMEOUT_MS),
    ("grpc.http2.ping_timeout_ms", WATCH_KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 1_000),
]
"""The channel a PeerWatch watches a peer's health on, its own connection: pinged every second,
so that a peer that falls silent (its machine cut off or frozen: no connection refused, nothing
at all) breaks the watch in 1 + 2 s (the ping timeout; gRPC's keepalive timeout alone did not
end a stream whose peer was frozen). HTTP/2 pings are answered by gRPC's core, not by Python, so
a peer busy computing still answers them; and no frame of training's shares the connection, so
none delays an answer."""
_SERVER_OPTIONS = [*_GRPC_OPTIONS, ("grpc.so_reuseport", 0),
                   ("grpc.http2.min_ping_interval_without_data_ms", WATCH_KEEPALIVE_MS // 2),
                   ("grpc.keepalive_permit_without_calls", 1)]
"""gRPC servers set SO_REUSEPORT by default, so a second server on a port in use would share it
silently (and take half of its neighbours' connections); without it the bind fails. A call that
stays open without data (a health Watch, a frame whose delivery waits) has the client ping every
keepalive_time (20 s, a watch's channel every second); a server takes pings that come closer than
5 min by default as abuse and drops the whole connection after the third ("too_many_pings"), so
it allows one per half second. A watch's channel also pings while no call is open on it (between
the Checks of a peer it asks instead of watching, or while a peer that answers again is asked
whether it restarted): a server that does not permit pings without calls takes each such ping as
abuse too, and dropped that connection 3 s into such a pause (seen on kind, and measured: an idle
watch channel went from READY to IDLE 3 s after its last Check)."""
SERVICE = "ravnest.v1.Peer"
ONE_MESSAGE_BYTES = CHUNK_BYTES
"""Frames up to this payload (one chunk's worth) go as one message, header and payload together
(`encode_one`), on the unary SendOne; larger ones are streamed in chunks, sent as they are
made."""
_HEADER_ALLOWANCE = 4096
"""Bytes of header (and the data Chunk's tag) a one-message frame may add to its payload."""
UNORDERED_LANES = 4
"""Sender threads per peer beyond the first: with them up to 5 calls are in flight at once."""
BYTES_IN_FLIGHT = 24 << 20
"""Payload bytes a Peer's sender threads may have in calls at once (a frame larger than this goes
alone): enough for every lane on ring pieces and typical activations, while a stage sending big
activations keeps one frame's copy in flight, not one per lane."""


@dataclass(frozen=True)
class Credentials:
    """What a peer must present: the job's secret token and the plan fingerprint and, given the
    node's `identity`, a proof that the caller is the node it names (identity.py): a server with
    an identity refuses calls without one, and frames whose sender is another node."""

    token: str
    fingerprint: str
    identity: NodeIdentity | None = None

    def metadata(self, recipient: str = "") -> tuple[tuple[str, str | bytes], ...]:
        """A call's metadata; with an identity, its proof towards node `recipient`."""
        base: tuple[tuple[str, str | bytes], ...] = (
            ("authorization", f"Bearer {self.token}"), ("x-ravnest-plan", self.fingerprint))
        if self.identity is None or not recipient:
            return base
        return (*base, *self.identity.call_proof(recipient, self.fingerprint))


def _deny(code: grpc.StatusCode, message: str) -> dict[str, grpc.RpcMethodHandler]:
    def abort(request: Any, context: grpc.ServicerContext) -> None:
        context.abort(code, message)

    return {"Send": grpc.stream_unary_rpc_method_handler(abort),
            "SendOne": grpc.unary_unary_rpc_method_handler(abort)}


class _Auth(grpc.ServerInterceptor):
    def __init__(self, creds: Credentials) -> None:
        self._token = f"Bearer {creds.token}".encode()
        self._fingerprint = creds.fingerprint
        self._me = creds.identity.node if creds.identity else ""
        self._verifier = creds.identity.verifier() if creds.identity else None
        self._unauthenticated = _deny(grpc.StatusCode.UNAUTHENTICATED,
                                      "missing or wrong job token")
        self._wrong_plan = _deny(grpc.StatusCode.FAILED_PRECONDITION,
                                 "peer runs a different plan (fingerprint mismatch)")

    def intercept_service(self, continuation: Callable[[Any], Any],
                          details: grpc.HandlerCallDetails) -> Any:
        if not details.method.startswith(f"/{SERVICE}/"):
            return continuation(details)
        md = dict(details.invocation_metadata or ())
        token = str(md.get("authorization", "")).encode()
        name = details.method.rsplit("/", 1)[-1]
        if not hmac.compare_digest(token, self._token):
            return self._unauthenticated.get(name)
        if md.get("x-ravnest-plan") != self._fingerprint:
            return self._wrong_plan.get(name)
        if self._verifier is not None:
            node, proof = md.get(NODE_HEADER, ""), md.get(PROOF_HEADER, b"")
            problem = self._verifier.call_sender(
                node if isinstance(node, str) else "", proof if isinstance(proof, bytes) else b"",
                self._me, self._fingerprint)
            if problem:
                return _deny(grpc.StatusCode.UNAUTHENTICATED, problem).get(name)
        return continuation(details)


class _Servicer:
    """Peer.Send with the request messages left serialized: framing parses them itself, copying
    each chunk's bytes once, into the frame's buffer. Peer.SendOne takes a frame that fits one
    message (header and payload in one Chunk) as a unary call, which costs grpc-python about
    half of a streaming call (no thread to consume a request iterator)."""

    def __init__(self, deliver: Callable[[Frame], None], max_frame_bytes: int,
                 on_bytes: Callable[[str, int], None] | None, buffers: BufferPool,
                 bound: bool = False, proven: bool = False) -> None:
        """`bound`: the connections are mutual TLS, and a frame's sender must be the node its
        client certificate names; `proven`: calls prove their node (`_Auth` checked it), and a
        frame's sender must be that node (`sender_problem`)."""
        self._deliver = deliver
        self._max = max_frame_bytes
        self._on_bytes = on_bytes
        self._buffers = buffers
        self._bound = bound
        self._proven = proven

    def SendOne(self, request: bytes, context: grpc.ServicerContext) -> pb.Ack:
        return self.Send(iter((request,)), context)

    def Send(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> pb.Ack:
        try:
            frame = decode_wire(request_iterator, self._max, self._buffers)
        except FrameError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        problem = None
        if self._proven:
            node = dict(context.invocation_metadata()).get(NODE_HEADER, "")
            problem = sender_problem(frame.sender, node if isinstance(node, str) else "",
                                     "identity")
        if self._bound and not problem:
            names = context.auth_context().get("x509_common_name") or [b""]
            problem = sender_problem(frame.sender, names[0].decode(errors="replace"))
        if problem:
            if frame.release is not None:
                frame.release()
            context.abort(grpc.StatusCode.PERMISSION_DENIED, problem)
        try:
            self._deliver(frame)
        except (KeyError, ValueError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"frame rejected: {e}")
        if self._on_bytes:
            self._on_bytes(frame.kind, frame.wire_bytes)
        return pb.Ack(received_bytes=frame.wire_bytes)


def sender_problem(sender: str, proven: str, by: str = "certificate") -> str | None:
    """Why a frame that says it is from `sender` may not come over a connection that proved to
    be `proven`'s, by its client certificate (which names a node's `tls.identity`) or by its node
    `identity` (which names the node), or None: a node speaks only for itself, whatever its
    frames write."""
    if sender and proven == (identity(sender) if by == "certificate" else sender):
        return None
    return (f"a frame that says it is from {shown(sender)} came over the connection of "
            f"{shown(proven)}'s {by}: a node speaks for itself only")


MAX_HEALTH_WATCHES = 16
"""Health Watch streams a server holds open at once; more are refused with RESOURCE_EXHAUSTED.
Nobody needs a token to watch (peers and probes use Check), so this bounds what anyone may hold."""


def _parse_health(request: bytes, context: grpc.ServicerContext) -> Any:
    """A HealthCheckRequest, or INVALID_ARGUMENT (grpc's own parsing would answer INTERNAL and log
    a traceback for every such call)."""
    try:
        return health_pb2.HealthCheckRequest.FromString(request)
    except DecodeError as e:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"not a HealthCheckRequest: {e}")


def _sent_apart(send_response: Callable[[Any], None]) -> Callable[[Any], None]:
    """`send_response` (grpc's, for a non-blocking stream) called in a thread of its own, in
    order, until None (the stream's end). grpcio-health-checking's servicer calls it while it
    holds its lock, and grpc's call blocks until the server's polling thread has seen the message
    go; when that thread meanwhile runs the servicer's close callback of another watch, which
    takes the same lock, neither moves again and the whole server stops answering (seen: a
    worker's server wedged, and a test process that never exited, its executor thread waiting in
    `_send_response` and the polling thread in `HealthServicer._on_close_callback`). Queued here,
    the servicer never waits under its lock."""
    responses: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def run() -> None:
        while (response := responses.get()) is not None:
            send_response(response)
        send_response(None)

    threading.Thread(target=run, daemon=True, name="health-watch").start()
    return responses.put


def _health_handler(servicer: health.HealthServicer,
                    max_watches: int = MAX_HEALTH_WATCHES) -> grpc.GenericRpcHandler:
    """The standard health service (Check, Watch), parsing requests itself. Watch is served
    non-blocking, as grpcio-health-checking's servicer is written for: a held stream occupies no
    thread of the server's (those carry training's frames), only a sending thread of its own,
    idle between status changes (`_sent_apart`), and at most `max_watches` are held at once."""
    slots = threading.BoundedSemaphore(max_watches)

    def check(request: bytes, context: grpc.ServicerContext) -> Any:
        return servicer.Check(_parse_health(request, context), context)

    def watch(request: bytes, context: grpc.ServicerContext,
              send_response_callback: Callable[[Any], None]) -> None:
        message = _parse_health(request, context)
        if not slots.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{max_watches} health watches are open already; use Check")
        if not context.add_callback(slots.release):  # the call has ended already
            slots.release()
            return
        send = _sent_apart(send_response_callback)
        if not context.add_callback(lambda: send(None)):
            send(None)
            return
        servicer.Watch(message, context, send)

    # grpc's server passes a send callback instead of taking a thread to drain an iterator
    setattr(watch, "experimental_non_blocking", True)  # noqa: B010 (a function attribute)
    respond = health_pb2.HealthCheckResponse.SerializeToString
    return grpc.method_handlers_generic_handler("grpc.health.v1.Health", {
        "Check": grpc.unary_unary_rpc_method_handler(check, response_serializer=respond),
        "Watch": grpc.unary_stream_rpc_method_handler(watch, response_serializer=respond)})


def _bind_problem(host: str, port: int) -> OSError | None:
    """What binding a listening socket to `host`:`port` fails with here (as gRPC binds:
    SO_REUSEADDR, no SO_REUSEPORT), or None if it would succeed now."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:
        return e
    problem: OSError | None = None
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(sockaddr)
            return None
        except OSError as e:
            problem = problem or e
    return problem


def listen_error(address: str, error: OSError | None = None, purpose: str = "") -> TransportError:
    """A TransportError saying why this machine cannot listen on `address` ("host:port"), with
    `error` the bind's failure if known (else found out by binding a socket there now) and
    `purpose` what the listener is for (" for ring data")."""
    host, _, port_text = address.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    head = f"cannot listen on {address}{purpose}"
    try:
        port = int(port_text)
    except ValueError:
        return TransportError(f"{head}: not a host:port address")
    if error is None:
        error = _bind_problem(host, port)
    if isinstance(error, socket.gaierror):
        return TransportError(f"{head}: {host} does not resolve to an address of this machine "
                              f"({error.strerror})")
    if error is None:
        return TransportError(f"{head} (gRPC could not bind it; GRPC_VERBOSITY=debug says why)")
    why = {errno.EADDRINUSE: "the port is in use (another provider or program holds it)",
           errno.EADDRNOTAVAIL: f"{host} is not an address of this machine; listen on 0.0.0.0 "
                                "with Node(listen_host='0.0.0.0') if it is behind NAT",
           errno.EACCES: f"no permission to listen on port {port} (ports below 1024 need "
                         "privileges)"}.get(error.errno or 0, error.strerror or str(error))
    return TransportError(f"{head}: {why}")


STOP_EXTRA_SECONDS = 5.0
"""How long past its grace period a server's stop is waited for."""


class Server:
    """The worker's gRPC server: the Peer service plus the standard health service. It listens
    on `address` as given, and fails at once, with a TransportError saying why, if it cannot (a
    port in use, an address this machine does not have)."""

    def __init__(self, address: str, creds: Credentials, deliver: Callable[[Frame], None],
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, threads: int = 16,
                 on_bytes: Callable[[str, int], None] | None = None,
                 tls: TlsMaterial | None = None, reuse_bytes: int = 256 << 20,
                 pinned: bool = False) -> None:
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads,
                                                              thread_name_prefix="grpc"),
                                   interceptors=[_Auth(creds)], options=_SERVER_OPTIONS)
        self.buffers = BufferPool(max_bytes=reuse_bytes, pinned=pinned)
        """Receive buffers of large frames (up to `reuse_bytes` of them), reused once their
        frame is dropped; 0 turns reuse off. `pinned`: in page-locked memory (a worker on a CUDA
        device copies its frames' tensors from them)."""
        servicer = _Servicer(deliver, max_frame_bytes, on_bytes, self.buffers,
                             bound=tls is not None, proven=creds.identity is not None)
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
            "Send": grpc.stream_unary_rpc_method_handler(
                servicer.Send, request_deserializer=None,
                response_serializer=pb.Ack.SerializeToString),
            "SendOne": grpc.unary_unary_rpc_method_handler(
                servicer.SendOne, request_deserializer=None,
                response_serializer=pb.Ack.SerializeToString)}),))
        self.health = health.HealthServicer()
        self._server.add_generic_rpc_handlers((_health_handler(self.health),))
        self.port = self._listen(address, tls)

    def _listen(self, address: str, tls: TlsMaterial | None) -> int:
        """Bind `address`; the port bound. grpc answers a failed bind with port 0 (older
        versions) or RuntimeError (newer ones) and no reason, so the reason is found out here."""
        try:
            if tls is None:
                port = self._server.add_insecure_port(address)
            else:
                port = self._server.add_secure_port(address, grpc.ssl_server_credentials(
                    [(tls.key, tls.cert)], root_certificates=tls.ca, require_client_auth=True))
        except RuntimeError:
            port = 0
        if port == 0:
            self._server.stop(None)
            raise listen_error(address)
        return int(port)

    def start(self) -> None:
        self._server.start()
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)

    def stop(self, grace: float = 1.0) -> None:
        # NOT_SERVING to every watcher first. The servicer sends it to each Watch stream in turn,
        # under its lock, waiting for each write to complete: a watcher behind a network cut
        # held that wait (and the lock, which the server's own close callbacks need) for good,
        # and the process never exited. So it is sent from a thread for at most `grace`. The
        # server's stop does not end such a write either (py-spy: waiting on its shutdown event
        # for good), so it too is waited for a bounded time: the process is on its way out.
        notify = threading.Thread(target=self.health.enter_graceful_shutdown, daemon=True,
                                  name="health-shutdown")
        notify.start()
        notify.join(grace)
        if not self._server.stop(grace).wait(grace + STOP_EXTRA_SECONDS):
            log.warning("the gRPC server did not stop within %.0fs (a stream to a peer behind a "
                        "network cut?); going on", grace + STOP_EXTRA_SECONDS)


class Peer:
    """One reused channel to a peer and 1 + `lanes` sender threads, so that several frames are in
    flight at once: each call waits a round trip for its Ack, and on a link with latency one call
    at a time would leave it idle for that round trip. Frames posted as ordered carry this Peer's
    random stream id and a sequence number, by which the receiving Inbox restores their order;
    the others (ring pieces, keyed by their step) may arrive in any order."""

    def __init__(self, address: str, creds: Credentials, compression: str = "none",
                 timeout: float = 120.0,
                 on_bytes: Callable[[str, int], None] | None = None,
                 tls: TlsMaterial | None = None, server_name: str = "",
                 lanes: int = UNORDERED_LANES, node: str = "") -> None:
        """With `tls`, the peer's certificate must come from the same CA and name `server_name`
        (its node's `tls.identity`) or, without one, the host of `address`. `node`: the peer's
        node, to which the calls prove who sends them (given `creds.identity`)."""
        self.address = address
        self._tls, self._server_name = tls, server_name
        self._channel = self._open(_PEER_OPTIONS)
        self._watch_channel: grpc.Channel | None = None
        # Peer.Send with pre-serialized Chunk messages (framing.encode_wire) as requests.
        self._send_rpc = self._channel.stream_unary(
            f"/{SERVICE}/Send", request_serializer=None, response_deserializer=pb.Ack.FromString)
        self._send_one_rpc = self._channel.unary_unary(
            f"/{SERVICE}/SendOne", request_serializer=None,
            response_deserializer=pb.Ack.FromString)
        self._metadata = creds.metadata(node)
        self._compression = compression
        self._timeout = timeout
        self._on_bytes = on_bytes
        self._queue: queue.Queue[tuple[str, list[bytes] | Frame] | None] = queue.Queue()
        self._deliveries = Deliveries(address)
        self._budget = threading.Condition()
        self._bytes_in_flight = 0
        self._closed = False
        self._threads = [threading.Thread(target=self._run, args=(self._queue,), daemon=True,
                                          name=f"send-{address}-{i}")
                         for i in range(1 + lanes)]
        for thread in self._threads:
            thread.start()

    def _open(self, options: list[tuple[str, Any]]) -> grpc.Channel:
        tls = self._tls
        if tls is None:
            return grpc.insecure_channel(self.address, options=options)
        return grpc.secure_channel(
            self.address, grpc.ssl_channel_credentials(tls.ca, tls.key, tls.cert),
            options=[*options, *([("grpc.ssl_target_name_override", self._server_name)]
                                 if self._server_name else [])])

    @property
    def channel(self) -> grpc.Channel:
        """The channel training's frames go on."""
        return self._channel

    @property
    def watch_channel(self) -> grpc.Channel:
        """A channel of its own to the peer's health service, pinged every second (see
        _WATCH_OPTIONS and watching.PeerWatch); opened on first use, closed with the Peer."""
        with self._budget:
            if self._watch_channel is None:
                self._watch_channel = self._open(_WATCH_OPTIONS)
                if self._closed:
                    self._watch_channel.close()
            return self._watch_channel

    def send(self, frame: Frame, compression: str | None = None) -> None:
        """Send now, in the caller's thread; raise TransportError on failure."""
        compression = self._compression if compression is None else compression
        self._send(frame.kind, [encode_one(frame, compression)]
                   if frame.nbytes() <= ONE_MESSAGE_BYTES else iter_wire(frame, compression))

    def _encode(self, frame: Frame) -> list[bytes]:
        return ([encode_one(frame, self._compression)] if frame.nbytes() <= ONE_MESSAGE_BYTES
                else encode_wire(frame, self._compression))

    def _send(self, kind: str, messages: Iterator[bytes] | list[bytes]) -> None:
        """One call: an encoded frame of at most ONE_MESSAGE_BYTES of payload (plus its header)
        goes as one message (one Chunk with both, or its header and data Chunks concatenated,
        which protobuf parses the same) on the unary SendOne; anything else is streamed on
        Send, a generator's messages as they are made."""
        try:
            if isinstance(messages, list) and len(messages) <= 2 and \
                    sum(map(len, messages)) <= ONE_MESSAGE_BYTES + _HEADER_ALLOWANCE:
                ack = self._send_one_rpc(b"".join(messages), metadata=self._metadata,
                                         timeout=self._timeout, wait_for_ready=True)
            else:
                ack = self._send_rpc(iter(messages), metadata=self._metadata,
                                     timeout=self._timeout, wait_for_ready=True)
        except (grpc.RpcError, ValueError) as e:  # ValueError: the channel is closed
            if self._closed:
                raise TransportError(f"peer {self.address}: the link was closed before the "
                                     "frame was delivered") from e
            if not isinstance(e, grpc.RpcError):
                raise
            code = e.code() if hasattr(e, "code") else None
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise PeerTimeout(f"peer {self.address} did not answer within "
                                  f"{self._timeout:.0f}s") from e
            details = e.details() if hasattr(e, "details") else str(e)
            raise TransportError(f"peer {self.address}: {code}: {details}") from e
        if self._on_bytes:
            self._on_bytes(kind, ack.received_bytes)

    def post(self, frame: Frame, ordered: bool = True, snapshot: bool = True) -> None:
        """Queue a frame for the sender threads; errors surface on the next call. Ordered frames
        are handed on by the receiving Inbox in the order they were posted (they are numbered
        here); unordered ones may overtake each other and ordered ones. With `snapshot` the
        frame is encoded here, so its tensors may change as soon as this returns; without, a
        sender thread encodes it (off the caller's thread) and the caller must leave its tensors
        as they are."""
        self.raise_error()
        check_sendable(frame)  # before it takes a number: a frame that cannot go breaks no order
        if ordered:
            self._deliveries.number(frame)
        if snapshot and frame.ready is not None:
            frame.ready()
        messages: list[bytes] | Frame = self._encode(frame) if snapshot else frame
        self._deliveries.started()
        self._queue.put((frame.kind, messages))

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every posted frame was delivered."""
        self._deliveries.wait(timeout)

    def raise_error(self) -> None:
        """Raise (once) the error of a frame the sender thread could not deliver."""
        self._deliveries.raise_error()

    def _run(self, frames: queue.Queue[tuple[str, list[bytes] | Frame] | None]) -> None:
        while (item := frames.get()) is not None:
            kind, messages = item
            size = (messages.nbytes() if isinstance(messages, Frame)
                    else sum(map(len, messages)))
            with self._budget:
                while self._bytes_in_flight and self._bytes_in_flight + size > BYTES_IN_FLIGHT:
                    self._budget.wait()
                self._bytes_in_flight += size
            error: TransportError | None = None
            try:
                if isinstance(messages, Frame) and messages.ready is not None:
                    messages.ready()  # (its tensors' copies from a device done)
                self._send(kind, self._encode(messages)
                           if isinstance(messages, Frame) else messages)
            except TransportError as e:
                log.error("sending %s frame to %s failed: %s", kind, self.address, e)
                error = e
            except Exception as e:  # a frame encoded here failed (not a send): report it
                log.exception("encoding %s frame to %s failed", kind, self.address)
                error = TransportError(f"{kind} frame to {self.address}: {e}")
            finally:
                with self._budget:
                    self._bytes_in_flight -= size
                    self._budget.notify_all()
                self._deliveries.finished(error)

    def wait_ready(self, timeout: float, stop: Callable[[], bool] | None = None) -> bool:
        """Block until the peer's health service says SERVING (True), or `stop()` says waiting
        is no longer needed (False)."""
        stub = health_pb2_grpc.HealthStub(self._channel)
        deadline = time.monotonic() + timeout
        while stop is None or not stop():
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=2.0,
                                    wait_for_ready=True).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise PeerTimeout(f"peer {self.address} not ready within {timeout:.0f}s")
            time.sleep(0.2)
        return False

    def close(self, timeout: float = 5.0) -> None:
        """Let the sender threads deliver what was posted before, for `timeout` seconds in all,
        then close the channel: calls still in flight (to a peer that is gone, which would
        otherwise wait out their own timeout) fail at once with TransportError, which `flush`
        and `send` raise. Never waits much longer than `timeout`; 0 gives up on them at once."""
        for _ in self._threads:
            self._queue.put(None)
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        with self._budget:
            self._closed = True
            watch_channel = self._watch_channel
        if watch_channel is not None:
            watch_channel.close()
        self._channel.close()
        for thread in self._threads:  # cancelled now: each fails its frames and ends
            thread.join(timeout=1.0)
