"""HeapTrimmer: the C heap is trimmed after an update only when RSS grew by more than the slack
since the last trim, and never where there is no glibc or /proc."""

from __future__ import annotations

from ravnest.heap import HeapTrimmer

MB = 1 << 20


class FakeProcess:
    def __init__(self, rss: int) -> None:
        self.rss = rss
        self.trims: list[int] = []

    def read(self) -> int:
        return self.rss

    def trim(self, pad: int) -> int:
        self.trims.append(pad)
        self.rss -= 50 * MB  # what the heap gave back
        return 1


def test_trims_only_after_growth_beyond_the_slack() -> None:
    p = FakeProcess(500 * MB)
    trimmer = HeapTrimmer(slack=64 * MB, rss=p.read, trim=p.trim)
    for grown in (0, 10, 64):  # flat, or within the slack: nothing to do
        p.rss = (500 + grown) * MB
        trimmer()
    assert p.trims == []
    p.rss = 600 * MB
    trimmer()
    assert p.trims == [0] and trimmer.trims == 1
    p.rss = 600 * MB  # the floor is now 550 MB: 600 is within the slack
    trimmer()
    assert trimmer.trims == 1
    p.rss = 700 * MB
    trimmer()
    assert trimmer.trims == 2


def test_without_glibc_or_proc_nothing_happens() -> None:
    p = FakeProcess(500 * MB)
    unreadable = HeapTrimmer(slack=0, rss=lambda: None, trim=p.trim)
    unreadable()
    assert p.trims == []


def test_on_this_linux_it_finds_malloc_trim_and_reads_rss() -> None:
    trimmer = HeapTrimmer(slack=0)
    assert trimmer._trim is not None and trimmer._floor is not None and trimmer._floor > 0
    trimmer()  # a real malloc_trim(0) when RSS moved at all: must not fail
