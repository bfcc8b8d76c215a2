"""The ticker that passes over every job between its changes, in-process with a fake pass: what
it queues, what it forgets, and that a pass runs in the context it was started from (kopf's, for
its Events)."""

from __future__ import annotations

import contextvars
import logging
import math
import threading

import kopf
import pytest

from ravnest_operator.ticking import Ticker, Tracked

A, B = Tracked("uid-a", "a", "ns"), Tracked("uid-b", "b", "ns")


def test_each_tracked_job_gets_a_pass_per_tick():
    seen: list[str] = []
    ticker = Ticker(60, lambda job: seen.append(job.name) or 0.0)
    ticker.track(A)
    ticker.track(B)
    for f in ticker.tick():
        f.result(10)
    assert sorted(seen) == ["a", "b"]
    for f in ticker.tick():
        f.result(10)
    assert sorted(seen) == ["a", "a", "b", "b"]
    ticker.stop()


def test_a_job_whose_pass_is_still_running_is_not_queued_again():
    release, started = threading.Event(), threading.Event()

    def slow(job: Tracked) -> bool:
        if job is A:
            started.set()
            assert release.wait(10)
        return 0.0

    ticker = Ticker(60, slow)
    ticker.track(A)
    ticker.track(B)
    first = ticker.tick()
    assert started.wait(10)
    second = ticker.tick()  # A's pass has not ended: only B's is queued
    for f in second:
        f.result(10)
    assert len(first) == 2 and len(second) == 1
    release.set()
    for f in first:
        f.result(10)
    assert len(ticker.tick()) == 2
    ticker.stop()


def test_a_job_found_gone_is_forgotten():
    ticker = Ticker(60, lambda job: None if job is A else 0.0)
    ticker.track(A)
    ticker.track(B)
    for f in ticker.tick():
        f.result(10)
    assert ticker.tracked() == [B]
    ticker.forget("uid-b")
    assert ticker.tracked() == [] and ticker.tick() == []
    ticker.stop()


def test_a_failing_pass_is_logged_and_tried_again(caplog):
    calls: list[str] = []

    def failing(job: Tracked) -> float:
        calls.append(job.name)
        if len(calls) == 1:
            raise kopf.TemporaryError("creating Pod a-node-0: 503 Service Unavailable")
        raise RuntimeError("boom")

    clock = Clock()
    ticker = Ticker(7, failing, clock=clock)
    ticker.track(A)
    with caplog.at_level(logging.WARNING, logger="ravnest_operator.ticking"):
        for _ in range(2):
            for f in ticker.tick():
                f.result(10)
            assert ticker.due_in("uid-a") == 7  # (due again after the interval)
            clock.now += 7
    assert calls == ["a", "a"] and ticker.tracked() == [A]
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == ("job ns/a: creating Pod a-node-0: 503 Service Unavailable; tried "
                           "again in 7 s")
    assert messages[1] == "job ns/a: the pass failed; tried again in 7 s"
    assert caplog.records[1].exc_info is not None
    ticker.stop()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_job_is_passed_over_when_its_pass_says_it_is_due_or_poked():
    """A job in progress is due after its interval; a finished one when its TTL ends, or never
    (math.inf) until a change handler tracks it again; a poke passes over it at once."""
    clock = Clock()
    rests = {"a": 2.0, "b": math.inf}
    seen: list[str] = []

    def one(job: Tracked) -> float:
        seen.append(job.name)
        return rests[job.name]

    ticker = Ticker(2, one, clock=clock)
    ticker.track(A)
    ticker.track(B)

    def tick() -> list[str]:
        seen.clear()
        for f in ticker.tick():
            f.result(10)
        return sorted(seen)

    assert tick() == ["a", "b"]
    assert tick() == []  # (nothing due yet)
    clock.now += 2
    assert tick() == ["a"]
    clock.now += 3600
    assert tick() == ["a"]  # b: finished, no TTL
    for f in ticker.poke("uid-b"):
        f.result(10)
    assert ticker.poke("uid-c") == []  # (not tracked)
    ticker.track(B)  # (a change of its spec)
    assert tick() == ["b"]
    ticker.stop()


SEEN: contextvars.ContextVar[str] = contextvars.ContextVar("seen", default="none")


@pytest.mark.parametrize("jobs", [1, 6])
def test_passes_run_in_the_context_the_ticker_started_in(jobs):
    """Started from kopf's startup handler, its passes see kopf's context variables (its Event
    queue), each pass in a copy of its own, several at once."""
    got: list[str] = []
    barrier = threading.Barrier(jobs, timeout=10)
    done = threading.Event()

    def look(job: Tracked) -> float:
        barrier.wait()  # (all passes at once: each in its own copy of the context)
        got.append(SEEN.get())
        if len(got) == jobs:
            done.set()
        return math.inf  # (one pass each: none left waiting at the barrier)

    ticker = Ticker(0.05, look, workers=jobs)
    for i in range(jobs):
        ticker.track(Tracked(f"uid-{i}", f"j{i}", "ns"))
    context = contextvars.copy_context()
    context.run(SEEN.set, "kopf's")
    context.run(ticker.start)
    assert done.wait(10)
    ticker.stop()
    assert got[:jobs] == ["kopf's"] * jobs


def test_a_job_is_due_again_counted_from_when_its_pass_began():
    """A pass of 1.5 s every 2 s: the next is due half a second after the last one ended."""
    clock = Clock()

    def slow(job: Tracked) -> float:
        clock.now += 1.5
        return 2.0

    ticker = Ticker(2, slow, clock=clock)
    ticker.track(A)
    for f in ticker.tick():
        f.result(10)
    assert ticker.due_in("uid-a") == 0.5
    ticker.stop()


def test_the_running_ticker_passes_over_a_job_when_it_is_due_not_on_the_next_tick():
    """Its interval bounds how long it sleeps; a job due sooner (a TTL ending, a pass that asks
    for the next one soon) is passed over then."""
    passes = threading.Semaphore(0)

    def soon(job: Tracked) -> float:
        passes.release()
        return 0.1

    ticker = Ticker(3600, soon)
    ticker.track(A)
    ticker.start()
    assert all(passes.acquire(timeout=10) for _ in range(3))  # (one tick: an hour)
    ticker.stop()
