"""HeapTrimmer: the C heap is trimmed after an update only when RSS grew by more than the slack
since the last trim, and never where there is no glibc or /proc."""

from __future__ import annotations

import os
import subprocess
import sys

from ravnest.train import heap
from ravnest.train.heap import HeapTrimmer

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


_CYCLES = """
import resource
{setup}
msg = bytes(1 << 20)
for _ in range(20):
    bytes(bytearray(msg))  # a received 1 MiB message, copied, both freed
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(200):
    bytes(bytearray(msg))
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _page_faults(setup: str, env: dict[str, str] | None = None) -> int:
    """Minor page faults of 200 allocate-copy-free cycles of 1 MiB in a fresh process."""
    out = subprocess.run([sys.executable, "-c", _CYCLES.format(setup=setup)], check=True,
                         capture_output=True, text=True, env={**os.environ, **(env or {})})
    return int(out.stdout.strip().splitlines()[-1])


def test_tuned_heap_keeps_the_pages_of_freed_megabyte_blocks() -> None:
    """With glibc's own thresholds the heap is grown and trimmed back around each 1 MiB block,
    so every cycle faults its pages in again (about 512 a cycle here); after `tune` the pages
    stay in the heap."""
    untuned = _page_faults("")
    tuned = _page_faults("from ravnest.train import heap\nassert heap.tune({})")
    assert tuned < 2_000, (tuned, untuned)
    assert tuned * 10 < untuned, (tuned, untuned)  # the cost it removes, on this glibc


def test_tune_leaves_a_heap_the_environment_tunes_alone() -> None:
    assert not heap.tune({"MALLOC_TRIM_THRESHOLD_": "131072"})
    assert not heap.tune({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"})
    # the user's setting stands: the same process with their trim threshold of 128 KiB faults
    env = {"MALLOC_TRIM_THRESHOLD_": "131072", "MALLOC_MMAP_THRESHOLD_": "33554432"}
    tried = _page_faults("import os\nfrom ravnest.train import heap\n"
                         "assert not heap.tune(os.environ)", env)
    assert tried > 200 * 100, tried
