"""Node metadata has one owner (`ravnest.run.metadata`): its JSON form round-trips, the operator's
pods take their ports and environment from it, and no other module spells them out."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from ravnest import parse_job, plan_job
from ravnest.errors import SpecError
from ravnest.run import metadata
from ravnest.run.metadata import NodeMetadata
from ravnest_operator import resources

ROOT = Path(__file__).resolve().parents[2]
OWNER = resources.Owner("digits", "team-a", "0000-1111")


@pytest.fixture(scope="module")
def job_and_plan():
    doc = yaml.safe_load((ROOT / "examples" / "digits.yaml").read_text())
    doc["spec"]["security"] = {"tls": True}
    job = parse_job(doc)
    plan, _, _ = plan_job(job)
    return job, plan


def test_a_workers_metadata_has_the_json_form_workers_and_the_operator_share(job_and_plan,
                                                                             tmp_path):
    job, plan = job_and_plan
    names = plan.names()
    meta = NodeMetadata(job=job, plan=plan, node="node_1",
                        addresses={n: f"127.0.0.1:{7000 + i}" for i, n in enumerate(names)},
                        output_dir="/out", listen="127.0.0.1:7001", metrics_port=9401,
                        namespace="team-a", tls_dir="/tls",
                        ring_addresses={n: f"127.0.0.1:{8000 + i}" for i, n in enumerate(names)},
                        ring_listen="127.0.0.1:8001")
    d = meta.to_dict()
    assert d == {"apiVersion": "ravnest.io/v1alpha1", "kind": "RavnestNodeMetadata",
                 "node": "node_1", "job": job.to_dict(), "plan": plan.to_dict(),
                 "addresses": meta.addresses, "outputDir": "/out", "listen": "127.0.0.1:7001",
                 "metricsPort": 9401, "namespace": "team-a", "tlsDir": "/tls",
                 "ringAddresses": meta.ring_addresses, "ringListen": "127.0.0.1:8001"}
    assert NodeMetadata.from_dict(json.loads(json.dumps(d))) == meta
    meta.save(tmp_path / "node_1.json")
    assert NodeMetadata.load(tmp_path / "node_1.json") == meta
    plain = replace(meta, tls_dir=None, ring_addresses=None)
    assert not {"tlsDir", "ringAddresses", "ringListen", "microbatches"} & set(plain.to_dict())
    assert NodeMetadata.from_dict(plain.to_dict()) == replace(plain, ring_listen="0.0.0.0:50052")


def test_the_seed_apis_metadata_names_no_job_but_its_microbatches(job_and_plan, tmp_path):
    _, plan = job_and_plan
    meta = NodeMetadata(plan=plan, node="node_0", addresses={"node_0": "10.0.0.1:8080"},
                        listen="0.0.0.0:8080", microbatches=4)
    d = meta.to_dict()
    assert "job" not in d and d["microbatches"] == 4
    meta.save(tmp_path / "node_0.json")
    assert NodeMetadata.load(tmp_path / "node_0.json") == meta


def test_metadata_that_is_not_node_metadata_is_a_spec_error(tmp_path):
    with pytest.raises(SpecError, match="kind: expected 'RavnestNodeMetadata'"):
        NodeMetadata.from_dict({"kind": "RavnestJob"})
    (tmp_path / "job.json").write_text(json.dumps({"kind": "RavnestJob"}))
    with pytest.raises(SpecError, match=r"job\.json: kind: expected 'RavnestNodeMetadata'"):
        NodeMetadata.load(tmp_path / "job.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(SpecError, match=r"broken\.json: not valid node metadata"):
        NodeMetadata.load(tmp_path / "broken.json")


def test_addresses_keep_their_ports_on_other_hosts(job_and_plan):
    job, plan = job_and_plan
    cm = resources.node_configmap(OWNER, job, plan, plan.nodes[0])
    shared = resources.plan_configmap(OWNER, plan, job)["data"]
    meta = NodeMetadata.from_dict(json.loads(cm["data"]["node.json"]),
                                  read=lambda path: shared[path.rsplit("/", 1)[1]])
    hosts = {n: f"127.1.1.{10 + i}" for i, n in enumerate(plan.names())}
    moved = meta.rehosted(hosts, "127.1.1.10")
    assert moved.listen == "127.1.1.10:50051" and moved.ring_listen == "127.1.1.10:50052"
    assert moved.addresses == {n: f"{h}:50051" for n, h in hosts.items()}
    assert moved.ring_addresses == {n: f"{h}:50052" for n, h in hosts.items()}
    assert metadata.ring_address("10.0.0.3:8080") == "10.0.0.3:8081"
    assert metadata.with_host("node-3.digits-workers.team-a.svc:50051", "h") == "h:50051"


def test_the_operators_pods_take_ports_environment_and_metadata_from_the_one_module(
        job_and_plan):
    job, plan = job_and_plan
    node = plan.nodes[0]
    pod = resources.pod(OWNER, job, plan, node, "img", final_scrape_seconds=30)
    container = pod["spec"]["containers"][0]
    assert [e["name"] for e in container["env"]] == [
        metadata.TOKEN_ENV, metadata.TORCH_THREADS_ENV, metadata.FINAL_SCRAPE_ENV,
        metadata.DRAIN_DIR_ENV, metadata.DEVICE_ENV]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {
        "grpc": metadata.GRPC_PORT, "metrics": metadata.METRICS_PORT, "ring": metadata.RING_PORT}
    assert (resources.GRPC_PORT, resources.RING_PORT, resources.METRICS_PORT) == (
        metadata.GRPC_PORT, metadata.RING_PORT, metadata.METRICS_PORT)
    cm = resources.node_configmap(OWNER, job, plan, node)
    shared = resources.plan_configmap(OWNER, plan, job)["data"]
    meta = NodeMetadata.from_dict(json.loads(cm["data"]["node.json"]),
                                  read=lambda path: shared[path.rsplit("/", 1)[1]])
    assert meta.listen == f"0.0.0.0:{metadata.GRPC_PORT}"
    assert meta.ring_listen == f"0.0.0.0:{metadata.RING_PORT}"
    assert meta.metrics_port == metadata.METRICS_PORT and meta.tls_dir == resources.TLS_DIR
    assert json.loads(cm["data"]["node.json"]) == json.loads(json.dumps(meta.to_dict(
        plan_file=f"{resources.PLAN_DIR}/plan.json", job_file=f"{resources.PLAN_DIR}/job.json")))


def test_no_other_module_spells_out_the_metadata_ports_or_the_workers_environment():
    """The worker package and the operator's resource builders take them from the one module."""
    literals = re.compile(r"\b(50051|50052|9400)\b|RAVNEST_(TOKEN|TORCH_THREADS|"
                          r"FINAL_SCRAPE_SECONDS|TERMINATION_LOG|DEVICE)\b|RavnestNodeMetadata")
    owners = {ROOT / "worker" / "ravnest" / "run" / "metadata.py",
              ROOT / "worker" / "ravnest" / "termination.py"}  # (the termination message's)
    sources = [*(ROOT / "worker" / "ravnest").rglob("*.py"),
               ROOT / "operator" / "ravnest_operator" / "resources.py"]
    offenders = [f"{p.relative_to(ROOT)}:{i}" for p in sources if p not in owners
                 for i, line in enumerate(p.read_text().splitlines(), 1) if literals.search(line)]
    assert offenders == []
