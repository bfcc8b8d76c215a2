"""Where the training loop's time goes: `ravnest_training_seconds_total` by activity."""

from __future__ import annotations

import threading
import time
import urllib.request

from ravnest.train.metrics import ACTIVITIES, Identity, WorkerMetrics

WHO = Identity("j", "ns", "node_1", "stem", 0, 1)


def seconds(m: WorkerMetrics) -> dict[str, float]:
    return {a: m.registry.get_sample_value("ravnest_training_seconds_total",
                                           {**WHO.labels(), "activity": a}) for a in ACTIVITIES}


def test_activities_are_exported_from_the_start_at_zero():
    assert seconds(WorkerMetrics(WHO)) == dict.fromkeys(ACTIVITIES, 0.0)


def test_nested_blocks_charge_the_innermost_activity_and_add_up_to_wall_time():
    m = WorkerMetrics(WHO)
    time.sleep(0.05)  # before the loop: not charged
    started = time.perf_counter()
    m.start_loop()
    with m.timed("compute"):
        time.sleep(0.03)
        with m.timed("communication"):
            time.sleep(0.02)
        time.sleep(0.01)
    with m.timed("waiting"):
        time.sleep(0.02)
    time.sleep(0.01)
    with m.timed("waiting"):
        pass
    wall = time.perf_counter() - started
    got = seconds(m)
    assert got["compute"] >= 0.04 and got["communication"] >= 0.02
    assert got["waiting"] >= 0.02 and got["other"] >= 0.01
    # sleeps overshoot, never undershoot: each activity got its own time and no more than the
    # slack of the whole run, and together they cover the loop's wall time
    slack = wall - 0.09
    assert got["compute"] <= 0.04 + slack and got["communication"] <= 0.02 + slack
    assert 0.09 <= sum(got.values()) <= wall


def test_a_finished_worker_waits_for_a_scrape_that_begins_after_it_finished():
    m = WorkerMetrics(WHO)
    port = m.serve(0, addr="127.0.0.1")

    def scrape() -> bytes:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            return bytes(r.read())

    m.steps.inc(66)
    scrape()  # before the wait: does not count
    assert m.wait_for_scrape(0.3) is False
    later = threading.Timer(0.2, scrape)
    later.start()
    started = time.monotonic()
    assert m.wait_for_scrape(30) is True
    assert time.monotonic() - started < 10  # the scrape ended the wait, not the timeout
    later.join()
    assert b"ravnest_steps_total{" in scrape()  # the watch itself exports nothing
