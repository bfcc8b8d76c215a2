"""The lock of a local run's output folder: one run at a time uses it, and other commands (`ravnest
drain`) can tell whether a run is going on there. Light: no torch, no grpc."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from ravnest.errors import RavnestError

LOCK_FILE = "run.lock"
"""In the output folder: flock'ed by the run that uses it, and names that run (pid, start)."""
ORDERS_LOCK_FILE = "orders.lock"
"""In the output folder: flock'ed while an order (`ravnest drain`, `ravnest grow`) is checked
against those given already and written."""
ORDERS_LOCK_SECONDS = 30.0
"""How long an order waits for another one being given at the same time."""


def lock_folder(folder: Path) -> int:
    """Create `folder` if need be and lock it for this process: the returned descriptor holds the
    lock until it is closed or the process ends (the kernel drops it even after SIGKILL).
    Raises RavnestError naming the run that holds it."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        raise RavnestError(f"cannot use {folder} as the output folder: {e}") from e
    try:
        _lock_or_refuse(fd, folder)
    except RavnestError:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    os.write(fd, json.dumps({"pid": os.getpid(), "started": started}).encode())
    return fd


def refuse_if_locked(folder: Path) -> None:
    """Raise RavnestError if a run holds `folder`; creates and changes nothing."""
    try:
        fd = os.open(folder / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return
    try:
        _lock_or_refuse(fd, folder)
    finally:
        os.close(fd)


def _lock_or_refuse(fd: int, folder: Path) -> None:
    """flock `fd` (the folder's lock file), or raise naming the run that holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = json.loads(os.pread(fd, 4096, 0))
            who = f"pid {holder['pid']}, started {holder['started']}"
        except (OSError, ValueError, KeyError, TypeError):
            who = "pid unknown"
        raise RavnestError(f"{folder} is in use by another run ({who}): wait for it to end or "
                           f"stop it, or choose another output folder") from None


def held(folder: Path) -> bool:
    """Whether a run holds `folder` now; creates and changes nothing."""
    try:
        refuse_if_locked(folder)
    except RavnestError:
        return True
    return False


@contextlib.contextmanager
def orders_locked(folder: Path, timeout: float = ORDERS_LOCK_SECONDS) -> Iterator[None]:
    """Hold the run folder's order lock: `ravnest drain` and `ravnest grow` given at once take
    turns, each checking its order against every one given before it. Raises RavnestError when
    another order holds it for `timeout` seconds."""
    try:
        fd = os.open(folder / ORDERS_LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:
        raise RavnestError(f"cannot give an order to the run in {folder}: {e}") from e
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise RavnestError(f"another order to the run in {folder} was being given "
                                       f"for {timeout:.0f}s: try again") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)


def write_whole(path: Path, text: str) -> None:
    """Write `path` whole or not at all: into a temporary file of this call's own beside it,
    then renamed over it, so that a reader never sees part of it and writers never share one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
