"""The operator under faults and load, against a real kube-apiserver + etcd (+ controller-manager)
with the harness kubelet running real worker processes (see test_operator.py).

- The operator killed with SIGKILL many times in a row, at seeded random moments while jobs are
  being created, planned, started and while they run: every job completes, with each of its
  objects created once and no restart of its workers (the operator tier's one real run of an
  operator lost mid-job).
- 50 RavnestJobs created at once: all reconcile, and the test prints the reconcile latency
  percentiles (create -> Planned, create -> Suspended).
"""

from __future__ import annotations

import json
import math
import random
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import kubernetes
import pytest
from kubernetes import watch
from operator_harness import (
    Operator,
    apply,
    get,
    job_doc,
    kctl,
    module_cluster,
    phase_of,
    wait_for,
)

from ravnest_operator.crds import GROUP, PLURAL, VERSION

pytestmark = pytest.mark.tools  # (scripts/test runs it once the tools are there)

KILLS = 8
"""Operator kills in the chaos test."""
FLEET = 50
"""Jobs created at once in the load test."""


@pytest.fixture(scope="module")
def cluster(operator_stack: tuple[Any, ...]) -> Iterator[tuple[Any, ...]]:
    with module_cluster(operator_stack) as parts:  # (the session's: conftest.py)
        yield parts


def _wait_alive(operator: Operator, timeout: float = 120) -> None:
    """Until the operator's liveness endpoint answers (kopf is up and talks to the API)."""
    url = f"http://127.0.0.1:{operator.liveness_port}/healthz"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert operator.running(), operator.log.read_text()[-3000:]
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    log = operator.log.read_text()[-3000:]
    raise AssertionError(f"operator not alive after {timeout}s:\n{log}")


def _tiny(name: str) -> dict[str, Any]:
    """Digits on one cluster of two providers: two worker pods, 176 updates."""
    return job_doc(name, epochs=4, plan={"clusters": 1},
                   providers=[{"ram": 2, "bandwidth": 1000, "replicas": 2}])


def _objects(kube: Any, job: str) -> dict[str, list[str]]:
    return {kind: sorted(o["metadata"]["name"] for o in get(
        kube, kind, selector=f"ravnest.io/job={job}")["items"])
        for kind in ("pods", "configmaps", "services", "secrets", "networkpolicies")}


class _Observer:
    """What the operator has done so far for some jobs, read straight from the API: per job its
    phase ("absent" before it is created), step and numbers of ConfigMaps and Pods."""

    def __init__(self, kube: Any, jobs: list[str]) -> None:
        client = kubernetes.config.new_client_from_config(config_file=str(kube.kubeconfig))
        self.core = kubernetes.client.CoreV1Api(client)
        self.custom = kubernetes.client.CustomObjectsApi(client)
        self.jobs = jobs
        self.selector = f"ravnest.io/job in ({','.join(jobs)})"

    def state(self) -> dict[str, tuple[Any, ...]]:
        cms = self.core.list_namespaced_config_map("default", label_selector=self.selector).items
        pods = self.core.list_namespaced_pod("default", label_selector=self.selector).items
        rjs = self.custom.list_namespaced_custom_object(GROUP, VERSION, "default", PLURAL)
        status = {o["metadata"]["name"]: o.get("status") or {} for o in rjs["items"]}
        return {j: (status[j].get("phase") if j in status else "absent",
                    (status.get(j, {}).get("progress") or {}).get("step"),
                    sum(c.metadata.labels["ravnest.io/job"] == j for c in cms),
                    sum(p.metadata.labels["ravnest.io/job"] == j for p in pods))
                for j in self.jobs}


def test_operator_killed_many_times_mid_reconcile_creates_no_duplicates(cluster, tmp_path):
    """Three jobs created one by one between kills. Each kill (SIGKILL, then a new operator at
    once, as a Deployment would) lands at a seeded random delay of 0-1 s after the restarted
    operator was seen acting on the jobs (an object created or a status changed), so every kill
    hits an operator in the middle of reconciling, and the jobs still progress between kills."""
    kube, kubelet, operator = cluster
    rng = random.Random(5)
    jobs = [f"chaos-{i}" for i in range(3)]
    seen = _Observer(kube, jobs)
    at_kill = []
    for i in range(KILLS):
        _wait_alive(operator)
        if i % 3 == 0:  # jobs created at kills 0, 3 and 6
            assert apply(kube, _tiny(jobs[i // 3]), tmp_path).returncode == 0
        quiet = seen.state()
        wait_for(f"the operator acting after restart {i}", lambda q=quiet: seen.state() != q,
                 300, kube, operator)
        time.sleep(rng.uniform(0.0, 1.0))
        operator.stop(kill=True)
        at_kill.append(seen.state())
        operator.start()
    for j in jobs:
        wait_for(f"{j} to succeed", lambda j=j: phase_of(kube, j) == "Succeeded", 400, kube,
                 operator)
    phases = [{j: s[0] for j, s in state.items()} for state in at_kill]
    # kills landed while a job was being created (no phase yet, Created, Planning or Planned) and
    # while
    # one was running
    assert any(phase in (None, "Created", "Planning", "Planned") for p in phases
               for phase in p.values()), \
        at_kill
    assert any("Running" in p.values() for p in phases), at_kill
    for j in jobs:
        status = get(kube, "rj", j)["status"]
        assert status.get("restarts", 0) == 0, status.get("conditions")
        assert status["result"]["updates"] == 176 and status["result"]["val_metric"] >= 0.9
        pods = [f"{j}-node-0", f"{j}-node-1"]
        uid = get(kube, "rj", j)["metadata"]["uid"]
        # each started once, the planner first (and deleted once it had planned)
        assert [p for p in kubelet.started if p.startswith(f"{j}-")] == [f"{j}-planner", *pods]
        assert _objects(kube, j) == {
            "pods": pods, "configmaps": sorted([f"{j}-plan", f"{j}-planner-{uid[:8]}", *pods]),
            "services": [f"{j}-workers"],
            "secrets": sorted([f"{j}-token", *(f"{p}-identity" for p in pods)]),
            "networkpolicies": [f"{j}-workers"]}
    print(f"\noperator killed {KILLS} times; (phase, step, configmaps, pods) of "
          f"{', '.join(jobs)} at each kill:")
    for state in at_kill:
        print("  " + "  ".join(str(state[j]) for j in jobs))


LEASE = {"RAVNEST_LEADER_ELECTION": "ravnest-operator", "RAVNEST_LEASE_NAMESPACE": "default",
         "RAVNEST_LEASE_SECONDS": "6", "RAVNEST_RENEW_SECONDS": "4", "RAVNEST_RETRY_SECONDS": "1"}
"""Two replicas' leader election, with a short lease (the chart's default is 15 s)."""


def _holder(kube: Any) -> str | None:
    lease = get(kube, "lease", "ravnest-operator")
    return (lease or {}).get("spec", {}).get("holderIdentity")


def _passes(operator: Operator) -> float:
    """The passes an operator has made (its reconcile histogram's count, from its metrics)."""
    url = f"http://127.0.0.1:{operator.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("ravnest_operator_reconcile_duration_seconds_count"))


def test_the_leader_killed_mid_job_the_other_replica_takes_over(cluster, tmp_path):
    """Two operators with leader election: one acts; killed (SIGKILL) while the job trains, the
    other takes the Lease over, the job succeeds, and nothing is made twice nor restarted. The
    test prints the failover time (from the kill to the new holder's first status write)."""
    kube, kubelet, operator = cluster
    operator.stop()
    replicas = {}
    for name in ("replica-a", "replica-b"):
        (tmp_path / name).mkdir()
        replicas[name] = Operator(kube, tmp_path / name,
                                  {**LEASE, "RAVNEST_LEADER_IDENTITY": name})
        replicas[name].start()
    try:
        first = next(iter(replicas.values()))
        wait_for("a leader", lambda: _holder(kube) in replicas, 60, kube, first)
        job = "ha"
        doc = _tiny(job)
        doc["spec"]["training"]["epochs"] = 16  # (704 updates: it trains on through the kill)
        assert apply(kube, doc, tmp_path).returncode == 0

        def step() -> int:
            return ((get(kube, "rj", job) or {}).get("status", {}).get("progress") or {}).get(
                "step") or 0
        leader = replicas[_holder(kube) or ""]
        wait_for("ha training", lambda: step() >= 20, 300, kube, leader)
        other = next(r for n, r in replicas.items() if r is not leader)
        assert _passes(leader) > 0 and _passes(other) == 0  # (a follower makes no pass)
        before = get(kube, "rj", job)["metadata"]["resourceVersion"]
        assert phase_of(kube, job) == "Running"
        leader.stop(kill=True)
        killed = time.monotonic()
        wait_for("the other replica to lead", lambda: _holder(kube) not in (
            None, *(n for n, r in replicas.items() if r is leader)), 60, kube, other)
        led = time.monotonic() - killed
        wait_for("a status written by the new leader", lambda: get(kube, "rj", job)[
            "metadata"]["resourceVersion"] != before, 60, kube, other)
        acted = time.monotonic() - killed
        wait_for("ha to succeed", lambda: phase_of(kube, job) == "Succeeded", 400, kube, other)
        status = get(kube, "rj", job)["status"]
        assert status.get("restarts", 0) == 0 and status["result"]["updates"] == 704, status
        pods = [f"{job}-node-0", f"{job}-node-1"]
        assert [p for p in kubelet.started if p.startswith(f"{job}-")] == [f"{job}-planner",
                                                                           *pods]
        uid = get(kube, "rj", job)["metadata"]["uid"]
        objects = _objects(kube, job)
        assert objects["pods"] == pods and objects["configmaps"] == sorted(
            [f"{job}-plan", f"{job}-planner-{uid[:8]}", *pods]), objects
        print(f"\nfailover: the Lease taken over {led:.1f} s after the leader was killed, the "
              f"first status write {acted:.1f} s after (lease 6 s, renew 4 s, retry 1 s)")
    finally:
        for r in replicas.values():
            r.stop()
        operator.start()


def _percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    s = sorted(xs)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def test_fifty_jobs_created_at_once_all_reconcile(cluster):
    """50 jobs with `suspend: true` created back to back. Each one is validated and Suspended with
    nothing created: a suspended job runs no pod, not even its planner (it plans when resumed), and
    50 jobs x 6 worker pods would not fit on the 2 cores CI has anyway. Latencies are from the
    create call returning to the watch event that first shows each phase."""
    kube, kubelet, operator = cluster
    client = kubernetes.config.new_client_from_config(config_file=str(kube.kubeconfig))
    api = kubernetes.client.CustomObjectsApi(client)
    first: dict[tuple[str, str], float] = {}
    w = watch.Watch()
    stopping = threading.Event()
    broken: list[Exception] = []

    def record() -> None:
        try:
            for ev in w.stream(api.list_namespaced_custom_object, GROUP, VERSION, "default",
                               PLURAL, label_selector="fleet=load", timeout_seconds=600):
                obj = ev["object"]
                phase = (obj.get("status") or {}).get("phase")
                if phase:
                    first.setdefault((obj["metadata"]["name"], phase), time.monotonic())
        except Exception as e:  # the stream cut while the jobs are deleted is no failure
            if not stopping.is_set():
                broken.append(e)

    watcher = threading.Thread(target=record, daemon=True)
    watcher.start()
    time.sleep(1)  # the watch is established
    created = {}
    names = [f"fleet-{i:02d}" for i in range(FLEET)]
    try:
        for name in names:
            doc = job_doc(name, runPolicy={"suspend": True})
            doc["metadata"]["labels"] = {"fleet": "load"}
            api.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, doc)
            created[name] = time.monotonic()

        def all_suspended() -> bool:
            failed = sorted(n for n, phase in list(first) if phase == "Failed")
            assert not failed, kctl(kube, "get", "rj", failed[0], "-o", "yaml").stdout
            return all((n, "Suspended") in first for n in names)

        wait_for("50 jobs suspended", all_suspended, 600, kube, operator)
        objects = {n: _objects(kube, n) for n in names}
        phases = json.loads(kctl(kube, "get", "rj", "-l", "fleet=load", "-o", "json").stdout)
    finally:
        stopping.set()
        w.stop()  # the stream ends at its next event: one of the deletions
        kctl(kube, "delete", "rj", "-l", "fleet=load", "--wait=true", "--timeout=120s")
        watcher.join(60)
    assert not watcher.is_alive() and not broken, broken
    assert [i["status"]["phase"] for i in phases["items"]] == ["Suspended"] * FLEET
    for n, objs in objects.items():  # a job created suspended has nothing yet
        assert objs == {"pods": [], "configmaps": [], "services": [], "secrets": [],
                        "networkpolicies": []}, objs
        assert (n, "Planning") not in first and (n, "Planned") not in first
    assert not any(p.startswith("fleet-") for p in kubelet.started)
    suspended = [first[(n, "Suspended")] - created[n] for n in names]

    def line(what: str, xs: list[float]) -> str:
        return (f"{what}: p50 {_percentile(xs, 0.5):.2f}s p90 {_percentile(xs, 0.9):.2f}s "
                f"p99 {_percentile(xs, 0.99):.2f}s max {max(xs):.2f}s")

    print(f"\n{FLEET} jobs created at once; reconcile latency\n"
          f"  {line('create -> Suspended', suspended)}")
