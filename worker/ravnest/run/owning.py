"""A checkpoint folder belongs to one job: who wrote it, with what settings, and who writes it now.

Two files at the folder's top, beside its ``step-…`` folders:

- ``ravnest-job.json``, the *record*: the job that owns the folder (on Kubernetes its namespace,
  name and uid; locally its name and job file) and the training settings that change what a
  step means (`STEP_SETTINGS`: the optimizer and its parameters, the schedule, the epochs...).
  A job of another name is refused. The same job with changed settings, or an earlier job of
  the same name (another uid, another job file), is refused unless its spec says
  ``checkpoint.resume: force``: each change is named by its path. Folders from before records
  existed are not judged (the plan fingerprint still is) and get one.
- ``ravnest-lease.json``, the *lease*: the run that writes the folder now, and until when
  (`LEASE_SECONDS`, renewed every `RENEW_SECONDS` while it runs). A live lease of another run is
  refused, so two jobs never write one folder. It is taken and changed atomically
  (`storing.Location.update`: an flock locally and on a claim, conditional writes on S3). A
  local run's lease is given back when the run ends and is taken over at once when the process
  that held it is gone from this machine; on Kubernetes the planner pod takes it, the roots of
  the job's clusters renew it, and an abandoned one runs out.

Both are checked before any worker starts: by `ravnest run` in `LocalRun.prepare`, and on
Kubernetes by the planner pod (`ravnest plan --termination-log`), which refuses the job as
invalid.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ravnest.errors import RavnestError, SpecError, shown
from ravnest.spec import Job
from ravnest.storing import Location, StorageError, is_durable, open_location

log = logging.getLogger(__name__)

RECORD = "ravnest-job.json"
LEASE = "ravnest-lease.json"
LEASE_SECONDS = 300.0
"""How long a lease holds unless renewed: a run that vanished (a deleted RavnestJob, a machine
that went away) keeps other jobs out of its folder at most this long."""
RENEW_SECONDS = 60.0
STEP_SETTINGS = ("epochs", "optimizer", "lrScheduler", "criterion", "updateFrequency",
                 "reduceFactor", "averageOptimizer", "outer", "schedule", "maxInFlight",
                 "gradientClipping", "precision")
"""The fields of spec.training that change what a checkpointed step means (the model and data,
batch size included, are the plan fingerprint's)."""
FIELD = "spec.checkpoint.path"


def identity(job: Job, source: str | Path | None = None) -> dict[str, Any]:
    """Which job this is: on Kubernetes (a uid), its namespace, name and uid; else its name and
    the job file it came from (`source`), if any."""
    md = job.metadata
    if md.uid:
        return {"namespace": md.namespace or "default", "name": md.name, "uid": md.uid}
    return {"name": md.name, "file": str(Path(source).resolve()) if source else None}


def settings(job: Job) -> dict[str, Any]:
    """The job's `STEP_SETTINGS`, as its spec gives them (camelCase, defaults filled in)."""
    training = job.spec.training.model_dump(by_alias=True, mode="json")
    return {k: training.get(k) for k in STEP_SETTINGS}


def _named(ident: dict[str, Any]) -> str:
    if ident.get("uid"):
        return f"RavnestJob {ident.get('namespace')}/{ident.get('name')} (uid {ident['uid']})"
    file = f" of {ident['file']}" if ident.get("file") else ""
    return f"job {ident.get('name')!r}{file}"


def _changes(then: Any, now: Any, path: str) -> list[str]:
    """Each leaf that differs between two settings documents, by its path."""
    if isinstance(then, dict) and isinstance(now, dict):
        return [c for k in sorted(then.keys() | now.keys(), key=str)
                for c in _changes(then.get(k), now.get(k), f"{path}.{k}")]
    return [] if then == now else [f"{path}: {shown(then)} then, {shown(now)} now"]


def judge(record: dict[str, Any] | None, job: Job, source: str | Path | None,
          force: bool, where: str) -> None:
    """Refuse `job` the folder `where` whose record is `record` (None: it has none), raising a
    SpecError that names what differs and what to do."""
    if not isinstance(record, dict):
        return
    theirs, mine = record.get("job"), identity(job, source)
    if not isinstance(theirs, dict):
        theirs = {}
    other_job = (theirs.get("name"), theirs.get("namespace")) != (mine["name"],
                                                                   mine.get("namespace"))
    if other_job:
        raise SpecError([f"{FIELD}: {where} holds the checkpoints of {_named(theirs)}, not of "
                         f"{_named(mine)}: they are not loaded and not overwritten. Choose "
                         f"another checkpoint path for this job, or move that folder away"])
    problems = []
    if theirs != mine:
        problems.append(f"{FIELD}: {where} was written by an earlier {_named(theirs)}; this is "
                        f"{_named(mine)}")
    problems += [f"{FIELD}: {where} was written with other training settings: {c}"
                 for c in _changes(record.get("settings"), settings(job), "spec.training")]
    if problems and not force:
        raise SpecError([*problems, "spec.checkpoint.resume: resuming from these checkpoints "
                         "would mix two runs; set resume: force to resume from them anyway, "
                         "or choose another checkpoint path to start afresh"])
    for p in problems:
        log.warning("resume: force: %s", p)


def read(root: Location, name: str) -> dict[str, Any] | None:
    """A JSON file of the folder's top (None: absent, or not a JSON object)."""
    try:
        data = json.loads(root.read(name))
    except FileNotFoundError:
        return None
    except ValueError:
        log.warning("%s/%s is not JSON; taken as absent", root, name)
        return None
    return data if isinstance(data, dict) else None


def claim(root: Location, job: Job, source: str | Path | None = None) -> Lease:
    """Take `root` for `job`, before any of its workers starts: its lease, then its record
    (judged, then written). Raises SpecError when the folder is another job's or another run's,
    or its record refuses the job; nothing is changed then."""
    lease = Lease(root, job, source)
    lease.take()
    try:
        judge(read(root, RECORD), job, source, job.spec.checkpoint.resume == "force", str(root))
        root.write(RECORD, json.dumps({
            "job": identity(job, source), "settings": settings(job),
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=1).encode())
    except BaseException:
        lease.release()
        raise
    return lease


class Lease:
    """One run's lease on a checkpoint folder."""

    def __init__(self, root: Location, job: Job, source: str | Path | None = None,
                 seconds: float = LEASE_SECONDS) -> None:
        self.root, self.seconds = root, seconds
        self.job = identity(job, source)
        self.local_run = not self.job.get("uid")
        if self.local_run:  # one process holds it; gone from this machine, its lease is too
            self.holder = f"ravnest run of {_named(self.job)}, pid {os.getpid()} on " \
                          f"{socket.gethostname()}"
        else:  # the job's pods (planner, roots) hold it together
            self.holder = _named(self.job)
        self.lost: str | None = None
        """Why the lease is no longer this run's (another took it), once it is not."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _mine(self) -> bytes:
        return json.dumps({"holder": self.holder, "job": self.job, "host": socket.gethostname(),
                           "pid": os.getpid() if self.local_run else None,
                           "expires": time.time() + self.seconds}).encode()

    def _refusal(self, lease: dict[str, Any]) -> str | None:
        """Why a lease found in the folder keeps this run out, or None (ours, run out, or held
        by a local process that is gone)."""
        holder = str(lease.get("holder", ""))
        expires = lease.get("expires")
        if holder == self.holder:
            return None
        if not isinstance(expires, (int, float)) or expires <= time.time():
            log.info("%s: the lease of %s ran out; taken over", self.root, holder[:200])
            return None
        pid = lease.get("pid")
        if (isinstance(pid, int) and lease.get("host") == socket.gethostname()
                and not _alive(pid)):
            log.info("%s: %s is gone; its lease taken over", self.root, holder[:200])
            return None
        left = expires - time.time()
        until = time.strftime("%H:%M:%S UTC", time.gmtime(expires))
        return (f"{FIELD}: {self.root} is in use by {holder[:200]} (its lease runs until "
                f"{until}, {left:.0f} s from now, and is renewed while it runs): two jobs never "
                f"write one checkpoint folder; wait for that run to end, or choose another path")

    def _take(self, old: bytes | None) -> bytes:
        lease = _parsed(old)
        refusal = None if lease is None else self._refusal(lease)
        if refusal:
            raise SpecError([refusal])
        return self._mine()

    def take(self) -> None:
        """Take the lease, or renew it; SpecError when another run holds it."""
        try:
            self.root.update(LEASE, self._take)
        except StorageError as e:
            raise SpecError([f"{FIELD}: cannot take the lease of {self.root}: {e}"]) from e

    def renew(self) -> None:
        """Take the lease again, or renew it: SpecError when another run holds it now; a
        StorageError (the store unreachable) as it comes, for the caller to try again."""
        self.root.update(LEASE, self._take)

    def stop(self) -> None:
        """Stop renewing the lease (it runs out unless others of the job renew it)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def release(self) -> None:
        """Give the lease back (if it is still this run's) and stop renewing it."""
        self.stop()

        def drop(old: bytes | None) -> bytes | None:
            lease = _parsed(old)
            return None if lease is not None and lease.get("holder") == self.holder else old

        try:
            self.root.update(LEASE, drop)
        except StorageError as e:
            log.warning("%s: could not give the lease back (%s); it runs out in %.0f s",
                        self.root, e, self.seconds)

    def keep(self, every: float = RENEW_SECONDS,
             on_lost: Callable[[str], None] | None = None) -> Lease:
        """Renew the lease every `every` seconds in a thread until `release`. When another
        run took it (this one's ran out meanwhile), `lost` says so and `on_lost` is called."""
        def renew() -> None:
            while not self._stop.wait(every):
                try:
                    self.renew()
                except SpecError as e:
                    self.lost = e.problems[0]
                    log.error("the checkpoint folder's lease is lost: %s", self.lost)
                    if on_lost is not None:
                        on_lost(self.lost)
                    return
                except Exception as e:  # storage down: try again; the lease outlasts a few
                    log.warning("%s: could not renew the lease (%s); trying again in %.0f s",
                                self.root, e, every)

        self._thread = threading.Thread(target=renew, name="checkpoint-lease", daemon=True)
        self._thread.start()
        return self

    def check(self) -> None:
        """Raise RavnestError once the lease was lost (before writing into the folder)."""
        if self.lost:
            raise RavnestError(self.lost)


def _parsed(data: bytes | None) -> dict[str, Any] | None:
    if data is None:
        return None
    try:
        lease = json.loads(data)
    except ValueError:
        return {}
    return lease if isinstance(lease, dict) else {}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def in_pods(job: Job, pvc_root: str) -> Location | None:
    """The job's checkpoint folder as its pods share it on Kubernetes: an object store or a
    claim; None for a path (each pod's own) or a job without a uid (not the operator's)."""
    uri = job.spec.checkpoint.path
    if not job.metadata.uid or not is_durable(uri):
        return None
    try:
        return open_location(uri, job.spec.storage.options(pvc_root))
    except StorageError as e:
        raise SpecError([f"{FIELD}: {e}"]) from e


def claim_checkpoints(job: Job, pvc_root: str) -> None:
    """The planner pod's part: take the job's checkpoint folder for it (`claim`) before any
    worker starts; the roots of its clusters renew the lease from then on (`Worker`)."""
    where = in_pods(job, pvc_root)
    if where is not None:
        claim(where, job)
