"""The job's pods seen disrupted, remembered until the job's passes have seen them gone.

A pod evicted (a drain), preempted or deleted by its node's taints carries a DisruptionTarget
condition only while it is being deleted: a pass every few seconds can miss that window and find
the pod gone, which reads as a pod deleted by hand, a failure. kopf's watch of the job's pods
(`handling.on_pod`) sees every change, the last included, and notes each disrupted pod here; the
job's next passes take a missing pod noted here for a disruption (`deciding.Observed.disrupted`),
which backoffLimit does not count. A note goes once a pod of that name that is another pod (its
replacement) is seen, after `KEPT_SECONDS`, or with its job. The notes are the operator's memory
only: an operator restarted between a pod's disruption and the pass that saw it gone counts it as
a failure.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .statuses import disruption

KEPT_SECONDS = 3600.0
"""How long a note is kept at most."""
PER_JOB = 1024
"""At most this many notes per job (the oldest go first)."""


@dataclass(frozen=True)
class Note:
    pod_uid: str
    why: str
    at: float


def job_of(pod: Mapping[str, Any]) -> str | None:
    """The uid of the RavnestJob that owns a pod (as the API returns it), if one does."""
    for ref in (pod.get("metadata") or {}).get("ownerReferences") or []:
        if isinstance(ref, Mapping) and ref.get("kind") == "RavnestJob" and ref.get("uid"):
            return str(ref["uid"])
    return None


class Disrupted:
    """Notes of disrupted pods, by job uid and pod name; safe across threads."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._notes: dict[str, dict[str, Note]] = {}
        self._guard = threading.Lock()

    def note(self, pod: Mapping[str, Any]) -> str | None:
        """Note a pod (as a watch event gives it) if it was disrupted: the uid of its job, or None
        (not disrupted, or not a job's)."""
        why, job = disruption(dict(pod)), job_of(pod)
        meta = pod.get("metadata") or {}
        if not why or job is None or not meta.get("name"):
            return None
        with self._guard:
            notes = self._notes.setdefault(job, {})
            notes.pop(meta["name"], None)
            notes[meta["name"]] = Note(str(meta.get("uid") or ""), why, self._clock())
            while len(notes) > PER_JOB:
                del notes[next(iter(notes))]
        return job

    def of(self, job: str, pods: Iterable[Mapping[str, Any]]) -> dict[str, str]:
        """Pod name -> why, for the job's pods noted disrupted; `pods`: the job's pods now, whose
        replacements (a pod of a noted name, another uid) end their notes."""
        now = self._clock()
        present = {(p.get("metadata") or {}).get("name"): (p.get("metadata") or {}).get("uid")
                   for p in pods}
        with self._guard:
            notes = self._notes.get(job)
            if not notes:
                return {}
            for name, n in list(notes.items()):
                replaced = name in present and present[name] != n.pod_uid
                if replaced or now - n.at > KEPT_SECONDS:
                    del notes[name]
            if not notes:
                del self._notes[job]
            return {name: n.why for name, n in notes.items()}

    def forget(self, job: str) -> None:
        with self._guard:
            self._notes.pop(job, None)
