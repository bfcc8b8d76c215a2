"""The operator's pure pieces: CRD generation, resource builders and status arithmetic."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import pytest
import yaml

from ravnest import parse_job, plan_job
from ravnest.comm.identity import Authority, NodeIdentity, Verifier
from ravnest.run import jobstatus, supervising
from ravnest.run.metadata import NodeMetadata
from ravnest_operator import crds, resources, statuses

ROOT = Path(__file__).resolve().parents[2]
OWNER = resources.Owner("digits", "team-a", "0000-1111")
AUTHORITY = Authority.fresh()


@pytest.fixture(scope="module")
def job_and_plan():
    doc = yaml.safe_load((ROOT / "examples" / "digits.yaml").read_text())
    job = parse_job(doc)
    plan, _, _ = plan_job(job)
    return job, plan


def test_checked_in_crd_is_generated_from_the_spec_model():
    assert (ROOT / "crds" / "ravnestjob.yaml").read_text() == crds.render(), \
        "crds/ravnestjob.yaml is stale: run python -m ravnest_operator.crds > crds/ravnestjob.yaml"


def _fields(schema, prefix=""):
    out = set()
    for name, sub in (schema.get("properties") or {}).items():
        out.add(prefix + name)
        out |= _fields(sub.get("items", sub), prefix + name + ".")
    return out


def test_crd_schema_covers_every_spec_field_and_is_structural():
    schema = crds.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    text = json.dumps(schema)
    assert "$ref" not in text and "anyOf" not in text and '"null"' not in text
    fields = _fields(schema)
    for expected in ("model.entrypoint", "model.exampleInput.shape", "data.batchSize",
                     "training.reduceFactor", "training.averageOptimizer", "training.schedule",
                     "providers.ram", "providers.bandwidth", "providers.nodeSelector",
                     "checkpoint.everySteps", "checkpoint.volume", "runPolicy.backoffLimit",
                     "runPolicy.cleanPodPolicy", "runPolicy.suspend", "plan.clusters"):
        assert expected in fields
    ram = schema["properties"]["providers"]["items"]["properties"]["ram"]
    assert ram["x-kubernetes-int-or-string"] is True
    assert schema["properties"]["training"]["properties"]["schedule"]["enum"] == ["sync", "async"]
    batch = schema["properties"]["data"]["properties"]["batchSize"]
    assert batch["minimum"] == 0 and batch["exclusiveMinimum"] is True


def test_static_objects_are_owned_labelled_and_named(job_and_plan):
    job, plan = job_and_plan
    objs = resources.static_objects(OWNER, job, plan, "s3cret", AUTHORITY)
    kinds = [o["kind"] for o in objs]
    assert kinds.count("ConfigMap") == 1 + len(plan.nodes)
    assert kinds.count("Service") == 1 and kinds.count("Secret") == 1 + len(plan.names())
    assert kinds.count("PodDisruptionBudget") == 1
    for o in objs:
        assert o["metadata"]["namespace"] == "team-a"
        assert o["metadata"]["ownerReferences"] == [{
            "apiVersion": "ravnest.io/v1alpha1", "kind": "RavnestJob", "name": "digits",
            "uid": "0000-1111", "controller": True, "blockOwnerDeletion": True}]
        assert o["metadata"]["labels"]["ravnest.io/job"] == "digits"
    svc = next(o for o in objs if o["kind"] == "Service")
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    secret = next(o for o in objs if o["metadata"]["name"] == "digits-token")
    assert base64.b64decode(secret["data"]["token"]).decode() == "s3cret"
    for o in objs:
        if o["kind"] == "ConfigMap":
            assert "s3cret" not in json.dumps(o)


def test_what_is_made_again_is_what_was_made_but_the_tls_secret_and_the_plan(job_and_plan):
    job, plan = job_and_plan
    made = resources.static_objects(OWNER, job, plan, "s3cret", AUTHORITY,
                                    network_policies=True)
    again = resources.remade_objects(OWNER, job, plan, "s3cret", AUTHORITY, True)
    assert again == [o for o in made if o["metadata"]["name"] != "digits-plan"]
    assert made[-1]["metadata"]["name"] == "digits-plan"  # (last: it marks the job planned)


def test_each_node_gets_an_identity_only_its_pod_mounts(job_and_plan):
    """Issue 40: each node's identity (its key and a certificate of the job's authority) is a
    Secret of its own; its pod mounts that one only, its metadata names it, the plan ConfigMap
    records the authority's public key, and no key is anywhere else."""
    job, plan = job_and_plan
    objs = resources.static_objects(OWNER, job, plan, "s3cret", AUTHORITY)
    secrets = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Secret"}
    verifier = Verifier(AUTHORITY.public)
    keys = []
    for n in plan.names():
        secret = secrets[f"digits-{n.replace('_', '-')}-identity"]
        text = base64.b64decode(secret["data"][resources.IDENTITY_FILE]).decode()
        me = NodeIdentity.loads(text)
        assert me.node == n and me.authority == AUTHORITY.public
        assert verifier.check(n, me.sign(b"x"), b"x") is None
        assert verifier.check("node_0" if n != "node_0" else "node_1", me.sign(b"x"), b"x")
        keys.append(json.loads(text)["key"])
    (planned,) = [o for o in objs if o["metadata"]["name"] == "digits-plan"]
    assert planned["data"][resources.AUTHORITY_KEY] == AUTHORITY.public.hex()
    for o in objs:
        if o["kind"] != "Secret":
            assert not any(k in json.dumps(o) for k in keys)
    node = plan.node("node_2")
    pod = resources.pod(OWNER, job, plan, node, "ravnest:test")
    c = pod["spec"]["containers"][0]
    mounted = [v["secret"]["secretName"] for v in pod["spec"]["volumes"] if "secret" in v]
    assert mounted == ["digits-node-2-identity"]
    assert {"name": "identity", "mountPath": resources.IDENTITY_DIR,
            "readOnly": True} in c["volumeMounts"]
    meta = _metadata(job, plan, node)
    assert meta.identity_file == f"{resources.IDENTITY_DIR}/{resources.IDENTITY_FILE}"


def _metadata(job, plan, node) -> NodeMetadata:
    """A node's metadata as its pod reads it: its ConfigMap's, with the plan and job from the
    plan ConfigMap's files at the path the pod mounts them."""
    shared = resources.plan_configmap(OWNER, plan, job)["data"]
    cm = resources.node_configmap(OWNER, job, plan, node)

    def read(path: str) -> str:
        folder, key = path.rsplit("/", 1)
        assert folder == resources.PLAN_DIR
        return shared[key]

    return NodeMetadata.from_dict(json.loads(cm["data"]["node.json"]), read=read)


def test_node_metadata_is_what_the_worker_reads(job_and_plan):
    job, plan = job_and_plan
    node = plan.nodes[3]
    meta = _metadata(job, plan, node)
    assert meta.node == node.name and meta.plan == plan and meta.job == job
    assert meta.addresses["node_0"] == "node-0.digits-workers.team-a.svc:50051"
    assert meta.namespace == "team-a"


def test_worker_pod(job_and_plan):
    job, plan = job_and_plan
    node = plan.node("node_1")
    pod = resources.pod(OWNER, job, plan, node, "ravnest:test", attempt=2)
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["name"] == "digits-node-1"
    assert meta["labels"]["ravnest.io/role"] == node.role
    assert meta["labels"]["ravnest.io/cluster"] == str(node.cluster)
    assert meta["annotations"]["ravnest.io/bandwidth-mbps"] == "1000"
    assert meta["annotations"]["ravnest.io/attempt"] == "2"
    assert spec["hostname"] == "node-1" and spec["subdomain"] == "digits-workers"
    assert spec["restartPolicy"] == "Never"
    c = spec["containers"][0]
    assert c["image"] == "ravnest:test"
    assert c["resources"]["requests"]["memory"] == "8192Mi"  # provider 1 has 8 GB
    assert c["resources"]["limits"]["memory"] == "8192Mi"
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert c["env"][0]["valueFrom"]["secretKeyRef"] == {"name": "digits-token", "key": "token"}
    assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"  # (why it failed, if it does)
    assert {"name": "node-metadata", "configMap": {"name": "digits-node-1"}} in spec["volumes"]
    assert "RAVNEST_FINAL_SCRAPE_SECONDS" not in {e["name"] for e in c["env"]}
    watched = resources.pod(OWNER, job, plan, node, "ravnest:test", final_scrape_seconds=30)
    assert {"name": "RAVNEST_FINAL_SCRAPE_SECONDS", "value": "30"} in watched["spec"][
        "containers"][0]["env"]


def _pod(name, phase, code=None, attempt=0, ip="10.0.0.5"):
    status = {"phase": phase, "podIP": ip}
    if code is not None:
        status["containerStatuses"] = [{"state": {"terminated": {"exitCode": code,
                                                                 "reason": "Error"}}}]
    return {"metadata": {"name": name, "annotations": {"ravnest.io/attempt": str(attempt)}},
            "status": status}


def test_observe_names_the_failing_pod_and_exit_code(job_and_plan):
    _, plan = job_and_plan
    pods = [_pod(resources.pod_name("digits", n), "Running") for n in plan.names()]
    pods[2] = _pod(resources.pod_name("digits", plan.names()[2]), "Failed", code=137)
    obs = statuses.observe("digits", plan, pods)
    failed = obs.nodes[plan.names()[2]]
    assert failed.failure() == "pod digits-node-2 failed with exit code 137 (Error)"
    assert [name for name, n in obs.nodes.items()
            if n.seen(name).phase == supervising.NodePhase.FAILED] == [plan.names()[2]]
    obs = statuses.observe("digits", plan, pods[:3])
    assert obs.missing == plan.names()[3:]
    assert obs.nodes[plan.names()[3]].failure() == "pod digits-node-3 was deleted"
    pods[2]["status"]["containerStatuses"][0]["state"]["terminated"]["message"] = "OOM\n"
    obs = statuses.observe("digits", plan, pods)
    assert obs.nodes[plan.names()[2]].failure() == \
        "pod digits-node-2 failed with exit code 137 (Error): OOM"
    pods[2]["status"]["phase"] = "Running"  # (a message of a container that did not fail: none)
    assert statuses.observe("digits", plan, pods).nodes[plan.names()[2]].failure() == \
        "pod digits-node-2 was lost"


def test_conditions_keep_transition_time_until_status_changes():
    c = jobstatus.set_condition([], "Running", True, "PodsRunning")
    t0 = c[0]["lastTransitionTime"]
    c[0]["lastTransitionTime"] = "2000-01-01T00:00:00Z"
    c = jobstatus.set_condition(c, "Running", True, "PodsRunning", "still")
    assert c[0]["lastTransitionTime"] == "2000-01-01T00:00:00Z" and c[0]["message"] == "still"
    c = jobstatus.set_condition(c, "Running", False, "Completed")
    assert c[0]["status"] == "False" and c[0]["lastTransitionTime"] >= t0


def test_progress_from_root_metrics():
    samples = [{"ravnest_step": 40, "ravnest_total_steps": 176, "ravnest_epoch": 1,
                "ravnest_loss": 0.25, "ravnest_validation_metric": 0.93,
                "ravnest_samples_total": 1280},
               {"ravnest_step": 38, "ravnest_samples_total": 1216}]
    p = statuses.progress(samples, jobstatus.timestamp(time.time()))
    assert p["step"] == 38 and p["totalSteps"] == 176 and p["display"] == "38/176"
    assert p["epoch"] == 2 and p["loss"] == 0.25 and p["validationMetric"] == 0.93


def test_worker_pods_run_unprivileged_on_a_read_only_root(job_and_plan):
    job, plan = job_and_plan
    for node in plan.nodes:
        spec = resources.pod(OWNER, job, plan, node, "ravnest:test")["spec"]
        (c,) = spec["containers"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] == resources.WORKER_UID != 0
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert spec["automountServiceAccountToken"] is False
        assert c["securityContext"] == {"allowPrivilegeEscalation": False,
                                        "readOnlyRootFilesystem": True,
                                        "capabilities": {"drop": ["ALL"]}}
        # what the worker writes goes to volumes: outputs/checkpoints and the temp dir
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert "emptyDir" in volumes[mounts["/tmp"]]
        assert mounts[resources.DATA_DIR] == "data"


def _certificates(plan):
    from ravnest.comm.tls import issue, make_authority

    ca = make_authority("digits")
    return {n: issue(ca, n, resources.tls_dns_names(OWNER, n)) for n in plan.names()}


def test_tls_secret_and_each_pod_mounts_only_its_own_key(job_and_plan):
    from cryptography import x509

    job, plan = job_and_plan
    job = job.model_copy(update={"spec": job.spec.model_copy(
        update={"security": job.spec.security.model_copy(update={"tls": True})})})
    certs = _certificates(plan)
    with pytest.raises(ValueError, match="certificate for every node"):
        resources.static_objects(OWNER, job, plan, "s3cret", AUTHORITY)
    objs = resources.static_objects(OWNER, job, plan, "s3cret", AUTHORITY, certs)
    (secret,) = [o for o in objs if o["metadata"]["name"] == "digits-tls"]
    data = {k: base64.b64decode(v) for k, v in secret["data"].items()}
    assert set(data) == {"ca.crt"} | {f"{n}.{e}" for n in plan.names() for e in ("crt", "key")}
    assert data["node_2.key"] == certs["node_2"].key
    cert = x509.load_pem_x509_certificate(data["node_2.crt"])
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    host = "node-2.digits-workers.team-a.svc"
    assert {"node-2", host} <= set(sans.get_values_for_type(x509.DNSName))
    assert resources.address(OWNER, "node_2") == f"{host}:{resources.GRPC_PORT}"
    for o in objs:  # keys only ever in the Secret
        if o is not secret:
            assert not any(m.key.decode() in json.dumps(o) for m in certs.values())

    node = plan.node("node_2")
    pod = resources.pod(OWNER, job, plan, node, "ravnest:test")
    c, volumes = pod["spec"]["containers"][0], pod["spec"]["volumes"]
    (tls,) = [v for v in volumes if v["name"] == "tls"]
    assert tls["secret"]["secretName"] == "digits-tls"
    assert tls["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"},
                                      {"key": "node_2.crt", "path": "tls.crt"},
                                      {"key": "node_2.key", "path": "tls.key"}]
    assert {"name": "tls", "mountPath": resources.TLS_DIR, "readOnly": True} in c["volumeMounts"]
    assert c["readinessProbe"]["tcpSocket"] == {"port": resources.GRPC_PORT}
    meta = _metadata(job, plan, node)
    assert meta.tls_dir == resources.TLS_DIR

    plain_job, _ = job_and_plan
    plain = resources.pod(OWNER, plain_job, plan, node, "ravnest:test")
    assert not [v for v in plain["spec"]["volumes"] if v["name"] == "tls"]
    assert plain["spec"]["containers"][0]["readinessProbe"]["grpc"] == {
        "port": resources.GRPC_PORT}
    assert "digits-tls" not in [o["metadata"]["name"] for o in resources.static_objects(
        OWNER, plain_job, plan, "s", AUTHORITY)]


def test_network_policy_lets_only_the_jobs_own_workers_reach_its_grpc_port(job_and_plan):
    job, plan = job_and_plan
    assert "NetworkPolicy" not in [o["kind"] for o in resources.static_objects(
        OWNER, job, plan, "s", AUTHORITY)]
    objs = resources.static_objects(OWNER, job, plan, "s", AUTHORITY,
                                    network_policies=True)
    (policy,) = [o for o in objs if o["kind"] == "NetworkPolicy"]
    assert policy["apiVersion"] == "networking.k8s.io/v1"
    assert policy["metadata"]["ownerReferences"][0]["uid"] == OWNER.uid
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    pods = resources.pods(OWNER, job, plan, "ravnest:test")
    selector = spec["podSelector"]["matchLabels"]
    assert all(selector.items() <= p["metadata"]["labels"].items() for p in pods)
    (rule,) = spec["ingress"]
    # the default ring transport (tcp) adds the ring data port; see the next test
    assert rule["ports"] == [{"protocol": "TCP", "port": resources.GRPC_PORT},
                             {"protocol": "TCP", "port": resources.RING_PORT}]
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}  # no namespaceSelector: the policy's own namespace
    allowed = peer["podSelector"]["matchLabels"]
    assert allowed["ravnest.io/job"] == "digits"
    other = resources.pods(resources.Owner("other", "team-a", "2"), job, plan, "ravnest:test")
    assert not any(allowed.items() <= p["metadata"]["labels"].items() for p in other)
    assert objs[-1]["metadata"]["name"] == "digits-plan"  # created last: it marks "planned"


def test_a_tcp_ring_job_opens_the_ring_port_to_its_own_workers_only(job_and_plan):
    """training.ringTransport: tcp (the default): every pod exposes the ring data port, the node
    metadata names each node's ring address, and the job's NetworkPolicy admits the port, again
    from the job's own workers only. A gRPC-ring job opens no such port."""
    job, plan = job_and_plan
    assert job.spec.training.ring_transport == "tcp"
    grpc = parse_job({**job.to_dict(), "spec": {**job.to_dict()["spec"], "training": {
        **job.to_dict()["spec"]["training"], "ringTransport": "grpc"}}})
    for j, ring in ((grpc, False), (job, True)):
        pod = resources.pod(OWNER, j, plan, plan.nodes[0], "ravnest:test")
        ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
        assert ("ring" in ports) == ring
        meta = _metadata(j, plan, plan.nodes[0])
        (policy,) = [o for o in resources.static_objects(OWNER, j, plan, "s", AUTHORITY,
                                                         network_policies=True)
                     if o["kind"] == "NetworkPolicy"]
        (rule,) = policy["spec"]["ingress"]
        assert rule["from"] == [{"podSelector": {"matchLabels": resources.job_labels("digits")}}]
        allowed = [p["port"] for p in rule["ports"]]
        if ring:
            assert ports["ring"] == resources.RING_PORT
            assert meta.ring_addresses is not None
            assert meta.ring_addresses["node_1"] == "node-1.digits-workers.team-a.svc:50052"
            assert meta.ring_listen == "0.0.0.0:50052"
            assert allowed == [resources.GRPC_PORT, resources.RING_PORT]
        else:
            assert meta.ring_addresses is None and allowed == [resources.GRPC_PORT]


def test_a_cuda_providers_pod_asks_for_one_gpu_and_says_its_device(digits_doc):
    """A cuda provider's ram is its GPU's memory, not the pod's: its pod asks for one GPU (and
    its CPU), and tells the worker its device; a provider's own resources stand as given. The
    planner pod asks for no GPU: it plans with fake tensors."""
    providers = digits_doc["spec"]["providers"]
    providers[1]["device"] = "cuda"
    providers[2].update(device="cuda", resources={"limits": {"nvidia.com/gpu": 2}})
    job = parse_job(digits_doc)
    plan, _, _ = plan_job(job)
    by_provider = {n.provider: n for n in plan.nodes}
    pods = {i: resources.pod(OWNER, job, plan, by_provider[i], "img")["spec"]["containers"][0]
            for i in (0, 1, 2)}
    assert pods[1]["resources"] == {"requests": {"cpu": "2000m"},
                                    "limits": {"nvidia.com/gpu": 1}}
    assert pods[2]["resources"] == {"limits": {"nvidia.com/gpu": 2}}
    assert "nvidia.com/gpu" not in json.dumps(pods[0]["resources"])
    assert [{e["name"]: e["value"] for e in pods[i]["env"] if "value" in e}["RAVNEST_DEVICE"]
            for i in (0, 1, 2)] == ["cpu", "cuda", "cuda"]
    planner = resources.planner_pod(OWNER, job, "img")["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in json.dumps(planner["resources"])


def test_the_plan_is_stored_once_not_in_every_nodes_configmap():
    """A provider of 100 replicas made 100 node ConfigMaps each holding the whole plan and job
    (53.8 MB for one job); now they hold their own node's part, and every pod of the job mounts
    the one plan ConfigMap where the metadata names its files."""
    doc = yaml.safe_load((ROOT / "examples" / "digits.yaml").read_text())
    doc["spec"]["providers"] = [{"ram": 4, "replicas": 24}]
    doc["spec"]["plan"] = {"clusters": 6}
    job = parse_job(doc)
    plan = plan_job(job)[0]
    sizes = [len(json.dumps(resources.node_configmap(OWNER, job, plan, n)))
             for n in plan.nodes]
    whole = len(json.dumps(resources.plan_configmap(OWNER, plan, job)))
    assert len(plan.nodes) == 24 and max(sizes) < whole / 4, (max(sizes), whole)
    for pod in (resources.pod(OWNER, job, plan, plan.nodes[5], "i"),
                resources.finisher_pod(OWNER, job, plan, "i")):
        spec = pod["spec"]
        assert {"name": "ravnest-plan", "configMap": {"name": "digits-plan"}} in spec["volumes"]
        assert {"name": "ravnest-plan", "mountPath": "/etc/ravnest-plan",
                "readOnly": True} in spec["containers"][0]["volumeMounts"]
    assert _metadata(job, plan, plan.nodes[5]).plan == plan


def test_metadata_with_its_plan_written_in_still_loads(job_and_plan, tmp_path):
    """Node ConfigMaps an earlier operator made (plan and job inline), and the local runner's
    files, read as before; relative plan files are found beside the metadata."""
    job, plan = job_and_plan
    meta = _metadata(job, plan, plan.nodes[0])
    assert NodeMetadata.from_dict(json.loads(json.dumps(meta.to_dict()))) == meta
    (tmp_path / "plan.json").write_text(plan.to_json())
    (tmp_path / "job.json").write_text(json.dumps(job.to_dict()))
    (tmp_path / "node.json").write_text(json.dumps(meta.to_dict(plan_file="plan.json",
                                                                job_file="job.json")))
    assert NodeMetadata.load(tmp_path / "node.json") == meta
