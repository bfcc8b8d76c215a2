"""kopf handlers: the glue between Kubernetes and the operator's decisions (`deciding`).

Each pass over a RavnestJob, run on every change and on a timer, reads what exists (the job's plan
ConfigMap and pods), lets `deciding.decide` choose the next step and carries its actions out, so an
operator restarted at any point adopts what is there and creates no duplicates. Planning runs in
kopf's handler thread, never on the event loop. Objects are owned by the job, so deleting it
garbage-collects them.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import secrets
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import kopf
import kubernetes
from kubernetes.client.rest import ApiException

from ravnest.comm.identity import Authority
from ravnest.comm.tls import TlsMaterial, issue, make_authority
from ravnest.errors import SpecError
from ravnest.plan.plans import Plan
from ravnest.run.jobstatus import finite
from ravnest.spec import parse_job

from . import monitoring, resources
from .actions import (
    Action,
    AnnotatePod,
    CountDrain,
    CountFinished,
    CountRecovery,
    CountRestart,
    CountRunning,
    CountTakeover,
    Create,
    CreateJobObjects,
    DeleteJob,
    DeletePod,
    Event,
    GrowJob,
    ScrapeProgress,
    SetStatus,
)
from .crds import GROUP, PLURAL, VERSION
from .deciding import FINISHED, Observed, added_providers, as_planned, decide, removed_providers
from .scraping import Scrapes
from .settings import Settings
from .statuses import progress

SETTINGS = Settings.from_env(os.environ)
"""The operator's settings, read from its environment once, when kopf imports this module."""


def _signing_key(path: str) -> bytes:
    """The operator's secret key (`Settings.signing_key_file`), or a fresh one."""
    if not path:
        return secrets.token_bytes(32)
    key = Path(path).read_bytes().strip()
    if len(key) < 32:
        raise RuntimeError(f"RAVNEST_SIGNING_KEY_FILE {path}: a key of {len(key)} bytes; "
                           f"give at least 32")
    return key


SIGNING_KEY = _signing_key(SETTINGS.signing_key_file)


def _authority(owner: resources.Owner) -> Authority:
    """The job's authority, which issues its nodes' identities: derived from the operator's key
    and the job's uid, the same after a restart (given the same key)."""
    return Authority.derived(SIGNING_KEY, owner.uid)


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
    if not SETTINGS.signing_key_file:
        logging.getLogger(__name__).warning(
            "RAVNEST_SIGNING_KEY_FILE is not set: the jobs' identities come from a key made now, "
            "so a job planned before this operator restarts cannot grow after it")
    monitoring.serve(SETTINGS.metrics_port)


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
        _core().delete_namespaced_pod(name, namespace)  # with the pod's own grace period
    except ApiException as e:
        if e.status != 404:
            raise kopf.TemporaryError(f"deleting pod {name}: {e.status} {e.reason}",
                                      delay=5) from e


def _annotate_pod(name: str, namespace: str, key: str, value: str) -> None:
    try:
        _core().patch_namespaced_pod(name, namespace, {"metadata": {"annotations": {key: value}}})
    except ApiException as e:
        if e.status != 404:
            raise kopf.TemporaryError(f"annotating pod {name}: {e.status} {e.reason}",
                                      delay=5) from e


def _owned(metadata: Any, uid: str) -> bool:
    """Whether an object belongs to the job with this uid, not to an earlier job of the same
    name whose objects the garbage collector has yet to delete."""
    return any(ref.uid == uid for ref in metadata.owner_references or [])


def _pods(job: str, namespace: str, uid: str) -> list[dict[str, Any]]:
    api = _core()
    found = api.list_namespaced_pod(namespace, label_selector=f"ravnest.io/job={job}")
    return [api.api_client.sanitize_for_serialization(p) for p in found.items
            if _owned(p.metadata, uid)]


def _load_plan(job: str, namespace: str, uid: str
               ) -> tuple[Plan | None, dict[str, Any] | None, str]:
    """The job's plan, the job as planned and the public key (hex) of the authority that
    issued its identities (None, None, "" before it is planned; the job None and the key ""
    for a plan ConfigMap of an operator that did not keep them)."""
    name = resources.plan_configmap_name(job)
    try:
        cm = _core().read_namespaced_config_map(name, namespace)
    except ApiException as e:
        if e.status == 404:
            return None, None, ""
        raise kopf.TemporaryError(f"reading the plan: {e.status} {e.reason}", delay=5) from e
    if not _owned(cm.metadata, uid):
        raise kopf.TemporaryError(f"ConfigMap {name} is an earlier job's of the same name; "
                                  f"waiting for it to be garbage-collected", delay=5)
    data = cm.data or {}
    planned = data.get(resources.PLANNED_JOB)
    return Plan.from_dict(json.loads(data[resources.PLAN_FILE])), (
        json.loads(planned) if planned else None), data.get(resources.AUTHORITY_KEY, "")


def _grow(owner: resources.Owner, action: GrowJob) -> None:
    """The new nodes' ConfigMaps; the running nodes' replaced with the grown plan (a pod made
    again, alone or with the whole job, takes the new nodes into its rings; a running worker does
    not read it again); last the plan ConfigMap's (a pass that stopped half-way is done again)."""
    authority = _authority(owner)
    for name in action.nodes:
        _create(resources.identity_secret(owner, authority.issue(name)))
    for node in action.plan.nodes:
        cm = resources.node_configmap(owner, action.job, action.plan, node)
        if node.name not in action.nodes or not _create(cm):
            _replace(cm)
    _replace(resources.plan_configmap(owner, action.plan, action.job, authority.public))


def _replace(cm: dict[str, Any]) -> None:
    update: Any = _core().replace_namespaced_config_map  # (takes the manifest as a dict)
    try:
        update(cm["metadata"]["name"], cm["metadata"]["namespace"], cm)
    except ApiException as e:
        raise kopf.TemporaryError(f"growing the plan: replacing ConfigMap "
                                  f"{cm['metadata']['name']}: {e.status} {e.reason}",
                                  delay=5) from e


def _delete_job(name: str, namespace: str) -> None:
    try:
        kubernetes.client.CustomObjectsApi().delete_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name)
    except ApiException as e:
        if e.status != 404:
            raise


def _certificates(owner: resources.Owner, plan: Plan,
                  tls: bool) -> dict[str, TlsMaterial] | None:
    """A fresh CA for the job and a certificate per node; the CA's key is dropped here."""
    if not tls:
        return None
    ca = make_authority(f"{owner.namespace}/{owner.name}")
    return {n: issue(ca, n, resources.tls_dns_names(owner, n)) for n in plan.names()}


SCRAPES = Scrapes(resources.METRICS_PORT)


def _scraped(uid: str, hosts: tuple[str, ...], started: str | None) -> dict[str, Any]:
    """Progress from the cluster roots' metrics as the last scrape read them; nothing when any
    of them could not be read (`scraping`: the pass does not wait for a scrape)."""
    samples = SCRAPES.latest(uid, hosts)
    return progress(samples, started) if samples else {}


def _observe(body: dict[str, Any], spec: dict[str, Any], status: dict[str, Any], name: str,
            namespace: str, uid: str) -> Observed:
    """What a pass needs to know of a job: nothing more for a finished one, the reasons for an
    invalid one, else its plan ConfigMap's plan and its pods."""
    generation = body["metadata"].get("generation")
    seen = Observed(name, namespace, uid, dict(spec), dict(status or {}),
                    created=body["metadata"].get("creationTimestamp"),
                    generation=generation if isinstance(generation, int) else None)
    if seen.status.get("phase") in FINISHED:
        return seen
    try:
        job = parse_job({"apiVersion": body["apiVersion"], "kind": body["kind"],
                         "metadata": {"name": name, "namespace": namespace, "uid": uid},
                         "spec": dict(spec)}, template_allow=SETTINGS.allowed(namespace))
    except SpecError as e:
        return replace(seen, problems=tuple(e.problems))
    plan, planned, issuer = _load_plan(name, namespace, uid)
    now = job
    job, changed = as_planned(job, planned)
    added = added_providers(now, job, changed)
    return replace(seen, job=job, plan=plan, changed=changed,
                   removed=removed_providers(now, job, changed), added=added,
                   edited=now if added else None, pods=tuple(_pods(name, namespace, uid)),
                   signs=not added or issuer == _authority(
                       resources.Owner(name, namespace, uid)).public.hex())


def _carry_out(action: Action, body: dict[str, Any], patch: kopf.Patch,
               owner: resources.Owner) -> None:
    """Do one step of a decision."""
    if isinstance(action, SetStatus):
        patch.status.update(action.fields)
    elif isinstance(action, CreateJobObjects):
        tls = _certificates(owner, action.plan, action.job.spec.security.tls)
        for obj in resources.static_objects(owner, action.job, action.plan,
                                            secrets.token_hex(16), _authority(owner), tls,
                                            SETTINGS.network_policies):
            _create(obj)
    elif isinstance(action, Create):
        _create(dict(action.manifest))
    elif isinstance(action, DeletePod):
        _delete_pod(action.name, owner.namespace)
    elif isinstance(action, GrowJob):
        _grow(owner, action)
    elif isinstance(action, AnnotatePod):
        _annotate_pod(action.name, owner.namespace, action.key, action.value)
    elif isinstance(action, DeleteJob):
        _delete_job(owner.name, owner.namespace)
    elif isinstance(action, Event):
        post = kopf.warn if action.warning else kopf.info
        post(kopf.Body(cast(kopf.RawBody, body)), reason=action.reason, message=action.message)
    elif isinstance(action, ScrapeProgress):
        patch.status["progress"] = {**action.base,
                                    **_scraped(owner.uid, action.hosts, action.started)}
    elif isinstance(action, CountRestart):
        monitoring.restarted()
    elif isinstance(action, CountRecovery):
        monitoring.recovered()
    elif isinstance(action, CountTakeover):
        monitoring.took_over()
    elif isinstance(action, CountDrain):
        monitoring.drained()
    elif isinstance(action, CountRunning):
        monitoring.running(action.created)
    elif isinstance(action, CountFinished):
        monitoring.finished(action.previous, action.phase, action.started)


def reconcile(body: dict[str, Any], spec: dict[str, Any], status: dict[str, Any], name: str,
              namespace: str, uid: str, patch: kopf.Patch) -> None:
    """Move one job one step towards its goal: observe, decide, carry out."""
    observed = _observe(body, spec, status, name, namespace, uid)
    decision = decide(observed, dt.datetime.now(dt.UTC), SETTINGS)
    owner = resources.Owner(name, namespace, uid)
    for action in decision.steps:
        _carry_out(action, body, patch, owner)


_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()


def _lock(uid: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(uid, threading.Lock())


def _current(name: str, namespace: str, uid: str) -> dict[str, Any] | None:
    """The job as the apiserver has it now (None: it is gone, or is another job of that name)."""
    try:
        job = cast(dict[str, Any], kubernetes.client.CustomObjectsApi()
                   .get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name))
    except ApiException as e:
        if e.status == 404:
            return None
        raise
    return job if job["metadata"].get("uid") == uid else None


def _write_status(name: str, namespace: str, status: dict[str, Any]) -> None:
    """A pass's status fields, merged into the job's status (a field set to None is removed)."""
    kubernetes.client.CustomObjectsApi().patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, PLURAL, name, {"status": status},
        _content_type="application/merge-patch+json")


def _reconcile_once(kwargs: dict[str, Any], wait: bool) -> None:
    """Change handlers and the timer share one lock per job: passes never overlap. Each pass
    reads the job as it is now and writes its status before the next pass begins: the body kopf
    hands a handler can be older than the status the last pass wrote (kopf applies a handler's
    patch after it returns, and sees it only when the watch brings it back), and a pass deciding
    on an older status than its plan and pods would take its own doing for a fault (pods it just
    created as stale, a cluster it just restarted or added as lost) and restart that cluster
    again."""
    lock = _lock(kwargs["uid"])
    if not lock.acquire(blocking=wait):
        return
    name, namespace = kwargs["name"], kwargs["namespace"]
    try:
        body = _current(name, namespace, kwargs["uid"])
        if body is None:
            return  # deleted since: its deletion handler follows
        status = dict(body.get("status") or {})
        patch = kopf.Patch()
        with monitoring.reconciling():
            reconcile(body, dict(body.get("spec") or {}), status, name, namespace,
                      kwargs["uid"], patch)
            if patch.get("status"):
                _write_status(name, namespace, finite(status, patch["status"]))
    finally:
        lock.release()
    phase = patch.status.get("phase") or status.get("phase")
    if phase in FINISHED:
        SCRAPES.forget(kwargs["uid"])
    monitoring.observe_phase(namespace, name, phase)


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
def on_change(**kwargs: Any) -> None:
    _reconcile_once(kwargs, wait=True)


@kopf.timer(GROUP, VERSION, PLURAL, interval=SETTINGS.reconcile_interval, sharp=False)
def on_timer(**kwargs: Any) -> None:
    _reconcile_once(kwargs, wait=False)


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True)
def on_delete(**kwargs: Any) -> None:
    monitoring.forget(kwargs["namespace"], kwargs["name"])
    SCRAPES.forget(kwargs["uid"])
    with _locks_guard:
        _locks.pop(kwargs["uid"], None)
