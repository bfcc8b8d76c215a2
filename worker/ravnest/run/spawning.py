"""Worker processes forked from one process that imported torch once (a fork server).

A fresh `python -m ravnest worker` spends about 4 CPU-seconds importing torch, grpc and ravnest
before it does anything of its own: for the 6 workers of the digits example, a third of the CPU
the whole run takes on 2 cores. `Spawner` starts one server process (`ravnest forkserver`), which
imports the worker's modules once (`PRELOAD`) and then forks a child for each process asked of it;
the child becomes the process `subprocess.Popen` would have started: its own session, umask,
working folder, environment, standard streams (the file descriptors passed to the server with the
request), and command line as `ps` shows it (setproctitle), and runs the CLI's entry point
(`ravnest.cli.entry`) with its arguments.

`Forked` is the part of `subprocess.Popen` that its callers use (pid, poll, wait, returncode,
stdin, send_signal, terminate, kill): the server reaps its children and reports each one's exit
status, negative for a signal as Popen has it.

Only the server forks, and only while it runs no Python thread besides its own (it starts none;
it checks), so a child starts from one thread's state, as fork requires (native pools, such as
OpenBLAS's, mend themselves across a fork). CUDA is never touched by
the server: a CUDA context does not survive a fork, so workers on a GPU are started as plain
processes by the runner (`LocalRun`), whose children they then are.

The server is reached through a socket pair that only the process that started it holds (no name
on the file system); it exits when that process closes its end or dies. A child is started with
the caller's environment, not the server's: `RUNNER_PID_ENV` (the process a worker dies with,
`ravnest.run.worker.exit_with_runner`) must then name the server, the child's parent, which
`Spawner.parent_env` gives.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any, NoReturn

import setproctitle

PRELOAD = ("ravnest.run.worker",)
"""What the server imports before its first fork: everything a worker imports to train. Not
torch._dynamo, which torch imports on the first call of an optimizer's methods (2 to 3
CPU-seconds in each worker): with it imported here, a SIGKILLed worker's peers no longer saw its
connections break (test_elastic's rejoin test: a ring round waited out its 30 s timeout instead;
cause not found), so each child still imports it for itself."""

MAX_MESSAGE = 1 << 20
"""The largest request or reply (one datagram of the socket pair: a command line and an
environment)."""

AT_START = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OPENBLAS_CORETYPE",
            "OPENBLAS_L2_SIZE", "LD_PRELOAD", "LD_LIBRARY_PATH", "MALLOC_ARENA_MAX")
"""Variables read once, when the interpreter or a library loads (and every variable named with
one of `AT_START_PREFIXES` but PYTHONPATH, which a child applies to its sys.path): a process
whose environment changes one of them from the server's is not what a fork of the server would
be (`Spawner.forks`)."""

AT_START_PREFIXES = ("PYTHON", "TORCH")
"""The interpreter's variables, and torch's (TORCH_SHOW_CPP_STACKTRACES, TORCH_LOGS, ...: many are
read when torch is imported, which the server did)."""

REAP_SECONDS = 0.1
"""How often the server looks for children that ended, at most, while it waits for a request."""


class SpawnError(RuntimeError):
    """The server could not start a process, or is gone."""


class Forked:
    """A process the server forked, as much of `subprocess.Popen` as the runner uses."""

    def __init__(self, spawner: Spawner, argv: Sequence[str], pid: int,
                 stdin: IO[bytes] | None) -> None:
        self.args = list(argv)
        self.pid = pid
        self.stdin = stdin
        self.returncode: int | None = None
        self._spawner = spawner

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self._spawner.changed:
            if not self._spawner.changed.wait_for(lambda: self.returncode is not None, timeout):
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Spawner:
    """A fork server, started with `env` (what its children inherit at import: OMP_NUM_THREADS
    is read once, when torch loads its OpenMP); close() ends it (its children live on)."""

    def __init__(self, env: Mapping[str, str] | None = None,
                 preload: Sequence[str] = PRELOAD) -> None:
        self._env = dict(env if env is not None else os.environ)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._server = subprocess.Popen(
                [sys.executable, "-m", "ravnest", "forkserver", "--fd", str(theirs.fileno()),
                 *(a for p in preload for a in ("--preload", p))],
                env=self._env, pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._sock = ours
        self.changed = threading.Condition()
        self._send = threading.Lock()
        self._replies: dict[int, dict[str, Any]] = {}
        self._children: dict[int, Forked] = {}
        self._ended: dict[int, int] = {}
        self._gone: str | None = None
        self._closed = False
        self._next = 0
        self._reader = threading.Thread(target=self._read, name="spawner", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self._server.pid

    def forks(self, env: Mapping[str, str]) -> bool:
        """Whether a process with `env` can be a fork of the server: what the interpreter and its
        libraries read when they load (`AT_START`) is the same in both."""
        mine = self._env
        return all(env.get(k) == mine.get(k) for k in {*env, *mine}
                   if k in AT_START or (k.startswith(AT_START_PREFIXES) and k != "PYTHONPATH"))

    def parent_env(self, env: Mapping[str, str], key: str) -> dict[str, str]:
        """`env` with `key`, when it names a process, naming the server instead: the parent of
        the processes it forks."""
        return {**env, key: str(self.pid)} if env.get(key) else dict(env)

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], stdout: int,
              stdin: int = subprocess.DEVNULL, umask: int | None = None,
              title: Sequence[str] | None = None) -> Forked:
        """Start `ravnest <argv>` (the CLI's arguments) with `env`, writing its stdout and stderr
        to descriptor `stdout`; its stdin is nothing (`subprocess.DEVNULL`), a pipe whose writing
        end is the returned process's `stdin` (`subprocess.PIPE`), or a descriptor, as Popen's.
        `title`: its command line as `ps` shows it."""
        write = -1
        if stdin == subprocess.PIPE:
            read, write = os.pipe()
        elif stdin == subprocess.DEVNULL:
            read = os.open(os.devnull, os.O_RDONLY)
        else:
            read = stdin
        try:
            reply = self._ask(argv, env, umask, title, [stdout, read])
        except BaseException:
            if write >= 0:
                os.close(write)
            raise
        finally:
            if read != stdin:
                os.close(read)  # (the server has its own copy, and so has the child)
        child = Forked(self, argv, int(reply["pid"]),
                       os.fdopen(write, "wb") if write >= 0 else None)
        with self.changed:
            self._children[child.pid] = child
            if child.pid in self._ended:  # (ended before this thread took the reply)
                child.returncode = self._ended.pop(child.pid)
        return child

    def _ask(self, argv: Sequence[str], env: Mapping[str, str], umask: int | None,
             title: Sequence[str] | None, fds: list[int]) -> dict[str, Any]:
        """Send one request with `fds` and return the server's reply to it."""
        with self._send:
            self._next += 1
            ident = self._next
            data = json.dumps({"id": ident, "argv": list(argv), "env": dict(env),
                               "cwd": os.getcwd(), "umask": umask,
                               "title": " ".join(title or argv)}).encode()
            if len(data) > MAX_MESSAGE:
                raise SpawnError(f"a request of {len(data)} bytes (at most {MAX_MESSAGE})")
            try:
                socket.send_fds(self._sock, [data], fds)
            except OSError as e:
                raise SpawnError(f"the fork server (pid {self.pid}) is gone: {e}") from None
        with self.changed:
            self.changed.wait_for(lambda: ident in self._replies or self._gone is not None)
            reply = self._replies.pop(ident, None)
        if reply is None:
            raise SpawnError(str(self._gone))
        if "error" in reply:
            raise SpawnError(f"the fork server could not start {' '.join(argv)}: "
                             f"{reply['error']}")
        return reply

    def _read(self) -> None:
        """The replies and exit statuses the server sends, until it closes its end."""
        why = f"the fork server (pid {self.pid}) ended"
        try:
            while True:
                data = self._sock.recv(MAX_MESSAGE)
                if not data:
                    break
                message = json.loads(data)
                with self.changed:
                    if "ended" in message:
                        pid, code = int(message["ended"]), int(message["code"])
                        child = self._children.pop(pid, None)
                        if child is None:
                            self._ended[pid] = code
                        else:
                            child.returncode = code
                    else:
                        self._replies[int(message["id"])] = message
                    self.changed.notify_all()
        except OSError as e:
            why = f"{why}: {e}"
        with self.changed:
            self._gone = why
            self.changed.notify_all()
        self._outlive()

    def _outlive(self) -> None:
        """The server is gone, and with it the exit statuses of the children still running:
        each one that ends from now on (the runner's workers die with the server, their parent)
        is said to have ended with SIGKILL, so that no caller waits for it for good (until
        close())."""
        while not self._closed:
            with self.changed:
                for pid, child in list(self._children.items()):
                    try:
                        os.kill(pid, 0)
                    except ProcessLookupError:
                        child.returncode = -signal.SIGKILL
                        del self._children[pid]
                        self.changed.notify_all()
            time.sleep(REAP_SECONDS)

    @property
    def alive(self) -> bool:
        """Whether the server still forks."""
        return self._gone is None

    def close(self) -> None:
        """End the server (its children go on; their ends are no longer reported)."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        try:
            self._server.wait(10)
        except subprocess.TimeoutExpired:
            self._server.kill()
            self._server.wait()
        self._reader.join(5)


def serve(fd: int, preload: Sequence[str], entry: Callable[[list[str]], NoReturn]) -> int:
    """The server's loop on socket `fd`: import `preload`, then fork a child per request and
    report each child's end, until the other end is closed (0). In a child, never returns: runs
    `entry` with the request's arguments."""
    # (set up now, while the environment whose space a longer title takes is still there)
    setproctitle.setproctitle(" ".join(sys.orig_argv))
    path = _SearchPath.of_this_process()
    for name in preload:
        importlib.import_module(name)
    sock = socket.socket(fileno=fd)
    children: set[int] = set()
    try:
        while True:
            _reap(sock, children)
            ready, _, _ = select.select([sock], [], [], REAP_SECONDS)
            if not ready:
                continue
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 2)
            if not data:
                return 0
            request = json.loads(data)
            try:
                if threading.active_count() > 1:
                    raise SpawnError(f"the fork server runs {threading.active_count()} Python "
                                     f"threads: it forks only with one")
                pid = os.fork()
            except (OSError, SpawnError) as e:
                for f in fds:
                    os.close(f)
                sock.send(json.dumps({"id": request["id"], "error": str(e)}).encode())
                continue
            if pid == 0:
                _become(sock, fds, request, path, entry)
            for f in fds:
                os.close(f)
            children.add(pid)
            sock.send(json.dumps({"id": request["id"], "pid": pid}).encode())
    except (BrokenPipeError, ConnectionResetError):
        return 0
    finally:
        sock.close()


def _reap(sock: socket.socket, children: set[int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        sock.send(json.dumps({"ended": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


class _SearchPath:
    """How the server's sys.path came to be: whether `python -m` put the working folder first,
    the PYTHONPATH entries after it, and the rest (the standard library, site-packages)."""

    def __init__(self, cwd_first: bool, rest: list[str]) -> None:
        self.cwd_first, self.rest = cwd_first, rest

    @classmethod
    def of_this_process(cls) -> _SearchPath:
        cwd = os.getcwd()
        cwd_first = bool(sys.path) and sys.path[0] == cwd
        given = _entries(os.environ.get("PYTHONPATH", ""), cwd)
        return cls(cwd_first, [p for p in sys.path[1 if cwd_first else 0:] if p not in given])

    def of(self, pythonpath: str, cwd: str) -> list[str]:
        """sys.path as `python -m` would have it, started in `cwd` with `pythonpath`."""
        return [*([cwd] if self.cwd_first else []), *_entries(pythonpath, cwd), *self.rest]


def _entries(pythonpath: str, cwd: str) -> list[str]:
    return [os.path.normpath(os.path.join(cwd, p)) for p in pythonpath.split(os.pathsep) if p]


def _become(sock: socket.socket, fds: list[int], request: dict[str, Any], path: _SearchPath,
            entry: Callable[[list[str]], NoReturn]) -> NoReturn:
    """In a forked child: become the process asked for, then run `entry` (which exits)."""
    try:
        sock.close()
        os.setsid()
        out, stdin = fds
        os.dup2(stdin, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        for f in {out, stdin}:
            if f > 2:
                os.close(f)
        if request.get("umask") is not None:
            os.umask(int(request["umask"]))
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path[:] = path.of(os.environ.get("PYTHONPATH", ""), request["cwd"])
        importlib.invalidate_caches()
        setproctitle.setproctitle(request["title"])
        sys.argv = [sys.argv[0], *request["argv"]]
    except BaseException:  # (nothing of the child's own ran yet: say why and go)
        import traceback

        traceback.print_exc()
        os._exit(127)
    entry(list(request["argv"]))
