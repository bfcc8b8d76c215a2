"""Finding the processes a local run started, by what their command line names (the run's folder,
a node's metadata file), to kill one mid-run or to check that none is left behind."""

from __future__ import annotations

import os
from pathlib import Path


def pids_with(*markers: str) -> list[int]:
    """Every live process whose command line contains all of `markers`."""
    pids = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if all(m in cmd for m in markers):
                pids.append(int(pid))
    return pids


def worker_pid(node_file: str | Path) -> int | None:
    """The worker process started with this node metadata file, if it runs."""
    return next(iter(pids_with(str(node_file), "worker")), None)
