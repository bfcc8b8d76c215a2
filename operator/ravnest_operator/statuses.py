"""Pure status arithmetic: pods and worker metrics in, RavnestJob status pieces out."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ravnest import termination
from ravnest.plan.plans import Plan
from ravnest.run.jobstatus import TIME_FORMAT
from ravnest.run.progress import progress as job_progress
from ravnest.run.supervising import NodePhase, Seen
from ravnest.termination import NOT_ENDED, Ending

from .resources import ATTEMPT_ANNOTATION, RECOVERY_ANNOTATION, pod_name


def timestamp(at: dt.datetime) -> str:
    """A time as the job's status writes it (`jobstatus.TIME_FORMAT`)."""
    return at.strftime(TIME_FORMAT)


def parse_time(value: str) -> dt.datetime:
    """A time as the status writes it, or as the API client gives one (`...+00:00`)."""
    at = dt.datetime.fromisoformat(value)
    return at.replace(tzinfo=dt.UTC) if at.tzinfo is None else at.astimezone(dt.UTC)


@dataclass
class NodeState:
    pod: str
    phase: str
    """Pod phase, or Missing when the pod does not exist."""
    exit_code: int | None = None
    reason: str | None = None
    ip: str | None = None
    attempt: int = 0
    recovery: int = 0
    """Which recovery of its cluster in this attempt created the pod (0: none)."""
    cluster: int = 0
    deleting: bool = False
    said: str = ""
    """What a terminated container said of its end: its termination message's last line (a
    failed worker's error, or its log's last line when it died without one)."""
    ending: Ending = NOT_ENDED
    """How its container ended (`termination.of_pod`)."""
    disrupted: str = ""
    """Why the pod was disrupted (`disruption`), when it was."""
    unscheduled_since: str | None = None
    """When the pod was made, while it is Pending and on no node yet (`unscheduled`)."""
    unscheduled_why: str = ""
    """What its PodScheduled condition says (the scheduler's reason and message)."""

    def seen(self, node: str) -> Seen:
        """The node as the supervisor's rules (`ravnest.run.supervising`) take it."""
        return Seen(node, self.cluster, NodePhase.of(self.phase), self.ending, self.deleting,
                    self.disrupted)

    def failure(self) -> str:
        """How the pod failed (its phase Failed) or was lost (deleted, or gone): a pod deleted
        says so first, as its deletion is why it failed (`kubectl delete pod` ends its worker
        with SIGTERM, exit code 143)."""
        failed = "" if self.phase != "Failed" else (
            f"failed with exit code {self.exit_code}"
            + (f" ({self.reason})" if self.reason else "")
            + (f": {self.said}" if self.said else ""))
        if self.disrupted:
            return f"pod {self.pod} was disrupted ({self.disrupted})"
        if self.deleting or self.phase == "Missing":
            return f"pod {self.pod} was deleted" + (f" and {failed}" if failed else "")
        return f"pod {self.pod} {failed or 'was lost'}"

    def to_status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"pod": self.pod, "phase": self.phase}
        if self.exit_code is not None:
            out["exitCode"] = self.exit_code
        if self.reason:
            out["reason"] = self.reason
        return out


@dataclass
class Observation:
    nodes: dict[str, NodeState] = field(default_factory=dict)

    @property
    def missing(self) -> list[str]:
        return [name for name, n in self.nodes.items() if n.phase == "Missing"]


def _int(value: Any) -> int:
    """An annotation's integer (anything else, or none: 0)."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


DISRUPTION_TARGET = "DisruptionTarget"
"""The pod condition Kubernetes sets on a pod it is about to delete for a disruption: evicted
(EvictionByEvictionAPI, a drain), preempted (PreemptionByScheduler), deleted by its node's taints
(DeletionByTaintManager) or ended by its kubelet (TerminationByKubelet)."""
DISRUPTION_REASON = 64
"""At most this many characters of a disruption's reason are kept."""


def disruption(pod: dict[str, Any]) -> str:
    """Why a pod (as the API returns it) was disrupted: its DisruptionTarget condition's reason,
    or Evicted for one its kubelet evicted (a node under pressure); empty if it was not."""
    status = pod.get("status") or {}
    for c in status.get("conditions") or []:
        if isinstance(c, dict) and c.get("type") == DISRUPTION_TARGET and c.get("status") == "True":
            reason = c.get("reason")
            return str(reason)[:DISRUPTION_REASON] if reason else DISRUPTION_TARGET
    return "Evicted" if status.get("reason") == "Evicted" else ""


def unscheduled(pod: dict[str, Any]) -> tuple[str | None, str]:
    """When a pod (as the API returns it) was made, if it is Pending on no node yet, and what its
    PodScheduled condition says; (None, "") for a pod placed (or ended, or of no known age)."""
    status = pod.get("status") or {}
    if (status.get("phase") or "Pending") != "Pending" or (pod.get("spec") or {}).get("nodeName"):
        return None, ""
    said = ""
    for c in status.get("conditions") or []:
        if isinstance(c, dict) and c.get("type") == "PodScheduled":
            if c.get("status") == "True":
                return None, ""
            said = ": ".join(str(x) for x in (c.get("reason"), c.get("message")) if x)[:200]
    created = (pod.get("metadata") or {}).get("creationTimestamp")
    return (created if isinstance(created, str) else None), said


def observe(job: str, plan: Plan, pods: list[dict[str, Any]],
            disrupted: Mapping[str, str] | None = None) -> Observation:
    """Per-node state from the job's pods (dicts as the API returns them; `disrupted`: pod name
    -> why, for pods seen disrupted before they were gone)."""
    by_name = {p["metadata"]["name"]: p for p in pods}
    obs = Observation()
    for node in plan.nodes:
        name = pod_name(job, node.name)
        p = by_name.get(name)
        if p is None:
            obs.nodes[node.name] = NodeState(pod=name, phase="Missing", cluster=node.cluster,
                                             disrupted=(disrupted or {}).get(name, ""))
            continue
        status = p.get("status") or {}
        ended = termination.of_pod(p)
        annotations = p["metadata"].get("annotations") or {}
        since, why = unscheduled(p)
        obs.nodes[node.name] = NodeState(
            pod=name, phase=status.get("phase") or "Pending", exit_code=ended.exit_code,
            reason=ended.reason,
            ip=status.get("podIP"), attempt=_int(annotations.get(ATTEMPT_ANNOTATION)),
            recovery=_int(annotations.get(RECOVERY_ANNOTATION)), cluster=node.cluster,
            deleting=bool(p["metadata"].get("deletionTimestamp")), said=ended.said,
            ending=ended, disrupted=disruption(p), unscheduled_since=since,
            unscheduled_why=why)
    return obs


def progress(samples: list[dict[str, float]], started: str | None) -> dict[str, Any]:
    """Job progress from the roots' metrics (see ravnest.run.progress)."""
    elapsed = (dt.datetime.now(dt.UTC) - parse_time(started)).total_seconds() if started else None
    return job_progress(samples, elapsed)
