"""The chart, the operator and real training jobs on a real cluster (see conftest.py).

In order: the operator becomes Ready and `helm test` passes; the digits example (3 epochs, and
providers shrunk to fit one node, see `digits_doc`) trains to >= 95% validation accuracy with its
pods scheduled by the scheduler and run from our image by the kubelet, finding each other through
the headless Service's DNS names; a worker pod deleted mid-run makes the job restart from its
checkpoint and still succeed, or costs only its cluster, which rejoins live; a model of the
user's own, from a user image FROM ours, trains with its checkpoints and outputs on an S3 store
(MinIO, in the cluster) and is fetched back from it; `helm uninstall` and deleting the namespaces
leave nothing behind.

A provider removed from a running job's spec (drain) has its real run in the operator tier
(tests/integration/test_operator.py: the real apiserver and operator, the kubelet stand-in
projecting the drain annotation into the pod's downward-API files as the kubelet does) and on
`ravnest run` (tests/integration/test_elastic.py). Here it cost 327 s of CI (a 40-epoch job,
long enough for the kubelet's late refresh of downward-API files); what only this tier showed of it
is that the real kubelet does refresh them, which the kubelet documents.

Providers added to a running job's spec (grow) have their real run on `ravnest run`
(tests/integration/test_elastic.py: the new cluster joins at a round boundary, the others never
stop, and the final round averages all of them to the same weights), and what the operator decides
and makes of them (the new cluster's ConfigMaps and pods, the membership it records) is tested in
tests/unit/test_operator_decide.py. Here it cost 181.5 s of a warm CI run (a 50-epoch job, long
enough for new pods to start and join); what only this tier showed of it, pods the operator made
mid-run reaching the others through the headless Service's DNS and the job's authenticated links,
the rejoin test's recreated pods show too.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import re
import secrets
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e_cluster import (
    BYO_IMAGE,
    IMAGE,
    JOBS_NS,
    RELEASE,
    SYSTEM_NS,
    TIMINGS,
    Cluster,
    minio_objects,
    run_pod,
)

ROOT = Path(__file__).resolve().parents[2]

# Cold: the first `up` builds kube-scheduler, kubelet, kube-proxy, coredns (minutes on 2 cores).
pytestmark = [pytest.mark.tools, pytest.mark.timeout(3600)]

# examples/digits.yaml declares 42 GB of RAM and 8 CPUs of requests over its 6 providers (the
# operator turns `ram` into the memory request and limit, `compute` into the CPU request); one node
# of this machine has 24 GiB and 2 CPUs. Same shapes, unequal, scaled down to fit: 11 GiB, 0.8 CPU.
SMALL_PROVIDERS = [
    {"ram": "1536Mi", "bandwidth": 1000, "compute": 0.1},
    {"ram": 2, "bandwidth": 1000, "compute": 0.2},
    {"ram": "1536Mi", "bandwidth": 500, "compute": 0.1},
    {"ram": "2560Mi", "bandwidth": 1000, "compute": 0.2},
    {"ram": "1536Mi", "bandwidth": 200, "compute": 0.1},
    {"ram": 2, "bandwidth": 1000, "compute": 0.1},
]


def digits_doc(name: str, epochs: int = 3) -> dict[str, Any]:
    doc = copy.deepcopy(yaml.safe_load((ROOT / "examples" / "digits.yaml").read_text()))
    doc["metadata"] = {"name": name, "namespace": JOBS_NS}
    doc["spec"]["training"]["epochs"] = epochs
    doc["spec"]["providers"] = copy.deepcopy(SMALL_PROVIDERS)
    return doc


def status_of(cluster: Cluster, name: str) -> dict[str, Any]:
    return (cluster.get("rj", name) or {}).get("status") or {}


def succeeded(cluster: Cluster, name: str, seen: list[str] | None = None) -> bool:
    st = status_of(cluster, name)
    if seen is not None and st.get("phase") and (not seen or seen[-1] != st["phase"]):
        seen.append(st["phase"])
    if st.get("phase") == "Failed":
        pytest.fail(f"job {name} failed: {st.get('conditions')}\n{cluster.diagnostics()}")
    return st.get("phase") == "Succeeded"


def test_operator_ready_and_helm_test_passes(cluster: Cluster, release: str):
    dep = cluster.get("deployment", "ravnest", namespace=SYSTEM_NS)
    assert dep["status"].get("readyReplicas") == 1, dep["status"]
    pods = cluster.get("pods", namespace=SYSTEM_NS,
                       selector="app.kubernetes.io/name=ravnest")["items"]
    running = [p for p in pods if p["status"]["phase"] == "Running"]
    assert running, [p["status"] for p in pods]
    assert running[0]["spec"]["containers"][0]["image"].endswith(IMAGE)
    start = time.monotonic()
    result = cluster.helm("test", release, "-n", SYSTEM_NS, "--timeout", "10m",
                          timeout=700)
    TIMINGS["helm_test_s"] = time.monotonic() - start
    assert "Phase:          Succeeded" in result.stdout, result.stdout


WORKERS = "ravnest.io/job=digits,app.kubernetes.io/component=worker"


def test_digits_trains_on_the_cluster(cluster: Cluster, release: str):
    cluster.apply(digits_doc("digits"))
    # Pods are scheduled onto a node and run our image.
    def all_running() -> list[dict[str, Any]] | None:
        pods = (cluster.get("pods", selector=WORKERS) or {}).get("items", [])
        if len(pods) == 6 and all(p["status"].get("phase") == "Running" for p in pods):
            return pods
        return None

    phases: list[str] = []
    start = time.monotonic()
    pods = cluster.wait_for("6 digits worker pods Running", all_running, 300)
    for p in pods:
        assert p["spec"]["nodeName"], p["metadata"]["name"]
    # On a cluster of several worker nodes (kind's, scripts/kind-e2e), the scheduler spreads them,
    # and peers reach each other across nodes.
    schedulable = [n for n in cluster.get("nodes", namespace="")["items"]
                   if not any(t.get("effect") == "NoSchedule"
                              for t in n["spec"].get("taints", []))]
    if len(schedulable) > 1:
        assert len({p["spec"]["nodeName"] for p in pods}) > 1, [p["spec"]["nodeName"] for p in pods]
    for p in pods:
        assert p["spec"]["containers"][0]["image"].endswith(IMAGE)
        cs = p["status"]["containerStatuses"][0]
        assert cs["imageID"] and cs["containerID"].startswith(("containerd://", "docker://"))
        assert p["status"]["podIP"]
    # Peers' DNS names (headless Service, CoreDNS) resolve inside a worker pod to the pods' IPs.
    ips = {p["spec"]["hostname"]: p["status"]["podIP"] for p in pods}
    script = ("import socket, sys\nfor h in sys.argv[1:]:\n"
              "    print(h.split('.')[0], socket.gethostbyname(h))")
    names = [f"{h}.digits-workers.{JOBS_NS}.svc.cluster.local" for h in sorted(ips)]
    out = cluster.kubectl("exec", "-n", JOBS_NS, pods[0]["metadata"]["name"], "--", "python",
                          "-c", script, *names, check=False)
    if out.returncode == 0:
        resolved = dict(line.split() for line in out.stdout.splitlines())
        assert resolved == ips, (resolved, ips)
    elif not succeeded(cluster, "digits"):  # the pod may have finished already
        pytest.fail(f"kubectl exec into {pods[0]['metadata']['name']}: {out.stderr}")
    table = cluster.kubectl("get", "rj", "-n", JOBS_NS).stdout
    assert table.split()[:9] == ["NAME", "PHASE", "PLAN", "CLUSTERS", "EPOCH", "STEP", "LOSS",
                                 "ACCURACY", "AGE"], table
    cluster.wait_for("digits to succeed", lambda: succeeded(cluster, "digits", phases), 600)
    TIMINGS["digits_job_s"] = time.monotonic() - start
    st = status_of(cluster, "digits")
    assert st["progress"]["validationMetric"] >= 0.95, st["progress"]
    assert st["result"]["updates"] == 66, st["result"]
    assert st["plan"]["summary"] == "2x3", st["plan"]
    assert st.get("restarts", 0) == 0
    # samples/s is the whole job's: every cluster root's samples (its termination message, as the
    # kubelet keeps it) over startTime to the last root's finishedAt (the kubelet's; both in whole
    # seconds), not a rate scraped while it ran
    roots: dict[int, tuple[int, dt.datetime]] = {}
    for pod in cluster.get("pods", selector=WORKERS)["items"]:
        term = pod["status"]["containerStatuses"][0]["state"]["terminated"]
        said = json.loads(term.get("message") or "{}")
        if "samples" in said:
            ended = dt.datetime.fromisoformat(term["finishedAt"])
            roots[said["cluster"]] = (said["samples"], ended)
    assert sorted(roots) == [0, 1], roots
    began = dt.datetime.fromisoformat(st["startTime"])
    seconds = (max(end for _, end in roots.values()) - began).total_seconds()
    samples = sum(n for n, _ in roots.values())
    assert st["result"]["samples"] == roots[0][0]
    assert st["progress"]["samplesPerSecond"] == pytest.approx(samples / seconds, abs=0.01), (
        st, roots)
    table = cluster.kubectl("get", "rj", "digits", "-n", JOBS_NS).stdout
    row = table.splitlines()[1].split()
    assert row[1] == "Succeeded" and row[3] == "2/2" and row[4:6] == ["3", "66/66"], table
    assert float(row[6]) > 0 and float(row[7]) >= 0.95, table
    pods = cluster.get("pods", selector=WORKERS)["items"]
    assert len(pods) == 6 and all(p["status"]["phase"] == "Succeeded" for p in pods)
    # planned by a pod of the job's image, deleted once it had handed the plan back
    assert not cluster.get("pods", selector="ravnest.io/job=digits,"
                                            "app.kubernetes.io/component=planner")["items"]
    events = cluster.kubectl("get", "events", "-n", JOBS_NS, "-o",
                             "jsonpath={.items[*].message}").stdout
    assert "from pod digits-planner" in events
    log = cluster.kubectl("logs", "-n", JOBS_NS, "digits-node-0").stdout
    assert "Traceback" not in log


def test_deleted_worker_pod_restarts_job_from_checkpoint(cluster: Cluster, release: str):
    name = "restart"
    # Checkpoints must outlive the pods: a hostPath PersistentVolume, made writable for the workers'
    # uid by a root pod of our image, on a folder every node mounts (kind's nodes here share one;
    # a cluster given by kubeconfig: RAVNEST_E2E_HOSTPATH), as a network file system would be.
    path = f"{cluster.hostpath}/ravnest-e2e-{int(time.time())}"
    cluster.apply({"apiVersion": "v1", "kind": "PersistentVolume",
                   "metadata": {"name": f"{JOBS_NS}-{name}"},
                   "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"],
                            "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
                            "claimRef": {"namespace": JOBS_NS, "name": name},
                            "hostPath": {"path": path, "type": "DirectoryOrCreate"}}})
    cluster.apply({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                   "metadata": {"name": name, "namespace": JOBS_NS},
                   "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "",
                            "volumeName": f"{JOBS_NS}-{name}",
                            "resources": {"requests": {"storage": "1Gi"}}}})
    chown = {"apiVersion": "v1", "kind": "Pod",
             "metadata": {"name": f"{name}-chown", "namespace": JOBS_NS},
             "spec": {"restartPolicy": "Never",
                      "containers": [{"name": "chown", "image": IMAGE,
                                      "imagePullPolicy": "IfNotPresent", "command": ["sh", "-c"],
                                      "args": ["chown 10001:10001 /data && chmod 0770 /data"],
                                      "securityContext": {"runAsUser": 0},
                                      "volumeMounts": [{"name": "d", "mountPath": "/data"}]}],
                      "volumes": [{"name": "d", "persistentVolumeClaim": {"claimName": name}}]}}
    cluster.apply(chown)
    cluster.wait_for("the checkpoint volume prepared", lambda: (cluster.get(
        "pod", f"{name}-chown") or {}).get("status", {}).get("phase") == "Succeeded", 180)
    cluster.kubectl("delete", "pod", "-n", JOBS_NS, f"{name}-chown", "--wait=false")

    try:
        # 220 updates: the pod goes at step 30 or a few later (progress is scraped every pass),
        # well before the end, and the restarted job resumes from step 20 or later
        doc = digits_doc(name, epochs=10)
        doc["spec"]["runPolicy"] = {"recovery": "job"}  # every pod restarts from the checkpoint
        doc["spec"]["checkpoint"] = {"path": "checkpoints", "everySteps": 10,
                                     "volume": {"persistentVolumeClaim": {"claimName": name}}}
        cluster.apply(doc)

        def step() -> int:
            return int((status_of(cluster, name).get("progress") or {}).get("step") or 0)

        # the roots' step; by 30 every node has written step 20's checkpoint
        cluster.wait_for("the restart job past step 30", lambda: step() >= 30, 600)
        victim = f"{name}-node-3"
        # The worker is its container's PID 1 and does not handle SIGTERM (ignored for PID 1), so a
        # plain delete takes the whole 30 s grace period, by when this short job is over.
        cluster.kubectl("delete", "pod", "-n", JOBS_NS, victim, "--grace-period=1", "--wait=false")
        # The operator must see the vanished pod as a failed worker and restart the whole job.
        cluster.wait_for(f"the job to restart after pod {victim} was deleted", lambda: status_of(
            cluster, name).get("restarts", 0) >= 1, 180)
        cluster.wait_for("the restarted job to succeed", lambda: succeeded(cluster, name), 900)
        st = status_of(cluster, name)
        restarting = next(c for c in st["conditions"] if c["type"] == "Restarting")
        assert "resumes from the last checkpoint" in restarting["message"], restarting
        assert st["progress"]["validationMetric"] >= 0.95, st["progress"]
        assert st["result"]["updates"] == 220, st["result"]
        log = cluster.kubectl("logs", "-n", JOBS_NS, f"{name}-node-0").stdout
        resumed = [int(line.split("at step ")[1].split()[0]) for line in log.splitlines()
                   if "resumed from checkpoint at step" in line]
        assert resumed and resumed[0] >= 20, log[-3000:]  # did not start over
    except BaseException:
        print(cluster.job_report(name))  # before its pods go
        raise
    finally:
        cluster.kubectl("delete", "rj", "-n", JOBS_NS, name, "--ignore-not-found", "--wait=true",
                        timeout=180, check=False)
        cluster.kubectl("delete", "pvc", "-n", JOBS_NS, name, "--ignore-not-found", "--wait=true",
                        timeout=120, check=False)
        cluster.kubectl("delete", "pv", f"{JOBS_NS}-{name}", "--ignore-not-found",
                        "--wait=true", timeout=120, check=False)


GATED_LOSS = (ROOT / "tests" / "integration" / "gated_loss.py").read_text()
GATE_ENV = re.search(r'^GATE_ENV = "(\w+)"', GATED_LOSS, re.MULTILINE)[1]  # type: ignore[index]
"""The variable naming gated_loss's gate (read from its source, which the job's pods get)."""
SLOW = re.search(r'^SLOW = "(\S+)"', GATED_LOSS, re.MULTILINE)[1]  # type: ignore[index]
"""The suffix of gated_loss's slow file (the gate's name plus it)."""
GATE = "/tmp/ravnest-gate"
"""The gate of tests/integration/gated_loss.py in a worker pod (its /tmp is an emptyDir): the
leaves of a pod with this file stop at their next micro-batch."""


def gated(doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` with gated_loss as its criterion, the module given to the job's pods (planner and
    workers) from the ConfigMap `gate_code` makes: code a job names, mounted into its own pods
    by its pod template, as a user's could be."""
    doc["spec"]["training"]["criterion"] = {"name": "gated_loss:criterion"}
    doc["spec"]["template"] = {"spec": {
        "volumes": [{"name": "gate-code", "configMap": {"name": "gate-code"}}],
        "containers": [{"name": "ravnest",
                        "env": [{"name": "PYTHONPATH", "value": "/opt/gate"},
                                {"name": GATE_ENV, "value": GATE}],
                        "volumeMounts": [{"name": "gate-code", "mountPath": "/opt/gate",
                                          "readOnly": True}]}]}}
    return doc


def gate_code(cluster: Cluster) -> None:
    cluster.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "gate-code"},
                   "data": {"gated_loss.py": GATED_LOSS}})


def test_deleted_worker_pod_costs_only_its_cluster_which_rejoins_live(cluster: Cluster,
                                                                       release: str):
    """Elastic training (runPolicy.recovery: cluster, the default) on the cluster: a worker pod of
    cluster 1 is deleted; the operator recreates that cluster's pods alone, they take their state
    from cluster 0 over the job's authenticated links and rejoin it, and cluster 0's pods train on
    untouched. No checkpoint volume: nothing is read back from disk."""
    name = "elastic"
    # Cluster 0 must still train when cluster 1 is back. Cluster 0's leaves wait at a gate
    # (gated_loss, closed in their pods) from the deletion until cluster 1's new pods picked their
    # join round and asked their ring members, as in the operator tier: an order the test sets,
    # not a race with the machine's speed. The join round is picked 5 s, plus the answer's delay,
    # ahead of the rounds the others are at, by how fast their last 16 rounds went; at full speed
    # that was 270 rounds on a machine whose rounds took 0.037 s, past the end of a 660-update
    # job, so this job was 1,980 updates long (90 epochs: 279-346 s of CI here, most of it
    # training after the rejoin). Now cluster 0's leaves are slowed (gated_loss's slow file:
    # 50 ms more per micro-batch, 0.2 s or more a round of 2 updates of 2 micro-batches) from
    # their start until the gate opens, so the join round is at most ~(5 + the delay) / 0.2
    # rounds ahead on any machine: 75 rounds (150 updates) for a 10 s delay, far from the end of
    # these 330 updates.
    epochs = 15
    doc = gated(digits_doc(name, epochs=epochs))
    try:
        gate_code(cluster)
        cluster.apply(doc)

        def step() -> int:
            st = status_of(cluster, name)
            if st.get("phase") == "Failed":
                pytest.fail(f"job {name} failed: {st.get('conditions')}")
            return int((st.get("progress") or {}).get("step") or 0)

        def running(c: int) -> list[str] | None:
            """Cluster c's pods once all of them run."""
            clusters = (status_of(cluster, name).get("plan") or {}).get("clusters")
            if not clusters:
                return None
            pods = [f"{name}-{n.replace('_', '-')}" for n in clusters[c]["nodes"]]
            return pods if all((cluster.get("pod", p) or {}).get("status", {}).get(
                "phase") == "Running" for p in pods) else None

        for p in cluster.wait_for("cluster 0's pods running", lambda: running(0), 600):
            cluster.kubectl("exec", "-n", JOBS_NS, p, "--", "touch", GATE + SLOW)
        slowed = step()  # (16 rounds slowed, and 6 more: a round under way may have been fast)
        cluster.wait_for(f"the elastic job past step {slowed + 44}",
                         lambda: step() >= slowed + 44, 600)
        clusters = status_of(cluster, name)["plan"]["clusters"]
        first = [f"{name}-{n.replace('_', '-')}" for n in clusters[0]["nodes"]]
        lost = [f"{name}-{n.replace('_', '-')}" for n in clusters[1]["nodes"]]
        uids = {p: cluster.get("pod", p)["metadata"]["uid"] for p in first + lost}
        (root,) = [n for n, p in zip(clusters[1]["nodes"], lost, strict=True)
                   if cluster.get("pod", p)["metadata"]["labels"]["ravnest.io/role"] == "root"]
        closed = step()
        for p in first:
            cluster.kubectl("exec", "-n", JOBS_NS, p, "--", "touch", GATE)
        cluster.kubectl("delete", "pod", "-n", JOBS_NS, lost[-1], "--grace-period=1",
                        "--wait=false")
        cluster.wait_for(f"cluster 1 restarted alone after pod {lost[-1]} was deleted",
                         lambda: status_of(cluster, name).get("recoveries", 0) >= 1, 180)

        def log(pod: str) -> str:
            """The log of `pod` as it is now; of cluster 1's, only once it is made again."""
            made = (cluster.get("pod", pod) or {}).get("metadata", {}).get("uid")
            if pod in lost and made in (None, uids[pod]):
                return ""
            return cluster.kubectl("logs", "-n", JOBS_NS, pod, check=False).stdout

        cluster.wait_for(f"cluster 1's root {root} to pick its join round with cluster 0",
                         lambda: any(f"{root} rejoins ring" in log(p) for p in first), 300)
        cluster.wait_for("cluster 1's new pods to ask their ring members", lambda: all(
            "answered within" in (said := log(p)) or "rejoined" in said for p in lost), 180)
        for p in first:
            cluster.kubectl("exec", "-n", JOBS_NS, p, "--", "rm", "-f", GATE, GATE + SLOW)
        cluster.wait_for("the elastic job to succeed", lambda: succeeded(cluster, name), 900)
        st = status_of(cluster, name)
        logs = {p: cluster.kubectl("logs", "-n", JOBS_NS, p).stdout for p in first + lost}
        story = rejoin_story(cluster, name, logs)
        assert st.get("restarts", 0) == 0 and st["recoveries"] == 1, story
        assert st["clusterRecoveries"] == [0, 1] and st["rejoining"] == [], st
        assert st["clusters"] == "2/2", st
        conds = {c["type"]: c for c in st["conditions"]}
        assert conds["Recovering"]["reason"] == "Rejoined", story
        assert f"pod {lost[-1]} was deleted" in conds["Recovering"]["message"]
        assert "cluster 1 restarted alone" in conds["Recovering"]["message"]
        for p in first:  # cluster 0 ran on in its first pods, from no checkpoint
            assert cluster.get("pod", p)["metadata"]["uid"] == uids[p], p
            assert "resumed from checkpoint" not in logs[p], logs[p][-3000:]
        for p in lost:  # cluster 1's pods were made again, and took the others' state
            pod = cluster.get("pod", p)
            assert pod["metadata"]["uid"] != uids[p], p
            assert pod["metadata"]["annotations"]["ravnest.io/recovery"] == "1", p
            assert "rejoined after round" in logs[p], logs[p][-3000:]
        # cluster 0 took cluster 1's new pods into its rings at the join round, not as soon as
        # they answered (a ring round then waited reduceTimeoutSeconds for a node not in it yet)
        (joined,) = re.findall(r"the cluster joins after round (\w+)",
                               "".join(logs[p] for p in lost))  # (its root's)
        back = [int(r) for p in first
                for r in re.findall(r"ring \S+ from round (\d+) on: .*\(all back\)", logs[p])]
        assert back == ([] if joined == "final" else [int(joined) + 1] * len(back)), story
        assert st["result"]["updates"] == epochs * 22, st["result"]
        # cluster 1 was in the final round, unless it joined only there
        assert st["result"]["final_clusters"] == [0, 1] or joined == "final", st["result"]
        assert st["progress"]["validationMetric"] >= 0.95, st["progress"]
        print(f"\nelastic: slowed from step {slowed}, the gate closed at step {closed}; cluster 1 "
              f"joined after round {joined} of {epochs * 11}; accuracy "
              f"{st['progress']['validationMetric']:.4f}")
    except BaseException:
        print(cluster.job_report(name))  # before its pods go
        raise
    finally:
        cluster.kubectl("delete", "rj", "-n", JOBS_NS, name, "--ignore-not-found", "--wait=true",
                        timeout=180, check=False)
        cluster.kubectl("delete", "configmap", "-n", JOBS_NS, "gate-code", "--ignore-not-found",
                        check=False)


STORY = re.compile(r"rejoin|restarted|is back|all back|was lost|skipped|late|past round|Error|"
                   r"ERROR|Traceback|failed")
"""The log lines that tell how a cluster's restart and rejoin went."""


def rejoin_story(cluster: Cluster, name: str, logs: dict[str, str]) -> str:
    """What a failed assertion on an elastic job prints first (the job report printed after it
    may be cut): the job's events and, from each pod's log, the lines about losses, restarts and
    rejoins."""
    events = cluster.kubectl("get", "events", "-n", JOBS_NS, "--sort-by=.lastTimestamp",
                             "--field-selector", f"involvedObject.name={name}", "-o",
                             "custom-columns=REASON:.reason,MESSAGE:.message",
                             check=False).stdout
    lines = [f"events of {name}:", *events.splitlines()[-12:]]
    for pod, log in logs.items():
        lines += [f"--- {pod}", *(line[:300] for line in log.splitlines()
                                   if STORY.search(line))][:40]
    return "\n".join(lines)


S3 = f"http://minio.{JOBS_NS}:9000"
S3_ENV = [*({"name": key, "valueFrom": {"secretKeyRef": {"name": "s3-credentials", "key": key}}}
            for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")),
          {"name": "S3_ENDPOINT", "value": S3}]
FETCH = """
import io, json, os, s3fs, torch
from spirals.data import datasets
from spirals.model import build
fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": os.environ["S3_ENDPOINT"],
                                      "region_name": "us-east-1"})
model = build()
model.load_state_dict(torch.load(io.BytesIO(fs.cat_file("models/spirals/model.pt")),
                                 weights_only=True))
model.eval()
_, val = datasets()
with torch.no_grad():
    accuracy = (model(val.tensors[0]).argmax(1) == val.tensors[1]).float().mean().item()
print(json.dumps({"accuracy": accuracy, "files": sorted(fs.ls("models/spirals"))}))
"""


def _start_minio(cluster: Cluster) -> None:
    """MinIO in the jobs' namespace and a bucket `models` in it, as a user's S3 store."""
    for obj in minio_objects("ravnest-e2e", secrets.token_hex(16)):
        cluster.apply(obj)

    def ready() -> bool:
        pod = cluster.get("pod", "minio") or {}
        return any(c["type"] == "Ready" and c["status"] == "True"
                   for c in (pod.get("status") or {}).get("conditions") or [])
    cluster.wait_for("minio Ready", ready, 180)
    run_pod(cluster, "make-bucket", BYO_IMAGE, "import os, s3fs; s3fs.S3FileSystem(client_kwargs="
            "{'endpoint_url': os.environ['S3_ENDPOINT'], 'region_name': 'us-east-1'})"
            ".mkdir('models')", S3_ENV)


def test_your_own_model_trains_from_its_own_image(cluster: Cluster, release: str):
    """A model and dataset that exist nowhere in our image (tests/e2e/byo: an MLP telling three
    spiral arms apart), installed in a user image FROM ours and named in spec.image: the planner
    pod and the workers run that image, the operator (which cannot even import the package) plans
    nothing itself, and the job trains to >= 95% validation accuracy. Its checkpoints and outputs
    go to an S3 store (MinIO in the cluster), from which a pod of the user's image fetches the
    trained model back and scores it."""
    _start_minio(cluster)
    doc = {"apiVersion": "ravnest.io/v1alpha1", "kind": "RavnestJob",
           "metadata": {"name": "spirals", "namespace": JOBS_NS},
           "spec": {"image": BYO_IMAGE,
                    "model": {"entrypoint": "spirals.model:build",
                              "exampleInput": {"shape": [64, 2]}},
                    "data": {"entrypoint": "spirals.data:datasets", "batchSize": 64, "seed": 1},
                    "training": {"epochs": 4, "criterion": {"name": "CrossEntropyLoss"},
                                 "optimizer": {"name": "Adam", "params": {"lr": 0.003}}},
                    "plan": {"clusters": 1},
                    "checkpoint": {"path": "s3://models/spirals/checkpoints"},
                    "output": {"uri": "s3://models/spirals"},
                    "storage": {"s3": {"endpointUrl": S3, "region": "us-east-1",
                                       "credentialsSecret": "s3-credentials"}},
                    "providers": [{"ram": 1, "bandwidth": 1000, "compute": 0.1,
                                   "replicas": 2}]}}
    cluster.apply(doc)
    start = time.monotonic()
    cluster.wait_for("spirals to succeed", lambda: succeeded(cluster, "spirals"), 600)
    TIMINGS["byo_job_s"] = time.monotonic() - start
    st = status_of(cluster, "spirals")
    assert st["progress"]["validationMetric"] >= 0.95, st["progress"]
    assert st["plan"]["summary"] == "1x2", st["plan"]
    conds = {c["type"]: c for c in st["conditions"]}
    assert conds["DurableCheckpoints"]["reason"] == "ObjectStore"
    assert conds["OutputsWritten"]["status"] == "True"
    assert st["outputs"]["model"] == "s3://models/spirals/model.pt", st["outputs"]
    pods = cluster.get("pods", selector="ravnest.io/job=spirals")["items"]
    assert sorted(p["metadata"]["labels"]["app.kubernetes.io/component"] for p in pods) == [
        "finisher", "worker", "worker"]
    assert all(p["spec"]["containers"][0]["image"] == BYO_IMAGE for p in pods)
    fetched = json.loads(run_pod(cluster, "fetch-model", BYO_IMAGE, FETCH, S3_ENV)
                         .strip().splitlines()[-1])
    assert fetched["accuracy"] >= 0.95
    assert fetched["accuracy"] == pytest.approx(st["result"]["fused_val_metric"], abs=1e-6)
    assert {f"models/spirals/{f}" for f in ("model.pt", "best_model.pt", "learning_curve.csv",
            "learning_curve.png", "summary.json", "checkpoints")} <= set(fetched["files"])
    events = cluster.kubectl("get", "events", "-n", JOBS_NS, "-o",
                             "jsonpath={.items[*].message}").stdout
    assert "from pod spirals-planner" in events
    operator = cluster.get("pods", namespace=SYSTEM_NS,
                           selector="app.kubernetes.io/name=ravnest")["items"][0]
    probe = cluster.kubectl("exec", "-n", SYSTEM_NS, operator["metadata"]["name"], "--",
                            "python", "-c", "import spirals", check=False)
    assert probe.returncode != 0 and "No module named 'spirals'" in probe.stderr


def test_uninstall_leaves_nothing_behind(cluster: Cluster, release: str):
    cluster.kubectl("delete", "rj", "--all", "-n", JOBS_NS, "--wait=true", timeout=300)
    cluster.helm("uninstall", release, "-n", SYSTEM_NS, "--wait", "--timeout", "5m", timeout=400)
    cluster.kubectl("delete", "namespace", JOBS_NS, SYSTEM_NS, "--wait=true", timeout=400)
    kinds = ("pods,services,configmaps,secrets,serviceaccounts,deployments,replicasets,roles,"
             "rolebindings,persistentvolumeclaims")
    left = cluster.kubectl("get", kinds, "-A", "-o", "name", "-l",
                           "app.kubernetes.io/name=ravnest").stdout.split()
    assert left == [], left
    for ns in (JOBS_NS, SYSTEM_NS):
        assert cluster.kubectl("get", "namespace", ns, check=False).returncode != 0
    cluster_wide = cluster.kubectl("get", "clusterroles,clusterrolebindings,pv", "-o",
                                   "name").stdout.split()
    ours = [n for n in cluster_wide if RELEASE in n.split("/", 1)[1] or JOBS_NS in n]
    assert ours == [], ours
    # Helm leaves the CRD by design (charts/ravnest/README.md); no RavnestJob remains.
    assert cluster.kubectl("get", "rj", "-A", "-o", "name").stdout.strip() == ""
