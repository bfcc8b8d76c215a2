"""The real operator (`kopf run`) against a real kube-apiserver + etcd (+ kube-controller-manager
for garbage collection), with tests/integration/kubelet.py playing the kubelet: every pod the
operator creates runs as a real worker process."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import s3fs
import torch
from operator_harness import (
    apply,
    get,
    job_doc,
    kctl,
    module_cluster,
    phase_of,
    wait_for,
)
from scoring import digits_accuracy

from ravnest_operator.resources import pod_name

pytestmark = pytest.mark.tools  # (scripts/test runs it once the tools are there)


@pytest.fixture(scope="module")
def cluster(operator_stack: tuple[Any, ...]) -> Iterator[tuple[Any, ...]]:
    with module_cluster(operator_stack) as parts:  # (the session's: conftest.py)
        yield parts


def test_digits_job_runs_to_success(cluster, tmp_path):
    kube, kubelet, operator = cluster
    assert apply(kube, job_doc("digits"), tmp_path).returncode == 0
    phases, steps = [], []

    def succeeded() -> bool:
        rj = get(kube, "rj", "digits") or {}
        st = rj.get("status", {})
        if st.get("phase") and (not phases or phases[-1] != st["phase"]):
            phases.append(st["phase"])
        if st.get("progress", {}).get("step"):
            steps.append(st["progress"]["step"])
        assert st.get("phase") != "Failed", json.dumps(st.get("conditions"))
        return st.get("phase") == "Succeeded"

    wait_for("digits to succeed", succeeded, 400, kube, operator)
    assert phases[0] in ("Created", "Planning") and phases[-1] == "Succeeded"
    assert "Running" in phases and phases.index("Planned") > phases.index("Planning")
    # the plan came from the job's planner pod, which ran before any worker and was then deleted
    assert next(p for p in kubelet.started if p.startswith("digits-")) == "digits-planner"
    assert "handed back" in kubelet.log_of("digits-planner")
    assert len(set(steps)) >= 3 and steps == sorted(steps)  # progress moved while training
    status = get(kube, "rj", "digits")["status"]
    assert status["progress"]["validationMetric"] >= 0.95
    assert status["result"]["updates"] == 66
    assert status["plan"]["summary"] == "2x2/4"
    assert status["startTime"] and status["completionTime"]
    conds = {c["type"]: c["status"] for c in status["conditions"]}
    assert conds["Created"] == conds["Planned"] == conds["Succeeded"] == "True"
    assert conds["DurableCheckpoints"] == "False"  # no spec.checkpoint.volume: said, not hidden

    pods = get(kube, "pods", selector="ravnest.io/job=digits")["items"]
    assert len(pods) == 6 and all(p["status"]["phase"] == "Succeeded" for p in pods)
    cms = get(kube, "configmaps", selector="ravnest.io/job=digits")["items"]
    uid = get(kube, "rj", "digits")["metadata"]["uid"]  # the planner's job, named for this job
    assert sorted(c["metadata"]["name"] for c in cms) == sorted(
        ["digits-plan", f"digits-planner-{uid[:8]}"] + [f"digits-node-{i}" for i in range(6)])
    assert get(kube, "service", "digits-workers")["spec"]["clusterIP"] == "None"
    assert get(kube, "secret", "digits-token") is not None
    roles = sorted(p["metadata"]["labels"]["ravnest.io/role"] for p in pods)
    assert roles.count("root") == 2 and roles.count("leaf") == 2
    logs = kubelet.log_of("digits-node-0")
    assert "Traceback" not in logs
    table = kctl(kube, "get", "rj", "digits").stdout
    assert "Succeeded" in table and "66/66" in table and "2x2/4" in table


def test_operator_metrics_liveness_and_cli_status(cluster):
    """After the digits job: the operator's own metrics, its liveness probe, `ravnest status`."""
    kube, _, operator = cluster
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(f"http://127.0.0.1:{operator.metrics_port}/metrics",
                                timeout=10) as r:
        families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    jobs = {s.labels["phase"]: s.value for s in families["ravnest_operator_jobs"].samples}
    assert jobs["Succeeded"] >= 1
    count: dict[str, float] = {}
    for s in (s for f in families.values() for s in f.samples if s.name.endswith("_count")):
        count[s.name] = count.get(s.name, 0) + s.value  # summed over labels (e.g. phase)
    assert count["ravnest_operator_reconcile_duration_seconds_count"] > 3
    assert count["ravnest_operator_time_to_running_seconds_count"] >= 1
    assert count["ravnest_operator_job_duration_seconds_count"] >= 1
    with urllib.request.urlopen(f"http://127.0.0.1:{operator.liveness_port}/healthz",
                                timeout=10) as r:
        assert r.status == 200
        assert json.loads(r.read())["apiserver"].startswith("v1.")
    env = {**os.environ, "KUBECONFIG": str(kube.kubeconfig)}
    out = subprocess.run([sys.executable, "-m", "ravnest", "status", "digits", "--kube"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "Succeeded" in out.stdout and "66/66" in out.stdout
    assert "digits-node-5" in out.stdout
    missing = subprocess.run([sys.executable, "-m", "ravnest", "status", "nosuchjob", "--kube"],
                             capture_output=True, text=True, env=env, timeout=60)
    assert missing.returncode != 0 and "nosuchjob" in missing.stderr


SCHEMA_REJECTED = [
    ("batch-zero", {"data__batchSize": 0}, "spec.data.batchSize"),
    ("bad-schedule", {"training__schedule": "sometimes"}, "spec.training.schedule"),
    ("negative-epochs", {"training__epochs": -2}, "spec.training.epochs"),
    ("typo-field", {"training__reduceFactr": 2}, "reduceFactr"),
    ("no-providers", {"providers": []}, "spec.providers"),
    ("bad-compression", {"training__compression": "zip"}, "spec.training.compression"),
]

STATUS_REJECTED = [
    ("bad-optimizer", {"training__optimizer": {"name": "Adamm"}},
     "spec.training.optimizer.name: must be a torch.optim optimizer"),
    ("bad-entrypoint", {"model__entrypoint": "nowhere.models:build"},
     "spec.model.entrypoint: cannot import module 'nowhere.models'"),
    ("tiny-ram", {"providers": [{"ram": "1Ki", "replicas": 2}]}, "total RAM"),
    ("too-many-stages", {"providers": [{"ram": 4, "replicas": 30}], "plan": {"clusters": 1}},
     "more stages than layers"),
    ("negative-ram", {"providers": [{"ram": "-1"}]}, "spec.providers[0].ram"),
    ("host-root",
     {"template": {"spec": {"volumes": [{"name": "root", "hostPath": {"path": "/"}}]}}},
     "spec.template.spec.volumes[0].hostPath: a hostPath volume is not allowed"),
]


@pytest.mark.parametrize(("name", "changes", "message"), SCHEMA_REJECTED,
                         ids=[c[0] for c in SCHEMA_REJECTED])
def test_schema_rejects_invalid_jobs_at_apply(cluster, tmp_path, name, changes, message):
    kube, _, _ = cluster
    result = apply(kube, job_doc(name, **changes), tmp_path)
    assert result.returncode != 0
    assert message in result.stderr
    assert get(kube, "rj", name) is None


@pytest.mark.parametrize(("name", "changes", "message"), STATUS_REJECTED,
                         ids=[c[0] for c in STATUS_REJECTED])
def test_operator_fails_invalid_jobs_with_a_clear_status(cluster, tmp_path, name, changes,
                                                         message):
    kube, _, operator = cluster
    assert apply(kube, job_doc(name, **changes), tmp_path).returncode == 0
    wait_for(f"{name} to fail", lambda: phase_of(kube, name) == "Failed", 60, kube, operator)
    status = get(kube, "rj", name)["status"]
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert message in failed["message"]
    pods = get(kube, "pods", selector=f"ravnest.io/job={name}")["items"]
    # a spec refused by its form starts nothing; one its planner pod could not plan keeps that
    # pod, failed, for `kubectl logs`, and starts no worker
    planned = failed["reason"] == "PlanFailed"
    assert [p["metadata"]["name"] for p in pods] == ([f"{name}-planner"] if planned else [])
    assert all(p["status"]["phase"] == "Failed" for p in pods)
    kctl(kube, "delete", "rj", name, "--wait=false")


CLAIM = {"persistentVolumeClaim": {"claimName": "checkpoints"}}
"""A checkpoint volume that outlives the pods (the harness kubelet shares a claim's folder across
a job's pods and restarts; an emptyDir is each pod's own and goes with it)."""


def _kill_when(kube, kubelet, operator, job: str, pod: str, step: int) -> None:
    _step_at_least(kube, operator, job, step)
    kubelet.kill(pod)


def test_a_job_on_s3_resumes_from_the_bucket_and_hands_back_its_model(cluster, tmp_path,
                                                                     s3_server):
    """Checkpoints and outputs on a real S3 store (MinIO): the pods' own data volumes are
    emptyDirs, so after a worker is killed the restarted pods (every pod: runPolicy.recovery:
    job, set by an edit of the running job) can only resume from the bucket; on success a
    finishing pod writes the model there and status.outputs says where. (A restart from
    checkpoints on a volume has its real run in the kind tier: tests/e2e/test_cluster.py, a
    deleted worker pod.)

    The edit, `kubectl apply` of the running job with its providers reordered and one added (not
    an addition after its own, which is how a running job grows) and runPolicy edited: the job
    says the providers edit is not applied (SpecChanged), the runPolicy edit is, and its pods are
    made again from the spec as planned."""
    kube, kubelet, operator = cluster
    bucket = f"op-{uuid.uuid4().hex[:12]}"
    s3_server.make_bucket(bucket)
    kctl(kube, "create", "secret", "generic", "s3-creds",
         f"--from-literal=AWS_ACCESS_KEY_ID={s3_server.access_key}",
         f"--from-literal=AWS_SECRET_ACCESS_KEY={s3_server.secret_key}")
    doc = job_doc("stored", epochs=4,
                  checkpoint={"path": f"s3://{bucket}/ckpt", "everySteps": 10},
                  output={"uri": f"s3://{bucket}/out"},
                  storage={"s3": {"endpointUrl": s3_server.endpoint_url, "region": "us-east-1",
                                  "credentialsSecret": "s3-creds"}})
    assert apply(kube, doc, tmp_path).returncode == 0
    wait_for("stored running", lambda: phase_of(kube, "stored") == "Running", 120, kube,
             operator)
    doc["spec"]["providers"] = [*doc["spec"]["providers"][::-1], {"ram": 4}]
    doc["spec"]["runPolicy"] = {"recovery": "job"}
    assert apply(kube, doc, tmp_path).returncode == 0

    def said() -> dict[str, Any] | None:
        conds = (get(kube, "rj", "stored") or {}).get("status", {}).get("conditions") or []
        return next((c for c in conds if c["type"] == "SpecChanged"), None)
    wait_for("SpecChanged", lambda: (said() or {}).get("status") == "True", 60, kube, operator)
    assert said()["reason"] == "NotApplied" and said()["message"].startswith("spec.providers ")
    _kill_when(kube, kubelet, operator, "stored", "stored-node-3", 30)
    wait_for("stored to succeed", lambda: phase_of(kube, "stored") == "Succeeded", 500, kube,
             operator)
    status = get(kube, "rj", "stored")["status"]
    assert status["restarts"] == 1 and status.get("recoveries", 0) == 0  # the edited runPolicy
    assert kubelet.started.count("stored-node-5") == 2  # every pod made again ...
    assert get(kube, "pod", "stored-node-5")["metadata"]["annotations"][
        "ravnest.io/provider"] == "5"  # ... as planned
    conds = {c["type"]: c for c in status["conditions"]}
    assert "pod stored-node-3 failed with exit code 137" in conds["Restarting"]["message"]
    assert (conds["DurableCheckpoints"]["status"], conds["DurableCheckpoints"]["reason"]) == (
        "True", "ObjectStore")
    resumed = [int(line.split("at step ")[1].split()[0])
               for line in kubelet.log_of("stored-node-0").splitlines()
               if "resumed from checkpoint at step" in line]
    assert resumed and resumed[0] >= 20  # from the bucket: each pod's emptyDir was new
    assert kubelet.started[-1] == "stored-finish"
    assert "Traceback" not in kubelet.log_of("stored-finish")
    assert status["outputs"]["model"] == f"s3://{bucket}/out/model.pt"
    assert status["outputs"]["learningCurvePng"] == f"s3://{bucket}/out/learning_curve.png"
    assert conds["OutputsWritten"]["status"] == "True"
    fs = s3fs.S3FileSystem(**s3_server.storage_options(), skip_instance_cache=True)
    model = torch.load(io.BytesIO(fs.cat_file(f"{bucket}/out/model.pt")), weights_only=True)
    accuracy = digits_accuracy(model)
    assert accuracy >= 0.95
    assert accuracy == pytest.approx(status["result"]["fused_val_metric"], abs=1e-6)
    summary = json.loads(fs.cat_file(f"{bucket}/out/summary.json"))
    assert summary["updates"] == status["result"]["updates"] == 88
    env = {**os.environ, "KUBECONFIG": str(kube.kubeconfig)}
    shown = subprocess.run([sys.executable, "-m", "ravnest", "status", "stored", "--kube"],
                           capture_output=True, text=True, env=env, timeout=60)
    assert f"model: s3://{bucket}/out/model.pt" in shown.stdout, shown.stdout


def test_a_job_on_a_claim_keeps_its_checkpoints_and_model_there(cluster, tmp_path):
    """pvc:// locations: the pods mount the claim and resolve the path below it (the harness
    kubelet's claims are folders per namespace and claim)."""
    kube, kubelet, operator = cluster
    doc = job_doc("claimed", epochs=2, checkpoint={"path": "pvc://store/ckpt/claimed"},
                  output={"uri": "pvc://store/models/claimed"})
    assert apply(kube, doc, tmp_path).returncode == 0
    wait_for("claimed to succeed", lambda: phase_of(kube, "claimed") == "Succeeded", 400, kube,
             operator)
    status = get(kube, "rj", "claimed")["status"]
    assert status["outputs"]["model"] == "pvc://store/models/claimed/model.pt"
    conds = {c["type"]: c for c in status["conditions"]}
    assert conds["DurableCheckpoints"]["reason"] == "Claim"
    claim = kubelet.workdir / "default" / "claims" / "store"
    model = torch.load(claim / "models" / "claimed" / "model.pt", weights_only=True)
    assert digits_accuracy(model) == pytest.approx(status["result"]["fused_val_metric"],
                                                   abs=1e-6)
    steps = sorted(p.name for p in (claim / "ckpt" / "claimed").iterdir()
                   if p.name.startswith("step-"))
    assert steps and steps[-1] == f"step-{status['result']['updates']:08d}"
    worker = get(kube, "pod", "claimed-node-0")["spec"]
    assert {"name": "claim-0", "persistentVolumeClaim": {"claimName": "store"}} in \
        worker["volumes"]
    # the folder is the job's (its planner pod took it; its roots renewed the lease) ...
    uid = get(kube, "rj", "claimed")["metadata"]["uid"]
    record = json.loads((claim / "ckpt" / "claimed" / "ravnest-job.json").read_text())
    assert record["job"] == {"namespace": "default", "name": "claimed", "uid": uid}
    lease = json.loads((claim / "ckpt" / "claimed" / "ravnest-lease.json").read_text())
    assert lease["holder"] == f"RavnestJob default/claimed (uid {uid})"
    # ... so another job pointed at it fails at planning, and its files stay as they were
    files = {p: p.read_bytes() for p in (claim / "ckpt" / "claimed").rglob("step-*/*")}
    other = job_doc("other", epochs=3, checkpoint={"path": "pvc://store/ckpt/claimed"})
    assert apply(kube, other, tmp_path).returncode == 0
    wait_for("other to fail", lambda: phase_of(kube, "other") == "Failed", 120, kube, operator)
    failed = next(c for c in get(kube, "rj", "other")["status"]["conditions"]
                  if c["type"] == "Failed")
    assert failed["reason"] == "PlanFailed"
    assert ("spec.checkpoint.path: pvc://store/ckpt/claimed is in use by RavnestJob "
            f"default/claimed (uid {uid})") in failed["message"], failed
    assert {p: p.read_bytes() for p in (claim / "ckpt" / "claimed").rglob("step-*/*")} == files


GATED = {"name": "gated_loss:criterion"}
"""spec.training.criterion of a job whose leaves stop while the `gate` is closed."""


def _kill_behind_gate(kube, kubelet, operator, job: str, pod: str, gate: Path,
                      rejoining: tuple[int, ...]) -> None:
    """Close the gate at step 30 (the leaves stop at their next micro-batch), kill `pod`, and
    open it once the root of its restarted cluster (node_1) picked its join round with node_0
    and every new worker of that cluster (`rejoining`) asked its ring members (or, sharing no
    parameters, rejoined at once): cluster 0 then trains on to that round and sends the state.
    The new workers may be as slow to start as the machine makes them; cluster 0 cannot finish
    meanwhile."""
    _step_at_least(kube, operator, job, 30)
    gate.touch()
    kubelet.kill(pod)
    wait_for(f"{job}'s node_1 to pick its join round", lambda: "node_1 rejoins ring" in
             kubelet.log_of(f"{job}-node-0"), 180, kube, operator)
    wait_for(f"{job}'s cluster to ask its ring members", lambda: all(
        "answered within" in (said := kubelet.log_of(f"{job}-node-{n}")) or "rejoined" in said
        for n in rejoining), 120, kube, operator)
    gate.unlink()


def test_a_hot_spare_takes_over_a_killed_workers_stage_on_its_own_machine(cluster, tmp_path,
                                                                           gate):
    """spec.plan.spares on Kubernetes: the spare provider runs a spare pod (its machine held, the
    job's model built, no token); when a worker of cluster 1 is killed, its new pod is placed as
    the spare provider (nodeSelector, annotation), the spare pod goes, the lost provider gets a
    spare pod, and cluster 1 rejoins live; spare pods are let go when the job succeeds."""
    kube, kubelet, operator = cluster
    doc = job_doc("spared", epochs=10, plan__spares=1, training__criterion=GATED)
    for i, p in enumerate(doc["spec"]["providers"]):
        p["nodeSelector"] = {"ravnest.test/machine": f"m{i}"}
    assert apply(kube, doc, tmp_path).returncode == 0
    wait_for("a spare pod", lambda: len(get(kube, "pods", selector=(
        "ravnest.io/job=spared,app.kubernetes.io/component=spare"))["items"]) == 1, 120, kube,
        operator)
    (spare,) = get(kube, "pods", selector="ravnest.io/job=spared,"
                                          "app.kubernetes.io/component=spare")["items"]
    k = int(spare["metadata"]["labels"]["ravnest.io/spare"])
    assert spare["spec"]["nodeSelector"] == {"ravnest.test/machine": f"m{k}"}
    wait_for("the spare ready", lambda: "hot spare ready" in kubelet.log_of(f"spared-spare-{k}"),
             120, kube, operator)
    _kill_behind_gate(kube, kubelet, operator, "spared", "spared-node-3", gate, (1, 2, 3))
    assert (get(kube, "rj", "spared") or {}).get("status", {}).get("takeovers") == {"node_3": k}
    wait_for("node_3 on the spare's machine", lambda: (get(kube, "pod", "spared-node-3") or {})
             .get("metadata", {}).get("annotations", {}).get("ravnest.io/provider") == str(k),
             60, kube, operator)
    moved = get(kube, "pod", "spared-node-3")
    assert moved["spec"]["nodeSelector"] == {"ravnest.test/machine": f"m{k}"}
    wait_for("provider 3 a spare", lambda: get(kube, "pod", "spared-spare-3") is not None, 60,
             kube, operator)
    assert get(kube, "pod", "spared-spare-3")["spec"]["nodeSelector"] == {
        "ravnest.test/machine": "m3"}
    wait_for("spared to succeed", lambda: phase_of(kube, "spared") == "Succeeded", 500, kube,
             operator)
    status = get(kube, "rj", "spared")["status"]
    assert status.get("restarts", 0) == 0 and status["recoveries"] == 1
    assert "spare_3" in status["spares"]  # the lost provider is the spare now
    assert "rejoined after round" in kubelet.log_of("spared-node-3")
    assert status["result"]["updates"] == 220 and status["result"]["final_clusters"] == [0, 1]
    assert status["progress"]["validationMetric"] >= 0.95
    wait_for("spare pods let go", lambda: all(
        p["status"].get("phase") != "Running" or p["metadata"].get("deletionTimestamp")
        for p in get(kube, "pods", selector="ravnest.io/job=spared,"
                                            "app.kubernetes.io/component=spare")["items"]),
        60, kube, operator)


def test_providers_removed_from_a_running_job_drain_their_cluster(cluster, tmp_path):
    """`kubectl apply` of a running job with provider 5 left out of spec.providers: its cluster
    (0: providers 0 and 5) is told to drain through its root pod's annotation (a downward-API
    file to the worker), leaves the ring at a round boundary and ends; cluster 1 trains on to
    the last update, its rounds never waiting for cluster 0, and the job succeeds with cluster
    1's model and says what drained. (Draining's one real run: `ravnest run`'s, in
    test_elastic.py, went, its `ravnest drain` answers to tests/unit/test_orders.py and what a
    restart after a drain does to tests/unit/test_operator_decide.py, the same decide() for both
    executors.)"""
    kube, kubelet, operator = cluster
    # 440 updates: the drain, ordered at update 30, took effect after round 67 (update 134) of a
    # 30-epoch run here and after round 54 (update 108) of this one, so cluster 1 still has about
    # 300 updates to train after it (30 epochs, as it was: 101 s of a warm CI run, 88 s alone;
    # 20: 61 s alone)
    epochs = 20
    doc = job_doc("shrunk", epochs=epochs)
    assert apply(kube, doc, tmp_path).returncode == 0
    _step_at_least(kube, operator, "shrunk", 30)
    doc["spec"]["providers"] = doc["spec"]["providers"][:5]
    assert apply(kube, doc, tmp_path).returncode == 0

    def drained() -> list[dict[str, Any]]:
        return (get(kube, "rj", "shrunk") or {}).get("status", {}).get("drained") or []
    wait_for("cluster 0 drained", drained, 120, kube, operator)
    (left,) = drained()
    assert left["cluster"] == 0 and left["providers"] == [5] and left["round"] > 0
    wait_for("shrunk to succeed", lambda: phase_of(kube, "shrunk") == "Succeeded", 300, kube,
             operator)
    status = get(kube, "rj", "shrunk")["status"]
    assert status["clusters"] == "1/2" and status["draining"] == []
    assert status["membership"]["versions"] == [
        {"version": 1, "fromRound": 1, "clusters": [0, 1]},
        {"version": 2, "fromRound": left["round"] + 1, "clusters": [1]}]
    conds = {c["type"]: c for c in status["conditions"]}
    assert conds.get("SpecChanged", {}).get("status") != "True"
    assert status.get("restarts", 0) == 0 and status.get("recoveries", 0) == 0
    assert status["result"]["cluster"] == 1 and status["result"]["updates"] == epochs * 22
    assert status["progress"]["validationMetric"] >= 0.95
    root = get(kube, "pod", "shrunk-node-0")
    assert root["metadata"]["annotations"]["ravnest.io/drain"]
    said = json.loads(root["status"]["containerStatuses"][0]["state"]["terminated"]["message"])
    assert said["drained"]["round"] == left["round"]
    assert kubelet.started.count("shrunk-node-0") == 1
    # each node of cluster 0 left after the same round, once; cluster 1's never waited for it: no
    # round of theirs waited out its timeout or was given up, none took it for lost, and every
    # member of a leaving node's rings was told the round after which it goes on without it
    plan = json.loads(get(kube, "configmap", "shrunk-plan")["data"]["plan.json"])
    leaving = {n["name"] for n in plan["nodes"] if n["cluster"] == 0}
    logs = {n["name"]: kubelet.log_of(pod_name("shrunk", n["name"])) for n in plan["nodes"]}
    for n in leaving:
        assert f"{n} drained after round {left['round']} at update {2 * left['round']}" in \
            logs[n], logs[n][-2000:]  # (reduceFactor 2)
        assert logs[n].count("drained after round") == 1, logs[n][-2000:]
    for n in set(logs) - leaving:
        assert "within 30s" not in logs[n] and "skipped" not in logs[n], logs[n][-3000:]
        assert "does not answer" not in logs[n], logs[n][-3000:]
        assert all(f"{m} was lost" not in logs[n] for m in leaving), logs[n][-3000:]
    for ring in plan["rings"]:
        for m in set(ring["members"]) & leaving:
            for n in set(ring["members"]) - leaving:
                assert f"{m} leaves ring {ring['id']} after round {left['round']}\n" in logs[n], \
                    logs[n][-3000:]
    print(f"\nshrunk: cluster 0 drained after round {left['round']} of {epochs * 11}")


def _step_at_least(kube, operator, job: str, step: int) -> None:
    def far_enough() -> bool:
        st = (get(kube, "rj", job) or {}).get("status", {})
        return st.get("phase") == "Running" and st.get("progress", {}).get("step", 0) >= step
    wait_for(f"{job} step {step}", far_enough, 300, kube, operator)


def _evict(name: str) -> Any:
    """Evict a pod through the Eviction API, as a drain does (None: its budget refused, 429)."""
    import kubernetes

    core = kubernetes.client.CoreV1Api()
    try:
        return core.create_namespaced_pod_eviction(name, "default", kubernetes.client.V1Eviction(
            metadata=kubernetes.client.V1ObjectMeta(name=name, namespace="default")))
    except kubernetes.client.ApiException as e:
        if e.status == 429:
            return None
        raise


def test_backoff_limit_zero_fails_naming_pod_and_exit_code(cluster, tmp_path):
    """backoffLimit 0: a drain's eviction of a worker restarts the job (a disruption: the job's
    PodDisruptionBudget lets one worker go, and no second until the job runs again); then a
    worker that crashes fails it."""
    import kubernetes

    kube, kubelet, operator = cluster
    kubernetes.config.load_kube_config(str(kube.kubeconfig))
    doc = job_doc("fragile", epochs=4, runPolicy__backoffLimit=0, runPolicy__recovery="job")
    assert apply(kube, doc, tmp_path).returncode == 0
    _step_at_least(kube, operator, "fragile", 3)
    wait_for("the budget to allow an eviction", lambda: _evict("fragile-node-2") is not None, 60,
             kube, operator)
    assert _evict("fragile-node-3") is None  # (one at a time)
    wait_for("the restart", lambda: (get(kube, "rj", "fragile")["status"].get("disruptions")
                                     or {}).get("restarts") == 1, 60, kube, operator)
    status = get(kube, "rj", "fragile")["status"]
    restarting = {c["type"]: c for c in status["conditions"]}["Restarting"]
    assert restarting["reason"] == "Disrupted", restarting
    assert restarting["message"].startswith(
        "pod fragile-node-2 was disrupted (EvictionByEvictionAPI); a disruption, not counted "
        "against backoffLimit"), restarting
    assert status["restarts"] == 1 and status["phase"] != "Failed"
    _kill_when(kube, kubelet, operator, "fragile", "fragile-node-1", 5)
    wait_for("fragile to fail", lambda: phase_of(kube, "fragile") == "Failed", 60, kube,
             operator)
    failed = next(c for c in get(kube, "rj", "fragile")["status"]["conditions"]
                  if c["type"] == "Failed")
    assert failed["reason"] == "BackoffLimitExceeded"
    assert "pod fragile-node-1 failed with exit code 137" in failed["message"]
    wait_for("running pods cleaned", lambda: all(
        p["status"].get("phase") != "Running"
        for p in get(kube, "pods", selector="ravnest.io/job=fragile")["items"]), 60, kube,
        operator)


def test_suspend_then_resume_continues_from_checkpoint(cluster, tmp_path):
    kube, kubelet, operator = cluster
    doc = job_doc("pause", epochs=4, checkpoint__everySteps=10, checkpoint__volume=CLAIM)
    assert apply(kube, doc, tmp_path).returncode == 0

    def step() -> int:
        return (get(kube, "rj", "pause") or {}).get("status", {}).get("progress", {}).get(
            "step", 0)
    wait_for("pause step 25", lambda: step() >= 25, 300, kube, operator)
    kctl(kube, "patch", "rj", "pause", "--type=merge", "-p",
                 '{"spec":{"runPolicy":{"suspend":true}}}')
    wait_for("suspended", lambda: phase_of(kube, "pause") == "Suspended", 60, kube, operator)
    wait_for("pods gone", lambda: get(kube, "pods", selector="ravnest.io/job=pause")["items"]
             == [], 60, kube, operator)
    kctl(kube, "patch", "rj", "pause", "--type=merge", "-p",
                 '{"spec":{"runPolicy":{"suspend":false}}}')
    wait_for("pause to succeed", lambda: phase_of(kube, "pause") == "Succeeded", 400, kube,
             operator)
    logs = kubelet.log_of("pause-node-0")
    assert any("resumed from checkpoint at step" in line for line in logs.splitlines())


def test_deleting_a_running_job_leaves_nothing_behind(cluster, tmp_path):
    """Deleted while no operator runs (kopf's timers put a finalizer on the job, and the delete
    hung until an operator came back): the job goes at once, the garbage collector takes what it
    owned, and the operator started again makes none of it again."""
    kube, kubelet, operator = cluster
    assert apply(kube, job_doc("doomed", epochs=3), tmp_path).returncode == 0
    wait_for("doomed running", lambda: phase_of(kube, "doomed") == "Running", 120, kube,
             operator)
    assert not get(kube, "rj", "doomed")["metadata"].get("finalizers")
    operator.stop(kill=True)
    try:
        kctl(kube, "delete", "rj", "doomed", "--wait=true", "--timeout=30s")
    finally:
        operator.start()

    def gone() -> bool:
        left = []
        for kind in ("pods", "configmaps", "services", "secrets"):
            left += get(kube, kind, selector="ravnest.io/job=doomed")["items"]
        return not left and not any(p.startswith("doomed-") for p in kubelet.running)
    wait_for("garbage collection of doomed", gone, 120, kube, operator)
