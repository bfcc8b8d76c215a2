"""The fork server (`ravnest.run.spawning`): a child it forks is the process `subprocess.Popen`
would have started for the same command (session, umask, folder, environment, search path,
standard streams, command line as `ps` shows it, exit status), and says how it ended as Popen
does. The children are real `ravnest` commands: `ravnest status -w` on a local run folder loops
until the status we write says the run finished, and `ravnest plan` imports a job's model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from ravnest.run import spawning

ROOT = Path(__file__).resolve().parents[2]
SERVER_ONLY = "RAVNEST_TEST_SERVER_ONLY"


def _env() -> dict[str, str]:
    """This environment, in which `python -m ravnest` imports the ravnest beside the tests."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        str(ROOT / "worker"), os.environ.get("PYTHONPATH")]))}


@pytest.fixture(scope="module")
def spawner() -> Iterator[spawning.Spawner]:
    server = spawning.Spawner({**_env(), SERVER_ONLY: "1"}, preload=("torch",))
    yield server
    server.close()


def _status(folder: Path, phase: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "status.json.tmp").write_text(json.dumps({"phase": phase}))
    (folder / "status.json.tmp").replace(folder / "status.json")


def _watch(spawner: spawning.Spawner, tmp_path: Path, env: dict[str, str] | None = None,
           umask: int | None = None, pipe: bool = False) -> tuple[spawning.Forked, Path]:
    """`ravnest status demo -o run -w` in tmp_path (run: a relative folder), its output in
    tmp_path/log: it runs until run/status.json says the run finished; its stdin is a pipe
    (`pipe`) or nothing."""
    _status(tmp_path / "run", "Running")
    log = tmp_path / "log"
    argv = ["status", "demo", "-o", "run", "-w", "--interval", "0.1"]
    with open(log, "ab") as fh:
        cwd = os.getcwd()
        os.chdir(tmp_path)
        try:
            child = spawner.spawn(argv, env if env is not None else _env(), fh.fileno(),
                                  stdin=subprocess.PIPE if pipe else subprocess.DEVNULL,
                                  umask=umask, title=[sys.executable, "-m", "ravnest", *argv])
        finally:
            os.chdir(cwd)
    return child, log


def _until(what: str, check, timeout: float = 60):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return got


def test_a_child_is_the_process_popen_would_have_started(spawner, tmp_path):
    child, log = _watch(spawner, tmp_path, umask=0o077)
    pid = child.pid
    _until("its first status line", lambda: "Running" in log.read_text())
    proc = Path(f"/proc/{pid}")
    cmdline = (proc / "cmdline").read_bytes().decode()
    assert "-m ravnest status demo -o run -w" in cmdline, cmdline
    assert os.getsid(pid) == pid and os.getpgid(pid) == pid  # a session of its own
    assert os.readlink(proc / "cwd") == str(tmp_path)
    umask = next(line for line in (proc / "status").read_text().splitlines()
                 if line.startswith("Umask:"))
    assert umask.split()[1] == "0077"
    assert os.readlink(proc / "fd" / "1") == os.readlink(proc / "fd" / "2") == str(log)
    assert child.poll() is None and child.returncode is None
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.2)

    _status(tmp_path / "run", "Succeeded")  # (read from the folder the child was started in)
    assert child.wait(60) == 0 == child.poll() == child.returncode
    assert "Succeeded" in log.read_text()


def test_a_child_runs_with_the_environment_it_was_given(spawner, tmp_path):
    """`ravnest status --kube` asks the `kubectl` on its PATH, here a script that says the
    phase is what two variables say: the one given to the child, not the server's own."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    kubectl = bin_dir / "kubectl"
    phase = "${" + SERVER_ONLY + ":-$CHILD_PHASE}"
    kubectl.write_text(f'#!/bin/sh\necho "{{\\"status\\": {{\\"phase\\": \\"{phase}\\"}}}}"\n')
    kubectl.chmod(0o755)
    env = {**_env(), "PATH": f"{bin_dir}:{os.environ['PATH']}", "CHILD_PHASE": "Succeeded"}
    log = tmp_path / "log"
    with open(log, "ab") as fh:
        child = spawner.spawn(["status", "demo", "--kube"], env, fh.fileno())
    assert child.wait(60) == 0, log.read_text()
    assert "Succeeded" in log.read_text(), log.read_text()


def test_a_child_ends_with_its_exit_code_or_minus_the_signal(spawner, tmp_path):
    failed, _ = _watch(spawner, tmp_path / "failed")
    killed, _ = _watch(spawner, tmp_path / "killed")
    stopped, log = _watch(spawner, tmp_path / "stopped")
    _status(tmp_path / "failed" / "run", "Failed")
    assert failed.wait(60) == 1  # (ravnest status says a failed run with exit 1)
    _until("the killed one's start", lambda: Path(f"/proc/{killed.pid}").exists())
    killed.kill()
    assert killed.wait(60) == -signal.SIGKILL
    _until("the stopped one's first line", lambda: "Running" in log.read_text())
    stopped.terminate()
    assert stopped.wait(60) == -signal.SIGTERM
    with open(tmp_path / "bad.log", "ab") as fh:
        bad = spawner.spawn(["status"], _env(), fh.fileno())
    assert bad.wait(60) == 2  # argparse: the job is missing
    assert "the following arguments are required: job" in (tmp_path / "bad.log").read_text()
    killed.kill()  # (a signal to a process that ended changes nothing)
    assert killed.returncode == -signal.SIGKILL


def test_a_child_reads_the_stdin_it_was_given(spawner, tmp_path):
    child, log = _watch(spawner, tmp_path, pipe=True)
    other, other_log = _watch(spawner, tmp_path / "other")
    for f in (log, other_log):  # (set up: its first line written)
        _until("its first line", lambda f=f: "Running" in f.read_text())
    assert child.stdin is not None  # a pipe: the child's fd 0 is its reading end
    fd0 = os.stat(f"/proc/{child.pid}/fd/0")
    assert fd0.st_ino == os.fstat(child.stdin.fileno()).st_ino
    child.stdin.close()
    assert other.stdin is None and os.readlink(f"/proc/{other.pid}/fd/0") == os.devnull
    given = tmp_path / "given"
    given.write_text("")
    with open(given, "rb") as fh, open(tmp_path / "third.log", "ab") as out:
        third = spawner.spawn(["status", "demo", "-o", str(tmp_path / "run"), "-w"], _env(),
                              out.fileno(), stdin=fh.fileno())
    _until("the third's first line", lambda: "Running" in (tmp_path / "third.log").read_text())
    assert third.stdin is None and os.readlink(f"/proc/{third.pid}/fd/0") == str(given)
    for c in (child, other, third):
        c.kill()
        c.wait(60)


def test_a_child_imports_from_its_own_pythonpath(spawner, tmp_path, digits_doc):
    """A job's model module is found on the child's PYTHONPATH, not the server's."""
    models = tmp_path / "mine"
    models.mkdir()
    (models / "my_models.py").write_text(
        "import torch\n\ndef tiny():\n    return torch.nn.Sequential(torch.nn.Flatten(), "
        "torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))\n\n"
        "def data():\n    d = torch.utils.data.TensorDataset(torch.zeros(64, 1, 8, 8), "
        "torch.zeros(64, dtype=torch.long))\n    return d, d\n")
    digits_doc["spec"]["model"] = {"entrypoint": "my_models:tiny",
                                   "exampleInput": {"shape": [32, 1, 8, 8]}}
    digits_doc["spec"]["data"]["entrypoint"] = "my_models:data"
    digits_doc["spec"]["providers"] = [{"ram": 4, "bandwidth": 1000, "replicas": 2}]
    digits_doc["spec"]["plan"] = {"clusters": 1}  # (planned at once)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(digits_doc))
    for pythonpath, code in [(os.environ.get("PYTHONPATH", ""), 2), (f"{models}", 0)]:
        log = tmp_path / f"plan-{code}.log"
        with open(log, "ab") as fh:
            child = spawner.spawn(["plan", str(job)], {
                **os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
                    pythonpath, str(ROOT / "worker")]))}, fh.fileno())
        assert child.wait(300) == code, log.read_text()[-3000:]
    assert "my_models" in (tmp_path / "plan-2.log").read_text()


def test_what_a_process_reads_as_it_starts_must_match_the_server_to_fork(spawner):
    same = dict(spawner._env)
    assert spawner.forks(same)
    assert spawner.forks({**same, "PYTHONPATH": "/elsewhere", "RAVNEST_TOKEN": "x"})
    assert not spawner.forks({**same, "OMP_NUM_THREADS": "7"})
    assert not spawner.forks({**same, "PYTHONHASHSEED": "3"})
    assert not spawner.forks({**same, "TORCH_LOGS": "dynamo"})  # (read as torch loads)
    assert not spawner.forks({k: v for k, v in same.items() if k != "PYTHONUNBUFFERED"}) \
        or "PYTHONUNBUFFERED" not in same
    assert spawner.parent_env({"RAVNEST_RUNNER_PID": "12"}, "RAVNEST_RUNNER_PID") == {
        "RAVNEST_RUNNER_PID": str(spawner.pid)}
    assert spawner.parent_env({}, "RAVNEST_RUNNER_PID") == {}


def test_children_outlive_a_closed_server_and_a_closed_server_starts_nothing(tmp_path):
    server = spawning.Spawner(_env(), preload=())
    child, log = _watch(server, tmp_path)
    _until("its first line", lambda: "Running" in log.read_text())
    server.close()
    try:
        assert Path(f"/proc/{child.pid}").exists()
        with pytest.raises(spawning.SpawnError, match="fork server"):
            _watch(server, tmp_path / "late")
    finally:
        os.kill(child.pid, signal.SIGKILL)


def test_a_child_of_a_server_that_died_is_not_waited_for_for_good(tmp_path):
    """The server killed while its child runs: the child's exit status is lost with it, yet its
    end is still seen (as a kill), and the server says it is gone."""
    server = spawning.Spawner(_env(), preload=())
    try:
        child, log = _watch(server, tmp_path)
        _until("its first line", lambda: "Running" in log.read_text())
        os.kill(server.pid, signal.SIGKILL)
        _until("the server's end to be seen", lambda: not server.alive)
        assert child.poll() is None  # (this child does not die with its parent)
        os.kill(child.pid, signal.SIGTERM)
        assert child.wait(30) == -signal.SIGKILL
        with pytest.raises(spawning.SpawnError, match="fork server"):
            _watch(server, tmp_path / "late")
    finally:
        server.close()
