"""kopf handlers: one idempotent reconcile of a RavnestJob, run on every change and on a timer.

Each pass reads what exists (plan ConfigMap, pods) and moves the job one step towards its goal, so
an operator restarted at any point adopts what is there and creates no duplicates:
validate -> plan (in a worker thread, never on the event loop) -> Service, Secret, ConfigMaps ->
pods -> watch pods and worker metrics -> restart from checkpoint on failure (up to backoffLimit),
suspend/resume, deadline, cleanup and TTL. Objects are owned by the job, so deleting it
garbage-collects them.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from typing import Any

import kopf
import kubernetes
from kubernetes.client.rest import ApiException

from ravnest.comm.tls import TlsMaterial, issue, make_authority
from ravnest.errors import PlanError, SpecError
from ravnest.plan.building import plan_job
from ravnest.plan.plans import Plan
from ravnest.run.progress import scrape
from ravnest.spec import parse_job

from . import monitoring, resources
from .crds import GROUP, PLURAL, VERSION
from .statuses import now, observe, parse_time, progress, set_condition

log = logging.getLogger(__name__)

IMAGE = os.environ.get("RAVNEST_WORKER_IMAGE", "ravnest:latest")
INTERVAL = float(os.environ.get("RAVNEST_RECONCILE_INTERVAL", "2"))
NETWORK_POLICIES = os.environ.get("RAVNEST_NETWORK_POLICIES", "false") == "true"
FINAL_SCRAPE_SECONDS = float(os.environ.get("RAVNEST_FINAL_SCRAPE_SECONDS", "0") or 0)
"""Set by the chart when its PodMonitor is on: how long a finished worker waits for Prometheus
to scrape its final metrics."""


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    settings.posting.level = logging.INFO
    # A job deleted while its timer is mid-reconcile keeps kopf's finalizer until the timer has
    # exited; kopf re-checks only every 60 s by default, so `kubectl delete` would hang that long.
    settings.background.cancellation_polling = 1.0
    monitoring.serve(int(os.environ.get("RAVNEST_OPERATOR_METRICS_PORT", "8080")))


@kopf.on.probe(id="apiserver")
def apiserver_reachable(**_: Any) -> str:
    """Part of `kopf run --liveness=http://0.0.0.0:8081/healthz`: the API answers us."""
    return str(kubernetes.client.VersionApi().get_code().git_version)


def _core() -> kubernetes.client.CoreV1Api:
    return kubernetes.client.CoreV1Api()


def _create(obj: dict[str, Any]) -> bool:
    """Create an object; False if it already exists (idempotent)."""
    api = _core()
    ns = obj["metadata"]["namespace"]
    create: Any = {"Service": api.create_namespaced_service,
                   "Secret": api.create_namespaced_secret,
                   "ConfigMap": api.create_namespaced_config_map,
                   "Pod": api.create_namespaced_pod,
                   "NetworkPolicy": kubernetes.client.NetworkingV1Api(
                       api.api_client).create_namespaced_network_policy}[obj["kind"]]
    try:
        create(ns, obj)
    except ApiException as e:
        if e.status == 409:
            return False
        raise kopf.TemporaryError(f"creating {obj['kind']} {obj['metadata']['name']}: "
                                  f"{e.status} {e.reason}", delay=5) from e
    return True


def _delete_pod(name: str, namespace: str) -> None:
    try:
        _core().delete_namespaced_pod(name, namespace, grace_period_seconds=5)
    except ApiException as e:
        if e.status != 404:
            raise kopf.TemporaryError(f"deleting pod {name}: {e.status} {e.reason}",
                                      delay=5) from e


def _pods(job: str, namespace: str) -> list[dict[str, Any]]:
    api = _core()
    found = api.list_namespaced_pod(namespace, label_selector=f"ravnest.io/job={job}")
    return [api.api_client.sanitize_for_serialization(p) for p in found.items]


def _load_plan(job: str, namespace: str) -> Plan | None:
    try:
        cm = _core().read_namespaced_config_map(resources.plan_configmap_name(job), namespace)
    except ApiException as e:
        if e.status == 404:
            return None
        raise kopf.TemporaryError(f"reading the plan: {e.status} {e.reason}", delay=5) from e
    return Plan.from_dict(json.loads((cm.data or {})["plan.json"]))


def _fail(patch: kopf.Patch, status: dict[str, Any], reason: str, message: str,
          body: kopf.Body) -> None:
    patch.status["phase"] = "Failed"
    patch.status["completionTime"] = now()
    conds = set_condition(status.get("conditions") or [], "Failed", True, reason, message)
    patch.status["conditions"] = set_condition(conds, "Running", False, reason, "")
    kopf.warn(body, reason=reason, message=message)
    monitoring.finished(status.get("phase"), "Failed", status.get("startTime"))


def _finished(body: kopf.Body, status: dict[str, Any], name: str, namespace: str,
              spec: dict[str, Any]) -> None:
    ttl = (spec.get("runPolicy") or {}).get("ttlSecondsAfterFinished")
    done = status.get("completionTime")
    if ttl is not None and done and time.time() - parse_time(done).timestamp() >= ttl:
        try:
            kubernetes.client.CustomObjectsApi().delete_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name)
        except ApiException as e:
            if e.status != 404:
                raise


def _clean_pods(policy: str, pods: list[dict[str, Any]], namespace: str) -> None:
    for p in pods:
        phase = (p.get("status") or {}).get("phase")
        if policy == "All" or (policy == "Running" and phase in ("Running", "Pending")):
            _delete_pod(p["metadata"]["name"], namespace)


def _result(pods: list[dict[str, Any]], plan: Plan, job: str) -> dict[str, Any]:
    """The final figures the cluster-0 root wrote as its termination message."""
    root = resources.pod_name(job, plan.clusters[0].nodes[0])
    for p in pods:
        if p["metadata"]["name"] != root:
            continue
        for cs in (p.get("status") or {}).get("containerStatuses") or []:
            msg = ((cs.get("state") or {}).get("terminated") or {}).get("message")
            if msg:
                try:
                    return dict(json.loads(msg))
                except ValueError:
                    return {}
    return {}


def _certificates(owner: resources.Owner, plan: Plan,
                  tls: bool) -> dict[str, TlsMaterial] | None:
    """A fresh CA for the job and a certificate per node; the CA's key is dropped here."""
    if not tls:
        return None
    ca = make_authority(f"{owner.namespace}/{owner.name}")
    return {n: issue(ca, n, resources.tls_dns_names(owner, n)) for n in plan.names()}


def reconcile(body: kopf.Body, spec: dict[str, Any], status: dict[str, Any], name: str,
              namespace: str, uid: str, patch: kopf.Patch) -> None:
    """Move one job one step towards its goal."""
    status = dict(status or {})
    phase = status.get("phase")
    if phase in ("Succeeded", "Failed"):
        _finished(body, status, name, namespace, spec)
        return
    try:
        job = parse_job({"apiVersion": body["apiVersion"], "kind": body["kind"],
                         "metadata": {"name": name, "namespace": namespace},
                         "spec": dict(spec)})
    except SpecError as e:
        _fail(patch, status, "InvalidSpec", "; ".join(e.problems), body)
        return
    owner = resources.Owner(name, namespace, uid)
    if not status.get("conditions"):
        patch.status["phase"] = phase = "Created"
        patch.status["conditions"] = set_condition([], "Created", True, "Accepted",
                                                   "spec is valid")
        status["conditions"] = patch.status["conditions"]
    plan = _load_plan(name, namespace)
    if plan is None:
        try:
            plan, _, _ = plan_job(job)
        except (PlanError, SpecError) as e:
            _fail(patch, status, "PlanFailed", str(e), body)
            return
        objects = resources.static_objects(owner, job, plan, secrets.token_hex(16),
                                           _certificates(owner, plan, job.spec.security.tls),
                                           NETWORK_POLICIES)
        for obj in objects:  # the plan ConfigMap last: it marks "planned"
            _create(obj)
        kopf.info(body, reason="Planned", message=f"{plan.summary()} plan {plan.fingerprint}")
    if phase in (None, "Created"):
        patch.status["phase"] = phase = "Planned"
        patch.status["plan"] = {"fingerprint": plan.fingerprint, "summary": plan.summary(),
                                "clusters": [{"id": c.id, "nodes": list(c.nodes)}
                                             for c in plan.clusters],
                                "stages": {n.name: f"{n.first_layer}..{n.last_layer}"
                                           for n in plan.nodes}}
        patch.status["conditions"] = set_condition(status["conditions"], "Planned", True,
                                                   "Planned", plan.summary())
        return
    pods = _pods(name, namespace)
    run_policy = spec.get("runPolicy") or {}
    conditions = status.get("conditions") or []
    if run_policy.get("suspend"):
        for p in pods:
            _delete_pod(p["metadata"]["name"], namespace)
        if phase != "Suspended":
            patch.status["phase"] = "Suspended"
            patch.status["conditions"] = set_condition(conditions, "Suspended", True,
                                                       "Suspended", "pods deleted; resumes "
                                                       "from the last checkpoint")
            kopf.info(body, reason="Suspended", message="pods deleted")
        return
    if phase == "Suspended":
        conditions = set_condition(conditions, "Suspended", False, "Resumed", "")
        patch.status["conditions"] = conditions
    restarts = int(status.get("restarts", 0))
    obs = observe(name, plan, pods)
    patch.status["nodes"] = {n: s.to_status() for n, s in obs.nodes.items()}
    stale = [s for s in obs.nodes.values() if s.phase != "Missing" and s.attempt != restarts]
    for s in stale:
        if not s.deleting:
            _delete_pod(s.pod, namespace)
    if stale:
        return
    # A worker pod that vanishes (or is being deleted) from a running job, by `kubectl delete pod`,
    # an eviction or a node drain, is lost like a failed one: its peers would wait for it forever.
    lost = [s for s in obs.nodes.values() if s.phase == "Missing" or s.deleting] \
        if phase == "Running" else []
    if obs.failed or lost:
        message = "; ".join(filter(None, [obs.failure_message(),
                                          *(f"pod {s.pod} was deleted" for s in lost)]))
        if restarts < int(run_policy.get("backoffLimit", 3)):
            for s in obs.nodes.values():
                if s.phase != "Missing" and not s.deleting:
                    _delete_pod(s.pod, namespace)
            patch.status["restarts"] = restarts + 1
            patch.status["phase"] = "Restarting"
            patch.status["conditions"] = set_condition(
                conditions, "Restarting", True, "WorkerFailed",
                f"{message}; restart {restarts + 1} resumes from the last checkpoint")
            kopf.warn(body, reason="Restarting", message=message)
            monitoring.restarted()
            return
        _fail(patch, status, "BackoffLimitExceeded", message, body)
        _clean_pods(run_policy.get("cleanPodPolicy", "Running"), pods, namespace)
        return
    if obs.all_succeeded:
        patch.status["phase"] = "Succeeded"
        patch.status["completionTime"] = now()
        result = _result(pods, plan, name)
        final = {**(status.get("progress") or {})}
        if result:
            patch.status["result"] = result
            final.update({k: v for k, v in {
                "step": result.get("updates"), "loss": result.get("train_loss"),
                "validationLoss": result.get("val_loss"),
                "validationMetric": result.get("val_metric")}.items() if v is not None})
            final["display"] = f"{final.get('step', 0)}/{final.get('totalSteps', 0)}"
        patch.status["progress"] = final
        conds = set_condition(conditions, "Succeeded", True, "Completed",
                              f"validation metric {result.get('val_metric')}")
        patch.status["conditions"] = set_condition(conds, "Running", False, "Completed", "")
        kopf.info(body, reason="Succeeded", message=json.dumps(result))
        monitoring.finished(phase, "Succeeded", status.get("startTime"))
        _clean_pods("All" if run_policy.get("cleanPodPolicy") == "All" else "None", pods,
                    namespace)
        return
    for node in plan.nodes:
        if obs.nodes[node.name].phase == "Missing":
            _create(resources.pod(owner, job, plan, node, IMAGE, attempt=restarts,
                                  final_scrape_seconds=FINAL_SCRAPE_SECONDS))
    started = status.get("startTime")
    if obs.all_running:
        if phase != "Running":
            patch.status["phase"] = "Running"
            conds = set_condition(conditions, "Running", True, "PodsRunning",
                                  f"{len(obs.nodes)} worker pods running")
            restarting = next((c for c in conds if c["type"] == "Restarting"), None)
            if restarting and restarting["status"] == "True":  # keep what it recovered from
                conds = set_condition(conds, "Restarting", False, "Recovered",
                                      f"running again after: {restarting['message']}")
            patch.status["conditions"] = conds
            if not started:
                patch.status["startTime"] = started = now()
                monitoring.running(body["metadata"].get("creationTimestamp"))
        patch.status["progress"] = {**(status.get("progress") or {}),
                                    **_progress(plan, obs, name, started)}
    deadline = run_policy.get("activeDeadlineSeconds")
    if deadline and started and time.time() - parse_time(started).timestamp() > deadline:
        _fail(patch, status, "DeadlineExceeded",
              f"job ran longer than activeDeadlineSeconds={deadline}", body)
        _clean_pods("All", pods, namespace)


def _progress(plan: Plan, obs: Any, job: str, started: str | None) -> dict[str, Any]:
    samples = []
    for c in plan.clusters:
        ip = obs.nodes[c.nodes[0]].ip
        if not ip:
            return {}
        try:
            samples.append(scrape(resources.METRICS_PORT, host=ip, timeout=1.0))
        except OSError:
            return {}
    return progress(samples, started)


_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()


def _lock(uid: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(uid, threading.Lock())


def _reconcile_once(kwargs: dict[str, Any], wait: bool) -> None:
    """Change handlers and the timer share one lock per job: passes never overlap."""
    lock = _lock(kwargs["uid"])
    if not lock.acquire(blocking=wait):
        return
    try:
        with monitoring.reconciling():
            reconcile(kwargs["body"], kwargs["spec"], kwargs["status"], kwargs["name"],
                      kwargs["namespace"], kwargs["uid"], kwargs["patch"])
    finally:
        lock.release()
    monitoring.observe_phase(kwargs["namespace"], kwargs["name"],
                             kwargs["patch"].status.get("phase") or kwargs["status"].get("phase"))


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
def on_change(**kwargs: Any) -> None:
    _reconcile_once(kwargs, wait=True)


@kopf.timer(GROUP, VERSION, PLURAL, interval=INTERVAL, sharp=False)
def on_timer(**kwargs: Any) -> None:
    _reconcile_once(kwargs, wait=False)


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True)
def on_delete(**kwargs: Any) -> None:
    monitoring.forget(kwargs["namespace"], kwargs["name"])
    with _locks_guard:
        _locks.pop(kwargs["uid"], None)
