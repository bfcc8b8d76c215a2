"""The operator's decisions without a cluster: `deciding.decide` on observed jobs, branch by
branch (plan, create pods, run, restart or fail, deadline, suspend and resume, succeed, TTL), and
the operator's settings read from the environment."""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt
import json
import math
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from ravnest import parse_job, plan_job
from ravnest.plan.handoff import encode
from ravnest.run.elastic import removed_providers as removed_providers_of
from ravnest.run.progress import render
from ravnest.spec import Provider
from ravnest_operator import resources
from ravnest_operator.actions import (
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
    SetStatus,
    SuspendJob,
)
from ravnest_operator.deciding import (
    NOT_DURABLE,
    Observed,
    added_providers,
    as_planned,
    decide,
    decide_refused,
    removed_providers,
    rest,
)
from ravnest_operator.refusals import Refusal
from ravnest_operator.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
NOW = dt.datetime(2026, 1, 2, 3, 4, 5, 250_000, tzinfo=dt.UTC)
AT = "2026-01-02T03:04:05Z"
SETTINGS = Settings(worker_image="ravnest:test", final_scrape_seconds=30)
EARLIER = "2000-01-01T00:00:00Z"
WHOLE = {"recovery": "job"}
"""runPolicy: a lost worker restarts the whole job (the default, cluster, restarts its cluster)."""
EMPTY = "starts over from step 0 (its checkpoints were on volumes that go with the pods)"
"""What a restart or resume of the digits example (no checkpoint volume) continues from."""


def _ago(seconds: float) -> str:
    return (NOW - dt.timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.fixture(scope="module")
def digits():
    doc = yaml.safe_load((ROOT / "examples" / "digits.yaml").read_text())
    job = parse_job(doc)
    plan, _, _ = plan_job(job)
    return doc, job, plan


def _cond(type_: str, status: str = "True", reason: str = "", message: str = "") -> dict:
    return {"type": type_, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": EARLIER}


def _pod(plan, i: int, phase: str, code: int | None = None, attempt: int = 0, ip: bool = True,
         message: str | None = None, deleting: bool = False, recovery: int = 0):
    """Node i's pod, at 10.0.0.<i + 1> unless it has no address yet."""
    node = plan.names()[i]
    status: dict[str, Any] = {"phase": phase}
    if ip:
        status["podIP"] = f"10.0.0.{i + 1}"
    if code is not None or message:
        status["containerStatuses"] = [{"state": {"terminated": {
            "exitCode": code if code is not None else 0, "reason": "Error" if code else None,
            "message": message}}}]
    meta: dict[str, Any] = {"name": resources.pod_name("digits", node),
                            "annotations": {"ravnest.io/attempt": str(attempt)}}
    if recovery:
        meta["annotations"]["ravnest.io/recovery"] = str(recovery)
    if deleting:
        meta["deletionTimestamp"] = AT
    return {"metadata": meta, "status": status}


def _pods(plan, phase: str, **kw: Any) -> list[dict]:
    return [_pod(plan, i, phase, **kw) for i in range(len(plan.nodes))]


def _observed(digits, status: dict, pods=(), plan: bool = True, **spec_changes: Any) -> Observed:
    doc, job, stored = digits
    spec = copy.deepcopy(doc["spec"])
    spec.update(spec_changes)
    if spec_changes:
        job = parse_job({**doc, "spec": spec})
    return Observed("digits", "team-a", "uid-1", spec, status, created=_ago(60), job=job,
                    plan=stored if plan else None, pods=tuple(pods))


def _running(**extra: Any) -> dict:
    return {"phase": "Running", "startTime": _ago(100),
            "conditions": [_cond("Created"), _cond("Planned"), _cond("Running")], **extra}


def _conditions(decision: Decision) -> dict[str, dict]:
    return {c["type"]: c for c in decision.status["conditions"]}


# --- settings ----------------------------------------------------------------------------------

def test_settings_defaults_and_environment():
    assert Settings.from_env({}) == Settings(
        worker_image="ravnest:latest", reconcile_interval=2.0, network_policies=False,
        metrics_port=8080, final_scrape_seconds=0.0)
    got = Settings.from_env({"RAVNEST_WORKER_IMAGE": "reg/ravnest:1", "RAVNEST_RECONCILE_INTERVAL":
                             "0.5", "RAVNEST_NETWORK_POLICIES": "true",
                             "RAVNEST_OPERATOR_METRICS_PORT": "9090",
                             "RAVNEST_FINAL_SCRAPE_SECONDS": "30"})
    assert got == Settings("reg/ravnest:1", 0.5, True, 9090, 30.0)
    assert Settings.from_env({"RAVNEST_NETWORK_POLICIES": "yes",
                              "RAVNEST_FINAL_SCRAPE_SECONDS": ""}) == Settings()


def test_decision_separates_the_status_patch_from_the_actions():
    d = Decision()
    d.set({"phase": "Running", "nodes": {}})
    d.do(DeletePod("a"))
    d.set({"phase": "Failed"})
    assert d.status == {"phase": "Failed", "nodes": {}}
    assert d.actions == [DeletePod("a")]
    assert isinstance(d.steps[0], SetStatus) and len(d.steps) == 3


# --- validate and plan -------------------------------------------------------------------------

def test_an_invalid_spec_fails_with_its_problems(digits):
    seen = Observed("digits", "team-a", "uid-1", {}, {}, problems=("spec.a: bad", "spec.b: worse"))
    d = decide(seen, NOW, SETTINGS)
    assert d.status["phase"] == "Failed" and d.status["completionTime"] == AT
    failed = _conditions(d)["Failed"]
    assert failed == {"type": "Failed", "status": "True", "reason": "InvalidSpec",
                      "message": "spec.a: bad; spec.b: worse", "lastTransitionTime": AT}
    assert _conditions(d)["Running"]["status"] == "False"
    assert d.actions == [Event("InvalidSpec", "spec.a: bad; spec.b: worse", warning=True),
                         CountFinished(None, "Failed", None)]


def _planner(phase: str, code: int | None = None, reason: str | None = None,
             message: str | None = None, waiting: dict | None = None,
             created: str | None = None) -> dict:
    """The planner pod as the API returns it."""
    status: dict[str, Any] = {"phase": phase}
    if code is not None:
        status["containerStatuses"] = [{"state": {"terminated": {
            "exitCode": code, "reason": reason, "message": message}}}]
    elif waiting:
        status["containerStatuses"] = [{"state": {"waiting": waiting}}]
    return {"metadata": {"name": "digits-planner",  # as the API client gives it
                         "creationTimestamp": (created or _ago(10)).replace("Z", "+00:00")},
            "status": status}


def _planning(phase: str = "Planning") -> dict:
    return {"phase": phase, "conditions": [_cond("Created"), _cond("Planned", "False")]}


def test_a_new_job_is_accepted_and_planned_in_a_pod_of_its_own_image(digits):
    _, job, _ = digits
    d = decide(_observed(digits, {}, plan=False), NOW, SETTINGS)
    assert d.status["phase"] == "Planning" and "plan" not in d.status
    conds = _conditions(d)
    assert conds["Created"] == {"type": "Created", "status": "True", "reason": "Accepted",
                                "message": "spec is valid", "lastTransitionTime": AT}
    assert conds["Planned"] == {"type": "Planned", "status": "False", "reason": "Planning",
                                "message": "planner pod digits-planner started",
                                "lastTransitionTime": AT}
    owner = resources.Owner("digits", "team-a", "uid-1")
    assert d.actions == [Create(resources.planner_configmap(owner, job)),
                         Create(resources.planner_pod(owner, job, "ravnest:test")),
                         Event("Planning", "planner pod digits-planner started")]
    assert d.steps[0] == SetStatus({"phase": "Created", "conditions": [conds["Created"]]})


def test_the_status_says_which_generation_of_the_spec_each_condition_was_set_from(digits):
    new = dataclasses.replace(_observed(digits, {}, plan=False), generation=1)
    d = decide(new, NOW, SETTINGS)
    assert d.status["observedGeneration"] == 1
    assert {c["type"]: c.get("observedGeneration") for c in d.status["conditions"]} == {
        "Created": 1, "Planned": 1}
    # the spec edited (generation 3) while it runs: the pass sees it; the conditions it leaves as
    # they were keep the generation they were set from, the one it changes gets the new one
    running = {**_running(), "observedGeneration": 1, "conditions": [
        {**_cond(t), "observedGeneration": 1} for t in ("Created", "Planned", "Running")]}
    _, _, plan = digits
    d = decide(dataclasses.replace(_observed(digits, running, _pods(plan, "Running")),
                                   generation=3), NOW, SETTINGS)
    assert d.status["observedGeneration"] == 3
    assert "conditions" not in d.status
    d = decide(dataclasses.replace(_observed(digits, running, [
        _pod(plan, 0, "Failed", 1), *(_pod(plan, i, "Running") for i in range(1, len(plan.nodes)))
    ]), generation=3), NOW, SETTINGS)
    stamps = {c["type"]: c.get("observedGeneration") for c in d.status["conditions"]}
    assert stamps["Created"] == 1 and stamps["Planned"] == 1
    assert 3 in [v for k, v in stamps.items() if k != "Created" and k != "Planned"], stamps
    # a pass that sees the generation it already acted on writes no observedGeneration again
    assert "observedGeneration" not in decide(dataclasses.replace(
        _observed(digits, {**running, "observedGeneration": 3}, _pods(plan, "Running")),
        generation=3), NOW, SETTINGS).status


def test_the_planner_pod_runs_the_job_image_with_no_token_and_hardened(digits):
    doc, job, _ = digits
    owner = resources.Owner("digits", "team-a", "uid-1")
    cm = resources.planner_configmap(owner, job)
    assert parse_job(json.loads(cm["data"]["job.json"])) == job
    pod = resources.planner_pod(owner, job, "ravnest:test")
    spec = pod["spec"]
    (c,) = spec["containers"]
    assert c["image"] == "ravnest:test"  # no spec.image: the operator's worker image
    assert c["command"] == ["ravnest"]
    assert c["args"] == ["plan", "/etc/ravnest/job.json", "--termination-log"]
    assert spec["automountServiceAccountToken"] is False and spec["restartPolicy"] == "Never"
    assert spec["activeDeadlineSeconds"] == 600
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"] == {"allowPrivilegeEscalation": False,
                                    "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}}
    assert c["resources"] == {"requests": {"cpu": "500m", "memory": "1Gi"},
                              "limits": {"memory": "4Gi"}}
    assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == "planner"
    assert pod["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    own = parse_job({**doc, "spec": {**doc["spec"], "image": "me/model:1", "plan": {
        "resources": {"limits": {"memory": "8Gi"}}, "timeoutSeconds": 60}}})
    pod = resources.planner_pod(owner, own, "ravnest:test")
    assert pod["spec"]["containers"][0]["image"] == "me/model:1"
    assert pod["spec"]["containers"][0]["resources"] == {"limits": {"memory": "8Gi"}}
    assert pod["spec"]["activeDeadlineSeconds"] == 60


def test_while_the_planner_works_the_job_says_where_it_is(digits):
    d = decide(_observed(digits, _planning(), pods=[_planner("Running")], plan=False), NOW,
               SETTINGS)
    assert d.status["phase"] == "Planning" and d.actions == []
    assert _conditions(d)["Planned"]["message"] == "planner pod digits-planner is Running"
    pulling = _planner("Pending", waiting={"reason": "ImagePullBackOff",
                                           "message": "Back-off pulling image me/model:1"})
    d = decide(_observed(digits, _planning(), pods=[pulling], plan=False), NOW, SETTINGS)
    assert _conditions(d)["Planned"]["message"] == (
        "planner pod digits-planner is Pending (ImagePullBackOff: Back-off pulling image "
        "me/model:1)")
    assert d.status["phase"] == "Planning" and d.actions == []


def test_the_planners_plan_creates_the_job_objects(digits):
    _, job, plan = digits
    done = _planner("Succeeded", 0, "Completed", encode(plan))
    d = decide(_observed(digits, _planning(), pods=[done], plan=False), NOW, SETTINGS)
    assert d.status["phase"] == "Planned"
    assert d.status["plan"] == {
        "fingerprint": plan.fingerprint, "summary": plan.summary(),
        "clusters": [{"id": c.id, "nodes": list(c.nodes)} for c in plan.clusters],
        "stages": {n.name: f"{n.first_layer}..{n.last_layer}" for n in plan.nodes}}
    assert _conditions(d)["Planned"]["status"] == "True"
    assert _conditions(d)["Planned"]["message"] == plan.summary()
    assert d.actions == [CreateJobObjects(job, plan), DeletePod("digits-planner"),
                         Event("Planned", f"{plan.summary()} plan {plan.fingerprint} from pod "
                                          f"digits-planner"),
                         Event("NoDurableCheckpoints", NOT_DURABLE, warning=True)]


def test_a_stored_plan_is_not_made_again(digits):
    status = {"phase": "Created", "conditions": [_cond("Created")]}
    d = decide(_observed(digits, status), NOW, SETTINGS)
    assert d.status["phase"] == "Planned"
    assert d.actions == [Event("NoDurableCheckpoints", NOT_DURABLE, warning=True)]


def test_a_job_says_whether_a_restart_keeps_its_progress(digits):
    """Checkpoints on the pods' emptyDir die with them: the job says so when planned (a condition
    and a Warning), and its restart and suspend messages do not promise a resume."""
    status = {"phase": "Created", "conditions": [_cond("Created")]}
    d = decide(_observed(digits, status), NOW, SETTINGS)
    cond = _conditions(d)["DurableCheckpoints"]
    assert (cond["status"], cond["reason"], cond["message"]) == ("False", "EmptyDir", NOT_DURABLE)
    assert "starts over from step 0" in NOT_DURABLE and "s3://" in NOT_DURABLE
    volume = {"volume": {"persistentVolumeClaim": {"claimName": "ckpt"}}}
    d = decide(_observed(digits, status, checkpoint=volume), NOW, SETTINGS)
    cond = _conditions(d)["DurableCheckpoints"]
    assert (cond["status"], cond["reason"]) == ("True", "Volume") and d.actions == []
    _, _, plan = digits
    pods = _pods(plan, "Running")
    pods[1] = _pod(plan, 1, "Failed", code=1)
    d = decide(_observed(digits, _running(), pods, checkpoint=volume, runPolicy=WHOLE), NOW,
               SETTINGS)
    assert _conditions(d)["Restarting"]["message"].endswith(
        "restart 1/3 resumes from the last checkpoint")
    d = decide(_observed(digits, _running(), _pods(plan, "Running"), checkpoint=volume,
                         runPolicy={"suspend": True}), NOW, SETTINGS)
    assert _conditions(d)["Suspended"]["message"] == \
        "pods deleted; resumes from the last checkpoint"


MOUNTED = {"spec": {"volumes": [{"name": "keep", "persistentVolumeClaim": {"claimName": "c"}},
                               {"name": "scratch", "emptyDir": {}}],
                   "containers": [{"volumeMounts": [{"name": "keep", "mountPath": "/keep"},
                                                    {"name": "scratch", "mountPath": "/scratch"}
                                                    ]}]}}


@pytest.mark.parametrize(("path", "reason"), [("s3://bucket/ckpt", "ObjectStore"),
                                              ("pvc://claim/ckpt", "Claim"),
                                              ("/keep/ckpt", "Volume")])
def test_checkpoints_on_an_object_store_or_a_claim_outlive_the_pods(digits, path, reason):
    status = {"phase": "Created", "conditions": [_cond("Created")]}
    d = decide(_observed(digits, status, checkpoint={"path": path}, template=MOUNTED), NOW,
               SETTINGS)
    cond = _conditions(d)["DurableCheckpoints"]
    assert (cond["status"], cond["reason"], cond["message"]) == (
        "True", reason, f"checkpoints go to {path}")
    assert d.actions == []


@pytest.mark.parametrize("volume", [{"emptyDir": {}}, {"emptyDir": {"medium": "Memory"}},
                                    {"ephemeral": {"volumeClaimTemplate": {"spec": {}}}},
                                    {"csi": {"driver": "inline.example.com"}}])
def test_a_checkpoint_volume_that_goes_with_the_pods_is_not_durable(digits, volume):
    status = {"phase": "Created", "conditions": [_cond("Created")]}
    d = decide(_observed(digits, status, checkpoint={"volume": volume}), NOW, SETTINGS)
    cond = _conditions(d)["DurableCheckpoints"]
    assert (cond["status"], cond["reason"], cond["message"]) == ("False", "EmptyDir", NOT_DURABLE)
    assert d.actions == [Event("NoDurableCheckpoints", NOT_DURABLE, warning=True)]


@pytest.mark.parametrize("volume", [{"nfs": {"server": "nfs.example", "path": "/ckpt"}},
                                    {"cephfs": {"monitors": ["10.0.0.1:6789"]}}])
def test_a_network_disk_as_checkpoint_volume_is_durable(digits, volume):
    """(Beyond the restricted level: a cluster admin's templatePolicy.allow 'volumes'.)"""
    status = {"phase": "Created", "conditions": [_cond("Created")]}
    doc = copy.deepcopy(digits[0])
    doc["spec"]["checkpoint"] = {"volume": volume}
    seen = replace(_observed(digits, status, checkpoint={}),
                   job=parse_job(doc, template_allow={"volumes"}))
    d = decide(seen, NOW, SETTINGS)
    assert _conditions(d)["DurableCheckpoints"]["reason"] == "Volume"


@pytest.mark.parametrize("path", ["/scratch/ckpt", "/keeper/ckpt", "keep/ckpt"])
def test_a_path_not_on_a_kept_volume_of_the_template_is_not_durable(digits, path):
    status = {"phase": "Created", "conditions": [_cond("Created")]}
    d = decide(_observed(digits, status, checkpoint={"path": path}, template=MOUNTED), NOW,
               SETTINGS)
    assert _conditions(d)["DurableCheckpoints"]["reason"] == "EmptyDir"


@pytest.mark.parametrize(("code", "reason", "message", "says"), [
    (1, "Error", "ModuleNotFoundError: No module named 'mymodel'",
     "planner pod digits-planner failed with exit code 1 (Error): ModuleNotFoundError: No "
     "module named 'mymodel'"),
    (1, "Error", "PlanError: the providers' total RAM (0.0 GB) cannot hold the model",
     "planner pod digits-planner failed with exit code 1 (Error): PlanError: the providers' "
     "total RAM (0.0 GB) cannot hold the model"),
    (137, "OOMKilled", None, "planner pod digits-planner failed with exit code 137 "
                             "(OOMKilled); give it more memory in spec.plan.resources"),
])
def test_a_failed_planner_fails_the_job_naming_pod_exit_code_and_reason(digits, code, reason,
                                                                        message, says):
    failed = _planner("Failed", code, reason, message)
    d = decide(_observed(digits, _planning(), pods=[failed], plan=False), NOW, SETTINGS)
    assert d.status["phase"] == "Failed"
    cond = _conditions(d)["Failed"]
    assert (cond["reason"], cond["message"]) == ("PlanFailed", says)
    assert d.actions == [Event("PlanFailed", says, warning=True),
                         CountFinished("Planning", "Failed", None)]


def test_a_planner_past_its_active_deadline_says_so(digits):
    """The kubelet ends a planner at spec.plan.timeoutSeconds (activeDeadlineSeconds): the pod's
    own reason names it."""
    late = _planner("Failed", 137, "Error")
    late["status"].update({"reason": "DeadlineExceeded",
                           "message": "Pod was active on the node longer than the specified "
                                      "deadline"})
    d = decide(_observed(digits, _planning(), pods=[late], plan=False), NOW, SETTINGS)
    assert _conditions(d)["Failed"]["message"] == (
        "planner pod digits-planner failed with exit code 137 (DeadlineExceeded): Pod was "
        "active on the node longer than the specified deadline")


def test_a_planner_that_hands_back_a_foreign_plan_fails_the_job(digits):
    _, _, plan = digits
    other = dataclasses.replace(plan, nodes=tuple(dataclasses.replace(n, provider=0)
                                                  for n in plan.nodes))
    for message in ("not a plan", encode(other), "ravnest-plan/v1\n!!!"):
        done = _planner("Succeeded", 0, "Completed", message)
        d = decide(_observed(digits, _planning(), pods=[done], plan=False), NOW, SETTINGS)
        cond = _conditions(d)["Failed"]
        assert cond["reason"] == "PlanFailed", message
        assert cond["message"].startswith("planner pod digits-planner handed back no usable "
                                          "plan: "), cond["message"]
        assert not any(isinstance(a, CreateJobObjects) for a in d.actions)


def test_a_plan_too_large_to_store_fails_the_job_before_anything_is_made(digits):
    """The plan ConfigMap holds the plan and the job: one past the apiserver's 1 MiB was refused
    after the node ConfigMaps were made, and the job sat in Planning for ever."""
    _, _, plan = digits
    big = {"metadata": {"annotations": {"note": "x" * (1 << 20)}}}
    done = _planner("Succeeded", 0, "Completed", encode(plan))
    d = decide(_observed(digits, _planning(), pods=[done], plan=False, template=big), NOW,
               SETTINGS)
    cond = _conditions(d)["Failed"]
    assert cond["reason"] == "PlanFailed"
    assert re.match(r"planner pod digits-planner handed back a plan too large to store "
                    r"\(ConfigMap digits-plan would hold \d+ bytes, more than the 1032192 a "
                    r"ConfigMap may\); nothing was made$", cond["message"]), cond["message"]
    assert not any(isinstance(a, CreateJobObjects | Create) for a in d.actions)


def test_a_job_created_suspended_starts_no_planner_until_resumed(digits):
    d = decide(_observed(digits, {}, plan=False, runPolicy={"suspend": True}), NOW, SETTINGS)
    assert d.status["phase"] == "Suspended"
    assert _conditions(d)["Suspended"]["message"] == "not planned yet: plans when resumed"
    assert d.actions == [Event("Suspended", "not planned yet: plans when resumed")]
    suspended = {"phase": "Suspended", "conditions": d.status["conditions"]}
    d = decide(_observed(digits, suspended, plan=False), NOW, SETTINGS)
    assert d.status["phase"] == "Planning"
    assert _conditions(d)["Suspended"]["status"] == "False"
    assert [type(a) for a in d.actions] == [Create, Create, Event]
    # suspended while planning: the planner pod goes
    d = decide(_observed(digits, _planning(), pods=[_planner("Running")], plan=False,
                         runPolicy={"suspend": True}), NOW, SETTINGS)
    assert d.status["phase"] == "Suspended" and DeletePod("digits-planner") in d.actions


def test_spec_suspend_holds_a_job_as_run_policy_suspend_does(digits):
    """spec.suspend, the field Kueue sets and clears: a job created suspended is not planned; a
    planned one's pods go; resuming is not an edit of the job as planned."""
    _, job, plan = digits
    d = decide(_observed(digits, {}, plan=False, suspend=True), NOW, SETTINGS)
    assert d.status["phase"] == "Suspended" and not [a for a in d.actions
                                                    if isinstance(a, Create)]
    running = decide(_observed(digits, _running(), _pods(plan, "Running"), suspend=True), NOW,
                     SETTINGS)
    assert running.status["phase"] == "Suspended"
    assert [a for a in running.actions if isinstance(a, DeletePod)] == [
        DeletePod(p["metadata"]["name"]) for p in _pods(plan, "Running")]
    held, changed = as_planned(parse_job({**digits[0], "spec": {**digits[0]["spec"],
                                                                "suspend": True}}),
                               job.to_dict())
    assert changed == () and held.spec.suspended


def test_a_job_another_controller_manages_is_left_alone(digits):
    """spec.managedBy names another controller: no pass does anything, its status included,
    and the ticker passes over it no more; this operator's own name, or none, is ours."""
    other = "kueue.x-k8s.io/multikueue"
    seen = dataclasses.replace(_observed(digits, {}, plan=False, managedBy=other), generation=1)
    assert decide(seen, NOW, SETTINGS) == Decision()
    assert rest({}, {"managedBy": other}, NOW, 2.0) == math.inf
    ours = dataclasses.replace(_observed(digits, {}, plan=False, managedBy="ravnest.io/operator"),
                               generation=1)
    assert decide(ours, NOW, SETTINGS).status["phase"] == "Planning"


def _unscheduled(pod: dict, seconds: float, message: str = "") -> dict:
    pod["metadata"]["creationTimestamp"] = _ago(seconds)
    pod["status"] = {"phase": "Pending"}
    if message:
        pod["status"]["conditions"] = [{"type": "PodScheduled", "status": "False",
                                        "reason": "Unschedulable", "message": message}]
    return pod


@pytest.mark.parametrize("action", ["Fail", "Suspend"])
def test_pods_left_unscheduled_past_the_timeout_free_what_the_job_holds(digits, action):
    """runPolicy.schedulingTimeoutSeconds: while no pod waited longer, nothing; then the job fails
    (its pods all deleted) or suspends itself, naming a pod and what the scheduler said."""
    _, _, plan = digits
    policy = {"schedulingTimeoutSeconds": 60, "schedulingTimeoutAction": action}
    status = {"phase": "Planned", "conditions": [_cond("Created"), _cond("Planned")]}
    pods = _pods(plan, "Running")
    pods[3] = _unscheduled(pods[3], 30, "0/3 nodes are available: 3 Insufficient cpu.")
    d = decide(_observed(digits, status, pods, runPolicy=policy), NOW, SETTINGS)
    assert "phase" not in d.status or d.status["phase"] != "Failed"
    assert not [a for a in d.actions if isinstance(a, SuspendJob)]
    pods[3] = _unscheduled(pods[3], 61, "0/3 nodes are available: 3 Insufficient cpu.")
    d = decide(_observed(digits, status, pods, runPolicy=policy), NOW, SETTINGS)
    text = (f"1 worker pod(s) not scheduled within runPolicy.schedulingTimeoutSeconds=60, "
            f"{pods[3]['metadata']['name']} among them (Unschedulable: 0/3 nodes are available: "
            f"3 Insufficient cpu.)")
    if action == "Fail":
        assert d.status["phase"] == "Failed"
        assert _conditions(d)["Failed"]["reason"] == "SchedulingTimeout"
        assert _conditions(d)["Failed"]["message"] == text
        assert {a.name for a in d.actions if isinstance(a, DeletePod)} == {
            p["metadata"]["name"] for p in pods}
    else:
        assert "phase" not in d.status
        assert d.actions == [SuspendJob(), Event(
            "SchedulingTimeout", f"{text}; the job suspends itself (spec.suspend: true) until "
            "resumed", warning=True)]
    placed = copy.deepcopy(pods)
    placed[3]["spec"] = {"nodeName": "node-a"}  # (on a node, its image pulling: not waiting)
    d = decide(_observed(digits, status, placed, runPolicy=policy), NOW, SETTINGS)
    assert not [a for a in d.actions if isinstance(a, SuspendJob)]
    assert d.status.get("phase") != "Failed"


def test_a_planner_pod_being_deleted_is_waited_for_not_read(digits):
    """Suspended while planning, resumed before the old planner was gone: its exit (SIGTERM) is
    no verdict on the job, and no second planner starts beside it."""
    going = _planner("Failed", 143, "Error", "Terminated")
    going["metadata"]["deletionTimestamp"] = AT
    d = decide(_observed(digits, _planning(), pods=[going], plan=False), NOW, SETTINGS)
    assert d.status["phase"] == "Planning" and d.actions == []
    assert "waiting for the earlier planner pod" in _conditions(d)["Planned"]["message"]


def test_a_planner_pod_left_behind_is_deleted_once_planned(digits):
    """An operator that died between creating the job's objects and deleting the planner."""
    _, _, plan = digits
    status = {"phase": "Planned", "conditions": [_cond("Created"), _cond("Planned")]}
    done = _planner("Succeeded", 0, "Completed", encode(plan))
    d = decide(_observed(digits, status, pods=[done]), NOW, SETTINGS)
    assert d.actions[0] == DeletePod("digits-planner")
    assert not any(isinstance(a, CreateJobObjects) for a in d.actions)


def test_a_planner_past_its_timeout_fails_the_job_and_is_deleted(digits):
    stuck = _planner("Pending", created=_ago(601), waiting={"reason": "ContainerCreating"})
    d = decide(_observed(digits, _planning(), pods=[stuck], plan=False), NOW, SETTINGS)
    cond = _conditions(d)["Failed"]
    assert cond["reason"] == "PlanFailed"
    assert cond["message"] == ("planner pod digits-planner did not finish within "
                               "spec.plan.timeoutSeconds=600 (Pending (ContainerCreating))")
    assert DeletePod("digits-planner") in d.actions
    in_time = _planner("Pending", created=_ago(599))
    d = decide(_observed(digits, _planning(), pods=[in_time], plan=False), NOW, SETTINGS)
    assert d.status["phase"] == "Planning"


# --- pods --------------------------------------------------------------------------------------

def test_a_planned_job_gets_its_pods(digits):
    _, job, plan = digits
    status = {"phase": "Planned", "conditions": [_cond("Created"), _cond("Planned")]}
    d = decide(_observed(digits, status), NOW, SETTINGS)
    owner = resources.Owner("digits", "team-a", "uid-1")
    assert d.actions == [Create(resources.pod(owner, job, plan, n, "ravnest:test", attempt=0,
                                              final_scrape_seconds=30)) for n in plan.nodes]
    assert d.status["nodes"] == {n: {"pod": resources.pod_name("digits", n), "phase": "Missing"}
                                 for n in plan.names()}
    assert "phase" not in d.status


REFUSAL = Refusal("Pod", "digits-node-1", 422, "Invalid", "spec.dnsPolicy: Unsupported value",
                  ("spec.dnsPolicy",))


def test_an_object_refused_fails_the_job_and_undoes_what_the_pass_made(digits):
    """The apiserver refused the second pod of a planned job's pass: the job fails naming the pod
    and its field, and the first pod, made by that pass, goes again."""
    status = {"phase": "Planned", "conditions": [_cond("Created"), _cond("Planned")]}
    seen = dataclasses.replace(_observed(digits, status), generation=3)
    made = [("Pod", "digits-node-0")]
    d = decide_refused(seen, NOW, SETTINGS, REFUSAL, made)
    assert d.status["phase"] == "Failed" and d.status["completionTime"] == AT
    failed = _conditions(d)["Failed"]
    assert failed["reason"] == "Refused" and failed["message"] == REFUSAL.said()
    assert failed["observedGeneration"] == 3 and d.status["observedGeneration"] == 3
    assert "spec.dnsPolicy" in failed["message"] and "digits-node-1" in failed["message"]
    assert _conditions(d)["Running"]["status"] == "False"
    assert d.actions == [Event("Refused", REFUSAL.said(), warning=True),
                         CountFinished("Planned", "Failed", None),
                         Delete("Pod", "digits-node-0")]
    assert "nodes" not in d.status  # (the refused pass's own status is not written)


def test_a_refusal_deletes_the_objects_made_newest_first_and_cleans_the_pods(digits):
    _, _, plan = digits
    pods = [_pod(plan, 0, "Running"), _pod(plan, 1, "Succeeded")]
    made = [("Secret", "digits-token"), ("Service", "digits-workers"),
            ("ConfigMap", "digits-node-0")]
    d = decide_refused(_observed(digits, _running(), pods), NOW, SETTINGS, REFUSAL, made)
    deletes = [a for a in d.actions if isinstance(a, Delete | DeletePod)]
    # (a Secret stays: the operator only ever creates one; pods: cleanPodPolicy Running)
    assert deletes == [Delete("ConfigMap", "digits-node-0"), Delete("Service", "digits-workers"),
                       DeletePod(pods[0]["metadata"]["name"])]
    kept = decide_refused(_observed(digits, _running(), pods,
                                    runPolicy={"cleanPodPolicy": "None"}),
                          NOW, SETTINGS, REFUSAL, [])
    assert not [a for a in kept.actions if isinstance(a, Delete | DeletePod)]


def test_a_finished_job_rests_until_its_ttl_ends_or_for_good():
    """The ticker's next pass: every interval while a job is in progress; a finished job's
    once its TTL ends (at once when it has), none without a TTL, or with a malformed one."""
    done = {"phase": "Succeeded", "completionTime": AT}
    assert rest({"phase": "Running"}, {}, NOW, 2.0) == 2.0
    assert rest({}, {"runPolicy": {"ttlSecondsAfterFinished": 5}}, NOW, 2.0) == 2.0
    assert rest(done, {"runPolicy": {"ttlSecondsAfterFinished": 60}}, NOW, 2.0) == 59.75
    later = NOW + dt.timedelta(seconds=600)
    assert rest({**done, "phase": "Failed"}, {"runPolicy": {"ttlSecondsAfterFinished": 60}},
                later, 2.0) == 0.0
    for spec in ({}, {"runPolicy": {"ttlSecondsAfterFinished": True}},
                 {"runPolicy": {"ttlSecondsAfterFinished": 1e300}}):
        assert rest(done, spec, NOW, 2.0) == math.inf
    assert rest({"phase": "Failed", "completionTime": "nonsense"},
                {"runPolicy": {"ttlSecondsAfterFinished": 1}}, NOW, 2.0) == math.inf


def test_only_missing_pods_are_created_with_the_current_attempt(digits):
    _, _, plan = digits
    status = {"phase": "Restarting", "restarts": 2, "conditions": [_cond("Created")]}
    pods = [_pod(plan, 0, "Pending", attempt=2)]
    d = decide(_observed(digits, status, pods), NOW, SETTINGS)
    created = [a.manifest for a in d.actions if isinstance(a, Create)]
    assert [m["metadata"]["name"] for m in created] == [
        resources.pod_name("digits", n) for n in plan.names()[1:]]
    assert {m["metadata"]["annotations"]["ravnest.io/attempt"] for m in created} == {"2"}


def test_pods_made_again_are_preceded_by_the_objects_they_read_but_the_first_ones(digits):
    """A job's first pods follow its objects, just made; after pods made again (a restart, a
    recovery, a resume) the objects they read are made again where deleted since."""
    _, job, plan = digits
    first = decide(_observed(digits, {"phase": "Planned", "conditions": [_cond("Created")]}),
                   NOW, SETTINGS)
    assert not [a for a in first.actions if isinstance(a, RemakeJobObjects)]
    status = {"phase": "Restarting", "restarts": 2, "conditions": [_cond("Created")]}
    again = decide(_observed(digits, status, [_pod(plan, 0, "Pending", attempt=2)]), NOW,
                   SETTINGS)
    assert again.actions[-1] == RemakeJobObjects(job, plan)
    assert again.actions[:-1] and all(isinstance(a, Create) for a in again.actions[:-1])
    running = decide(_observed(digits, _running(), _pods(plan, "Running")), NOW, SETTINGS)
    assert not [a for a in running.actions if isinstance(a, RemakeJobObjects)]  # (none missing)


def test_all_pods_running_makes_the_job_running(digits):
    _, _, plan = digits
    status = {"phase": "Planned", "conditions": [_cond("Created"), _cond("Planned")]}
    d = decide(_observed(digits, status, _pods(plan, "Running")), NOW, SETTINGS)
    assert d.status["phase"] == "Running" and d.status["startTime"] == AT
    assert _conditions(d)["Running"]["message"] == f"{len(plan.nodes)} worker pods running"
    roots = [plan.names().index(c.nodes[0]) for c in plan.clusters]
    assert d.actions == [CountRunning(_ago(60)),
                         ScrapeProgress(tuple(f"10.0.0.{i + 1}" for i in roots), AT, {})]


def test_a_running_job_reports_progress_from_its_roots(digits):
    _, _, plan = digits
    status = _running(progress={"step": 3, "totalSteps": 66})
    d = decide(_observed(digits, status, _pods(plan, "Running")), NOW, SETTINGS)
    assert "phase" not in d.status and "conditions" not in d.status
    (scrape,) = d.actions
    assert isinstance(scrape, ScrapeProgress)
    assert scrape.started == _ago(100) and scrape.base == status["progress"]
    assert scrape.hosts[0] == f"10.0.0.{plan.names().index(plan.clusters[0].nodes[0]) + 1}"


def test_progress_stays_as_it_was_while_a_root_has_no_address(digits):
    _, _, plan = digits
    pods = _pods(plan, "Running", ip=False)
    status = _running(progress={"step": 3})
    d = decide(_observed(digits, status, pods), NOW, SETTINGS)
    assert d.actions == [] and d.status["progress"] == {"step": 3}


def test_pods_of_an_earlier_attempt_are_deleted_first(digits):
    _, _, plan = digits
    pods = _pods(plan, "Running", attempt=0)
    pods[1] = _pod(plan, 1, "Running", attempt=0, deleting=True)
    pods[2] = _pod(plan, 2, "Running", attempt=1)
    status = {**_running(), "phase": "Restarting", "restarts": 1}
    d = decide(_observed(digits, status, pods), NOW, SETTINGS)
    assert d.actions == [DeletePod(p["metadata"]["name"]) for i, p in enumerate(pods)
                         if i not in (1, 2)]
    assert set(d.status) == {"nodes", "clusters"}


# --- failures ----------------------------------------------------------------------------------

def test_a_failed_pod_restarts_the_job_within_backoff_limit(digits):
    _, _, plan = digits
    pods = _pods(plan, "Running", attempt=1)
    pods[2] = _pod(plan, 2, "Failed", code=137, attempt=1)
    failed = pods[2]["metadata"]["name"]
    d = decide(_observed(digits, _running(restarts=1), pods, runPolicy=WHOLE), NOW, SETTINGS)
    message = f"pod {failed} failed with exit code 137 (Error)"
    assert d.status["phase"] == "Restarting" and d.status["restarts"] == 2
    assert _conditions(d)["Restarting"]["message"] == (
        f"{message}; restart 2/3 {EMPTY}")
    assert d.status["nodes"][plan.names()[2]] == {"pod": failed, "phase": "Failed",
                                                 "exitCode": 137, "reason": "Error"}
    assert d.actions == [*(DeletePod(p["metadata"]["name"]) for p in pods),
                         Event("Restarting", message, warning=True), CountRestart()]


def test_a_pod_gone_after_an_eviction_restarts_the_job_past_backoff_limit(digits):
    """backoffLimit 0, every restart used: the pod the watch saw evicted is gone by this pass;
    the job restarts (a disruption), and its status counts the restart apart."""
    _, _, plan = digits
    pods = _pods(plan, "Running", attempt=1)
    gone = pods.pop(2)["metadata"]["name"]
    observed = dataclasses.replace(
        _observed(digits, _running(restarts=1, disruptions={"restarts": 1, "recoveries": 0}),
                  pods, runPolicy={**WHOLE, "backoffLimit": 0}),
        disrupted={gone: "EvictionByEvictionAPI"})
    d = decide(observed, NOW, SETTINGS)
    assert d.status["phase"] == "Restarting" and d.status["restarts"] == 2
    assert d.status["disruptions"] == {"restarts": 2, "recoveries": 0}
    restarting = _conditions(d)["Restarting"]
    assert restarting["reason"] == "Disrupted"
    assert restarting["message"] == (
        f"pod {gone} was disrupted (EvictionByEvictionAPI); a disruption, not counted against "
        f"backoffLimit: the job restarts and {EMPTY}")
    lost = decide(dataclasses.replace(observed, disrupted={}), NOW, SETTINGS)
    assert lost.status["phase"] == "Failed"  # (gone, not seen disrupted: a failure)


def test_a_pod_lost_from_a_running_job_restarts_it(digits):
    _, _, plan = digits
    pods = _pods(plan, "Running")
    gone = pods.pop(4)["metadata"]["name"]
    pods[0] = _pod(plan, 0, "Running", deleting=True)
    d = decide(_observed(digits, _running(), pods), NOW, SETTINGS)
    assert d.status["phase"] == "Restarting"
    deleting = pods[0]["metadata"]["name"]
    assert _conditions(d)["Restarting"]["message"] == (
        f"pod {deleting} was deleted; pod {gone} was deleted; restart 1/3 {EMPTY}")
    assert d.actions[:-2] == [DeletePod(p["metadata"]["name"]) for p in pods[1:]]


def test_a_pod_deleted_and_failed_meanwhile_is_said_to_be_deleted(digits):
    """`kubectl delete pod` ends the worker with SIGTERM (143): the pod is then both being
    deleted and Failed, and what the operator says names the deletion, the cause, first."""
    _, _, plan = digits
    pods = _pods(plan, "Running")
    pods[2] = _pod(plan, 2, "Failed", code=143, deleting=True)
    d = decide(_observed(digits, _running(), pods), NOW, SETTINGS)
    name = pods[2]["metadata"]["name"]
    assert _conditions(d)["Recovering"]["message"].startswith(
        f"pod {name} was deleted and failed with exit code 143 (Error); cluster 1 restarted "
        f"alone")


# --- elastic: a lost cluster restarted alone ----------------------------------------------------
# digits plans 2 clusters: cluster 0 is node_0 (root) and node_5 (leaf), cluster 1 node_1..node_4;
# each of cluster 0's nodes shares a ring with cluster 1.

CLUSTER_0, CLUSTER_1 = (0, 5), (1, 2, 3, 4)


def _env(pod: dict) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in pod["spec"]["containers"][0]["env"]}


def test_a_failed_pod_restarts_only_its_cluster_while_the_others_train_on(digits):
    _, _, plan = digits
    pods = _pods(plan, "Running")
    pods[5] = _pod(plan, 5, "Failed", code=137)
    failed = pods[5]["metadata"]["name"]
    d = decide(_observed(digits, _running(), pods), NOW, SETTINGS)
    message = (f"pod {failed} failed with exit code 137 (Error); cluster 0 restarted alone "
               f"(recovery 1/10): it takes its state from cluster(s) 1 and rejoins at a round "
               f"boundary, while they train on")
    assert "phase" not in d.status and "restarts" not in d.status  # the job runs on
    assert d.status["recoveries"] == 1 and d.status["clusterRecoveries"] == [1, 0]
    assert d.status["rejoining"] == [0] and d.status["clusters"] == "1/2"
    cond = _conditions(d)["Recovering"]
    assert (cond["status"], cond["reason"], cond["message"]) == ("True", "WorkerFailed", message)
    assert d.actions == [*(DeletePod(pods[i]["metadata"]["name"]) for i in CLUSTER_0),
                         Event("Recovering", message, warning=True), CountRecovery()]


def test_a_cluster_restarted_alone_gets_pods_that_rejoin_and_is_not_lost_meanwhile(digits):
    _, _, plan = digits
    status = _running(recoveries=1, clusterRecoveries=[1], rejoining=[0])
    pods = [p for i, p in enumerate(_pods(plan, "Running")) if i not in CLUSTER_0]
    # a pod of the cluster from before its recovery is deleted first, then waited for
    stale = [*pods, _pod(plan, 0, "Running")]
    d = decide(_observed(digits, status, stale), NOW, SETTINGS)
    assert d.actions == [DeletePod(stale[-1]["metadata"]["name"])]
    d = decide(_observed(digits, status, pods), NOW, SETTINGS)
    created = [a.manifest for a in d.actions if isinstance(a, Create)]
    assert [m["metadata"]["name"] for m in created] == [
        resources.pod_name("digits", plan.names()[i]) for i in CLUSTER_0]
    for m in created:
        assert m["metadata"]["annotations"]["ravnest.io/recovery"] == "1"
        assert _env(m)["RAVNEST_REJOIN"] == "1"
    assert "phase" not in d.status and "conditions" not in d.status
    # progress goes on from the clusters training (cluster 1's root, node_1 at 10.0.0.2)
    assert [(a.hosts, a.started) for a in d.actions if isinstance(a, ScrapeProgress)] == [
        (("10.0.0.2",), _ago(100))]
    # a new pod of the other cluster is created as it was: it does not rejoin
    assert "RAVNEST_REJOIN" not in _env(resources.pod(
        resources.Owner("digits", "team-a", "uid-1"), digits[1], plan, plan.nodes[1], "img"))


def test_a_job_whose_pods_all_succeeded_has_every_cluster_back(digits):
    """The last pass may be given a status older than the one that said the cluster was back
    (rejoining [0]): with every pod succeeded, the clusters are 2/2 all the same."""
    _, _, plan = digits
    stale = _running(recoveries=1, clusterRecoveries=[1], rejoining=[0])
    pods = [_pod(plan, i, "Succeeded", code=0, recovery=1 if i in CLUSTER_0 else 0)
            for i in range(6)]
    d = decide(_observed(digits, stale, pods), NOW, SETTINGS)
    assert d.status["phase"] == "Succeeded" and d.status["clusters"] == "2/2"


def test_a_failed_pod_s_own_words_are_in_the_recovery_it_causes(digits):
    """A worker that fails says why in its termination message (or, dead without a word, its
    log's tail does): the operator repeats its last line, since the pod and its log go."""
    _, _, plan = digits
    pods = _pods(plan, "Running")
    said = ("RavnestError: node_5: node_2 was past round 40 (at 43) when asked to take this node "
            "in again; its cluster must be restarted again")
    pods[5] = _pod(plan, 5, "Failed", code=1, message=f"Traceback (most recent call last):\n"
                   f"  File \"x.py\", line 1, in <module>\n{said}\n\n")
    d = decide(_observed(digits, _running(), pods), NOW, SETTINGS)
    cond = _conditions(d)["Recovering"]
    assert cond["message"].startswith(
        f"pod {pods[5]['metadata']['name']} failed with exit code 1 (Error): {said}; cluster 0 "
        f"restarted alone"), cond["message"]
    pods[5] = _pod(plan, 5, "Failed", code=1, message="x" * 5000)  # (a log's tail: one long line)
    cond = _conditions(decide(_observed(digits, _running(), pods), NOW, SETTINGS))["Recovering"]
    assert f"(Error): {'x' * 297}...; cluster 0" in cond["message"]


def test_once_its_pods_run_the_cluster_is_back_and_recovering_ends(digits):
    _, _, plan = digits
    running = _running(recoveries=1, clusterRecoveries=[1], rejoining=[0])
    running["conditions"].append(_cond("Recovering", "True", "WorkerFailed", "pod x failed"))
    pods = [_pod(plan, i, "Running", recovery=1 if i in CLUSTER_0 else 0) for i in range(6)]
    d = decide(_observed(digits, running, pods), NOW, SETTINGS)
    assert d.status["rejoining"] == [] and d.status["clusters"] == "2/2"
    cond = _conditions(d)["Recovering"]
    assert (cond["status"], cond["reason"]) == ("False", "Rejoined")
    assert cond["message"] == "cluster(s) 0 running again after: pod x failed"
    assert Event("Rejoined", "cluster(s) 0 running again, rejoining the others") in d.actions
    assert not any(isinstance(a, (Create, DeletePod)) for a in d.actions)
    # lost again later: its second recovery
    pods[0] = _pod(plan, 0, "Failed", code=1, recovery=1)
    later = _running(recoveries=1, clusterRecoveries=[1], rejoining=[])
    d = decide(_observed(digits, later, pods), NOW, SETTINGS)
    assert d.status["recoveries"] == 2 and d.status["clusterRecoveries"] == [2, 0]


def test_a_succeeded_job_says_its_samples_per_second_from_start_to_end(digits):
    """The samples/s scraped while the job ran could be minutes old when it ended (a kind run
    showed 8.8 samples/s for a job that trained at 2,800): at success the figure is every
    cluster root's samples (termination message) over startTime to the last root's end."""
    _, _, plan = digits
    roots = {plan.names().index(c.nodes[0]) for c in plan.clusters}
    ends = {i: _ago(10 + 10 * k) for k, i in enumerate(sorted(roots))}

    def pods(finished: bool) -> list[dict]:
        out = []
        for i in range(6):
            said = json.dumps({"node": plan.names()[i], "updates": 66,
                               **({"samples": 900, "val_metric": 0.97} if i in roots else {})})
            p = _pod(plan, i, "Succeeded", code=0, message=said)
            if finished and i in roots:
                p["status"]["containerStatuses"][0]["state"]["terminated"]["finishedAt"] = ends[i]
            out.append(p)
        return out

    stale = {**_running(), "progress": {"samplesPerSecond": 8.8, "step": 3, "totalSteps": 66}}
    d = decide(_observed(digits, stale, pods(True)), NOW, SETTINGS)
    assert d.status["phase"] == "Succeeded"
    assert d.status["progress"]["samplesPerSecond"] == 2 * 900 / 90  # 100 s ago to 10 s ago
    assert d.status["progress"]["step"] == 66
    # without the roots' end times, the scraped figure stays (nothing better is known)
    d = decide(_observed(digits, stale, pods(False)), NOW, SETTINGS)
    assert d.status["progress"]["samplesPerSecond"] == 8.8


@pytest.mark.parametrize("case", ["policy job", "both clusters", "limit", "spec error",
                                  "other not running", "deleted from both"])
def test_a_loss_elasticity_cannot_absorb_restarts_the_whole_job(digits, case):
    _, _, plan = digits
    pods = _pods(plan, "Running")
    pods[5] = _pod(plan, 5, "Failed", code=2 if case == "spec error" else 137)
    status, policy = _running(), {}
    if case == "policy job":
        policy = WHOLE
    elif case == "both clusters":
        pods[1] = _pod(plan, 1, "Failed", code=137)
    elif case == "limit":
        policy, status = {"recoveryLimit": 2}, _running(recoveries=2)
    elif case == "other not running":
        pods[3] = _pod(plan, 3, "Pending")
    elif case == "deleted from both":
        pods[5] = _pod(plan, 5, "Running", deleting=True)
        pods.pop(2)
    seen = _observed(digits, status, pods, **({"runPolicy": policy} if policy else {}))
    d = decide(seen, NOW, SETTINGS)
    assert d.status["phase"] == "Restarting" and d.status["restarts"] == 1
    assert d.status["clusterRecoveries"] == [] and d.status["rejoining"] == []
    assert "recoveries" not in d.status or d.status["recoveries"] == status.get("recoveries")
    assert CountRestart() in d.actions and CountRecovery() not in d.actions


@pytest.mark.parametrize("how", ["failed", "rejoining"])
def test_a_cluster_that_cannot_rejoin_before_the_others_finish_is_left_out(digits, how):
    """Cluster 0 fails (or is restarted alone and not running yet) once cluster 1 has finished:
    nobody is left to take the state from, so the job ends with cluster 1's model (the final round
    averaged both) instead of starting everything over."""
    _, _, plan = digits
    result = {"updates": 66, "train_loss": 0.1, "val_loss": 0.2, "val_metric": 0.97}
    pods = _pods(plan, "Succeeded", code=0)
    pods[1] = _pod(plan, 1, "Succeeded", code=0, message=json.dumps(result))  # cluster 1's root
    status = _running()
    if how == "failed":
        pods[0] = _pod(plan, 0, "Failed", code=1)
        pods[5] = _pod(plan, 5, "Running")
    else:
        pods = [p for i, p in enumerate(pods) if i not in CLUSTER_0]
        status = _running(recoveries=1, clusterRecoveries=[1], rejoining=[0])
    d = decide(_observed(digits, status, pods), NOW, SETTINGS)
    assert d.status["abandoned"] == [0] and d.status["rejoining"] == []
    assert d.status["phase"] == "Succeeded" and d.status["result"] == result
    assert "restarts" not in d.status
    cond = _conditions(d)["Recovering"]
    assert (cond["status"], cond["reason"]) == ("False", "Abandoned")
    assert cond["message"].startswith("cluster(s) 0 could not rejoin before the others finished")
    deleted = [a.name for a in d.actions if isinstance(a, DeletePod)]
    assert deleted == ([pods[5]["metadata"]["name"]] if how == "failed" else [])
    # with recovery: job, the same failure restarts everything as before
    if how == "failed":
        d = decide(_observed(digits, _running(), pods, runPolicy=WHOLE), NOW, SETTINGS)
        assert d.status["phase"] == "Restarting" and "abandoned" not in d.status


@pytest.mark.parametrize("final", [[0], [0, 1], None])
def test_a_restarted_cluster_running_again_too_late_for_the_final_round_is_left_out(digits, final):
    """Cluster 1, restarted alone, runs again (its pods Running) once cluster 0 has finished; if
    cluster 0's nodes say their final round neither held it nor sent it the state, its workers can
    only wait for nodes that are gone (until their peer timeout): the job ends without it at once.
    If they say they did (it rejoined, at the final round), or say nothing (an older worker), it
    is waited for."""
    _, _, plan = digits
    result = {"updates": 66, "train_loss": 0.1, "val_loss": 0.2, "val_metric": 0.97}
    said = {} if final is None else {"final_clusters": final}
    pods = [_pod(plan, i, "Succeeded", code=0, message=json.dumps(
        {**said, **(result if i == 0 else {"updates": 66})})) for i in CLUSTER_0]
    pods += [_pod(plan, i, "Running", recovery=1) for i in CLUSTER_1]
    status = _running(recoveries=1, clusterRecoveries=[0, 1], rejoining=[])
    d = decide(_observed(digits, status, pods), NOW, SETTINGS)
    deleted = [a.name for a in d.actions if isinstance(a, DeletePod)]
    if final != [0]:
        assert "abandoned" not in d.status and "phase" not in d.status and not deleted
        return
    assert d.status["abandoned"] == [1] and d.status["phase"] == "Succeeded"
    assert d.status["result"] == {**said, **result}
    cond = _conditions(d)["Recovering"]
    assert (cond["status"], cond["reason"]) == ("False", "Abandoned")
    assert "running again only after the others' final round" in cond["message"]
    assert sorted(deleted) == sorted(pods[i]["metadata"]["name"] for i in range(2, 6))


def test_a_rejoining_cluster_that_fails_while_the_others_finish_waits_for_them(digits):
    """Cluster 1, restarted alone, fails again while cluster 0 is finishing (its leaf done, its
    root still shutting down, so that cluster 1's links to it break): nothing is restarted a
    moment before the end; once cluster 0 has finished, the job ends without cluster 1."""
    _, _, plan = digits
    result = {"updates": 66, "train_loss": 0.1, "val_loss": 0.2, "val_metric": 0.97}
    status = _running(recoveries=1, clusterRecoveries=[0, 1], rejoining=[])
    pods = [_pod(plan, 0, "Running"), _pod(plan, 5, "Succeeded", code=0)]
    pods += [_pod(plan, i, "Running", recovery=1) for i in CLUSTER_1]
    pods[2] = _pod(plan, CLUSTER_1[0], "Failed", code=1, recovery=1,
                   message="PeerFailed: node_0 began shutting down")
    d = decide(_observed(digits, status, pods), NOW, SETTINGS)
    assert "phase" not in d.status and "restarts" not in d.status and "recoveries" not in d.status
    assert not any(isinstance(a, (Create, DeletePod, Event)) for a in d.actions)
    cond = _conditions(d)["Recovering"]
    assert (cond["status"], cond["reason"]) == ("True", "OthersFinishing")
    assert cond["message"].endswith("cluster(s) 0 finishing: the job ends without the lost "
                                    "cluster once they have finished")
    pods[0] = _pod(plan, 0, "Succeeded", code=0, message=json.dumps(result))
    d = decide(_observed(digits, status, pods), NOW, SETTINGS)
    assert d.status["abandoned"] == [1] and d.status["phase"] == "Succeeded"
    assert (_conditions(d)["Recovering"]["reason"]) == "Abandoned"


def test_a_cluster_running_late_is_waited_for_not_left_out(digits):
    _, _, plan = digits
    pods = _pods(plan, "Succeeded", code=0)
    pods[0] = _pod(plan, 0, "Running")
    d = decide(_observed(digits, _running(), pods), NOW, SETTINGS)
    assert "abandoned" not in d.status and "phase" not in d.status
    assert not any(isinstance(a, (Create, DeletePod)) for a in d.actions)


def test_a_one_cluster_job_restarts_whole(digits):
    _, _, plan = digits
    pods = _pods(plan, "Running")[:1]
    pods[0] = _pod(plan, 0, "Failed", code=137)
    doc, _, _ = digits
    one = parse_job({**doc, "spec": {**doc["spec"], "plan": {"clusters": 1}}})
    plan1, _, _ = plan_job(one)
    seen = dataclasses.replace(_observed(digits, _running(), pods), job=one, plan=plan1,
                               pods=tuple(_pods(plan1, "Running")[:-1]))
    d = decide(seen, NOW, SETTINGS)
    assert d.status["phase"] == "Restarting"


def test_missing_pods_of_a_job_not_yet_running_are_created_not_lost(digits):
    _, _, plan = digits
    pods = _pods(plan, "Pending")[1:]
    status = {"phase": "Planned", "conditions": [_cond("Planned")]}
    d = decide(_observed(digits, status, pods), NOW, SETTINGS)
    assert [type(a) for a in d.actions] == [Create]


def test_beyond_backoff_limit_the_job_fails_naming_pod_and_exit_code(digits):
    _, _, plan = digits
    pods = _pods(plan, "Running", attempt=3)
    pods[3] = _pod(plan, 3, "Failed", code=3, attempt=3)
    pods[5] = _pod(plan, 5, "Succeeded", code=0, attempt=3)
    pods[0] = _pod(plan, 0, "Pending", attempt=3)
    d = decide(_observed(digits, _running(restarts=3, startTime=_ago(10)), pods), NOW, SETTINGS)
    message = (f"pod {pods[3]['metadata']['name']} failed with exit code 3 (Error) after 3 "
               "restart(s), backoffLimit 3")
    assert d.status["phase"] == "Failed" and d.status["completionTime"] == AT
    conds = _conditions(d)
    assert conds["Failed"]["reason"] == "BackoffLimitExceeded"
    assert conds["Failed"]["message"] == message
    assert conds["Running"] == {"type": "Running", "status": "False",
                                "reason": "BackoffLimitExceeded", "message": "",
                                "lastTransitionTime": AT}
    # cleanPodPolicy Running (the default): the running and pending pods go, finished ones stay
    assert d.actions == [Event("BackoffLimitExceeded", message, warning=True),
                         CountFinished("Running", "Failed", _ago(10)),
                         *(DeletePod(p["metadata"]["name"]) for i, p in enumerate(pods)
                           if i not in (3, 5))]


def test_backoff_limit_zero_and_clean_pod_policy_all(digits):
    _, _, plan = digits
    pods = _pods(plan, "Running")
    pods[1] = _pod(plan, 1, "Failed", code=1)
    seen = _observed(digits, _running(), pods,
                     runPolicy={"backoffLimit": 0, "cleanPodPolicy": "All", **WHOLE})
    d = decide(seen, NOW, SETTINGS)
    assert d.status["phase"] == "Failed"
    assert [a for a in d.actions if isinstance(a, DeletePod)] == [
        DeletePod(p["metadata"]["name"]) for p in pods]


def test_active_deadline_fails_the_job_and_deletes_its_pods(digits):
    _, _, plan = digits
    pods = _pods(plan, "Running")
    seen = _observed(digits, _running(), pods, runPolicy={"activeDeadlineSeconds": 99})
    d = decide(seen, NOW, SETTINGS)
    assert d.status["phase"] == "Failed"
    message = "job ran longer than activeDeadlineSeconds=99"
    assert _conditions(d)["Failed"]["reason"] == "DeadlineExceeded"
    assert _conditions(d)["Failed"]["message"] == message
    assert d.actions[1:] == [Event("DeadlineExceeded", message, warning=True),
                             CountFinished("Running", "Failed", _ago(100)),
                             *(DeletePod(p["metadata"]["name"]) for p in pods)]
    within = _observed(digits, _running(), pods, runPolicy={"activeDeadlineSeconds": 101})
    assert "phase" not in decide(within, NOW, SETTINGS).status


def test_active_deadline_counts_pending_pods_from_when_they_were_made(digits):
    """The pods were made 200 s ago (status.activeSince) and some are still Pending: a
    deadline of 150 s has passed, as a Kubernetes Job's would; the first pods made set
    activeSince, and a suspend clears it (a resume counts again)."""
    _, _, plan = digits
    pods = _pods(plan, "Running")
    pods[1]["status"] = {"phase": "Pending"}
    status = {"phase": "Planned", "activeSince": _ago(200),
              "conditions": [_cond("Created"), _cond("Planned")]}
    d = decide(_observed(digits, status, pods, runPolicy={"activeDeadlineSeconds": 150}), NOW,
               SETTINGS)
    assert _conditions(d)["Failed"]["reason"] == "DeadlineExceeded"
    new = {"phase": "Planned", "conditions": [_cond("Created"), _cond("Planned")]}
    d = decide(_observed(digits, new), NOW, SETTINGS)
    assert d.status["activeSince"] == AT
    d = decide(_observed(digits, status, pods, runPolicy={"activeDeadlineSeconds": 250}), NOW,
               SETTINGS)
    assert d.status.get("phase") != "Failed" and "activeSince" not in d.status


# --- suspend and resume ------------------------------------------------------------------------

def test_suspend_deletes_the_pods_once_and_says_so(digits):
    _, _, plan = digits
    pods = _pods(plan, "Running")
    d = decide(_observed(digits, _running(), pods, runPolicy={"suspend": True}), NOW, SETTINGS)
    assert d.status == {"phase": "Suspended", "activeSince": None, "conditions": [
        *_running()["conditions"],
        {"type": "Suspended", "status": "True", "reason": "Suspended",
         "message": f"pods deleted; {EMPTY}", "lastTransitionTime": AT}]}
    assert d.actions == [*(DeletePod(p["metadata"]["name"]) for p in pods),
                         Event("Suspended", f"pods deleted; {EMPTY}")]
    suspended = {**_running(), "phase": "Suspended"}
    again = decide(_observed(digits, suspended, pods[:2], runPolicy={"suspend": True}), NOW,
                   SETTINGS)
    assert again.status == {} and again.actions == [DeletePod(p["metadata"]["name"])
                                                    for p in pods[:2]]


def test_resume_recreates_the_pods(digits):
    _, _, plan = digits
    status = {**_running(), "phase": "Suspended",
              "conditions": [_cond("Running"), _cond("Suspended", reason="Suspended")]}
    d = decide(_observed(digits, status), NOW, SETTINGS)
    assert _conditions(d)["Suspended"] == {"type": "Suspended", "status": "False",
                                           "reason": "Resumed", "message": "",
                                           "lastTransitionTime": AT}
    assert len([a for a in d.actions if isinstance(a, Create)]) == len(plan.nodes)


def test_running_again_after_a_restart_keeps_what_it_recovered_from(digits):
    _, _, plan = digits
    status = {"phase": "Restarting", "restarts": 1, "startTime": _ago(100),
              "conditions": [_cond("Running", "False"),
                             _cond("Restarting", reason="WorkerFailed", message="pod x failed")]}
    d = decide(_observed(digits, status, _pods(plan, "Running", attempt=1)), NOW, SETTINGS)
    assert d.status["phase"] == "Running" and "startTime" not in d.status
    assert _conditions(d)["Restarting"] == {
        "type": "Restarting", "status": "False", "reason": "Recovered",
        "message": "running again after: pod x failed", "lastTransitionTime": AT}
    assert not [a for a in d.actions if isinstance(a, CountRunning)]


# --- success and TTL ---------------------------------------------------------------------------

def test_success_records_the_roots_result(digits):
    _, _, plan = digits
    root = plan.names().index(plan.clusters[0].nodes[0])
    result = {"updates": 66, "train_loss": 0.1, "val_loss": 0.2, "val_metric": 0.97}
    pods = _pods(plan, "Succeeded", code=0)
    pods[root] = _pod(plan, root, "Succeeded", code=0, message=json.dumps(result))
    status = _running(progress={"step": 64, "totalSteps": 66, "epoch": 3})
    d = decide(_observed(digits, status, pods), NOW, SETTINGS)
    assert d.status["phase"] == "Succeeded" and d.status["completionTime"] == AT
    assert d.status["result"] == result
    assert d.status["progress"] == {"step": 66, "totalSteps": 66, "epoch": 3, "loss": 0.1,
                                    "validationLoss": 0.2, "validationMetric": 0.97,
                                    "display": "66/66"}
    conds = _conditions(d)
    assert conds["Succeeded"]["message"] == \
        "validation metric 0.97; no spec.output.uri, so the trained model was not kept"
    assert conds["Running"]["status"] == "False" and conds["Running"]["reason"] == "Completed"
    assert d.actions == [Event("Succeeded", json.dumps(result)),
                         CountFinished("Running", "Succeeded", _ago(100))]


def test_a_job_done_before_its_first_scrape_shows_its_steps_and_epoch(digits):
    # kind's digits job once ended before the operator scraped its roots: `kubectl get rj` showed
    # no epoch and step 66/0; the root's figures alone fill the progress (as the local run's)
    _, _, plan = digits
    root = plan.names().index(plan.clusters[0].nodes[0])
    result = {"updates": 66, "epoch": 3, "train_loss": 0.1, "val_loss": None, "val_metric": 0.9}
    pods = _pods(plan, "Succeeded", code=0)
    pods[root] = _pod(plan, root, "Succeeded", code=0, message=json.dumps(result))
    d = decide(_observed(digits, _running(), pods), NOW, SETTINGS)
    assert d.status["progress"] == {"step": 66, "totalSteps": 66, "epoch": 3, "loss": 0.1,
                                    "validationMetric": 0.9, "display": "66/66"}
    assert render(d.status).startswith(f"Succeeded [{'#' * 30}] 66/66 epoch 3 loss 0.1000")


def test_success_without_a_result_and_clean_pod_policy_all(digits):
    _, _, plan = digits
    pods = _pods(plan, "Succeeded", code=0)
    seen = _observed(digits, _running(progress={"step": 5}), pods,
                     runPolicy={"cleanPodPolicy": "All"})
    d = decide(seen, NOW, SETTINGS)
    assert "result" not in d.status and d.status["progress"] == {"step": 5}
    assert _conditions(d)["Succeeded"]["message"].startswith("validation metric None;")
    assert d.actions[0] == Event("Succeeded", "{}")
    assert d.actions[2:] == [DeletePod(p["metadata"]["name"]) for p in pods]


OUTPUT = {"uri": "s3://models/digits"}


def _finisher(phase: str, code: int | None = None, message: str = "", reason: str | None = None,
              created: str | None = None) -> dict:
    status: dict[str, Any] = {"phase": phase}
    if code is not None:
        status["containerStatuses"] = [{"state": {"terminated": {
            "exitCode": code, "reason": reason, "message": message}}}]
    return {"metadata": {"name": "digits-finish", "creationTimestamp": created or _ago(10)},
            "status": status}


def test_with_an_output_uri_a_finishing_pod_writes_the_outputs_before_success(digits):
    """Every worker done: the finishing pod (the job's image, its storage, no token) starts; the
    job is Finishing until it hands back where the outputs are, then Succeeded saying so."""
    _, _, plan = digits
    pods = _pods(plan, "Succeeded", code=0)
    d = decide(_observed(digits, _running(), pods, output=OUTPUT), NOW, SETTINGS)
    assert d.status["phase"] == "Finishing"
    created = [a.manifest for a in d.actions if isinstance(a, Create)]
    assert [b["metadata"]["name"] for b in created] == ["digits-finish"]
    container = created[0]["spec"]["containers"][0]
    assert container["args"][0] == "finish" and created[0]["spec"][
        "automountServiceAccountToken"] is False
    assert _conditions(d)["OutputsWritten"]["status"] == "False"

    d = decide(_observed(digits, {**_running(), "phase": "Finishing"},
                         [*pods, _finisher("Running")], output=OUTPUT), NOW, SETTINGS)
    assert d.status["phase"] == "Finishing" and not any(isinstance(a, Create) for a in d.actions)

    outputs = {"uri": "s3://models/digits", "model": "s3://models/digits/model.pt",
               "summary": "s3://models/digits/summary.json", "evil": "x"}
    message = json.dumps({"outputs": outputs, "fused_val_metric": 0.96, "seconds": "no"})
    d = decide(_observed(digits, {**_running(), "phase": "Finishing"},
                         [*pods, _finisher("Succeeded", 0, message)], output=OUTPUT),
               NOW, SETTINGS)
    assert d.status["phase"] == "Succeeded"
    assert d.status["outputs"] == {k: v for k, v in outputs.items() if k != "evil"}
    assert d.status["result"]["fused_val_metric"] == 0.96 and "seconds" not in d.status["result"]
    conds = _conditions(d)
    assert conds["OutputsWritten"]["status"] == "True"
    assert conds["Succeeded"]["message"].endswith("outputs in s3://models/digits")


@pytest.mark.parametrize(("finisher", "says"), [
    (_finisher("Failed", 1, "StorageError: cannot write s3://models/digits/model.pt: denied",
               "Error"),
     "finishing pod digits-finish failed with exit code 1 (Error): StorageError: cannot write"),
    (_finisher("Failed", 137, "", "OOMKilled"),
     "give it more memory in spec.output.resources"),
    (_finisher("Succeeded", 0, "not json"), "finishing pod digits-finish handed back no outputs"),
    (_finisher("Pending", created=_ago(1801)),
     "did not finish within spec.output.timeoutSeconds=1800 (Pending)"),
])
def test_outputs_that_cannot_be_written_fail_the_job_saying_why(digits, finisher, says):
    _, _, plan = digits
    pods = [*_pods(plan, "Succeeded", code=0), finisher]
    d = decide(_observed(digits, {**_running(), "phase": "Finishing"}, pods, output=OUTPUT),
               NOW, SETTINGS)
    assert d.status["phase"] == "Failed"
    failed = _conditions(d)["Failed"]
    assert failed["reason"] == "OutputsFailed" and says in failed["message"], failed["message"]


@pytest.mark.parametrize("phase", ["Succeeded", "Failed"])
def test_a_finished_job_is_deleted_once_its_ttl_has_passed(digits, phase):
    status = {"phase": phase, "completionTime": _ago(30)}
    ttl = {"runPolicy": {"ttlSecondsAfterFinished": 30}}
    assert decide(Observed("digits", "team-a", "u", ttl, status), NOW, SETTINGS).steps == [
        DeleteJob()]
    later = {"runPolicy": {"ttlSecondsAfterFinished": 31}}
    assert decide(Observed("digits", "team-a", "u", later, status), NOW, SETTINGS).steps == []
    assert decide(Observed("digits", "team-a", "u", {}, status), NOW, SETTINGS).steps == []


# --- hot spares (spec.plan.spares) --------------------------------------------------------------

@pytest.fixture(scope="module")
def spared():
    """digits with one spare, each provider on its own machine (nodeSelector)."""
    doc = copy.deepcopy(yaml.safe_load((ROOT / "examples" / "digits.yaml").read_text()))
    doc["spec"]["plan"]["spares"] = 1
    for i, p in enumerate(doc["spec"]["providers"]):
        p["nodeSelector"] = {"machine": f"m{i}"}
    job = parse_job(doc)
    plan, _, _ = plan_job(job)
    assert len(plan.spares) == 1
    return doc, job, plan


def _spare_pod(provider: int, phase: str = "Running") -> dict:
    return {"metadata": {"name": f"digits-spare-{provider}",
                         "labels": {"ravnest.io/job": "digits", "ravnest.io/spare": str(provider)}},
            "status": {"phase": phase}}


def _created(d) -> dict[str, dict]:
    return {a.manifest["metadata"]["name"]: a.manifest for a in d.actions if isinstance(a, Create)}


def test_a_spare_runs_as_a_pod_on_its_providers_machine_holding_no_token(spared):
    _, _, plan = spared
    (spare,) = plan.spares
    d = decide(_observed(spared, _running(), _pods(plan, "Running")), NOW, SETTINGS)
    made = _created(d)
    assert list(made) == [f"digits-spare-{spare.provider}"]
    pod = made[f"digits-spare-{spare.provider}"]
    assert pod["spec"]["nodeSelector"] == {"machine": f"m{spare.provider}"}
    assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == "spare"
    assert pod["spec"]["containers"][0]["args"][:2] == ["worker", "--spare"]
    assert "RAVNEST_TOKEN" not in _env(pod) and "ports" not in pod["spec"]["containers"][0]
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert d.status["spares"] == {spare.name: "Missing"}
    # once it runs, nothing more is done for it
    pods = [*_pods(plan, "Running"), _spare_pod(spare.provider)]
    d = decide(_observed(spared, _running(), pods), NOW, SETTINGS)
    assert _created(d) == {} and d.status["spares"] == {spare.name: "Running"}


def test_a_running_spare_takes_over_the_stage_of_a_lost_node_on_its_machine(spared):
    _, job, plan = spared
    (spare,) = plan.spares
    victim = plan.cluster_nodes(1)[-1]
    i = plan.names().index(victim.name)
    pods = [*_pods(plan, "Running"), _spare_pod(spare.provider)]
    pods[i] = _pod(plan, i, "Failed", code=137)
    d = decide(_observed(spared, _running(), pods), NOW, SETTINGS)
    assert d.status["takeovers"] == {victim.name: spare.provider}
    assert DeletePod(f"digits-spare-{spare.provider}") in d.actions
    assert d.actions.count(CountTakeover()) == 1
    assert Event("TookOver", f"spare {spare.name} (provider {spare.provider}) takes over the "
                             f"stage of {victim.name}: its pod is placed as that provider") \
        in d.actions
    assert d.status["recoveries"] == 1 and d.status["rejoining"] == [1]  # its cluster rejoins
    # (and says which spare took over, as the local runner does)
    assert f"cluster 1 restarted alone (recovery 1/10); spare {spare.name} took over the " \
           f"stage of {victim.name}: it takes its state" in _conditions(d)["Recovering"]["message"]

    # the next passes: the node's new pod goes on the spare's machine, the lost provider's
    # machine gets the spare pod
    status = _running(recoveries=1, clusterRecoveries=[0, 1], rejoining=[1],
                      takeovers={victim.name: spare.provider})
    left = [p for k, p in enumerate(_pods(plan, "Running"))
            if plan.nodes[k].cluster != 1]
    d = decide(_observed(spared, status, left), NOW, SETTINGS)
    made = _created(d)
    new = made[resources.pod_name("digits", victim.name)]
    assert new["spec"]["nodeSelector"] == {"machine": f"m{spare.provider}"}
    assert new["metadata"]["annotations"]["ravnest.io/provider"] == str(spare.provider)
    assert _env(new)["RAVNEST_REJOIN"] == "1"
    other = made[resources.pod_name("digits", plan.cluster_nodes(1)[0].name)]
    assert other["spec"]["nodeSelector"] == {"machine": f"m{plan.cluster_nodes(1)[0].provider}"}
    lost = made[f"digits-spare-{victim.provider}"]
    assert lost["spec"]["nodeSelector"] == {"machine": f"m{victim.provider}"}
    assert d.status["spares"] == {f"spare_{victim.provider}": "Missing"}
    assert job.spec.expanded_providers()[spare.provider].ram * 2**30 >= victim.memory_bytes


def test_a_spare_that_does_not_run_takes_nothing_over(spared):
    _, _, plan = spared
    (spare,) = plan.spares
    pods = [*_pods(plan, "Running"), _spare_pod(spare.provider, "Pending")]
    pods[1] = _pod(plan, 1, "Failed", code=137)
    d = decide(_observed(spared, _running(), pods), NOW, SETTINGS)
    assert "takeovers" not in d.status and d.status["recoveries"] == 1
    assert DeletePod(f"digits-spare-{spare.provider}") not in d.actions


def test_a_spare_takes_over_at_a_whole_restart_too(spared):
    _, _, plan = spared
    (spare,) = plan.spares
    pods = [*_pods(plan, "Running"), _spare_pod(spare.provider)]
    pods[0] = _pod(plan, 0, "Failed", code=137)
    d = decide(_observed(spared, _running(), pods, runPolicy=WHOLE), NOW, SETTINGS)
    assert d.status["phase"] == "Restarting" and d.status["restarts"] == 1
    assert d.status["takeovers"] == {plan.nodes[0].name: spare.provider}
    # (and says so, as the local runner does: tests/unit/test_supervising.py)
    (restarting,) = [c for c in d.status["conditions"] if c["type"] == "Restarting"]
    assert restarting["message"].endswith(
        f"; spare {spare.name} took over the stage of {plan.nodes[0].name}")


def test_spare_pods_are_let_go_when_training_ends_whatever_the_clean_policy(spared):
    _, _, plan = spared
    (spare,) = plan.spares
    pods = [*_pods(plan, "Succeeded", code=0), _spare_pod(spare.provider)]
    d = decide(_observed(spared, _running(), pods, runPolicy={"cleanPodPolicy": "None"}), NOW,
               SETTINGS)
    assert d.status["phase"] == "Succeeded"
    assert d.actions.count(DeletePod(f"digits-spare-{spare.provider}")) >= 1
    assert all(a.name == f"digits-spare-{spare.provider}"
               for a in d.actions if isinstance(a, DeletePod))  # the workers' pods are kept
    pods = [*_pods(plan, "Running", attempt=3), _spare_pod(spare.provider)]
    pods[0] = _pod(plan, 0, "Failed", code=1, attempt=3)
    d = decide(_observed(spared, _running(restarts=3), pods,
                         runPolicy={"cleanPodPolicy": "None", "recovery": "job"}), NOW, SETTINGS)
    assert d.status["phase"] == "Failed"
    assert DeletePod(f"digits-spare-{spare.provider}") in d.actions


# --- a spec edited after planning -----------------------------------------------------------------

def test_a_running_job_keeps_to_its_plan_when_its_spec_is_edited_and_says_so(digits):
    """kubectl apply of a running job with its providers edited (reordered and one added: not an
    addition after its own, which is how a running job grows): its pods are still made from the spec
    as planned, runPolicy edits apply, and a SpecChanged condition and Warning say what was not
    applied, until the spec is as planned again."""
    doc, job, plan = digits
    spec = copy.deepcopy(doc["spec"])
    spec["providers"] = [*spec["providers"][::-1], {"ram": 4}]
    spec["runPolicy"] = {"backoffLimit": 7, "recovery": "job"}
    now = parse_job({**doc, "spec": spec})
    got, changed = as_planned(now, job.to_dict())
    assert changed == ("providers",) and removed_providers(now, got, changed) is None
    assert got.spec.providers == job.spec.providers
    assert got.spec.run_policy.backoff_limit == 7 and got.spec.run_policy.recovery == "job"
    assert as_planned(job, None) == (job, ())  # a plan ConfigMap without the job: as it is
    assert as_planned(job, job.to_dict()) == (job, ())

    pods = _pods(plan, "Running")
    del pods[5]  # node_5 (provider 5, gone from the edited spec) is lost
    observed = dataclasses.replace(_observed(digits, _running(), pods), job=got, changed=changed,
                                   spec=spec)
    d = decide(observed, NOW, SETTINGS)
    cond = _conditions(d)["SpecChanged"]
    assert (cond["status"], cond["reason"]) == ("True", "NotApplied")
    assert cond["message"].startswith("spec.providers changed after the job was planned, and is "
                                      "not applied: the job runs on as planned")
    assert Event("SpecChanged", cond["message"], warning=True) in d.actions
    assert d.status["phase"] == "Restarting"  # recovery: job, from the edited runPolicy

    status = {**_running(restarts=1, conditions=[*_running()["conditions"], cond]),
              "phase": "Restarting"}
    observed = dataclasses.replace(observed, status=status, pods=())
    d = decide(observed, NOW, SETTINGS)
    made = {a.manifest["metadata"]["name"] for a in d.actions if isinstance(a, Create)}
    assert made == {resources.pod_name("digits", n) for n in plan.names()}
    assert not any(isinstance(a, Event) and a.reason == "SpecChanged" for a in d.actions)

    d = decide(dataclasses.replace(observed, changed=()), NOW, SETTINGS)
    cond = _conditions(d)["SpecChanged"]
    assert (cond["status"], cond["reason"]) == ("False", "AsPlanned")


# --- providers removed from a running job: their clusters drain ----------------------------------

def test_the_providers_an_edit_removed_are_found_and_other_edits_are_not_removals():
    a, b, c = (Provider(ram=r) for r in (4, 8, 2))
    assert removed_providers_of([a, a, b, c], [a, b]) == [1, 3]  # an entry's last replicas go
    assert removed_providers_of([a, b, c], [a, b, c]) == []
    assert removed_providers_of([a, b, c], [c]) == [0, 1]
    assert removed_providers_of([a, b], [b, a]) is None  # reordered
    assert removed_providers_of([a, b], [a, b, c]) is None  # added
    assert removed_providers_of([a, b], [a, Provider(ram=8, compute=2)]) is None  # changed


def _drain_edit(digits, keep: list[int], status: dict, pods=()) -> Observed:
    """The digits job running with spec.providers edited to the providers `keep` (by index)."""
    doc, job, _ = digits
    spec = copy.deepcopy(doc["spec"])
    spec["providers"] = [spec["providers"][i] for i in keep]
    now = parse_job({**doc, "spec": spec})
    got, changed = as_planned(now, job.to_dict())
    return dataclasses.replace(_observed(digits, status, pods), spec=spec, job=got,
                               changed=changed, removed=removed_providers(now, got, changed))


def test_providers_removed_from_a_running_job_drain_their_cluster(digits):
    """kubectl apply with provider 5 left out: its cluster (0: providers 0 and 5) is told to
    drain through its root pod's annotation, which the pod's downward-API volume shows its worker;
    the others train on, and the edit is applied, not refused."""
    _, _, plan = digits
    pods = _pods(plan, "Running")
    observed = _drain_edit(digits, [0, 1, 2, 3, 4], _running(), pods)
    assert observed.removed == (5,)
    d = decide(observed, NOW, SETTINGS)
    order = json.dumps({"providers": [5], "at": AT})
    root = pods[0]["metadata"]["name"]
    assert AnnotatePod(root, resources.DRAIN_ANNOTATION, order) in d.actions
    assert d.status["draining"] == [{"cluster": 0, "orderedAt": AT, "providers": [5]}]
    assert d.status["drained"] == [] and "phase" not in d.status
    assert "SpecChanged" not in {c["type"] for c in d.status.get("conditions") or []}
    assert [a.reason for a in d.actions if isinstance(a, Event)] == ["Draining"]
    assert not any(isinstance(a, DeletePod | Create) for a in d.actions)
    # the next pass orders nothing again; a root pod made meanwhile carries the order
    pods[0]["metadata"]["annotations"][resources.DRAIN_ANNOTATION] = order
    again = dataclasses.replace(observed, status=_running(**{
        k: d.status[k] for k in ("draining", "drained")}), pods=tuple(pods))
    d = decide(again, NOW, SETTINGS)
    assert not any(isinstance(a, AnnotatePod | Event) for a in d.actions)
    made = resources.pod(resources.Owner("digits", "team-a", "uid-1"), digits[1], plan,
                         plan.nodes[0], "img", drain=order)
    assert made["metadata"]["annotations"][resources.DRAIN_ANNOTATION] == order
    (volume,) = [v for v in made["spec"]["volumes"] if v["name"] == "drain"]
    assert volume["downwardAPI"]["items"] == [{"path": "cluster_0", "fieldRef": {
        "fieldPath": f"metadata.annotations['{resources.DRAIN_ANNOTATION}']"}}]
    assert _env(made)["RAVNEST_DRAIN_DIR"] == resources.DRAIN_DIR


def test_a_drained_cluster_is_out_of_the_job_and_a_restart_leaves_it_out(digits):
    """Once the root's termination message says it drained: status.drained, the membership's
    second version and clusters 1/2; its pods gone are not lost, nor made again; a whole restart
    makes only the other cluster's pods, which are told the drained nodes are gone."""
    _, _, plan = digits
    ordered = [{"cluster": 0, "orderedAt": AT, "providers": [5]}]
    said = json.dumps({"node": "node_0", "updates": 40, "drained": {"round": 20, "updates": 40}})
    pods = [_pod(plan, i, "Running") for i in range(6)]
    for i in CLUSTER_0:
        pods[i] = _pod(plan, i, "Succeeded", code=0, message=said if i == 0 else None)
    d = decide(_drain_edit(digits, [0, 1, 2, 3, 4], _running(draining=ordered), pods), NOW,
               SETTINGS)
    drained = [{**ordered[0], "round": 20, "updates": 40}]
    assert d.status["drained"] == drained and d.status["draining"] == []
    assert d.status["clusters"] == "1/2"
    assert d.status["membership"] == {"plan": plan.fingerprint, "versions": [
        {"version": 1, "fromRound": 1, "clusters": [0, 1]},
        {"version": 2, "fromRound": 21, "clusters": [1]}]}
    assert Event("Drained", "cluster 0 drained after round 20 (update 40): the job goes on "
                            "without it") \
        in d.actions and CountDrain() in d.actions
    others = [p for i, p in enumerate(pods) if i in CLUSTER_1]
    d = decide(_drain_edit(digits, [0, 1, 2, 3, 4], _running(drained=drained), others), NOW,
               SETTINGS)
    assert "phase" not in d.status and d.status["clusters"] == "1/2"
    assert not any(isinstance(a, Create | DeletePod) for a in d.actions)
    assert [a.hosts for a in d.actions if isinstance(a, ScrapeProgress)] == [("10.0.0.2",)]
    others[0] = _pod(plan, 1, "Failed", code=137)
    d = decide(_drain_edit(digits, [0, 1, 2, 3, 4], _running(drained=drained), others), NOW,
               SETTINGS)
    assert d.status["phase"] == "Restarting"  # no other cluster to take the state from
    restarted = _drain_edit(digits, [0, 1, 2, 3, 4], {
        **_running(drained=drained, restarts=1), "phase": "Restarting"})
    made = [a.manifest for a in decide(restarted, NOW, SETTINGS).actions if isinstance(a, Create)]
    assert sorted(m["metadata"]["name"] for m in made) == sorted(
        resources.pod_name("digits", plan.names()[i]) for i in CLUSTER_1)
    assert {_env(m)["RAVNEST_GONE"] for m in made} == {"node_0,node_5"}


@pytest.mark.parametrize("keep, why", [
    ([0], "would leave no cluster to train: stop the job instead"),
    ([0, 1, 2, 3, 4, 5], "provider(s) 5 left the job and are listed again: a drained cluster "
                         "does not come back"),
])
def test_a_removal_that_cannot_drain_is_refused_and_nothing_is_ordered(digits, keep, why):
    _, _, plan = digits
    status = _running()
    if len(keep) == 6:  # provider 5 drained before, and is back in the spec
        status["drained"] = [{"cluster": 0, "orderedAt": AT, "providers": [5], "round": 3}]
    observed = _drain_edit(digits, keep, status, _pods(plan, "Running"))
    d = decide(observed, NOW, SETTINGS)
    cond = _conditions(d)["SpecChanged"]
    assert (cond["status"], cond["reason"]) == ("True", "NotApplied")
    assert cond["message"].startswith("spec.providers: the providers removed are not drained: ")
    assert why in cond["message"]
    assert not any(isinstance(a, AnnotatePod) for a in d.actions)
    assert not d.status.get("draining")


def test_a_cluster_told_to_drain_too_near_the_end_finishes_and_counts(digits):
    """A root that finished training as usual (its termination message says no drain: the leave
    round would have been past the job's last) is no longer draining; the job ends with it."""
    _, _, plan = digits
    ordered = [{"cluster": 0, "orderedAt": AT, "providers": [5]}]
    said = json.dumps({"node": "node_0", "updates": 66, "cluster": 0, "val_metric": 0.97})
    pods = [_pod(plan, i, "Succeeded", code=0, message=said if i == 0 else None)
            for i in range(6)]
    d = decide(_drain_edit(digits, [0, 1, 2, 3, 4], _running(draining=ordered), pods), NOW,
               SETTINGS)
    assert d.status["draining"] == [] and d.status["drained"] == []
    assert d.status["notDrained"] == ordered
    assert [a.reason for a in d.actions if isinstance(a, Event)] == ["NotDrained", "Succeeded"]
    assert d.status["phase"] == "Succeeded" and d.status["result"]["cluster"] == 0


# --- growing (issue 20) -----------------------------------------------------------------------

def _grow_edit(digits, added: list[dict], status: dict, pods=(), **spec_changes: Any
               ) -> Observed:
    """The digits job running with `added` listed after its providers (and `spec_changes`)."""
    doc, job, _ = digits
    spec = copy.deepcopy(doc["spec"])
    spec["providers"] = [*spec["providers"], *added]
    spec.update(spec_changes)
    now = parse_job({**doc, "spec": spec})
    got, changed = as_planned(now, job.to_dict())
    added_ = added_providers(now, got, changed)
    return dataclasses.replace(_observed(digits, status, pods), spec=spec, job=got,
                               changed=changed, removed=removed_providers(now, got, changed),
                               added=added_, edited=now if added_ else None)


def _like_cluster_0(plan) -> list[dict]:
    return [{"ram": plan.node(n).ram_gb} for n in plan.clusters[0].nodes]


def test_providers_added_to_a_running_job_form_a_cluster_that_joins(digits):
    """kubectl apply with two providers listed after the job's: they form cluster 2 with the
    stages of cluster 0; its ConfigMaps and the grown plan are written, then its pods are made
    (not taken for lost ones), it counts as rejoining until they run, and once its root ended,
    saying after which round it joined, the membership has a version from the round after."""
    _, _, plan = digits
    observed = _grow_edit(digits, _like_cluster_0(plan), _running(), _pods(plan, "Running"))
    assert observed.added == (6, 7) and observed.removed is None
    d = decide(observed, NOW, SETTINGS)
    (grow,) = [a for a in d.actions if isinstance(a, GrowJob)]
    assert grow.nodes == ("node_6", "node_7") and grow.job == observed.edited
    assert len(grow.plan.clusters) == 3 and grow.plan.planned == 2
    assert grow.plan.fingerprint == plan.fingerprint
    assert d.status["grown"] == [{"providers": [6, 7], "clusters": [2], "at": AT}]
    assert d.status["rejoining"] == [2] and d.status["clusters"] == "2/3"
    assert "SpecChanged" not in {c["type"] for c in d.status.get("conditions") or []}
    assert [a for a in d.actions if isinstance(a, Event)] == [Event(
        "Growing", "provider(s) 6, 7 added to spec.providers form cluster(s) 2: they join the "
                   "running job at a round boundary with its latest state, while the others "
                   "train on")]
    assert not any(isinstance(a, Create | DeletePod) for a in d.actions)

    # the next pass reads the grown plan and the edited job as planned: the new pods are made
    grown, edited = grow.plan, grow.job
    status = _running(grown=d.status["grown"], rejoining=[2])

    def passing(pods: list[dict]) -> Decision:
        return decide(dataclasses.replace(observed, job=edited, plan=grown, changed=(),
                                          removed=(), added=(), edited=None, status=status,
                                          pods=tuple(pods)), NOW, SETTINGS)

    old = _pods(plan, "Running")
    d = passing(old)
    made = [a.manifest for a in d.actions if isinstance(a, Create)]
    assert sorted(m["metadata"]["name"] for m in made) == ["digits-node-6", "digits-node-7"]
    assert "phase" not in d.status and d.status["clusters"] == "2/3"
    assert not any(isinstance(a, DeletePod | CountRecovery) for a in d.actions)
    new = [_pod(grown, i, "Running") for i in (6, 7)]
    d = passing([*old, *new])
    assert d.status["rejoining"] == [] and d.status["clusters"] == "3/3"
    assert Event("Rejoined", "cluster(s) 2 running joining the others") in d.actions
    said = json.dumps({"node": "node_6", "updates": 80, "rejoined": {"round": 30}})
    ended = [_pod(grown, i, "Succeeded", code=0, message=said if i == 6 else None)
             for i in range(8)]
    d = passing(ended)
    assert d.status["joined"] == [{"cluster": 2, "round": 30}]
    assert d.status["membership"]["versions"] == [
        {"version": 1, "fromRound": 1, "clusters": [0, 1]},
        {"version": 2, "fromRound": 31, "clusters": [0, 1, 2]}]


@pytest.mark.parametrize("added, changes, why", [
    ([{"ram": 0.000001}], {}, r"spec.providers: the providers added do not join: "
                             r"spec.providers\[6\]: the providers added from here on cannot form"),
    (None, {"security": {"tls": True}}, "a job with spec.security.tls cannot grow yet"),
    (None, {"signs": False}, "the operator's signing key is not the one this job was planned "
                             "with"),
])
def test_providers_that_cannot_join_are_refused_and_nothing_is_done(digits, added, changes,
                                                                     why):
    doc, job, plan = digits
    changes = dict(changes)
    signs = changes.pop("signs", True)
    if changes:  # (TLS as planned too: only the providers differ)
        doc = {**doc, "spec": {**doc["spec"], **changes}}
        job = parse_job(doc)
        digits = (doc, job, plan)
    observed = replace(_grow_edit(digits, added or _like_cluster_0(plan), _running(),
                                  _pods(plan, "Running")), signs=signs)
    assert observed.added
    d = decide(observed, NOW, SETTINGS)
    assert not any(isinstance(a, GrowJob | Create | DeletePod) for a in d.actions)
    assert "grown" not in d.status
    changed = _conditions(d)["SpecChanged"]
    assert changed["status"] == "True" and changed["reason"] == "NotApplied"
    assert re.search(why, changed["message"]), changed["message"]
