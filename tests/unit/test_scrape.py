"""The scrape of a metrics endpoint (`ravnest.run.progress.scrape`) is bounded in bytes and in
total time: the operator scrapes every running job's cluster roots, and a job's endpoint is its
tenant's to make. Served in-process on 127.0.0.1 (a real prometheus_client server for the good
case)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from ravnest.run.progress import ScrapeError, scrape


@pytest.fixture
def serve() -> Iterator[Callable[[Callable[[socket.socket], None]], int]]:
    """A one-connection-at-a-time TCP server whose answer `talk(connection)` writes."""
    listeners: list[socket.socket] = []

    def start(talk: Callable[[socket.socket], None]) -> int:
        lst = socket.create_server(("127.0.0.1", 0))
        listeners.append(lst)

        def loop() -> None:
            while True:
                try:
                    conn, _ = lst.accept()
                except OSError:
                    return
                with conn:
                    conn.recv(65536)
                    try:
                        talk(conn)
                    except OSError:
                        pass  # the scraper hung up

        threading.Thread(target=loop, daemon=True).start()
        return int(lst.getsockname()[1])

    yield start
    for lst in listeners:
        lst.close()


def test_a_workers_metrics_are_read():
    registry = CollectorRegistry()
    Gauge("ravnest_step", "step", registry=registry).set(7)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        assert scrape(server.server_port)["ravnest_step"] == 7.0
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_an_endless_answer_is_refused_past_the_byte_limit(serve):
    line = b"ravnest_step 1\n" * 1000

    def endless(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n")
        for _ in range(10_000):  # 150 MB if read to the end
            conn.sendall(line)

    with pytest.raises(ScrapeError, match="more than 100000 bytes"):
        scrape(serve(endless), timeout=30, max_bytes=100_000)


def test_a_declared_length_past_the_limit_is_refused_unread(serve):
    def big(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 419430400\r\n\r\nravnest_step 1\n")

    with pytest.raises(ScrapeError, match="419430400 bytes"):
        scrape(serve(big))


@pytest.mark.parametrize("in_headers", [True, False])
def test_a_dripping_answer_ends_at_the_deadline_not_at_its_last_byte(serve, in_headers):
    """Each byte comes well within the timeout, so only a bound on the whole scrape stops it:
    unbounded, this scrape would return the metrics after 4 s."""
    head = b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n"
    body = b"ravnest_step 1\n" * 2

    def drip(conn: socket.socket) -> None:
        if not in_headers:
            conn.sendall(head)
        for byte in (head + body if in_headers else body):
            conn.sendall(bytes([byte]))
            time.sleep(4 / (len(head) + len(body)) if in_headers else 4 / len(body))

    port = serve(drip)
    with pytest.raises(ScrapeError, match="took too long"):
        scrape(port, timeout=0.5)


@pytest.mark.parametrize(("answer", "says"), [
    (b"HTTP/1.0 404 Not Found\r\n\r\n", "answered 404"),
    (b"HTTP/1.0 200 OK\r\n\r\n\xff\xfe not text", "not Prometheus metrics"),
    (b"HTTP/1.0 200 OK\r\n\r\nravnest_step one two three\n", "not Prometheus metrics"),
    (b"SSH-2.0-OpenSSH\r\n", "not an HTTP answer"),
])
def test_an_answer_that_is_not_metrics_is_a_scrape_error(serve, answer, says):
    port = serve(lambda conn: conn.sendall(answer))
    with pytest.raises(ScrapeError, match=says):
        scrape(port)


def test_a_closed_port_is_an_os_error():
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    with pytest.raises(OSError):
        scrape(port)
