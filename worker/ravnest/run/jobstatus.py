"""A RavnestJob's status, typed: what its supervisor (the operator) writes and `ravnest status`,
`kubectl get rj` and the dashboards read.

`JobStatus` is the one definition: the CRD's `.status` schema is generated from it
(`ravnest_operator.crds`), so the apiserver keeps exactly these fields, and every status patch the
operator decides is checked against it before it is written (`check_patch`), so a field the schema
lacks is a failing test here, not a field the apiserver silently prunes. Field names are the API's
(camelCase). Only what workers report about their own training (`result`) is a free-form map.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class Phase(StrEnum):
    """Where the job stands: Created, Planning, Planned, Running, Restarting, Finishing (its
    outputs being written), Succeeded, Failed or Suspended."""

    CREATED = "Created"
    PLANNING = "Planning"
    PLANNED = "Planned"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    FINISHING = "Finishing"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    SUSPENDED = "Suspended"


FINISHED = frozenset({Phase.SUCCEEDED, Phase.FAILED})
"""The phases a job never leaves."""


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Condition(_Part):
    """One condition, as Kubernetes' conventions have it."""

    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str = ""
    message: str = ""
    lastTransitionTime: str | None = None
    observedGeneration: int | None = Field(None, ge=0)
    """The job's metadata.generation that the condition was set from."""


class PlanCluster(_Part):
    id: int = Field(ge=0)
    nodes: list[str]


class PlanStatus(_Part):
    """The plan in brief: its fingerprint, its summary (`clusters x stages`), each cluster's
    nodes and each node's layers (`first..last`), and the hot spares."""

    fingerprint: str
    summary: str
    clusters: list[PlanCluster] = []
    stages: dict[str, str] = {}
    spares: list[str] | None = None


class NodeStatus(_Part):
    """A worker node's pod: its name, phase (Missing: no pod), and how it ended."""

    pod: str
    phase: str
    exitCode: int | None = None
    reason: str | None = None


class Progress(_Part):
    """Training progress from the cluster roots' metrics (`ravnest.run.progress`)."""

    epoch: int | None = None
    step: int | None = None
    totalSteps: int | None = None
    display: str | None = None
    """`step/totalSteps`, for `kubectl get`."""
    loss: float | None = None
    validationLoss: float | None = None
    validationMetric: float | None = None
    samplesPerSecond: float | None = None
    etaSeconds: int | None = None


class Drain(_Part):
    """A cluster told to drain (providers removed from spec.providers): when, for which
    providers, and, once drained, after which round and update."""

    cluster: int = Field(ge=0)
    providers: list[int] = []
    orderedAt: str | None = None
    round: int | None = None
    updates: int | None = None


class Joined(_Part):
    """A cluster added to the running job, and after which round it joined (None: the final)."""

    cluster: int = Field(ge=0)
    round: int | None = None


class Grown(_Part):
    """Providers added to the running job, the clusters they make, and when."""

    providers: list[int]
    clusters: list[int]
    at: str


class MembershipVersion(_Part):
    version: int = Field(ge=1)
    fromRound: int = Field(ge=1)
    clusters: list[int]


class Membership(_Part):
    """Which clusters take part in the rounds, versioned (`ravnest.run.elastic.membership`)."""

    plan: str
    versions: list[MembershipVersion]


class LastFailures(_Part):
    """How the last failures read (`ravnest.run.supervising.failed_as`): the one that led to the
    last whole restart, and, by cluster id, the one each cluster was last restarted alone for
    (None: none known). A failure that reads the same again is not restarted the same way."""

    job: str | None = None
    clusters: list[str | None] = []


class Disruptions(_Part):
    """Of the restarts and recoveries, those for a disruption (pods evicted or preempted,
    `ravnest.run.supervising.AfterLoss.disruption`): backoffLimit and recoveryLimit do not count
    them."""

    restarts: int = Field(0, ge=0)
    recoveries: int = Field(0, ge=0)


class JobStatus(_Part):
    """A RavnestJob's `.status`."""

    observedGeneration: int | None = Field(None, ge=0)
    """The job's metadata.generation the operator last acted on."""
    phase: Phase | None = None
    conditions: list[Condition] | None = None
    plan: PlanStatus | None = None
    clusters: str | None = None
    """Clusters training / planned."""
    nodes: dict[str, NodeStatus] | None = None
    spares: dict[str, str] | None = None
    """Each hot spare's pod phase, by spare name."""
    takeovers: dict[str, int] | None = None
    """Node -> the spare provider that took over its stage."""
    progress: Progress | None = None
    startTime: str | None = None
    """When every worker pod first ran (the job's figures count from here)."""
    activeSince: str | None = None
    """When the job's worker pods were first made, or made again on a resume: on Kubernetes
    runPolicy.activeDeadlineSeconds counts from here, Pending pods included, as a Kubernetes
    Job's counts from its startTime (a suspend clears it)."""
    completionTime: str | None = None
    restarts: int | None = Field(None, ge=0)
    """Whole-job restarts from the last checkpoint."""
    recoveries: int | None = Field(None, ge=0)
    """Clusters restarted alone (elastic), in all."""
    clusterRecoveries: list[int] | None = None
    """Recoveries in this attempt, by cluster id."""
    disruptions: Disruptions | None = None
    lastFailures: LastFailures | None = None
    rejoining: list[int] | None = None
    abandoned: list[int] | None = None
    """Clusters the job ended without (they could not rejoin in time)."""
    draining: list[Drain] | None = None
    drained: list[Drain] | None = None
    notDrained: list[Drain] | None = None
    joined: list[Joined] | None = None
    grown: list[Grown] | None = None
    membership: Membership | None = None
    outputs: dict[str, str] | None = None
    """Where the trained model, its curve and summary went."""
    result: dict[str, Any] | None = None
    """The final figures the first cluster's root reported (and the fused model's)."""


TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
"""How a status writes a time: RFC 3339, UTC, whole seconds."""


def timestamp(seconds: float) -> str:
    """A time (seconds since the epoch) as a status writes it (`TIME_FORMAT`)."""
    return time.strftime(TIME_FORMAT, time.gmtime(seconds))


def set_condition(conditions: list[dict[str, Any]], type_: str, status: bool, reason: str,
                  message: str = "", at: str | None = None) -> list[dict[str, Any]]:
    """Conditions with `type_` set (a new list); its lastTransitionTime (`at`, or now) only moves
    when its status changes, as Kubernetes' conventions have it."""
    value = "True" if status else "False"
    at = at or timestamp(time.time())
    out = []
    found = False
    for c in conditions:
        if c.get("type") == type_:
            found = True
            changed = c.get("status") != value
            c = {**c, "status": value, "reason": reason, "message": message}
            if changed:
                c["lastTransitionTime"] = at
        out.append(c)
    if not found:
        out.append({"type": type_, "status": value, "reason": reason, "message": message,
                    "lastTransitionTime": at})
    return out


def condition(conditions: list[dict[str, Any]], type_: str) -> dict[str, Any] | None:
    """The condition of type `type_`, if set."""
    return next((c for c in conditions if c.get("type") == type_), None)


def is_true(conditions: list[dict[str, Any]], type_: str) -> bool:
    """Whether the condition of type `type_` is set and True."""
    found = condition(conditions, type_)
    return found is not None and found.get("status") == "True"


class StatusError(ValueError):
    """A status the schema does not take: each problem with its field path."""


def check_patch(fields: Mapping[str, Any]) -> JobStatus:
    """`fields` (a status patch: some top-level fields, None to remove one) as a `JobStatus`;
    StatusError naming each field the schema does not take."""
    try:
        return JobStatus.model_validate(dict(fields))
    except ValidationError as e:
        problems = ["status." + ".".join(str(p) for p in err["loc"]) + f": {err['msg']}"
                    for err in e.errors()]
        raise StatusError("; ".join(problems)) from None


NON_FINITE = "NonFiniteValues"
"""The condition that says which status numbers were not finite, and were written as null."""


def finite(current: Mapping[str, Any], patch: Mapping[str, Any],
           at: str | None = None) -> dict[str, Any]:
    """`patch` (status fields to write over `current`) with every NaN or infinite number in it
    made None, and the NonFiniteValues condition saying which were (True), or that none were
    (False, once it had been True). JSON has no such numbers, so the apiserver refuses a status
    that holds one (400), and a job whose validation loss is NaN by design would never have its
    status written again: stuck in its phase, its TTL never applied."""
    found: list[str] = []
    out = _finite(dict(patch), "status", found)
    conditions = list(out.get("conditions") or current.get("conditions") or [])
    if found:
        shown = ", ".join(found[:8]) + (f" and {len(found) - 8} more" if len(found) > 8 else "")
        out["conditions"] = set_condition(conditions, NON_FINITE, True, "NotFinite",
                                          f"written as null: {shown}", at)
    elif is_true(conditions, NON_FINITE):
        out["conditions"] = set_condition(conditions, NON_FINITE, False, "Finite",
                                          "every number in the status is finite", at)
    return out


def _finite(value: Any, path: str, found: list[str]) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        found.append(f"{path} ({value})")
        return None
    if isinstance(value, dict):
        return {k: _finite(v, f"{path}.{k}", found) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v, f"{path}[{i}]", found) for i, v in enumerate(value)]
    return value
