"""The operator tier, security: a job with `spec.security.tls` gets its own CA and certificates in
a Secret, its worker pods mount only their own key, it trains over mutual TLS, and a per-job
NetworkPolicy is accepted by the real apiserver. Then a scan: neither the job's token nor any
private key appears in a ConfigMap, the job's status, an Event, a pod spec, or a line the workers
or the operator logged."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import pytest
from operator_harness import apply, get, job_doc, kctl, module_cluster, wait_for

pytestmark = pytest.mark.tools  # (scripts/test runs it once the tools are there)


@pytest.fixture(scope="module")
def cluster(operator_stack: tuple[Any, ...]) -> Iterator[tuple[Any, ...]]:
    with module_cluster(operator_stack) as parts:  # (the session's: conftest.py)
        yield parts


def test_a_tls_job_trains_and_no_secret_leaks(cluster, tmp_path):
    kube, kubelet, operator = cluster
    doc = job_doc("sealed", epochs=1, security__tls=True,
                  providers=[{"ram": 2, "bandwidth": 1000, "replicas": 4}],
                  # a pod template, merged over the workers' pods, as the real apiserver takes it
                  template={"metadata": {"labels": {"team": "vision"}},
                            "spec": {"containers": [{"env": [{"name": "TEAM", "value": "v"}]}],
                                     "tolerations": [{"key": "gpu", "operator": "Exists"}]}})
    assert apply(kube, doc, tmp_path).returncode == 0

    def succeeded() -> bool:
        st = (get(kube, "rj", "sealed") or {}).get("status", {})
        assert st.get("phase") != "Failed", json.dumps(st.get("conditions"))
        return st.get("phase") == "Succeeded"

    wait_for("sealed to succeed", succeeded, 400, kube, operator)
    rj = get(kube, "rj", "sealed")
    assert rj["status"]["progress"]["validationMetric"] >= 0.8
    assert rj["status"]["plan"]["summary"] == "2x2"

    tls = get(kube, "secret", "sealed-tls")["data"]
    keys = {k: base64.b64decode(v) for k, v in tls.items() if k.endswith(".key")}
    assert sorted(keys) == [f"node_{i}.key" for i in range(4)]
    token = base64.b64decode(get(kube, "secret", "sealed-token")["data"]["token"]).decode()
    assert len(token) >= 32
    secrets = {"token": token, **{k: v.decode().split("-----")[2].strip()
                                  for k, v in keys.items()}}

    pods = get(kube, "pods", selector="ravnest.io/job=sealed")["items"]
    assert len(pods) == 4
    for p in pods:
        assert p["metadata"]["labels"]["team"] == "vision"
        assert {"name": "TEAM", "value": "v"} in p["spec"]["containers"][0]["env"]
        assert {"key": "gpu", "operator": "Exists"} in p["spec"]["tolerations"]
        assert p["spec"]["securityContext"]["runAsNonRoot"] is True
    for p in pods:  # each pod mounts the CA, its own certificate and its own key only
        node = p["metadata"]["labels"]["ravnest.io/node"].replace("-", "_")
        (volume,) = [v for v in p["spec"]["volumes"] if v["name"] == "tls"]
        assert [i["key"] for i in volume["secret"]["items"]] == [
            "ca.crt", f"{node}.crt", f"{node}.key"]
    for node_dir in (kubelet.workdir / "pods").glob("sealed-node-*/*"):
        assert (node_dir / "tls" / "tls.key").read_bytes().strip() in [
            v.strip() for v in keys.values()]

    policy = get(kube, "networkpolicy", "sealed-workers")
    assert policy["spec"]["podSelector"]["matchLabels"]["ravnest.io/job"] == "sealed"
    assert policy["metadata"]["ownerReferences"][0]["name"] == "sealed"

    places = {
        "configmaps": json.dumps(get(kube, "configmaps")["items"]),
        "job status": json.dumps(rj),
        "events": kctl(kube, "get", "events", "-o", "json").stdout,
        "pods": json.dumps(pods),
        "operator log": operator.log.read_text(errors="replace"),
        **{f"log of {p['metadata']['name']}": kubelet.log_of(p["metadata"]["name"])
           for p in pods},
    }
    assert "sealed" in places["events"] and "Planned" in places["events"]
    assert "sealed" in places["operator log"]
    leaks = [f"{what} in {where}" for where, text in places.items()
             for what, secret in secrets.items() if secret in text]
    assert not leaks, leaks
    assert not [where for where, text in places.items() if "PRIVATE KEY" in text]


def test_code_a_job_names_runs_in_its_planner_pod_never_in_the_operator(cluster, tmp_path):
    """The trick that once ran in the operator (whose ClusterRole creates pods and secrets
    anywhere): `os:system` as the model entrypoint, as the data entrypoint, and a criterion whose
    module does something when imported (`this` prints the Zen of Python). Each command writes the
    id of the process that ran it: only the job's own planner pod ran them, the operator nothing.
    Each job fails, saying why, with its planner pod named and no worker pod started."""
    kube, kubelet, operator = cluster
    ran = tmp_path / "ran"
    command = f"echo $PPID >> {ran}"
    jobs = {
        "evil-model": job_doc("evil-model", model__entrypoint="os:system",
                              model__kwargs={"command": command}),
        "evil-data": job_doc("evil-data", data__entrypoint="os:system",
                             data__kwargs={"command": command}),
        "evil-loss": job_doc("evil-loss", training__criterion={"name": "this:s"}),
    }
    for doc in jobs.values():
        assert apply(kube, doc, tmp_path).returncode == 0
    says = {"evil-model": "spec.model.entrypoint: os:system returned",
            "evil-data": "spec.data.entrypoint: os:system must return",
            "evil-loss": "spec.training.criterion.name: 'this:s' is not callable"}
    for name, text in says.items():
        def failed(name: str = name) -> bool:
            st = (get(kube, "rj", name) or {}).get("status", {})
            return st.get("phase") == "Failed"

        wait_for(f"{name} to fail", failed, 300, kube, operator)
        cond = {c["type"]: c for c in get(kube, "rj", name)["status"]["conditions"]}["Failed"]
        assert cond["reason"] == "PlanFailed", cond
        assert cond["message"].startswith(f"planner pod {name}-planner failed with exit code "), \
            cond
        assert text in cond["message"], cond
        pods = get(kube, "pods", selector=f"ravnest.io/job={name}")["items"]
        assert [p["metadata"]["name"] for p in pods] == [f"{name}-planner"]
    planners = {kubelet.running[f"{n}-planner"].proc.pid for n in ("evil-model", "evil-data")}
    assert operator.proc is not None
    assert sorted(int(line) for line in ran.read_text().split()) == sorted(planners)
    assert operator.proc.pid not in planners
    zen = "Beautiful is better than ugly"
    assert zen in kubelet.log_of("evil-loss-planner")
    assert zen not in operator.log.read_text(errors="replace")
