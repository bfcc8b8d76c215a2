"""Inbox: numbered frames (a Peer's ordered posts, sent on several calls at once) are handed to
the compute thread in their stream's order, whatever order they arrive in."""

from __future__ import annotations

import queue
import random
import threading

import pytest
import torch

from ravnest.comm.framing import Frame
from ravnest.comm.inboxes import ORDER_WINDOW, Inbox


def numbered(stream: int, sequence: int, kind: str = "forward") -> Frame:
    return Frame(kind, {"x": torch.tensor([float(sequence)])}, microbatch=sequence,
                 stream=stream, sequence=sequence)


def drain(inbox: Inbox) -> list[tuple[int, int]]:
    out = []
    while True:
        try:
            f = inbox.pipeline.get_nowait()
        except queue.Empty:
            return out
        out.append((f.stream, f.sequence))


def test_frames_arriving_out_of_order_leave_in_their_streams_order() -> None:
    inbox = Inbox(capacity=100)
    arrivals = [numbered(s, q) for s in (7, 9) for q in range(1, 21)]
    random.Random(3).shuffle(arrivals)
    for f in arrivals:
        inbox.deliver(f)
    got = drain(inbox)
    assert sorted(got) == sorted((f.stream, f.sequence) for f in arrivals)
    for stream in (7, 9):
        assert [q for s, q in got if s == stream] == list(range(1, 21))


def test_an_early_frame_waits_for_the_ones_before_it() -> None:
    inbox = Inbox()
    inbox.deliver(numbered(5, 2))
    inbox.deliver(numbered(5, 3))
    assert drain(inbox) == []
    inbox.deliver(numbered(5, 1))
    assert drain(inbox) == [(5, 1), (5, 2), (5, 3)]


def test_unnumbered_frames_pass_while_numbered_ones_wait() -> None:
    inbox = Inbox()
    inbox.deliver(numbered(5, 2))
    inbox.deliver(Frame("control", control={"op": "finish"}))
    assert drain(inbox) == [(0, 0)]


@pytest.mark.parametrize("sequence", [1, 2], ids=["delivered", "waiting"])
def test_a_frame_that_came_twice_is_refused_and_changes_nothing(sequence: int) -> None:
    inbox = Inbox()
    inbox.deliver(numbered(5, 1))
    inbox.deliver(numbered(5, 2 if sequence == 2 else 3))
    with pytest.raises(ValueError, match=f"frame {sequence} of stream 5 came twice"):
        inbox.deliver(numbered(5, sequence))
    inbox.deliver(numbered(5, 2 if sequence == 1 else 3))
    assert drain(inbox) == [(5, 1), (5, 2), (5, 3)]


def test_a_frame_too_far_ahead_is_refused() -> None:
    inbox = Inbox()
    with pytest.raises(ValueError, match=f"more than {ORDER_WINDOW} ahead of 1"):
        inbox.deliver(numbered(5, 1 + ORDER_WINDOW))
    inbox.deliver(numbered(5, ORDER_WINDOW))  # the last one the window admits
    assert drain(inbox) == []


def test_an_unknown_kind_is_refused_before_it_takes_its_number() -> None:
    inbox = Inbox()
    with pytest.raises(ValueError, match="unknown frame kind"):
        inbox.deliver(numbered(5, 1, kind="bogus"))
    inbox.deliver(numbered(5, 1))
    assert drain(inbox) == [(5, 1)]


def test_numbered_ring_pieces_keep_their_place_in_the_stream() -> None:
    inbox = Inbox()
    piece = Frame("reduce", {"p": torch.ones(2)}, step=1, version=0, ring="r", stream=5,
                  sequence=2)
    inbox.deliver(piece)
    inbox.deliver(numbered(5, 3))
    assert drain(inbox) == []
    inbox.deliver(numbered(5, 1))
    assert drain(inbox) == [(5, 1), (5, 3)]
    assert inbox.take_ring("r", 1, 0, timeout=0).sequence == 2


def test_concurrent_deliveries_with_backpressure_keep_the_order() -> None:
    """Five threads take one stream's frames in order, as a Peer's sender lanes do, and deliver
    them after random delays (so they overtake each other) into a queue of 4 that the compute
    thread empties."""
    inbox = Inbox(capacity=4)
    todo: queue.Queue[Frame] = queue.Queue()
    for q in range(1, 201):
        todo.put(numbered(11, q))
    errors: list[BaseException] = []
    arrived = []

    def lane(seed: int) -> None:
        rng = random.Random(seed)
        try:
            while True:
                try:
                    f = todo.get_nowait()
                except queue.Empty:
                    return
                threading.Event().wait(rng.random() * 0.002)
                arrived.append(f.sequence)
                inbox.deliver(f)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=lane, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    got = [inbox.pipeline.get(timeout=10).sequence for _ in range(200)]
    for t in threads:
        t.join(timeout=10)
    assert not errors
    assert arrived != sorted(arrived), "the frames never arrived out of order"
    assert got == list(range(1, 201))


def test_offers_are_withdrawn_with_their_round() -> None:
    """An offered tensor is claimed once, for its exact key, dtype and size; a new offer replaces
    the ring's old ones, and a completed or forgotten round leaves nothing a late piece could be
    received into."""
    inbox, t = Inbox(), torch.zeros(4)
    cancel = lambda: None  # noqa: E731
    inbox.expect("r", 1, {0: t, 1: torch.zeros(4)})
    assert inbox.claim("r", 1, 0, torch.bfloat16, 4, cancel) is None
    assert inbox.claim("r", 1, 0, torch.float32, 5, cancel) is None
    assert inbox.claim("r", 2, 0, torch.float32, 4, cancel) is None
    assert inbox.claim("other", 1, 0, torch.float32, 4, cancel) is None
    assert inbox.claim("r", 1, 0, torch.float32, 4, cancel) is t
    inbox.landed("r", 1, 0)
    assert inbox.claim("r", 1, 0, torch.float32, 4, cancel) is None  # once
    inbox.expect("r", 1, {})  # the round completed
    assert inbox.claim("r", 1, 1, torch.float32, 4, cancel) is None
    inbox.expect("r", 2, {0: t})
    inbox.forget_rounds_before("r", 3)  # the round was given up
    assert inbox.claim("r", 2, 0, torch.float32, 4, cancel) is None
    inbox.expect("r", 2, {0: t})  # an offer for a round already forgotten is never claimed
    assert inbox.claim("r", 2, 0, torch.float32, 4, cancel) is None
    inbox.expect("r", 3, {0: torch.zeros(2, 2).t()})  # not contiguous: cannot be written in place
    assert inbox.claim("r", 3, 0, torch.float32, 4, cancel) is None


def test_a_node_told_training_is_over_stops_waiting_for_peers_that_left() -> None:
    """A run resumed at its end: a neighbour passes its own wait, sends `finish` and exits before
    this node asks whether it is up. The wait must end with the `finish`, not run out (300 s)."""
    from ravnest.comm.transport import Credentials, Peer
    from ravnest.run.local import free_ports

    inbox = Inbox()
    gone = Peer(f"127.0.0.1:{free_ports(1)[0]}", Credentials("t", "plan"))  # nothing listens
    waiting = threading.Thread(target=gone.wait_ready, args=(300.0,),
                               kwargs={"stop": lambda: "finish" in inbox.control_ops},
                               daemon=True)
    waiting.start()
    waiting.join(1.0)
    assert waiting.is_alive()  # still waiting for the peer
    inbox.deliver(Frame("control", control={"op": "finish"}))
    waiting.join(30.0)
    assert not waiting.is_alive() and inbox.control_ops == {"finish"}
    gone.close(timeout=0)
