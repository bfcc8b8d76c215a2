"""The operator's decisions, pure: what one reconcile pass does to a RavnestJob.

`decide` takes what the pass observed (the job, its plan ConfigMap's plan, its pods) and the time,
and returns the status fields to set and the actions to take, in order (see `actions`). It calls no
API, reads no clock and draws no random number, so every branch is tested without a cluster
(tests/unit/test_operator_decide.py); `handling` reads the cluster, calls it and carries the
actions out. Each pass moves the job one step: validate -> plan -> Service, Secrets, ConfigMaps ->
pods -> watch pods and worker metrics -> restart from checkpoint on failure (up to backoffLimit),
suspend/resume, deadline, cleanup and TTL.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ravnest import storing, termination
from ravnest.errors import PlanError, RavnestError, SpecError
from ravnest.plan import growth
from ravnest.plan.handoff import decode
from ravnest.plan.plans import Plan, ProviderInfo, SparePlan, spare_name
from ravnest.run import elastic, progress, supervising
from ravnest.run.jobstatus import FINISHED, Phase, set_condition
from ravnest.spec import MANAGER, Job, durable_volume, parse_job

from . import resources
from .actions import (
    AnnotatePod,
    CountDrain,
    CountFinished,
    CountRecovery,
    CountRestart,
    CountRunning,
    CountTakeover,
    Create,
    CreateJobObjects,
    Decision,
    Delete,
    DeleteJob,
    DeletePod,
    Event,
    GrowJob,
    RemakeJobObjects,
    ScrapeProgress,
    SuspendJob,
)
from .planning import PlannerPod
from .refusals import Refusal
from .settings import Settings
from .statuses import Observation, observe, parse_time, timestamp

NOT_DURABLE = ("checkpoints are on volumes that go with the pods (emptyDir, ephemeral, an inline "
               "csi or a node's hostPath): a restart or a suspend starts over from step 0; to "
               "keep them, set spec.checkpoint.path to an object store (s3://bucket/prefix) or a "
               "claim (pvc://claim/path), or mount a persistentVolumeClaim as "
               "spec.checkpoint.volume")


@dataclass(frozen=True)
class Observed:
    """What one pass knows of a job. A finished job needs nothing read; an invalid one is not
    read for (its name may not even make a label selector)."""
    name: str
    namespace: str
    uid: str
    spec: Mapping[str, Any]
    """The job's .spec as the API holds it."""
    status: Mapping[str, Any]
    """The job's .status as the API holds it."""
    created: str | None = None
    """metadata.creationTimestamp."""
    generation: int | None = None
    """metadata.generation: which version of its spec this pass sees."""
    job: Job | None = None
    """The validated job; None when finished or invalid."""
    problems: tuple[str, ...] = ()
    """What makes the spec invalid."""
    changed: tuple[str, ...] = ()
    """The spec's fields (camelCase) that differ from the job as planned (`as_planned`)."""
    removed: tuple[int, ...] | None = None
    """When spec.providers is the one field changed and only by providers left out: those
    providers, as indices into the providers as planned (`removed_providers`; empty: the spec is
    as planned); None otherwise."""
    added: tuple[int, ...] = ()
    """When spec.providers is the one field changed and only by providers listed after those
    planned: those providers, as indices into the spec's (`added_providers`)."""
    edited: Job | None = None
    """The job as its spec is now, when providers were added (`added`)."""
    plan: Plan | None = None
    """The plan its plan ConfigMap holds; None when that does not exist (yet)."""
    signs: bool = True
    """Whether the operator can issue identities to the job's new nodes: its key derives the
    authority that issued the job's (not so after a restart with another key). Found out only
    when providers were added (`added`), the one time it is needed."""
    pods: tuple[dict[str, Any], ...] = field(default_factory=tuple)
    """The job's pods, as the API returns them."""
    disrupted: Mapping[str, str] = field(default_factory=dict)
    """Pods the operator saw disrupted (evicted, preempted: `statuses.disruption`) that may be
    gone by now, by name: their loss is a disruption, not a failure."""


@dataclass
class _Pass:
    """One pass in progress: what it observed, its clock, and the status as it stands."""
    observed: Observed
    now: dt.datetime
    settings: Settings
    status: dict[str, Any]
    out: Decision = field(default_factory=Decision)
    drained: set[int] = field(default_factory=set)
    """The clusters that drained (`_drains`): out of the job, their pods left as they ended."""
    draining: dict[int, str] = field(default_factory=dict)
    """Cluster -> its drain order (JSON), for the clusters told to drain and not drained yet."""

    @property
    def at(self) -> str:
        return timestamp(self.now)

    @property
    def owner(self) -> resources.Owner:
        """The job, as the objects it owns name it."""
        return resources.Owner(self.observed.name, self.observed.namespace, self.observed.uid)

    @property
    def run_policy(self) -> dict[str, Any]:
        return dict(self.observed.spec.get("runPolicy") or {})

    def fail(self, reason: str, message: str) -> None:
        """Phase Failed, with a Warning Event."""
        self.out.set({"phase": Phase.FAILED, "completionTime": self.at,
                      "conditions": supervising.failed(self.status.get("conditions") or [],
                                                       reason, message, self.at)})
        self.out.do(Event(reason, message, warning=True),
                    CountFinished(self.status.get("phase"), Phase.FAILED,
                                  self.status.get("startTime")))

    def clean(self, policy: str) -> None:
        """Delete the pods runPolicy.cleanPodPolicy names: All, Running (and Pending), None."""
        for p in self.observed.pods:
            phase = (p.get("status") or {}).get("phase")
            spare = resources.SPARE_LABEL in (p["metadata"].get("labels") or {})
            if policy == "All" or ((policy == "Running" or spare) and
                                   phase in ("Running", "Pending")):
                self.out.do(DeletePod(p["metadata"]["name"]))


def decide(observed: Observed, now: dt.datetime, settings: Settings) -> Decision:
    """Move one job one step towards its goal: the status fields and actions, in order. The
    status says which generation of the spec the pass acted on (status.observedGeneration), and
    each condition it set or changed, which generation that was (its observedGeneration). A job
    another controller manages (spec.managedBy) gets nothing: not even its status is written."""
    if not managed_here(observed.spec):
        return Decision()
    return _stamped(observed, _decide(observed, now, settings))


def managed_here(spec: Mapping[str, Any]) -> bool:
    """Whether this operator runs the job: spec.managedBy unset, or `MANAGER`."""
    return spec.get("managedBy") in (None, MANAGER)


REFUSED = "Refused"
"""The reason a job fails with when the apiserver refused an object made for it."""


def decide_refused(observed: Observed, now: dt.datetime, settings: Settings, refusal: Refusal,
                   made: Sequence[tuple[str, str]]) -> Decision:
    """The pass that `decide` began ends here when the apiserver refused an object it made
    (`refusals.refusal`: sending it again cannot change the answer): the job fails, its Failed
    condition and a Warning Event naming the object and the fields refused; the objects this
    pass made (`made`: kind and name, in the order made) are deleted, newest first, so nothing of
    it is left half made, but for its Secrets: the operator may create a Secret and nothing
    more (it never reads or deletes one), and the job's go when the job is deleted; and the job's
    pods go as runPolicy.cleanPodPolicy says. The status the pass had set so far is not written:
    this decision's is the pass's whole status."""
    run = _Pass(observed, now, settings, dict(observed.status))
    run.fail(REFUSED, refusal.said())
    run.out.do(*(Delete(kind, name) for kind, name in reversed(made) if kind != "Secret"))
    run.clean(run.run_policy.get("cleanPodPolicy", "Running"))
    return _stamped(observed, run.out)


def _stamped(observed: Observed, out: Decision) -> Decision:
    generation = observed.generation
    if generation is None:
        return out
    conditions = out.status.get("conditions")
    if conditions:
        before = {c.get("type"): _unstamped(c) for c in observed.status.get("conditions") or []
                  if isinstance(c, Mapping)}
        stamped = [c if before.get(c["type"]) == _unstamped(c) else
                   {**c, "observedGeneration": generation} for c in conditions]
        if stamped != conditions:
            out.set({"conditions": stamped})
    if observed.status.get("observedGeneration") != generation:
        out.set({"observedGeneration": generation})
    return out


def _unstamped(condition: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in condition.items() if k != "observedGeneration"}


def _decide(observed: Observed, now: dt.datetime, settings: Settings) -> Decision:
    run = _Pass(observed, now, settings, dict(observed.status))
    phase = run.status.get("phase")
    if phase in FINISHED:
        _expire(run)
        return run.out
    if observed.job is None:
        run.fail("InvalidSpec", "; ".join(observed.problems))
        return run.out
    if not run.status.get("conditions"):
        phase = Phase.CREATED
        run.status["conditions"] = set_condition([], "Created", True, "Accepted",
                                                 "spec is valid", run.at)
        run.out.set({"phase": phase, "conditions": run.status["conditions"]})
    if observed.plan is None and observed.job.spec.suspended:
        _suspend(run, phase, run.status["conditions"], "not planned yet: plans when resumed")
        return run.out
    plan = observed.plan if observed.plan is not None else _plan(run, observed.job)
    if plan is None:
        return run.out
    left = _planner_of(observed)
    if observed.plan is not None and left is not None and not _going(left):
        # an operator that stopped between creating the objects and deleting the planner
        run.out.do(DeletePod(resources.planner_name(observed.name)))
    if phase in (None, Phase.CREATED, Phase.PLANNING):
        _planned(run, observed.job, plan)
        return run.out
    refused = _drains(run, observed.job, plan)
    if observed.added:
        refused = _grows(run, plan)
        if refused is None:  # (the next pass runs the grown plan)
            return run.out
    _spec_changed(run, () if (observed.removed is not None or observed.added) and refused is None
                  else observed.changed, refused)
    _run(run, observed.job, plan, phase)
    return run.out


LIVE = ("runPolicy", "suspend")
"""The fields of a planned job's spec whose edits take effect."""


def as_planned(job: Job, planned: Mapping[str, Any] | None) -> tuple[Job, tuple[str, ...]]:
    """The job as it was planned (the plan ConfigMap's copy), with the spec's runPolicy and
    suspend as they are now (suspend, limits, deadlines take effect when edited), and the other
    fields of the spec edited since (camelCase, sorted): a running job's pods keep being made
    from what was planned, so an edit cannot make them disagree with the plan (nor, with fewer
    providers, name a provider that is gone). Without a copy (a plan of an earlier operator), the
    job as it is."""
    if planned is None:
        return job, ()
    try:
        then = parse_job(dict(planned), template_allow=None)  # (checked when admitted)
    except SpecError:
        return job, ()
    now, before = job.to_dict()["spec"], then.to_dict()["spec"]
    changed = tuple(sorted(k for k in now.keys() | before.keys()
                           if k not in LIVE and now.get(k) != before.get(k)))
    spec = then.spec.model_copy(update={"run_policy": job.spec.run_policy,
                                        "suspend": job.spec.suspend})
    return then.model_copy(update={"spec": spec}), changed


def removed_providers(now: Job, planned: Job, changed: tuple[str, ...]) -> tuple[int, ...] | None:
    """`Observed.removed`: the providers (indices as planned) the spec `now` left out of the
    job `planned`, when that is its one edit (`changed`: the fields edited; none: none left
    out); None otherwise."""
    if not changed:
        return ()
    if changed != ("providers",):
        return None
    removed = elastic.removed_providers(planned.spec.expanded_providers(),
                                        now.spec.expanded_providers())
    return None if removed is None else tuple(removed)


def added_providers(now: Job, planned: Job, changed: tuple[str, ...]) -> tuple[int, ...]:
    """`Observed.added`: the providers (indices into the spec `now`'s, replicas expanded) that it
    lists after those of the job `planned`, when that is its one edit; () otherwise."""
    if changed != ("providers",):
        return ()
    added = elastic.added_providers(planned.spec.expanded_providers(),
                                    now.spec.expanded_providers())
    return tuple(added or ())


SPEC_CHANGED = ("{} changed after the job was planned, and is not applied: the job runs on as "
                "planned (a running job shrinks when providers are removed from spec.providers "
                "and grows when providers are listed after its own, but takes no other edits; "
                "delete it and apply it again to plan it anew)")
"""The SpecChanged condition's message ({}: the fields)."""


def _spec_changed(run: _Pass, changed: tuple[str, ...], refused: str | None = None) -> None:
    """SpecChanged: True (NotApplied, and a Warning) while fields that the plan was made from
    differ from the spec as planned (`changed`), or providers removed cannot be drained
    (`refused`: why); False (AsPlanned) once they are as planned again, or drained."""
    conditions = run.status.get("conditions") or []
    now = next((c for c in conditions if c.get("type") == "SpecChanged"), None)
    if changed or refused:
        text = SPEC_CHANGED.format(", ".join(f"spec.{k}" for k in changed))
        if refused:
            text = f"spec.providers: {refused}; the job runs on as planned"
        if now is not None and now.get("status") == "True" and now.get("message") == text:
            return
        conditions = set_condition(conditions, "SpecChanged", True, "NotApplied", text, run.at)
        run.out.do(Event("SpecChanged", text, warning=True))
    elif now is not None and now.get("status") == "True":
        conditions = set_condition(conditions, "SpecChanged", False, "AsPlanned",
                                   "the spec is the one planned again, or the one drained to",
                                   run.at)
    else:
        return
    run.status["conditions"] = conditions
    run.out.set({"conditions": conditions})


def _drains(run: _Pass, job: Job, plan: Plan) -> str | None:
    """Draining (issue 20, shrink): providers removed from a running job's spec take their
    clusters (`elastic.drain_for`) out at a round boundary, while the others train on. The root
    pod of each such cluster gets the order as an annotation (`resources.DRAIN_ANNOTATION`, which
    its worker reads from a downward-API file, as `ravnest drain` leaves it a file on
    `ravnest run`); once its termination message says it drained, the cluster is out of the job
    (status.drained, status.membership, status.clusters); one that finished training first (told
    too near the end) stays in the job's model (status.notDrained). Sets `run.drained` and
    `run.draining`; returns why the providers removed cannot be drained (nothing is ordered
    then), or None."""
    ordered, drained, late = (
        [d for d in run.status.get(key) or [] if isinstance(d, dict)
         and isinstance(d.get("cluster"), int) and 0 <= d["cluster"] < len(plan.clusters)]
        for key in ("draining", "drained", "notDrained"))
    pods = {p["metadata"]["name"]: p for p in run.observed.pods}
    root = {c.id: resources.pod_name(run.observed.name, c.nodes[0]) for c in plan.clusters}
    for d in list(ordered):  # a root that drained said so as it ended
        ended = pods.get(root[int(d["cluster"])], {})
        said = termination.of_pod(ended).figures.get("drained")
        if isinstance(said, dict):
            ordered.remove(d)
            drained.append({**d, "round": said.get("round"), "updates": said.get("updates")})
            run.out.do(Event("Drained", elastic.drained_out(int(d["cluster"]), said.get("round"),
                                                            said.get("updates"))), CountDrain())
        elif (ended.get("status") or {}).get("phase") == "Succeeded":
            ordered.remove(d)  # (asked too near the end: the worker says so in its log)
            late.append(d)
            run.out.do(Event("NotDrained", elastic.not_drained(int(d["cluster"])),
                             warning=True))
    refused = None
    if run.observed.removed is not None:
        ordered, refused = _order_drains(run, job, plan, ordered, [*drained, *late])
        refused = refused and f"the providers removed are not drained: {refused}"
    run.drained = {int(d["cluster"]) for d in drained}
    run.draining = {int(d["cluster"]): json.dumps({"providers": d["providers"],
                                                   "at": d["orderedAt"]}) for d in ordered}
    for c, order in run.draining.items():
        pod = pods.get(root[c])
        if pod is not None and not _going(pod) and (pod["metadata"].get("annotations") or {}
                                                    ).get(resources.DRAIN_ANNOTATION) != order:
            run.out.do(AnnotatePod(root[c], resources.DRAIN_ANNOTATION, order))
    joined = _joined(plan, pods, root)
    if ordered or drained or late or joined:
        run.out.set({"draining": ordered, "drained": drained,
                     **({"notDrained": late} if late else {}),
                     **({"joined": joined} if joined else {}),
                     "membership": elastic.membership(
                         plan, [d for d in drained if isinstance(d.get("round"), int)], joined)})
    return refused


def _joined(plan: Plan, pods: Mapping[str, Mapping[str, Any]], root: Mapping[int, str]
            ) -> list[dict[str, Any]]:
    """The clusters added to the job (`_grows`) whose root said, as it ended, after which round
    it joined (status.joined, and a version of status.membership; None: asked too near the end,
    it took the final state only)."""
    joined = []
    for c in plan.clusters[plan.planned:]:
        said = termination.of_pod(pods.get(root[c.id], {})).figures.get("rejoined")
        if isinstance(said, dict) and (said.get("round") is None or isinstance(said["round"], int)):
            joined.append({"cluster": c.id, "round": said.get("round")})  # (None: the final)
    return joined


def _order_drains(run: _Pass, job: Job, plan: Plan, ordered: list[dict[str, Any]],
                  drained: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str | None]:
    """Order the clusters of the providers the spec newly left out to drain (`drained`: the
    orders done with, drained or not): the orders as they stand, and why none was given (a
    provider drained before is back: a running job does not grow; one that runs no stage; no
    cluster would be left)."""
    assert run.observed.removed is not None
    want = set(run.observed.removed)
    have = {int(p) for d in [*ordered, *drained] for p in d.get("providers") or []}
    if have - want:
        back = ", ".join(map(str, sorted(have - want)))
        return ordered, (f"provider(s) {back} left the job and are listed again: a drained "
                         f"cluster does not come back (list new providers after the others to "
                         f"grow the job)")
    if not want - have:
        return ordered, None
    runs_on = {n.name: n.provider for n in plan.nodes} | _runs_on(run.status, job, plan)
    try:
        clusters = elastic.drain_for(plan, sorted(want - have), runs_on,
                                     {int(d["cluster"]) for d in [*ordered, *drained]})
    except RavnestError as e:
        return ordered, str(e)
    new: list[dict[str, Any]] = []
    for c in sorted(clusters):
        providers = elastic.drained_by(plan, c, want - have, runs_on)
        new.append({"cluster": c, "orderedAt": run.at, "providers": providers})
        run.out.do(Event("Draining", f"provider(s) {', '.join(map(str, providers))} removed "
                                     f"from spec.providers: cluster {c} drains at a round "
                                     f"boundary, the others train on"))
    return [*ordered, *new], None


def _grows(run: _Pass, plan: Plan) -> str | None:
    """Growing (issue 20, grow): providers listed after a running job's form new clusters with
    the stages of planned ones (`growth.grow`). Their ConfigMaps and the grown plan are written
    (`GrowJob`), their clusters count as rejoining until their pods run (their workers join at a
    round boundary with the latest state, as a cluster restarted alone does), and status.grown
    records them. Returns why they cannot join (nothing is done then), or None."""
    edited = run.observed.edited
    assert edited is not None
    if edited.spec.security.tls:
        return ("the providers added do not join: a job with spec.security.tls cannot grow yet "
                "(its CA's key is not kept, so no certificate can be issued to a new node)")
    if not run.observed.signs:
        return ("the providers added do not join: the operator's signing key is not the one "
                "this job was planned with (it restarted without RAVNEST_SIGNING_KEY_FILE), so "
                "no identity its nodes accept can be issued to a new node")
    pool = edited.spec.expanded_providers()
    try:
        grown = growth.grow(plan, [(i, ProviderInfo(pool[i].ram, pool[i].bandwidth,
                                                     pool[i].compute))
                                   for i in run.observed.added])
    except PlanError as e:
        return f"the providers added do not join: {e}"
    new = tuple(n.name for n in grown.nodes if n.name not in set(plan.names()))
    clusters = list(range(len(plan.clusters), len(grown.clusters)))
    rejoining = sorted({*(run.status.get("rejoining") or []), *clusters})
    text = elastic.growing(run.observed.added, clusters, "to spec.providers")
    run.out.do(GrowJob(edited, grown, new), Event("Growing", text))
    run.out.set({"grown": [*(run.status.get("grown") or []), {
        "providers": list(run.observed.added), "clusters": clusters, "at": run.at}],
        "rejoining": rejoining, "plan": _plan_status(grown),
        "clusters": _active(run, grown, set(rejoining))})
    return None


def _planned(run: _Pass, job: Job, plan: Plan) -> None:
    """Phase Planned; and whether a restart keeps the job's progress: without a volume its
    checkpoints live on the pods' emptyDir, which the job says in a condition and a Warning."""
    conds = set_condition(run.status["conditions"], "Planned", True, "Planned", plan.summary(),
                          run.at)
    durable = _durability(job) != "EmptyDir"
    conds = set_condition(conds, "DurableCheckpoints", durable, _durability(job),
                          f"checkpoints go to {job.spec.checkpoint.path}" if durable
                          else NOT_DURABLE, run.at)
    run.out.set({"phase": Phase.PLANNED, "plan": _plan_status(plan), "conditions": conds})
    if not durable:
        run.out.do(Event("NoDurableCheckpoints", NOT_DURABLE, warning=True))


def rest(status: Mapping[str, Any], spec: Mapping[str, Any], now: dt.datetime,
         interval: float) -> float:
    """Seconds until a job needs its next timed pass (`ticking`): `interval` while it is not
    finished; a finished one only when its runPolicy.ttlSecondsAfterFinished ends (at once if it
    has), else never (math.inf: nothing happens to it until it changes)."""
    if not managed_here(spec):
        return math.inf
    if status.get("phase") not in FINISHED:
        return interval
    ttl = (spec.get("runPolicy") or {}).get("ttlSecondsAfterFinished")
    done = status.get("completionTime")
    if not isinstance(ttl, int | float) or isinstance(ttl, bool) or not isinstance(done, str):
        return math.inf
    try:
        ends = parse_time(done) + dt.timedelta(seconds=ttl)
    except (ValueError, OverflowError):
        return math.inf
    return max((ends - now).total_seconds(), 0.0)


def _expire(run: _Pass) -> None:
    """A finished job is deleted once ttlSecondsAfterFinished has passed since it finished."""
    ttl = run.run_policy.get("ttlSecondsAfterFinished")
    done = run.status.get("completionTime")
    if ttl is not None and done and (run.now - parse_time(done)).total_seconds() >= ttl:
        run.out.do(DeleteJob())


def _plan(run: _Pass, job: Job) -> Plan | None:
    """The job's plan, from a planner pod of the job's own image; the operator runs none of the
    job's code. Starts the planner, waits for it, and once it succeeded creates the job's objects
    from its plan (the plan ConfigMap last: it marks "planned") and deletes it. None until then,
    and when planning failed, which fails the job."""
    name = resources.planner_name(run.observed.name)
    found = _planner_of(run.observed)
    if found is not None and _going(found):
        # e.g. suspended while planning and resumed at once: its end is no verdict on this job
        _planning(run, f"waiting for the earlier planner pod {name} to be deleted")
        return None
    if found is None:
        owner = run.owner
        run.out.do(Create(resources.planner_configmap(owner, job)),
                   Create(resources.planner_pod(owner, job, run.settings.worker_image)),
                   Event("Planning", f"planner pod {name} started"))
        _planning(run, f"planner pod {name} started")
        return None
    planner = PlannerPod.of(found)
    if planner.phase == "Succeeded":
        try:
            plan = decode(planner.message, job.spec)
        except PlanError as e:
            run.fail("PlanFailed", f"planner pod {name} handed back no usable plan: {e}")
            return None
        owner = run.owner
        too_large = resources.oversized(owner, job, plan)
        if too_large:
            run.fail("PlanFailed", f"planner pod {name} handed back a plan too large to store "
                                   f"({too_large}); nothing was made")
            return None
        run.out.do(CreateJobObjects(job, plan), DeletePod(name),
                   Event("Planned", f"{plan.summary()} plan {plan.fingerprint} from pod {name}"))
        return plan
    if planner.phase == "Failed":
        run.fail("PlanFailed", planner.failure(name))
        return None
    timeout = job.spec.plan.timeout_seconds
    if planner.created and (run.now - parse_time(planner.created)).total_seconds() > timeout:
        run.fail("PlanFailed", f"planner pod {name} did not finish within "
                               f"spec.plan.timeoutSeconds={timeout} ({planner.describe()})")
        run.out.do(DeletePod(name))
        return None
    _planning(run, f"planner pod {name} is {planner.describe()}")
    return None


def _planner_of(observed: Observed) -> dict[str, Any] | None:
    """The job's planner pod, if it has one."""
    name = resources.planner_name(observed.name)
    return next((p for p in observed.pods if p["metadata"]["name"] == name), None)


def _going(pod: dict[str, Any]) -> bool:
    """Whether a pod is being deleted."""
    return bool(pod["metadata"].get("deletionTimestamp"))


def _planning(run: _Pass, message: str) -> None:
    """Phase Planning, its condition saying where the planner pod is (and a job created
    suspended, resumed)."""
    conditions = run.status.get("conditions") or []
    if run.status.get("phase") == Phase.SUSPENDED:
        conditions = set_condition(conditions, "Suspended", False, "Resumed", "", run.at)
    run.status["conditions"] = set_condition(conditions, "Planned", False, "Planning", message,
                                             run.at)
    run.out.set({"phase": Phase.PLANNING, "conditions": run.status["conditions"]})


def _plan_status(plan: Plan) -> dict[str, Any]:
    return {"fingerprint": plan.fingerprint, "summary": plan.summary(),
            "clusters": [{"id": c.id, "nodes": list(c.nodes)} for c in plan.clusters],
            "stages": {n.name: f"{n.first_layer}..{n.last_layer}" for n in plan.nodes},
            **({"spares": [s.name for s in plan.spares]} if plan.spares else {})}


def _run(run: _Pass, job: Job, plan: Plan, phase: str) -> None:
    """A planned job: suspend, clear pods of an earlier attempt (or recovery), restart a lost
    cluster alone or the whole job, or fail, on a failure; finish, or create the missing pods and
    watch the running ones."""
    conditions = run.status.get("conditions") or []
    if job.spec.suspended:
        _suspend(run, phase, conditions, f"pods deleted; {_resumes(job)}")
        return
    if phase == Phase.SUSPENDED:
        conditions = set_condition(conditions, "Suspended", False, "Resumed", "", run.at)
        run.out.set({"conditions": conditions})
    restarts = int(run.status.get("restarts", 0))
    recoveries = _cluster_recoveries(run.status, plan)
    obs = observe(run.observed.name, plan, list(run.observed.pods), run.observed.disrupted)
    rejoining = _still_rejoining(run, plan, obs, recoveries)
    runs_on = _runs_on(run.status, job, plan)
    spares = _Spares.of(run, job, plan, runs_on)
    run.out.set({"nodes": {n: s.to_status() for n, s in obs.nodes.items()},
                 "clusters": _active(run, plan, rejoining), **spares.status()})
    # a drained cluster's pods are done with: neither waited for, nor lost, nor made again
    obs = Observation({n: s for n, s in obs.nodes.items() if s.cluster not in run.drained})
    stale = [s for s in obs.nodes.values() if s.phase != "Missing" and (
        s.attempt != restarts or s.recovery != recoveries[s.cluster])]
    run.out.do(*(DeletePod(s.pod) for s in stale if not s.deleting))
    if stale:
        return
    if _unschedulable(run, job, obs):
        return
    started = run.status.get("startTime")
    since = run.status.get("activeSince") or started  # (an earlier operator's: from the start)
    # A worker pod that vanishes (or is being deleted) from a running job, by `kubectl delete pod`,
    # an eviction or a node drain, is lost like a failed one: its peers would wait for it forever.
    # (The pods of a cluster restarted alone are missing until created again: not lost.)
    decided = supervising.decide_running(
        plan, job.spec.run_policy, {n: s.seen(n) for n, s in obs.nodes.items()},
        supervising.Memory.of_status(run.status),
        lambda down: "; ".join(obs.nodes[s.node].failure() for s in down),
        rejoining=rejoining, drained=run.drained,
        abandoned={int(c) for c in run.status.get("abandoned") or []},
        recovered=[c for c, n in recoveries.items() if n],
        seconds_running=(run.now - parse_time(since)).total_seconds() if since else 0.0,
        vanished_lost=phase == Phase.RUNNING)
    if decided.ends is not None:
        conditions = _ended_without(run, plan, obs, decided.ends, rejoining)
    obs = Observation({n: s for n, s in obs.nodes.items() if s.cluster not in decided.away})
    rejoining -= decided.away
    if decided.loss is not None:
        _lost(run, job, plan, obs, decided, recoveries, rejoining, conditions, spares)
        return
    run.out.do(*(DeletePod(name) for name in spares.unwanted()))
    if decided.done:
        run.out.do(*(DeletePod(name) for name in spares.running()))  # training is over
        if job.spec.output.uri:
            _finish(run, job, plan, phase, conditions)
        else:
            _succeeded(run, plan, phase, conditions)
        return
    _create_missing(run, job, plan, obs, restarts, recoveries, runs_on, spares)
    conditions, rejoining = _rejoined(run, plan, decided.back, rejoining, conditions)
    _watch(run, plan, obs, phase, conditions, rejoining, decided.past, decided.up)


SCHEDULING_TIMEOUT = "SchedulingTimeout"


def _unschedulable(run: _Pass, job: Job, obs: Observation) -> bool:
    """A worker pod made more than runPolicy.schedulingTimeoutSeconds ago and on no node yet:
    the job gives its pods up, failing (cleanPodPolicy All) or suspending itself, as
    runPolicy.schedulingTimeoutAction says. Whether it did."""
    policy = job.spec.run_policy
    timeout = policy.scheduling_timeout_seconds
    if not timeout:
        return False
    waiting = sorted((s for s in obs.nodes.values() if s.unscheduled_since and not s.deleting
                      and (run.now - parse_time(s.unscheduled_since)).total_seconds() > timeout),
                     key=lambda s: s.pod)
    if not waiting:
        return False
    first = waiting[0]
    why = f" ({first.unscheduled_why})" if first.unscheduled_why else ""
    text = (f"{len(waiting)} worker pod(s) not scheduled within runPolicy."
            f"schedulingTimeoutSeconds={timeout}, {first.pod} among them{why}")
    if policy.scheduling_timeout_action == "Suspend":
        run.out.do(SuspendJob(), Event(SCHEDULING_TIMEOUT, f"{text}; the job suspends itself "
                                       "(spec.suspend: true) until resumed", warning=True))
        return True
    run.fail(SCHEDULING_TIMEOUT, text)
    run.clean("All")
    return True


def _lost(run: _Pass, job: Job, plan: Plan, obs: Observation, decided: supervising.Running,
          recoveries: dict[int, int], rejoining: set[int],
          conditions: list[dict[str, Any]], spares: _Spares) -> None:
    """Pods failed or were lost (deleted, or gone: `decided.down`): do what
    `supervising.after_loss` said, restart their cluster alone, or every pod (free hot spares
    that hold a lost node's stage take it over), or fail the job, or wait for the clusters
    finishing (the job then ends without the lost one: `supervising.ends_without`)."""
    after = decided.loss
    assert after is not None
    taking = spares.choose(plan, [s.node for s in decided.down]) if (
        after.act in (supervising.Act.RESTART_CLUSTER, supervising.Act.RESTART_JOB)) else {}
    taken = elastic.taken_over({n: sp.name for n, sp in taking.items()})
    if after.act == supervising.Act.RESTART_CLUSTER:
        _recover(run, plan, obs, after, recoveries, rejoining, conditions, taken)
    elif after.act == supervising.Act.RESTART_JOB:
        _restart(run, job, obs, after, conditions, taken)
    elif after.act == supervising.Act.WAIT:
        run.out.set({"conditions": supervising.on_loss(conditions, after, after.said(), run.at)})
    else:
        run.fail(after.reason, after.said())
        run.clean(run.run_policy.get("cleanPodPolicy", "Running"))
    spares.take_over(run, taking)


def _still_rejoining(run: _Pass, plan: Plan, obs: Observation,
                     recoveries: Mapping[int, int]) -> set[int]:
    """The clusters restarted alone and not back yet (status.rejoining). One all of whose pods
    succeeded rejoins no more, even where the status this pass was given is older than the pass
    that said it was back (the last pass returns before it would say so again)."""
    return {int(c) for c in run.status.get("rejoining") or [] if c in recoveries} - {
        c.id for c in plan.clusters if all(obs.nodes[n].phase == "Succeeded" for n in c.nodes)}


def _ended_without(run: _Pass, plan: Plan, obs: Observation, ends: supervising.EndsWithout,
                   rejoining: set[int]) -> list[dict[str, Any]]:
    """The job ends without the clusters `ends` names (status.abandoned): the pods still running
    of those new to it are deleted (failed ones are kept), and the job finishes with the others.
    The conditions as they stand."""
    text = ends.said()
    rest = set(ends.clusters)
    conditions = supervising.on_ends_without(run.status.get("conditions") or [], ends, run.at)
    run.status.update(conditions=conditions, abandoned=sorted(rest))
    run.out.set({"abandoned": sorted(rest), "rejoining": sorted(rejoining - rest),
                 "clusters": _active(run, plan, rest), "conditions": conditions})
    run.out.do(Event(supervising.ABANDONED, text, warning=True),
               *(DeletePod(s.pod) for s in obs.nodes.values() if s.cluster in ends.new
                 and s.phase in ("Running", "Pending") and not s.deleting))  # failed: kept
    return conditions


def _active(run: _Pass, plan: Plan, away: set[int]) -> str:
    """status.clusters (`away`: those rejoining or left out; those drained are away too)."""
    return supervising.clusters_active(plan, set(away) | run.drained)


def _cluster_recoveries(status: Mapping[str, Any], plan: Plan) -> dict[int, int]:
    """Each cluster's recoveries in this attempt (status.clusterRecoveries, by cluster id)."""
    given = status.get("clusterRecoveries")
    given = given if isinstance(given, list) else []
    return {c.id: given[c.id] if 0 <= c.id < len(given) and isinstance(given[c.id], int) else 0
            for c in plan.clusters}


def _recover(run: _Pass, plan: Plan, obs: Observation, after: supervising.AfterLoss,
             recoveries: dict[int, int], rejoining: set[int],
             conditions: list[dict[str, Any]], taken: str = "") -> None:
    """Restart only the cluster `after` names (elastic training, runPolicy.recovery: cluster):
    its pods are deleted and created again, and their workers take their state from the other
    clusters and rejoin them at a round boundary while those train on (`taken`: which spares
    take lost stages over, `elastic.taken_over`)."""
    assert after.cluster is not None
    cluster = after.cluster
    recoveries = {**recoveries, cluster: recoveries[cluster] + 1}
    run.out.do(*(DeletePod(s.pod) for s in obs.nodes.values()
                 if s.cluster == cluster and s.phase != "Missing" and not s.deleting))
    text = after.said(taken)
    rejoining = rejoining | {cluster}
    run.out.set({"recoveries": after.memory.recoveries,
                 "lastFailures": after.memory.last_failures(),
                 "disruptions": after.memory.disruptions(),
                 "clusterRecoveries": [recoveries.get(i, 0)
                                       for i in range(max(recoveries) + 1)],
                 "rejoining": sorted(rejoining),
                 "clusters": _active(run, plan, rejoining),
                 "conditions": supervising.on_loss(conditions, after, text, run.at)})
    run.out.do(Event("Recovering", text, warning=True), CountRecovery())


def _rejoined(run: _Pass, plan: Plan, back: frozenset[int], rejoining: set[int],
              conditions: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], set[int]]:
    """Clusters restarted alone whose pods all run again (`back`) are no longer rejoining; once
    none is, Recovering turns False. The conditions as they stand, and the clusters still
    rejoining."""
    if not back:
        return conditions, rejoining
    left = rejoining - back
    conditions = supervising.on_back(conditions, back, left, run.at)
    run.out.set({"rejoining": sorted(left), "conditions": conditions,
                 "clusters": _active(run, plan, left)})
    new = {c for c in back if plan.grown(c)}  # (added to the job: never ran before)
    run.out.do(Event("Rejoined", f"cluster(s) {', '.join(map(str, sorted(back)))} running "
                                 f"{'' if new == back else 'again, re'}joining the others"))
    return conditions, left


def _create_missing(run: _Pass, job: Job, plan: Plan, obs: Observation, restarts: int,
                    recoveries: dict[int, int], runs_on: Mapping[str, int],
                    spares: _Spares) -> None:
    """Create the worker pods that are missing (as this attempt's and their cluster's recovery's;
    placed as the spare that took a node over, if one did) and the spares' pods; then, but for
    the job's first pods (phase Planned: its objects were just made), the objects they read
    that were deleted since (`RemakeJobObjects`)."""
    owner = run.owner
    gone = elastic.gone_nodes(plan, run.drained)
    made = [Create(resources.pod(
                owner, job, plan, node, run.settings.worker_image, attempt=restarts,
                final_scrape_seconds=run.settings.final_scrape_seconds,
                recovery=recoveries[node.cluster], provider_index=runs_on.get(node.name),
                gone=gone, drain=run.draining.get(node.cluster)))
            for node in plan.nodes
            if node.name in obs.nodes and obs.nodes[node.name].phase == "Missing"]
    made += [Create(resources.spare_pod(owner, job, plan, i, run.settings.worker_image))
             for i in spares.missing()]
    if made and not run.status.get("activeSince"):
        run.out.set({"activeSince": run.at})  # (activeDeadlineSeconds counts from here)
    run.out.do(*made)
    if made and run.status.get("phase") != Phase.PLANNED:
        # (after the pods, which it does not delay: their kubelets wait for what they mount)
        run.out.do(RemakeJobObjects(job, plan))


def _runs_on(status: Mapping[str, Any], job: Job, plan: Plan) -> dict[str, int]:
    """status.takeovers: node -> the provider (a spare's) that runs its stage now, when not the
    node's own; entries that are not the plan's nodes and providers are ignored."""
    given = status.get("takeovers")
    count = len(job.spec.expanded_providers())
    names = set(plan.names())
    return {n: p for n, p in (given.items() if isinstance(given, dict) else ())
            if n in names and isinstance(p, int) and not isinstance(p, bool) and 0 <= p < count}


@dataclass
class _Spares:
    """The job's hot spares now (spec.plan.spares): the providers that run no node's stage (the
    plan's spares, less those that took a stage over, plus the providers they took it from), and
    their pods (`resources.spare_pod`)."""
    job: Job
    providers: list[int]
    pods: dict[int, dict[str, Any]]
    """Provider -> its spare pod, of any spare pod of the job (a spare's or not)."""

    @classmethod
    def of(cls, run: _Pass, job: Job, plan: Plan, runs_on: Mapping[str, int]) -> _Spares:
        working = {runs_on.get(n.name, n.provider) for n in plan.nodes}
        providers = sorted(set(range(len(job.spec.expanded_providers()))) - working) \
            if plan.spares else []
        pods = {}
        for p in run.observed.pods:
            label = (p["metadata"].get("labels") or {}).get(resources.SPARE_LABEL)
            if label is not None and label.isdigit():
                pods[int(label)] = p
        return cls(job, providers, pods)

    def _phase(self, i: int) -> str:
        p = self.pods.get(i)
        if p is None:
            return "Missing"
        if p["metadata"].get("deletionTimestamp"):
            return "Terminating"
        return str((p.get("status") or {}).get("phase") or "Pending")

    def status(self) -> dict[str, Any]:
        """status.spares: each spare's pod phase, by spare name."""
        if not self.providers:
            return {}
        return {"spares": {spare_name(i): self._phase(i) for i in self.providers}}

    def missing(self) -> list[int]:
        return [i for i in self.providers if i not in self.pods]

    def unwanted(self) -> list[str]:
        """Spare pods of providers that are no spares (any more), not yet being deleted."""
        return [p["metadata"]["name"] for i, p in self.pods.items()
                if i not in self.providers and not p["metadata"].get("deletionTimestamp")]

    def running(self) -> list[str]:
        return [self.pods[i]["metadata"]["name"] for i in self.providers
                if self._phase(i) in ("Running", "Pending")]

    def choose(self, plan: Plan, lost: list[str]) -> dict[str, SparePlan]:
        """The running spare that takes over the stage of each node in `lost` (its pod failed
        or gone, and to be created again) whose stage one holds (`elastic.choose_spares`)."""
        ram = [p.ram for p in self.job.spec.expanded_providers()]
        return elastic.choose_spares(plan, lost, [SparePlan(spare_name(i), i, ram[i])
                                                  for i in self.providers
                                                  if self._phase(i) == "Running"])

    def take_over(self, run: _Pass, chosen: Mapping[str, SparePlan]) -> None:
        """Each node `chosen` gets its spare's provider: the spare's pod is deleted and the
        node's new pod takes its placement; the lost provider becomes a spare."""
        taken = {node: spare.provider for node, spare in chosen.items()}
        for node, spare in chosen.items():
            run.out.do(DeletePod(self.pods[spare.provider]["metadata"]["name"]),
                       Event("TookOver", f"spare {spare.name} (provider {spare.provider}) takes "
                                         f"over the stage of {node}: its pod is placed as that "
                                         f"provider"), CountTakeover())
        if taken:
            before = dict(run.out.status.get("takeovers") or run.status.get("takeovers") or {})
            run.out.set({"takeovers": {**before, **taken}})


def _durability(job: Job) -> str:
    """The reason of the DurableCheckpoints condition: where checkpoints live (EmptyDir: they
    die with the pods)."""
    c = job.spec.checkpoint
    if (c.volume and durable_volume(c.volume)) or _on_template_volume(job):
        return "Volume"
    if c.volume:
        return "EmptyDir"  # an emptyDir, ephemeral, csi or hostPath volume: gone with the pod
    return {"pvc": "Claim", "file": "EmptyDir"}.get(storing.scheme(c.path), "ObjectStore")


def _on_template_volume(job: Job) -> bool:
    """Whether checkpoint.path is an absolute path below a mount of the pod template whose
    volume outlives the pod (e.g. the user's own persistentVolumeClaim)."""
    path, pod = job.spec.checkpoint.path, job.spec.template and job.spec.template.spec
    if not path.startswith("/") or not pod or not pod.containers:
        return False
    kept = {v.get("name") for v in pod.volumes or [] if durable_volume(v)}
    return any(m.get("name") in kept and (path + "/").startswith(
                   str(m.get("mountPath", "")).rstrip("/") + "/")
               for m in pod.containers[0].volume_mounts or [])


def _resumes(job: Job) -> str:
    """What a restart or resume of the job's pods continues from."""
    if _durability(job) != "EmptyDir":
        return "resumes from the last checkpoint"
    return "starts over from step 0 (its checkpoints were on volumes that go with the pods)"


def _suspend(run: _Pass, phase: str | None, conditions: list[dict[str, Any]],
             message: str) -> None:
    """No pods while suspended (a planner pod neither: a job created suspended is planned when
    resumed)."""
    run.out.do(*(DeletePod(p["metadata"]["name"]) for p in run.observed.pods if not _going(p)))
    if phase != Phase.SUSPENDED:
        run.out.set({"phase": Phase.SUSPENDED, "activeSince": None,
                     "conditions": set_condition(conditions, "Suspended", True, "Suspended",
                                                 message, run.at)})
        run.out.do(Event("Suspended", message))


def _restart(run: _Pass, job: Job, obs: Observation, after: supervising.AfterLoss,
             conditions: list[dict[str, Any]], taken: str = "") -> None:
    """Restart every pod from the last checkpoint (`after`: a whole restart; `taken`: which
    spares take lost stages over, `elastic.taken_over`)."""
    run.out.do(*(DeletePod(s.pod) for s in obs.nodes.values()
                 if s.phase != "Missing" and not s.deleting))
    text = after.said(taken, resumes=_resumes(job))
    run.out.set({"restarts": after.memory.restarts, "phase": Phase.RESTARTING, "rejoining": [],
                 "clusterRecoveries": [], "lastFailures": after.memory.last_failures(),
                 "disruptions": after.memory.disruptions(),
                 "conditions": supervising.on_loss(conditions, after, text, run.at)})
    run.out.do(Event("Restarting", after.failure, warning=True), CountRestart())


OUTPUT_KEYS = ("uri", "model", "bestModel", "learningCurve", "learningCurvePng", "summary")
"""What status.outputs may say (`ravnest.run.finishing.outputs`), each a location."""
FUSED_KEYS = ("fused_val_loss", "fused_val_metric", "samples_per_second", "seconds",
              "resumed_from_step")
"""The finishing pod's figures the job's result takes."""


def _finish(run: _Pass, job: Job, plan: Plan, phase: str,
            conditions: list[dict[str, Any]]) -> None:
    """Every worker succeeded and the job names spec.output.uri: a finishing pod of the job's
    image fuses the stages there and writes the outputs; the job succeeds once it has, saying
    where they are (status.outputs), and fails if it cannot."""
    name = resources.finisher_name(run.observed.name)
    found = next((p for p in run.observed.pods if p["metadata"]["name"] == name), None)
    uri = job.spec.output.uri
    if found is not None and _going(found):  # one of a suspended attempt: no verdict on this one
        _finishing(run, conditions, f"waiting for the earlier finishing pod {name} to be deleted")
        return
    if found is None:
        owner = run.owner
        run.out.do(Create(resources.finisher_pod(owner, job, plan, run.settings.worker_image)),
                   Event("Finishing", f"finishing pod {name} writes the outputs to {uri}"))
        _finishing(run, conditions, f"finishing pod {name} started")
        return
    pod = PlannerPod.of(found)
    if pod.phase == "Succeeded":
        handed = _handed_outputs(pod.message)
        if handed is None:
            run.fail("OutputsFailed", f"finishing pod {name} handed back no outputs: "
                                      f"{pod.message[:200]!r}")
            return
        outputs, fused = handed
        conds = set_condition(conditions, "OutputsWritten", True, "Written",
                              f"outputs in {outputs.get('uri', uri)}", run.at)
        _succeeded(run, plan, phase, conds, outputs, fused)
        return
    if pod.phase == "Failed":
        run.fail("OutputsFailed", pod.failure(name, "finishing", "spec.output.resources"))
        return
    timeout = job.spec.output.timeout_seconds
    if pod.created and (run.now - parse_time(pod.created)).total_seconds() > timeout:
        run.fail("OutputsFailed", f"finishing pod {name} did not finish within "
                                  f"spec.output.timeoutSeconds={timeout} ({pod.describe()})")
        run.out.do(DeletePod(name))
        return
    _finishing(run, conditions, f"finishing pod {name} is {pod.describe()}")


def _finishing(run: _Pass, conditions: list[dict[str, Any]], message: str) -> None:
    run.out.set({"phase": Phase.FINISHING, "conditions": set_condition(
        conditions, "OutputsWritten", False, "Finishing", message, run.at)})


def _handed_outputs(message: str) -> tuple[dict[str, str], dict[str, Any]] | None:
    """The locations and figures a finishing pod's termination message holds, as data: known
    keys only, strings and numbers only; None if it is not such a message."""
    try:
        body = json.loads(message)
        outputs = body["outputs"]
    except (ValueError, TypeError, KeyError):
        return None
    if not isinstance(outputs, dict) or not isinstance(outputs.get("model"), str):
        return None
    kept = {k: v[:1024] for k in OUTPUT_KEYS if isinstance(v := outputs.get(k), str)}
    fused = {k: v for k in FUSED_KEYS
             if isinstance(v := body.get(k), int | float) and not isinstance(v, bool)}
    return kept, fused


def _succeeded(run: _Pass, plan: Plan, phase: str, conditions: list[dict[str, Any]],
               outputs: dict[str, str] | None = None,
               fused: dict[str, Any] | None = None) -> None:
    """Every pod succeeded: the job's result and final figures from the cluster-0 root (and,
    with outputs written, where they are and the fused model's figures)."""
    result = {**_result(run.observed, plan, run.status, run.drained), **(fused or {})}
    if outputs:
        run.out.set({"outputs": outputs})
    rate = _final_rate(run.observed, plan, run.status.get("startTime"))
    final = progress.final(run.status.get("progress") or {}, result, rate)
    if result:
        run.out.set({"result": result})
    kept = (f"; outputs in {outputs.get('uri')}" if outputs else
            "; no spec.output.uri, so the trained model was not kept")
    conds = set_condition(conditions, "Succeeded", True, "Completed",
                          f"validation metric {result.get('val_metric')}{kept}", run.at)
    run.out.set({"phase": Phase.SUCCEEDED, "completionTime": run.at, "progress": final,
                 "conditions": set_condition(conds, "Running", False, "Completed", "", run.at)})
    run.out.do(Event("Succeeded", json.dumps(result)),
               CountFinished(phase, Phase.SUCCEEDED, run.status.get("startTime")))
    run.clean("All" if run.run_policy.get("cleanPodPolicy") == "All" else "None")


def _result(observed: Observed, plan: Plan, status: Mapping[str, Any],
            drained: set[int]) -> dict[str, Any]:
    """The final figures the first cluster's root wrote as its termination message (of the
    clusters the job did not end without, status.abandoned, and that did not drain)."""
    gone = {int(c) for c in status.get("abandoned") or []} | drained
    roots = [resources.pod_name(observed.name, c.nodes[0]) for c in plan.clusters
             if c.id not in gone]
    pods = {p["metadata"]["name"]: p for p in observed.pods}
    return termination.of_pod(pods.get(roots[0], {})).figures if roots else {}


def _final_rate(observed: Observed, plan: Plan, started: str | None) -> float | None:
    """Samples/s of the whole job as it ended: the samples every cluster root says it trained
    (its termination message) over the time from status.startTime to the last of them finishing.
    The figure scraped while the job ran is older (a job of a minute could end between two
    scrapes, at a tenth of its rate). None when a root's figures or times are missing."""
    if not started:
        return None
    pods = {p["metadata"]["name"]: p for p in observed.pods}
    samples, ends = 0.0, []
    for c in plan.clusters:
        pod = pods.get(resources.pod_name(observed.name, c.nodes[0]), {})
        ended = termination.of_pod(pod)
        said = ended.figures
        if not isinstance(said.get("samples"), int | float) or not ended.finished_at:
            return None
        samples += said["samples"]
        ends.append(parse_time(ended.finished_at))
    seconds = (max(ends) - parse_time(started)).total_seconds()
    return round(samples / seconds, 2) if seconds > 0 and samples else None


def _watch(run: _Pass, plan: Plan, obs: Observation, phase: str,
           conditions: list[dict[str, Any]], rejoining: set[int] | None = None,
           past: str | None = None, up: bool = False) -> None:
    """Running once every pod runs (`up`), progress from the roots' metrics, and the deadline
    (`past`: why the job fails now, `supervising.past_deadline`)."""
    started = run.status.get("startTime")
    if up:
        if phase != Phase.RUNNING:
            conds = supervising.all_running(conditions, "PodsRunning",
                                            f"{len(obs.nodes)} worker pods running", run.at)
            run.out.set({"phase": Phase.RUNNING, "conditions": conds})
            if not started:
                started = run.at
                run.out.set({"startTime": started})
                run.out.do(CountRunning(run.observed.created))
        _progress(run, plan, obs, started, rejoining or set())
    elif rejoining and started:  # the others train on: their progress goes on
        _progress(run, plan, obs, started, rejoining)
    if past:
        run.fail(supervising.DEADLINE_EXCEEDED, past)
        run.clean("All")


def _progress(run: _Pass, plan: Plan, obs: Observation, started: str | None,
              rejoining: set[int]) -> None:
    """status.progress from the cluster roots' metrics, once every root has an address (of the
    clusters training: not those restarted alone and not back yet, nor those the job ended
    without)."""
    base = dict(run.status.get("progress") or {})
    hosts = [obs.nodes[c.nodes[0]].ip for c in plan.clusters
             if c.nodes[0] in obs.nodes and c.id not in rejoining]
    if not all(hosts):
        run.out.set({"progress": base})
        return
    run.out.do(ScrapeProgress(tuple(h for h in hosts if h), started, base))
