"""Give memory the C heap keeps after frees back to the OS, between updates.

glibc keeps freed allocations of 128 KiB to 32 MiB (its mmap threshold rises to the size of the
largest one freed) in its heaps, spread over gRPC's and PyTorch's threads. Frames and
activations come and go at every microbatch, so a worker's RSS creeps up by several
microbatches' worth beyond what it holds (`bench/memory.py`: the stem of the activation run
peaked at 1.48-1.62x of what it holds plus the runtime's overhead). `malloc_trim(0)` returns the
free pages. A worker calls `HeapTrimmer` after each update; it trims only when RSS grew by more
than `slack` since the last trim, so it costs a read of /proc/self/statm while RSS is flat.
Without glibc (or /proc) it does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable

log = logging.getLogger(__name__)

SLACK_BYTES = 64 << 20


def _glibc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim from the symbols the process already has (no library search, which
    runs `ldconfig -p`); None where the C library has none (musl)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim  # type: ignore[no-any-return]


def _statm_rss() -> int | None:
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class HeapTrimmer:
    """Call after each update: trims the C heap when RSS grew by more than `slack` bytes."""

    def __init__(self, slack: int = SLACK_BYTES,
                 rss: Callable[[], int | None] = _statm_rss,
                 trim: Callable[[int], int] | None = None) -> None:
        self._slack, self._rss = slack, rss
        self._trim = trim if trim is not None else _glibc_trim()
        self._floor = rss()
        self.trims = 0

    def __call__(self) -> None:
        if self._trim is None or self._floor is None:
            return
        rss = self._rss()
        if rss is None or rss <= self._floor + self._slack:
            return
        self._trim(0)
        self.trims += 1
        self._floor = self._rss()
        log.debug("heap trimmed: RSS %.0f -> %s MB", rss / 1e6,
                  "?" if self._floor is None else f"{self._floor / 1e6:.0f}")
