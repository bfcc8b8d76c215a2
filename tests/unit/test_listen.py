"""A worker listens on the address it is given, or fails at once saying why: a port that another
program holds (gRPC's default SO_REUSEPORT would have shared it silently), an address this
machine does not have. A failed attempt leaves no thread and no port behind."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from ravnest.comm.dataplane import RingServer
from ravnest.comm.transport import Credentials, Server, listen_error
from ravnest.errors import RavnestError, TransportError

CREDS = Credentials(token="s3cret-token", fingerprint="plan-0123abcd")
NOT_HERE = "192.0.2.1"
"""TEST-NET-1 (RFC 5737): an address no machine of ours has."""


def ignore(frame: object) -> None:
    pass


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port on 127.0.0.1 that a plain listening socket holds."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def can_bind(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _new_threads(before: set[threading.Thread]) -> list[str]:
    """Threads started since `before` and still alive: none may be left by a server that failed
    to start. Compared as sets, since a thread an earlier test left may end meanwhile, which a
    count would take for a difference."""
    return [t.name for t in set(threading.enumerate()) - before]


def test_a_port_in_use_fails_at_construction_and_says_so(held_port: int) -> None:
    before = set(threading.enumerate())
    with pytest.raises(TransportError) as e:
        Server(f"127.0.0.1:{held_port}", CREDS, ignore)
    assert str(e.value) == (f"cannot listen on 127.0.0.1:{held_port}: the port is in use "
                            "(another provider or program holds it)")
    assert isinstance(e.value, RavnestError)
    assert _new_threads(before) == []


def test_a_second_server_does_not_share_the_first_ones_port() -> None:
    first = Server("127.0.0.1:0", CREDS, ignore)
    first.start()
    try:
        with pytest.raises(TransportError, match="the port is in use"):
            Server(f"127.0.0.1:{first.port}", CREDS, ignore)
        with pytest.raises(TransportError, match="the port is in use"):
            Server(f"0.0.0.0:{first.port}", CREDS, ignore)
    finally:
        first.stop(grace=0)


def test_an_address_this_machine_does_not_have_fails_and_says_so() -> None:
    before = set(threading.enumerate())
    with pytest.raises(TransportError) as e:
        Server(f"{NOT_HERE}:8081", CREDS, ignore)
    assert str(e.value) == (f"cannot listen on {NOT_HERE}:8081: {NOT_HERE} is not an address "
                            "of this machine; listen on 0.0.0.0 with "
                            "Node(listen_host='0.0.0.0') if it is behind NAT")
    assert _new_threads(before) == []


def test_a_name_that_does_not_resolve_fails_and_says_so() -> None:
    with pytest.raises(TransportError,
                       match=r"cannot listen on nosuchhost\.invalid:8081: nosuchhost\.invalid "
                             r"does not resolve"):
        Server("nosuchhost.invalid:8081", CREDS, ignore)


def test_the_ring_data_plane_says_the_same(held_port: int) -> None:
    before = set(threading.enumerate())
    with pytest.raises(TransportError) as e:
        RingServer(f"127.0.0.1:{held_port}", "token", "plan", ignore)
    assert str(e.value) == (f"cannot listen on 127.0.0.1:{held_port} for ring data: the port "
                            "is in use (another provider or program holds it)")
    with pytest.raises(TransportError, match=f"for ring data: {NOT_HERE} is not an address of "
                                             "this machine"):
        RingServer(f"{NOT_HERE}:8082", "token", "plan", ignore)
    assert _new_threads(before) == []


def test_a_failed_attempt_leaves_the_port_free() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = int(holder.getsockname()[1])
        with pytest.raises(TransportError):
            Server(f"127.0.0.1:{port}", CREDS, ignore)
        with pytest.raises(TransportError):
            RingServer(f"127.0.0.1:{port}", "token", "plan", ignore)
    assert can_bind(port)


def test_a_stopped_server_frees_its_port_for_the_next_one() -> None:
    server = Server("127.0.0.1:0", CREDS, ignore)
    server.start()
    port = server.port
    server.stop(grace=0)
    again = Server(f"127.0.0.1:{port}", CREDS, ignore)  # a restarted worker takes it back
    again.stop(grace=0)


def test_listen_error_names_what_it_cannot_tell() -> None:
    assert str(listen_error("nonsense")) == "cannot listen on nonsense: not a host:port address"
    assert "no permission to listen on port 80" in str(
        listen_error("127.0.0.1:80", PermissionError(13, "Permission denied")))
