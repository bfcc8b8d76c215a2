"""Shared fixtures: job documents built from the shipped example, and an environment in which
worker processes can import the test models."""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

if TYPE_CHECKING:
    from minio_server import S3Server

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent


@pytest.fixture
def digits_doc() -> dict[str, Any]:
    """The shipped examples/digits.yaml as a mutable document."""
    return copy.deepcopy(yaml.safe_load((ROOT / "examples" / "digits.yaml").read_text()))


@pytest.fixture
def worker_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let worker subprocesses import tests/models.py."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]))


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One MinIO (tests/minio_server.py) for the session; tests make buckets of their own."""
    from minio_server import minio_server  # imported here: s3fs takes seconds to import

    with minio_server() as server:
        yield server


_TIERS: dict[str, list[float]] = {}
"""Tier (tests/<tier>/...) -> [tests, seconds] of this session, setup and teardown included."""
_NOT_RUN: dict[str, int] = {}
"""Tier -> its tests skipped in this session (not run: each one's reason is in pytest's -ra
summary), which the tier table says apart from the tests that ran."""
_MODULES: dict[str, float] = {}
"""Test module -> seconds of this session, setup and teardown included."""


_RSS_SAID = [4.0]
"""pytest's own resident memory (GB) above which the next 2 GB more are said (`_say_memory`)."""


def _say_memory(nodeid: str) -> None:
    """Say on stderr, at once, when this process's own resident memory passed the next mark
    after a test: a CI run was once killed by the OOM killer with pytest at 23.7 GB, and its log
    could not say which test had grown it."""
    try:
        line = next(ln for ln in Path("/proc/self/status").read_text().splitlines()
                    if ln.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return
    gb = int(line.split()[1]) / 2**20
    if gb > _RSS_SAID[0]:
        import sys

        print(f"\npytest's own memory: {gb:.1f} GB resident after {nodeid}", file=sys.stderr,
              flush=True)
        _RSS_SAID[0] = gb + 2.0


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Add each phase of each test to its tier's and its module's time (and say when pytest's
    own memory passed a mark, `_say_memory`)."""
    if report.when == "teardown":
        _say_memory(report.nodeid)
    module = report.nodeid.split("::", 1)[0]
    parts = module.split("/")
    tier = parts[1] if len(parts) > 2 and parts[0] == "tests" else "other"
    spent = _TIERS.setdefault(tier, [0, 0.0])
    spent[1] += report.duration
    if report.when == "setup":
        spent[0] += 1
    if report.skipped:
        _NOT_RUN[tier] = _NOT_RUN.get(tier, 0) + 1
    _MODULES[module] = _MODULES.get(module, 0.0) + report.duration


def _add_earlier_runs() -> int:
    """Where scripts/test runs pytest more than once (RAVNEST_TEST_TIMES names a file they
    share), add the earlier runs' tier and module times to this one's, and leave the sums there
    for the next; how many runs the sums cover."""
    import json

    path = os.environ.get("RAVNEST_TEST_TIMES")
    if not path:
        return 1
    try:
        before = json.loads(Path(path).read_text() or "{}")
    except (OSError, ValueError):
        before = {}
    for tier, (tests, seconds) in (before.get("tiers") or {}).items():
        spent = _TIERS.setdefault(tier, [0, 0.0])
        spent[0] += tests
        spent[1] += seconds
    for tier, n in (before.get("not_run") or {}).items():
        _NOT_RUN[tier] = _NOT_RUN.get(tier, 0) + n
    for module, seconds in (before.get("modules") or {}).items():
        _MODULES[module] = _MODULES.get(module, 0.0) + seconds
    runs = int(before.get("runs") or 0) + 1
    Path(path).write_text(json.dumps({"tiers": _TIERS, "not_run": _NOT_RUN,
                                      "modules": _MODULES, "runs": runs}))
    return runs


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Where this session's minutes went: each tier's tests and wall time, and the slowest
    modules, so that the next person sees what a new test costs CI (summed over the earlier
    pytest runs of the same scripts/test too: `_add_earlier_runs`)."""
    runs = _add_earlier_runs()
    if not _TIERS:
        return
    total = sum(seconds for _, seconds in _TIERS.values()) or 1.0
    write = terminalreporter.write_line
    terminalreporter.section("time by tier" + (f" (the {runs} pytest runs of scripts/test so far)"
                                                if runs > 1 else ""))
    write(f"{'tier':<14}{'tests':>7}{'not run':>9}{'seconds':>10}{'share':>8}")
    for tier, (tests, seconds) in sorted(_TIERS.items(), key=lambda kv: -kv[1][1]):
        write(f"{tier:<14}{int(tests):>7}{_NOT_RUN.get(tier, 0):>9}{seconds:>10.1f}"
              f"{seconds / total:>8.0%}")
    write(f"{'all':<14}{sum(int(t) for t, _ in _TIERS.values()):>7}"
          f"{sum(_NOT_RUN.values()):>9}{total:>10.1f}")
    if _NOT_RUN:
        write("not run: the tests skipped, each with its reason in the short summary (SKIPPED)")
    write("slowest modules:")
    for module, seconds in sorted(_MODULES.items(), key=lambda kv: -kv[1])[:12]:
        write(f"  {seconds:>8.1f} s  {module}")


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Say what would keep this process from exiting once the tests are done: threads that are not
    daemons and executors' threads (the interpreter joins both at exit), and child processes
    still running (they may hold the output pipe of whoever ran the tests), each with where it
    is. CI only sees a run that never ends; this names why."""
    import sys
    import threading
    import traceback
    from concurrent.futures import thread as executor_threads

    frames = sys._current_frames()
    joined = set(getattr(executor_threads, "_threads_queues", {}))  # joined at exit, daemons too

    def idle(t: threading.Thread) -> bool:  # an executor's thread waiting for work ends at exit
        frame = frames.get(t.ident or -1)
        return frame is not None and frame.f_code.co_name == "_worker" and \
            frame.f_code.co_filename == executor_threads.__file__

    threads = [t for t in threading.enumerate() if t is not threading.main_thread()
               and t.is_alive() and (not t.daemon or t in joined) and not idle(t)]
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == os.getpid():  # (state, ppid, ...)
                cmd = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(
                    errors="replace")
                children.append(f"pid {stat.parent.name}: {cmd.strip()}")
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    if not threads and not children:
        return
    lines = ["", "still running after the tests (the process may not exit):"]
    for t in threads:
        frame = frames.get(t.ident or -1)
        stack = "".join(traceback.format_stack(frame)[-6:]) if frame else "  (no frame)\n"
        lines.append(f"thread {t.name!r}:\n{stack}")
    lines += [f"child process {c}" for c in children]
    print("\n".join(lines), file=sys.stderr, flush=True)
