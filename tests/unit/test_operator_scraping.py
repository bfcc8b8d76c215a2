"""The operator's progress scrapes run off its passes' threads (`ravnest_operator.scraping`): a
pass takes the last scrape that ended and never waits on a job's metrics endpoint."""

from __future__ import annotations

import threading

from ravnest_operator.scraping import Scrapes, scrape_roots

ROOTS = ("10.0.0.1", "10.0.0.2")


def _wait(scrapes: Scrapes, uid: str, hosts: tuple[str, ...]):
    for _ in range(500):
        got = scrapes.latest(uid, hosts)
        if got is not None:
            return got
        threading.Event().wait(0.01)
    raise AssertionError("no scrape ended")


def test_a_pass_gets_the_last_scrape_that_ended():
    calls = []

    def read(hosts, port, timeout):
        calls.append(hosts)
        return [{"ravnest_step": float(len(calls))} for _ in hosts]

    scrapes = Scrapes(9090, read=read)
    assert scrapes.latest("a", ROOTS) is None  # the first pass starts one
    got = _wait(scrapes, "a", ROOTS)
    assert len(got) == 2 and got[0]["ravnest_step"] >= 1
    assert scrapes.latest("a", ("10.0.0.9",)) is None  # a restarted root's: not the old pods'


def test_an_endpoint_that_never_answers_holds_its_own_job_only():
    stuck, calls = threading.Event(), []

    def read(hosts, port, timeout):
        calls.append(hosts)
        if hosts == ("slow",):
            stuck.wait()
        return [{"ravnest_step": 3.0}]

    scrapes = Scrapes(9090, threads=2, read=read)
    try:
        for _ in range(20):  # twenty passes of the slow job: one scrape in flight, none waited on
            assert scrapes.latest("slow", ("slow",)) is None
        assert calls.count(("slow",)) == 1
        assert _wait(scrapes, "fast", ("fast",)) == [{"ravnest_step": 3.0}]
    finally:
        stuck.set()


def test_a_failed_scrape_gives_nothing_and_the_next_is_tried():
    results = [OSError("refused"), [{"ravnest_step": 5.0}]]

    def read(hosts, port, timeout):
        r = results.pop(0) if results else [{"ravnest_step": 6.0}]
        if isinstance(r, Exception):
            raise r
        return r

    scrapes = Scrapes(9090, read=read)
    assert scrapes.latest("a", ROOTS[:1]) is None
    assert _wait(scrapes, "a", ROOTS[:1])[0]["ravnest_step"] in (5.0, 6.0)
    scrapes.forget("a")
    assert scrapes.latest("a", ROOTS[:1]) is None  # forgotten: starts again


def test_only_the_workers_own_samples_are_kept(monkeypatch):
    import ravnest_operator.scraping as scraping

    monkeypatch.setattr(scraping, "scrape", lambda port, host, timeout: {
        "ravnest_step": 1.0, "process_cpu_seconds_total": 2.0, "x" * 100: 3.0})
    assert scrape_roots(("h",), 9090, 1.0) == [{"ravnest_step": 1.0}]
