"""One pass of the operator against a real apiserver, called in this process: what it decides on
and where its status goes. kopf hands a handler its copy of the job, which can be older than the
status the last pass wrote (kopf applies a handler's patch after the handler returns, and its copy
catches up only when the watch brings the change back); on a loaded machine a pass decided on
such a copy took the pods it had just made for stale, or a cluster it had just restarted or added
for lost, and restarted that cluster again (seen on kind: a job grown by a cluster recovered it at
once; an elastic job's restarted cluster recovered twice and was left out)."""

from __future__ import annotations

import copy

import kopf
import kubernetes
import pytest
from kube import LocalApiserver, local_apiserver
from operator_harness import ROOT, apply, get, job_doc, kctl

pytestmark = pytest.mark.tools  # (scripts/test runs it once the tools are there)


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory):
    with local_apiserver(tmp_path_factory.mktemp("passes") / "kube") as kube:
        kctl(kube, "apply", "-f", str(ROOT / "crds" / "ravnestjob.yaml"))
        kctl(kube, "wait", "--for=condition=Established", "crd/ravnestjobs.ravnest.io",
             "--timeout=60s")
        kubernetes.config.load_kube_config(str(kube.kubeconfig))
        yield kube


def _events(uid: str) -> dict[str, str]:
    """The Events on the job with this uid: name -> reason."""
    found = kubernetes.client.CoreV1Api().list_namespaced_event(
        "default", field_selector=f"involvedObject.uid={uid}")
    return {e.metadata.name: (int(e.metadata.resource_version), e.reason) for e in found.items}


def _pass(job: dict, status: dict) -> tuple[kopf.Patch, list[str]]:
    """One pass as the ticker calls it, handed `job` with `status` (kopf's copy): kopf's patch
    it leaves, and the reasons of the Events it posted on the job, in the order posted (read
    back from the apiserver)."""
    from ravnest_operator import handling

    meta = job["metadata"]
    patch = kopf.Patch()
    body = {**copy.deepcopy(job), "status": status}
    before = _events(meta["uid"])
    handling._reconcile_once({"body": body, "spec": body["spec"], "status": status,
                              "name": meta["name"], "namespace": meta["namespace"],
                              "uid": meta["uid"], "patch": patch}, wait=True)
    posted = [e for name, e in _events(meta["uid"]).items() if name not in before]
    return patch, [reason for _, reason in sorted(posted)]


def _pods(kube: LocalApiserver, job: str) -> list[str]:
    return [p["metadata"]["name"] for p in get(kube, "pods", selector=f"ravnest.io/job={job}")
            ["items"]]


def test_a_pass_decides_on_the_status_the_apiserver_has_not_on_an_older_copy(kube, tmp_path):
    """The job finished (its status says Succeeded); kopf's copy is from before its first pass.
    A pass decided on that copy would plan the job again: a planner pod, phase Planning."""
    assert apply(kube, job_doc("done"), tmp_path).returncode == 0
    kctl(kube, "patch", "rj", "done", "--subresource=status", "--type=merge", "-p",
         '{"status": {"phase": "Succeeded", "completionTime": "2026-11-27T08:00:00Z"}}')
    job = get(kube, "rj", "done")
    patch, events = _pass(job, status={})
    assert _pods(kube, "done") == [] and events == []
    assert get(kube, "rj", "done")["status"]["phase"] == "Succeeded"
    assert not patch  # nothing left for kopf to apply later, over a later pass's status


def test_a_pass_writes_its_status_before_the_next_pass_reads_it(kube, tmp_path):
    """A new job's first pass starts planning; its status is in the apiserver when the pass
    returns (not when kopf gets round to it), so the next pass, handed kopf's copy from before
    the first, plans nothing twice."""
    assert apply(kube, job_doc("fresh"), tmp_path).returncode == 0
    job = get(kube, "rj", "fresh")
    _, events = _pass(job, status={})
    assert events == ["Planning"]
    status = get(kube, "rj", "fresh")["status"]
    assert status["phase"] == "Planning", status
    assert _pods(kube, "fresh") == ["fresh-planner"]
    _, events = _pass(job, status={})  # kopf's copy: still the one from before the first pass
    assert events == []
    after = get(kube, "rj", "fresh")["status"]
    assert after["phase"] == "Planning" and _pods(kube, "fresh") == ["fresh-planner"], after
    conditions = {c["type"]: c for c in after["conditions"]}
    assert conditions["Created"]["status"] == "True"
    # which generation of the spec the pass acted on, and each condition was set from
    assert after["observedGeneration"] == job["metadata"]["generation"] == 1
    assert {c["observedGeneration"] for c in after["conditions"]} == {1}


FULL = {
    "observedGeneration": 4, "phase": "Running",
    "conditions": [{"type": "Running", "status": "True", "reason": "PodsRunning",
                    "message": "6 worker pods running",
                    "lastTransitionTime": "2026-11-28T04:00:00Z", "observedGeneration": 4}],
    "plan": {"fingerprint": "ab12", "summary": "2x2/4",
             "clusters": [{"id": 0, "nodes": ["node_0"]}], "stages": {"node_0": "conv1..fc"},
             "spares": ["spare_6"]},
    "clusters": "2/2", "nodes": {"node_0": {"pod": "full-node-0", "phase": "Failed", "exitCode": 1,
                                            "reason": "Error"}},
    "spares": {"spare_6": "Running"}, "takeovers": {"node_3": 6},
    "progress": {"epoch": 2, "step": 30, "totalSteps": 66, "display": "30/66", "loss": 0.25,
                 "validationLoss": 0.5, "validationMetric": 0.9, "samplesPerSecond": 812.5,
                 "etaSeconds": 12},
    "startTime": "2026-11-28T04:00:00Z", "activeSince": "2026-11-28T03:59:00Z",
    "completionTime": "2026-11-28T04:01:00Z", "restarts": 1,
    "recoveries": 2, "clusterRecoveries": [0, 2], "rejoining": [1], "abandoned": [2],
    "disruptions": {"restarts": 1, "recoveries": 1},
    "lastFailures": {"job": "exit code 1: ValueError: boom", "clusters": [None, "exit code 3: x"]},
    "draining": [{"cluster": 1, "providers": [3, 4], "orderedAt": "2026-11-28T04:00:30Z"}],
    "drained": [{"cluster": 2, "providers": [5], "orderedAt": "2026-11-28T04:00:10Z", "round": 7,
                 "updates": 14}],
    "notDrained": [{"cluster": 0, "providers": [0], "orderedAt": "2026-11-28T04:00:50Z"}],
    "joined": [{"cluster": 3, "round": 9}, {"cluster": 4, "round": None}],
    "grown": [{"providers": [7], "clusters": [3], "at": "2026-11-28T04:00:20Z"}],
    "membership": {"plan": "ab12", "versions": [{"version": 1, "fromRound": 1, "clusters": [0, 1]},
                                                {"version": 2, "fromRound": 8, "clusters": [0]}]},
    "outputs": {"uri": "s3://out/full", "model": "s3://out/full/model.pt"},
    "result": {"node": "node_0", "updates": 66, "val_metric": 0.97, "final_clusters": [0, 1],
               "rejoined": {"round": 9}},
}


def test_the_apiserver_keeps_every_field_of_the_typed_status_and_no_other(kube, tmp_path):
    """The CRD's status schema is generated from JobStatus: a status with every field the model
    has comes back as written; a field it lacks is pruned by the apiserver (so an operator that
    wrote one would lose it silently: Decision.set refuses it instead)."""
    from ravnest.run.jobstatus import JobStatus

    full = JobStatus.model_validate(FULL).model_dump(mode="json", exclude_none=True)
    assert set(full) == set(JobStatus.model_fields)  # (every field, so every one is checked)
    assert apply(kube, job_doc("full"), tmp_path).returncode == 0
    kubernetes.client.CustomObjectsApi().patch_namespaced_custom_object_status(
        "ravnest.io", "v1alpha1", "default", "ravnestjobs", "full",
        {"status": {**FULL, "unknownField": 1, "progress": {**FULL["progress"], "other": 2}}},
        _content_type="application/merge-patch+json")
    kept = get(kube, "rj", "full")["status"]
    full["joined"][1] = {"cluster": 4}  # (a null inside a list item is pruned like any null)
    assert kept == full
    bad = kctl(kube, "patch", "rj", "full", "--subresource=status", "--type=merge", "-p",
               '{"status": {"phase": "Runing"}}', check=False)
    assert bad.returncode != 0 and "Unsupported value" in bad.stderr, bad.stderr


def test_a_pass_on_a_job_deleted_meanwhile_does_nothing(kube, tmp_path):
    assert apply(kube, job_doc("gone"), tmp_path).returncode == 0
    job = get(kube, "rj", "gone")
    kctl(kube, "delete", "rj", "gone", "--wait=true")
    assert _pass(job, status={})[1] == []
    assert _pods(kube, "gone") == [] and get(kube, "rj", "gone") is None


def test_a_pass_does_not_act_on_a_new_job_of_the_same_name(kube, tmp_path):
    """kopf's copy is of a job deleted since; one of the same name was made again (another uid):
    that job's own handlers see to it."""
    assert apply(kube, job_doc("again"), tmp_path).returncode == 0
    old = get(kube, "rj", "again")
    kctl(kube, "delete", "rj", "again", "--wait=true")
    assert apply(kube, job_doc("again"), tmp_path).returncode == 0
    assert _pass(old, status={})[1] == []
    assert _pods(kube, "again") == []
    assert "status" not in get(kube, "rj", "again")



def _configmaps(kube: LocalApiserver, job: str) -> list[str]:
    return sorted(c["metadata"]["name"] for c in get(
        kube, "configmaps", selector=f"ravnest.io/job={job}")["items"])


def _failed(kube: LocalApiserver, job: str) -> dict:
    status = get(kube, "rj", job)["status"]
    assert status["phase"] == "Failed", status
    return {c["type"]: c for c in status["conditions"]}["Failed"]


def test_a_pod_the_apiserver_refuses_fails_the_job_and_leaves_nothing_half_made(kube, tmp_path):
    """The template's nodeSelector has a key the apiserver refuses (422): the first pass made the
    planner's ConfigMap, then its pod was refused. The job fails at once naming the pod and the
    field, with a Warning Event, and the ConfigMap goes again; a second pass retries nothing."""
    doc = job_doc("refused", template={"spec": {"nodeSelector": {"bad key!": "x"}}})
    assert apply(kube, doc, tmp_path).returncode == 0
    job = get(kube, "rj", "refused")
    _, events = _pass(job, status={})
    assert events == ["Refused"]
    failed = _failed(kube, "refused")
    assert failed["reason"] == "Refused", failed
    assert "refused Pod refused-planner: 422 Invalid" in failed["message"], failed
    assert "(fields: spec.nodeSelector)" in failed["message"], failed
    assert _pods(kube, "refused") == [] and _configmaps(kube, "refused") == []
    again = get(kube, "rj", "refused")
    _, events = _pass(again, status=again["status"])
    assert events == [] and _pods(kube, "refused") == []


def _planned(kube: LocalApiserver, doc: dict, plan) -> dict:
    """The job, planned: its first pass made the planner pod, which is then reported as having
    handed back `plan`, and the next pass made the job's objects from it."""
    from ravnest.plan.handoff import encode

    name = doc["metadata"]["name"]
    job = get(kube, "rj", name)
    _pass(job, status={})
    kubernetes.client.CoreV1Api().patch_namespaced_pod_status(
        f"{name}-planner", "default", {"status": {
            "phase": "Succeeded", "containerStatuses": [{
                "name": "planner", "image": "ravnest:test", "imageID": "", "ready": False,
                "restartCount": 0, "state": {"terminated": {
                    "exitCode": 0, "reason": "Completed", "message": encode(plan)}}}]}})
    _, events = _pass(job, status=get(kube, "rj", name)["status"])
    assert "Planned" in events and get(kube, "rj", name)["status"]["phase"] == "Planned"
    return job


def test_objects_deleted_by_hand_are_made_again_as_they_were(kube, tmp_path):
    """A running job's Service, token Secret, a node's identity Secret and ConfigMap and its
    budget deleted by hand, then a pod lost: the job restarts, and before its pods are made again
    those objects are, the same as before (the token and identities derive from the operator's
    key), with a Warning Event naming them."""
    from ravnest import parse_job, plan_job

    doc = job_doc("remade", runPolicy={"recovery": "job"})
    plan, _, _ = plan_job(parse_job(doc))
    assert apply(kube, doc, tmp_path).returncode == 0
    job = _planned(kube, doc, plan)
    _pass(job, status=get(kube, "rj", "remade")["status"])
    pods = [p for p in _pods(kube, "remade") if p != "remade-planner"]
    assert len(pods) == len(plan.nodes)
    core = kubernetes.client.CoreV1Api()
    for i, pod in enumerate(pods):
        core.patch_namespaced_pod_status(pod, "default", {"status": {
            "phase": "Running", "podIP": f"10.0.0.{i + 1}",
            "conditions": [{"type": "Ready", "status": "True"}]}})
    _pass(job, status=get(kube, "rj", "remade")["status"])
    assert get(kube, "rj", "remade")["status"]["phase"] == "Running"
    node = plan.nodes[0].name.replace("_", "-")
    gone = {"secret": ["remade-token", f"remade-{node}-identity"], "service": ["remade-workers"],
            "configmap": [f"remade-{node}"], "pdb": ["remade-workers"]}
    before = {(kind, name): get(kube, kind, name) for kind, names in gone.items()
              for name in names}
    assert all(before.values()), before
    for (kind, name) in before:
        kctl(kube, "delete", kind, name)
    kctl(kube, "delete", "pod", pods[1], "--wait=true")
    for _ in range(4):  # (lost -> restarting: pods deleted -> pods made again)
        _, events = _pass(job, status=get(kube, "rj", "remade")["status"])
        if "Remade" in events:
            break
    assert "Remade" in events, events
    for (kind, name), was in before.items():
        now = get(kube, kind, name)
        assert now is not None, (kind, name)
        for part in ("data", "spec"):
            assert now.get(part) == was.get(part), (kind, name, part)


def test_a_worker_pod_refused_deletes_the_pods_its_pass_made(kube, tmp_path):
    """One provider's resources ask for more CPU than their limit (the planner pod takes none of
    them): planning goes through, then the pass that makes the worker pods has that provider's
    refused, and the pods it had made before are deleted; the job fails naming it."""
    from ravnest import parse_job, plan_job
    from ravnest.plan.handoff import encode
    from ravnest_operator.resources import pod_name

    doc = job_doc("halfway")
    plan, _, _ = plan_job(parse_job(doc))
    last = plan.nodes[-1]  # (its pod is made last: the others are made before it is refused)
    doc["spec"]["providers"][last.provider]["resources"] = {"requests": {"cpu": "2"},
                                                            "limits": {"cpu": "1"}}
    assert plan_job(parse_job(doc))[0].fingerprint == plan.fingerprint
    assert apply(kube, doc, tmp_path).returncode == 0
    job = get(kube, "rj", "halfway")
    _pass(job, status={})
    assert _pods(kube, "halfway") == ["halfway-planner"]
    core = kubernetes.client.CoreV1Api()
    core.patch_namespaced_pod_status("halfway-planner", "default", {"status": {
        "phase": "Succeeded", "containerStatuses": [{
            "name": "planner", "image": "ravnest:test", "imageID": "", "ready": False,
            "restartCount": 0, "state": {"terminated": {
                "exitCode": 0, "reason": "Completed", "message": encode(plan)}}}]}})
    _, events = _pass(job, status=get(kube, "rj", "halfway")["status"])
    assert "Planned" in events and get(kube, "rj", "halfway")["status"]["phase"] == "Planned"
    made = _configmaps(kube, "halfway")
    _, events = _pass(job, status=get(kube, "rj", "halfway")["status"])
    assert events == ["Refused"], events
    failed = _failed(kube, "halfway")
    assert f"refused Pod {pod_name('halfway', last.name)}: 422 Invalid" in failed["message"]
    assert "spec.containers[0].resources.requests" in failed["message"], failed
    assert [p for p in _pods(kube, "halfway") if p != "halfway-planner"] == []
    assert _configmaps(kube, "halfway") == made  # (an earlier pass's: the failed job keeps them)


def test_managed_by_is_immutable_and_a_job_managed_elsewhere_is_left_alone(kube, tmp_path):
    """The CRD's CEL rule holds spec.managedBy even with no webhook: it cannot be set, changed or
    taken away after creation. A pass over a job another controller manages makes nothing and
    writes no status."""
    doc = job_doc("elsewhere", managedBy="kueue.x-k8s.io/multikueue")
    assert apply(kube, doc, tmp_path).returncode == 0
    for change in ('{"spec": {"managedBy": "ravnest.io/operator"}}',
                   '{"spec": {"managedBy": null}}'):
        refused = kctl(kube, "patch", "rj", "elsewhere", "--type=merge", "-p", change,
                       check=False)
        assert refused.returncode != 0 and "spec.managedBy is immutable" in refused.stderr, (
            refused.stderr)
    assert apply(kube, job_doc("here"), tmp_path).returncode == 0
    added = kctl(kube, "patch", "rj", "here", "--type=merge", "-p",
                 '{"spec": {"managedBy": "kueue.x-k8s.io/multikueue"}}', check=False)
    assert added.returncode != 0 and "spec.managedBy is immutable" in added.stderr, added.stderr
    job = get(kube, "rj", "elsewhere")
    patch, events = _pass(job, status={})
    assert events == [] and not patch and _pods(kube, "elsewhere") == []
    assert "status" not in get(kube, "rj", "elsewhere")
    assert kctl(kube, "patch", "rj", "here", "--type=merge", "-p",
                '{"spec": {"suspend": true}}').returncode == 0  # (others stay editable)
