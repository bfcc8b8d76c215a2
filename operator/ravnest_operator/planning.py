"""What a planner or finishing pod says about itself, read from the pod as the API returns it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ravnest import termination

WAITING_SHOWN = 200
"""Characters of a waiting container's message shown in the job's condition."""


@dataclass(frozen=True)
class PlannerPod:
    phase: str
    """Pod phase: Pending, Running, Succeeded, Failed (Unknown while its node is unreachable)."""
    created: str | None = None
    exit_code: int | None = None
    reason: str | None = None
    """Why the container ended (OOMKilled, Error, DeadlineExceeded) or waits (ImagePullBackOff)."""
    message: str = ""
    """Its termination message: the plan, or what went wrong."""
    waiting: str = ""
    """Why the container has not started, with the kubelet's message."""

    @classmethod
    def of(cls, pod: dict[str, Any]) -> PlannerPod:
        status = pod.get("status") or {}
        ended = termination.of_pod(pod)
        code, reason, message, waiting = ended.exit_code, ended.reason, ended.message, ""
        for cs in status.get("containerStatuses") or []:
            wait = (cs.get("state") or {}).get("waiting")
            if wait:
                reason = wait.get("reason")
                waiting = f"{wait.get('reason')}: {wait.get('message') or ''}".strip(": ")
        # the pod's own reason says more when it has one (DeadlineExceeded, Evicted)
        reason = status.get("reason") or reason
        message = message or status.get("message") or ""
        return cls(phase=status.get("phase") or "Pending",
                   created=(pod.get("metadata") or {}).get("creationTimestamp"),
                   exit_code=code, reason=reason, message=message,
                   waiting=waiting[:WAITING_SHOWN])

    def failure(self, name: str, role: str = "planner",
                resources: str = "spec.plan.resources") -> str:
        """Why the pod failed: the pod, its exit code and reason, and its message; `role` names
        the pod's kind and `resources` the field that sizes it."""
        why = f"{role} pod {name} failed"
        if self.exit_code is not None:
            why += f" with exit code {self.exit_code}"
        if self.reason:
            why += f" ({self.reason})"
        if self.reason == "OOMKilled":
            why += f"; give it more memory in {resources}"
        return f"{why}: {self.message.strip()}" if self.message.strip() else why

    def describe(self) -> str:
        """Where the pod stands, for a condition's message."""
        return f"{self.phase}" + (f" ({self.waiting})" if self.waiting else "")
