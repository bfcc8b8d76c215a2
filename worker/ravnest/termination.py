"""How a process of a job tells its supervisor how it ended: its exit code and its container's
termination message. One writer and one reader for every party to that channel: a worker, a
planner pod and a finishing pod write (through the CLI); the operator and the local runner read.

On Kubernetes the kubelet keeps the message in the pod's status (`state.terminated.message`, at most
`LIMIT` bytes) with the exit code; `ravnest run` points each worker at a file beside its log
(`TERMINATION_LOG_ENV`) and reads the same message from there. A message is one of:

- a JSON object: a worker's final figures (`{"node": ..., "updates": ..., "samples": ...}`), a
  drained cluster's (`{"drained": ...}`), or a finishing pod's outputs (`{"outputs": ...}`);
- the plan a planner pod hands back (`ravnest.plan.handoff`);
- a line saying why the process failed (`TypeError: ...`, `invalid job: ...`).

A reader treats every message as data from a process it does not trust: `figures` is a JSON object
or nothing, `said` is one line of bounded length.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

TERMINATION_LOG_ENV = "RAVNEST_TERMINATION_LOG"
"""Where a process leaves its termination message (default: Kubernetes' `KUBELET_PATH`)."""
KUBELET_PATH = Path("/dev/termination-log")
"""Where the kubelet reads a container's termination message (its default
terminationMessagePath), made by the kubelet for each container it starts."""
LIMIT = 4096
"""Bytes of a container's termination message the kubelet keeps."""
SHOWN = 300
"""Characters of a failed process's message that a status, an event or a log line repeats."""
SPEC_ERROR_EXIT = 2
"""The exit code of a process that found the job invalid (`ravnest.cli`): no restart cures it."""


def destination(env: Mapping[str, str] | None = None, *, in_pod: bool = False) -> Path | None:
    """Where this process's termination message goes: the file `TERMINATION_LOG_ENV` names, else
    the kubelet's. `in_pod`: the process runs only in a pod (a planner or finishing pod), so the
    kubelet's file is the place even if it cannot be seen; otherwise it is used only where it
    exists (a worker started by hand outside a pod leaves no message, and makes nothing in /dev)."""
    named = (os.environ if env is None else env).get(TERMINATION_LOG_ENV)
    if named:
        return Path(named)
    return KUBELET_PATH if in_pod or KUBELET_PATH.exists() else None


def bounded(text: str) -> str:
    """`text` cut to the `LIMIT` bytes the kubelet keeps, on a character boundary."""
    raw = text.encode()
    return text if len(raw) <= LIMIT else raw[:LIMIT].decode(errors="ignore")


def write(text: str, env: Mapping[str, str] | None = None, *, in_pod: bool = False) -> None:
    """Leave `text` (bounded) as this process's termination message (`destination`). A worker's
    failure to write it is logged, not raised: its exit code still says how it ended. With
    `in_pod` the message is the pod's answer (a plan, outputs), and failing to write it raises
    OSError."""
    path = destination(env, in_pod=in_pod)
    if path is None:
        return
    try:
        path.write_text(bounded(text))
    except OSError:
        if in_pod:
            raise
        log.debug("no termination log at %s", path)


def write_figures(figures: Mapping[str, Any], env: Mapping[str, str] | None = None, *,
                  in_pod: bool = False) -> None:
    """Leave `figures` as a compact JSON object (`write`)."""
    write(json.dumps(dict(figures), separators=(",", ":")), env, in_pod=in_pod)


def write_error(error: BaseException, env: Mapping[str, str] | None = None, *,
                in_pod: bool = False) -> None:
    """Leave why the process failed: `Type: message` (`write`)."""
    write(describe(error), env, in_pod=in_pod)


def describe(error: BaseException) -> str:
    """An error as a termination message says it: `Type: message`."""
    return f"{type(error).__name__}: {error}"


def figures(message: str) -> dict[str, Any]:
    """The JSON object a message holds ({} when it holds none: a plan, an error, nothing)."""
    try:
        said = json.loads(message)
    except ValueError:
        return {}
    return dict(said) if isinstance(said, dict) else {}


def last_line(message: str, limit: int = SHOWN) -> str:
    """A message's last non-empty line, at most `limit` characters ("..." where cut)."""
    said = next((ln for ln in reversed([ln.strip() for ln in message.splitlines()]) if ln), "")
    return said if len(said) <= limit else said[:limit - 3] + "..."


@dataclass(frozen=True)
class Ending:
    """How a process ended: its exit code, why (Kubernetes' reason: Error, OOMKilled, Completed),
    its termination message, and when (an RFC 3339 time, on Kubernetes)."""

    exit_code: int | None
    reason: str | None = None
    message: str = ""
    finished_at: str | None = None

    @property
    def figures(self) -> dict[str, Any]:
        """The JSON object its message holds ({} without one)."""
        return figures(self.message)

    @property
    def said(self) -> str:
        """Its message's last line, bounded (`last_line`): a failed process's error."""
        return last_line(self.message)

    @property
    def spec_error(self) -> bool:
        """It found the job invalid: no restart cures that."""
        return self.exit_code == SPEC_ERROR_EXIT


NOT_ENDED = Ending(exit_code=None)
"""A process that has not ended (or left no trace of how it did)."""


def of_pod(pod: Mapping[str, Any]) -> Ending:
    """How a pod's own container ended, from the pod as the API returns it (a dict): the
    container named first in its spec (the one the operator made; a template merges into it, and
    sidecars an admission controller injects come after it), else the first that terminated.
    While none has terminated: `NOT_ENDED` (no exit code, no message, no figures)."""
    status = pod.get("status") or {}
    spec = pod.get("spec") or {}
    ours = next((c.get("name") for c in spec.get("containers") or []), None)
    ended = [(cs.get("name"), (cs.get("state") or {}).get("terminated"))
             for cs in status.get("containerStatuses") or []]
    ended = [(name, term) for name, term in ended if isinstance(term, Mapping)]
    term = next((t for name, t in ended if name == ours), None) or next(
        (t for _, t in ended), None)
    if term is None:
        return NOT_ENDED
    code = term.get("exitCode")
    return Ending(exit_code=code if isinstance(code, int) else None,
                  reason=term.get("reason") or None, message=str(term.get("message") or ""),
                  finished_at=term.get("finishedAt") or None)


def beside(log_file: Path) -> Path:
    """Where `ravnest run` has a worker that logs to `log_file` leave its message."""
    return log_file.with_suffix(".termination")


def local_env(env: Mapping[str, str], log_file: Path) -> dict[str, str]:
    """`env` for a local worker that logs to `log_file`, its message going beside that log (none
    left from before)."""
    path = beside(log_file)
    path.unlink(missing_ok=True)
    return {**env, TERMINATION_LOG_ENV: str(path.resolve())}


def of_local(log_file: Path, exit_code: int | None) -> Ending:
    """How a local worker that logs to `log_file` ended (`local_env`), with its exit code."""
    try:
        message = beside(log_file).read_text(errors="replace")
    except OSError:
        message = ""
    return Ending(exit_code=exit_code, reason=None, message=message)
