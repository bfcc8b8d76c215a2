"""What a reconcile pass does, as data: `deciding.decide` returns it, `handling` carries it out.

A `Decision` keeps the status fields it sets and its actions in one ordered list, because the order
is part of the behaviour: kopf applies a handler's status patch even when the handler then fails,
so what the status records when an API call fails half-way depends on what came before it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ravnest.plan.plans import Plan
from ravnest.run.jobstatus import check_patch
from ravnest.spec import Job


@dataclass(frozen=True)
class SetStatus:
    """Status fields to patch (a later SetStatus of the same field wins)."""
    fields: Mapping[str, Any]


@dataclass(frozen=True)
class CreateJobObjects:
    """Everything of a planned job but its pods (`resources.static_objects`), with a fresh token
    and, under security.tls, a fresh CA and certificates: the glue mints those."""
    job: Job
    plan: Plan


@dataclass(frozen=True)
class RemakeJobObjects:
    """Once pods are made again (a restart, a recovery, a resume): make again the objects of
    the job its pods read that are missing, deleted by hand since (`resources.remade_objects`:
    the Service, budget, token and identity Secrets, node ConfigMaps, NetworkPolicy; each the
    same as before, all derived from the plan and the operator's key), with a Warning Event
    naming them. The plan ConfigMap is read each pass, and the TLS Secret cannot be made again
    (its CA's key is not kept)."""
    job: Job
    plan: Plan


@dataclass(frozen=True)
class Create:
    """Create one object (a worker pod); one that already exists is left as it is."""
    manifest: Mapping[str, Any]


@dataclass(frozen=True)
class DeletePod:
    """Delete a pod of the job with its own grace period (terminationGracePeriodSeconds: the
    template's, else `resources.GRACE_SECONDS`); one already gone is not an error."""
    name: str


@dataclass(frozen=True)
class Delete:
    """Delete an object this pass made (a Pod with its own grace period, as `DeletePod`): a pass
    whose object the apiserver refused leaves nothing of itself half made. One already gone is
    not an error."""
    kind: str
    name: str


@dataclass(frozen=True)
class GrowJob:
    """Providers were added to a running job (issue 20, grow): create the ConfigMaps of the new
    `nodes`, replace the others' with the grown plan, then replace the plan ConfigMap's plan and
    planned job with the grown ones (last: it marks the growth done, as its creation marks a job
    planned). The new nodes' pods are made as any missing pod is."""
    job: Job
    plan: Plan
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class AnnotatePod:
    """Set one annotation on a pod (a merge patch); a pod already gone is not an error."""
    name: str
    key: str
    value: str


@dataclass(frozen=True)
class DeleteJob:
    """Delete the RavnestJob itself (its ttlSecondsAfterFinished ran out)."""


@dataclass(frozen=True)
class SuspendJob:
    """Set the job's spec.suspend (runPolicy.schedulingTimeoutAction: Suspend): its next pass
    deletes its pods, and it waits to be resumed."""


@dataclass(frozen=True)
class Event:
    """A Kubernetes Event on the job: Normal (kopf.info) or, with `warning`, Warning (kopf.warn)."""
    reason: str
    message: str
    warning: bool = False


@dataclass(frozen=True)
class ScrapeProgress:
    """Set status.progress to `base` updated with the progress the cluster roots' metrics give
    (scraped from `hosts`, cluster 0 first; `base` alone when any scrape fails)."""
    hosts: tuple[str, ...]
    started: str | None
    """status.startTime, for samples/s and the ETA."""
    base: Mapping[str, Any]


@dataclass(frozen=True)
class CountRestart:
    """The operator's metric of job restarts goes up by one."""


@dataclass(frozen=True)
class CountRecovery:
    """The operator's metric of clusters restarted alone (elastic training) goes up by one."""


@dataclass(frozen=True)
class CountTakeover:
    """The operator's metric of stages taken over by a hot spare goes up by one."""


@dataclass(frozen=True)
class CountDrain:
    """The operator's metric of clusters drained out of running jobs goes up by one."""


@dataclass(frozen=True)
class CountRunning:
    """The operator's metric of time to running observes this job (created at `created`)."""
    created: str | None


@dataclass(frozen=True)
class CountFinished:
    """The operator's metric of job durations observes this job, unless `previous` was already a
    finished phase."""
    previous: str | None
    phase: str
    started: str | None


Action = (SetStatus | CreateJobObjects | RemakeJobObjects | Create | GrowJob | DeletePod | Delete
          | AnnotatePod | DeleteJob | SuspendJob | Event | ScrapeProgress | CountRestart
          | CountRecovery | CountTakeover | CountDrain | CountRunning | CountFinished)


@dataclass
class Decision:
    """One pass's decision: its steps in the order they are carried out."""
    steps: list[Action] = field(default_factory=list)

    def set(self, fields: Mapping[str, Any]) -> None:
        """Patch these status fields; StatusError (a bug of the operator's) for one the job's
        status schema (`JobStatus`, the CRD's) would not keep."""
        check_patch(fields)
        self.steps.append(SetStatus(dict(fields)))

    def do(self, *actions: Action) -> None:
        self.steps.extend(actions)

    @property
    def status(self) -> dict[str, Any]:
        """The status patch the pass makes (ScrapeProgress's progress not included)."""
        out: dict[str, Any] = {}
        for step in self.steps:
            if isinstance(step, SetStatus):
                out.update(step.fields)
        return out

    @property
    def actions(self) -> list[Action]:
        """What the pass does beyond patching the status."""
        return [s for s in self.steps if not isinstance(s, SetStatus)]
