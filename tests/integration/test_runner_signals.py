"""`ravnest run` told to stop: what `timeout`, `kill` and systemd do to it (SIGTERM), and what
happens when it dies outright (SIGKILL). Either way no worker trains on unsupervised; a SIGTERM
also leaves a status that says the run ended."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from processes import pids_with

from ravnest.run.locking import lock_folder

WORKERS = 6
"""Workers of examples/digits.yaml."""
GENEROUS = 300.0
"""Seconds to wait for six workers to start on a loaded two-core machine."""


def _status(out: Path) -> dict[str, Any]:
    try:
        return dict(json.loads((out / "status.json").read_text()))
    except (OSError, ValueError):
        return {}


def _stderr(tmp_path: Path) -> str:
    return (tmp_path / "stderr").read_text(errors="replace")


def _workers(out: Path) -> list[int]:
    return pids_with(str(out / "nodes"), "worker")


def _start_training(tmp_path: Path, digits_doc: dict[str, Any],
                    ) -> tuple[subprocess.Popen[str], Path]:
    """A `ravnest run` of digits long enough never to finish here, once its six workers train."""
    digits_doc["spec"]["training"]["epochs"] = 200
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(digits_doc))
    out = tmp_path / "out"
    with open(tmp_path / "stderr", "w") as err:
        runner = subprocess.Popen(
            [sys.executable, "-m", "ravnest", "run", str(job), "-o", str(out), "--no-progress"],
            stdout=subprocess.DEVNULL, stderr=err, text=True)
    deadline = time.monotonic() + GENEROUS
    # (Running: every worker process runs; progress: the roots have trained)
    while not (_status(out).get("phase") == "Running" and _status(out).get("progress")
               and len(_workers(out)) == WORKERS):
        if runner.poll() is not None:
            raise AssertionError(f"the run ended before training:\n{_stderr(tmp_path)}")
        if time.monotonic() > deadline:
            runner.kill()
            raise AssertionError(f"no training after {GENEROUS:.0f} s: {_status(out)}")
        time.sleep(0.5)
    return runner, out


def _gone(pids: list[int], within: float) -> list[int]:
    """The pids still alive after waiting up to `within` seconds for them to end."""
    deadline = time.monotonic() + within
    while True:
        alive = [p for p in pids if Path(f"/proc/{p}").exists() and not _zombie(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


@pytest.fixture
def reaper(tmp_path: Path) -> Iterator[None]:
    """Whatever the test's outcome, no process of its run outlives it."""
    yield
    for pid in pids_with(str(tmp_path / "out")):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_sigterm_stops_the_workers_and_records_the_run(tmp_path, digits_doc, reaper):
    runner, out = _start_training(tmp_path, digits_doc)
    workers = _workers(out)
    second = subprocess.run([sys.executable, "-m", "ravnest", "run", str(tmp_path / "job.yaml"),
                             "-o", str(out), "--no-progress"], capture_output=True, text=True,
                            timeout=300)
    assert second.returncode == 1
    assert f"is in use by another run (pid {runner.pid}, started " in second.stderr
    runner.send_signal(signal.SIGTERM)
    try:
        runner.wait(timeout=120)
    finally:
        runner.kill()
    stderr = _stderr(tmp_path)
    assert runner.returncode == 128 + signal.SIGTERM, stderr
    assert "stopped by SIGTERM" in stderr
    assert "Traceback" not in stderr
    assert _gone(workers, 0) == []
    assert _workers(out) == []
    status = _status(out)
    assert status["phase"] == "Failed" and status["completionTime"]
    (failed,) = [c for c in status["conditions"] if c["type"] == "Failed"]
    assert failed["reason"] == "Terminated" and failed["status"] == "True"
    assert "stopped by SIGTERM" in failed["message"]
    shown = subprocess.run([sys.executable, "-m", "ravnest", "status", "digits", "-o", str(out)],
                           capture_output=True, text=True, timeout=120)
    assert shown.stdout.startswith("Failed"), shown.stdout


def test_workers_end_when_the_runner_is_killed(tmp_path, digits_doc, reaper):
    runner, out = _start_training(tmp_path, digits_doc)
    workers = _workers(out)
    os.kill(runner.pid, signal.SIGKILL)
    runner.wait(timeout=60)
    assert _gone(workers, 30) == []
    os.close(lock_folder(out))  # the kernel dropped the dead runner's lock: the folder is free
