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
from operator_harness import apply, get, job_doc, kctl, operator_cluster, wait_for


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, ...]]:
    with operator_cluster(tmp_path_factory.mktemp("cluster")) as parts:
        yield parts


def test_a_tls_job_trains_and_no_secret_leaks(cluster, tmp_path):
    kube, kubelet, operator = cluster
    doc = job_doc("sealed", epochs=1, security__tls=True,
                  providers=[{"ram": 2, "bandwidth": 1000, "replicas": 4}])
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
