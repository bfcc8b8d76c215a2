"""A worker's C heap: thresholds fixed at start, and what it keeps given back between updates.

glibc raises its mmap threshold to the largest block freed and its trim threshold to twice that.
A worker receives gRPC messages of up to 1 MiB (a frame's chunks): each is a new `bytes` object,
freed after the copy into the frame's buffer, so with a threshold of 1 MiB the heap grew by `brk`
and was trimmed back at nearly every message, and every call paid the page faults of fresh
memory again (a 1 MiB `bytes` copy took 0.72 ms against 0.018 ms for 512 KiB; `Peer.send` of
1 MiB reached 0.73 of a raw gRPC stream). `tune` fixes them: blocks under MMAP_THRESHOLD come
from the heap, and it keeps up to TRIM_THRESHOLD free at its top (settings the environment
already gives, MALLOC_*_ or GLIBC_TUNABLES, stand instead).

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
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger(__name__)

SLACK_BYTES = 64 << 20
MMAP_THRESHOLD = 32 << 20
"""Blocks of this size or more are mmap'd, and unmapped when freed (where glibc's dynamic
threshold stops rising anyway)."""
TRIM_THRESHOLD = SLACK_BYTES
"""Free bytes a heap keeps at its top before glibc gives them back (more than that, RSS growth
is HeapTrimmer's to return after an update)."""
ENVIRONMENT = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")
"""Settings by which a user tunes glibc's heap: where one is given, `tune` changes nothing."""
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h


def tune(environ: Mapping[str, str]) -> bool:
    """Fix glibc's mmap and trim thresholds for this process (see the module doc); True if they
    were set, False without glibc or where `environ` already tunes the heap."""
    if any(name in environ for name in ENVIRONMENT):
        return False
    mallopt = _glibc("mallopt", ctypes.c_int, ctypes.c_int)
    return mallopt is not None and bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                                        and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def _glibc(name: str, *argtypes: Any) -> Callable[..., int] | None:
    """A C library function returning int, from the symbols the process already has (no library
    search, which runs `ldconfig -p`); None where the C library has none (musl)."""
    try:
        function = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = list(argtypes), ctypes.c_int
    return function  # type: ignore[no-any-return]


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
        self._trim = trim if trim is not None else _glibc("malloc_trim", ctypes.c_size_t)
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
