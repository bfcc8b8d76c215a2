"""kopf handlers: the glue between Kubernetes and the operator's decisions (`deciding`).

Each pass over a RavnestJob, run on every change and every few seconds (`ticking`), reads what
exists (the job's plan ConfigMap and pods), lets `deciding.decide` choose the next step and carries
its actions out, so an operator restarted at any point adopts what is there and creates no
duplicates. Passes run in threads, never on kopf's event loop. Objects are owned by the job, so
deleting it garbage-collects them; the job carries no finalizer, so deleting it never waits for
an operator.
"""

from __future__ import annotations

import datetime as dt
import hmac
import json
import logging
import os
import secrets
import socket
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
    Delete,
    DeleteJob,
    DeletePod,
    Event,
    GrowJob,
    RemakeJobObjects,
    ScrapeProgress,
    SetStatus,
    SuspendJob,
)
from .crds import GROUP, PLURAL, VERSION
from .deciding import (
    FINISHED,
    Observed,
    added_providers,
    as_planned,
    decide,
    decide_refused,
    managed_here,
    removed_providers,
    rest,
)
from .disruptions import Disrupted
from .leading import Leadership, election_of
from .refusals import Refusal, refusal
from .scraping import Scrapes
from .settings import Settings
from .statuses import progress
from .ticking import Ticker, Tracked

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
LEADERSHIP = Leadership(election_of(os.environ, socket.gethostname(), os.getpid()))
"""Whether this replica acts (`leading`): always without an election."""


def _token(owner: resources.Owner) -> str:
    """The job's token (its Secret's): derived from the operator's key and the job's uid, so a
    token Secret deleted by hand is made again as it was (`RemakeJobObjects`)."""
    return hmac.digest(SIGNING_KEY, b"ravnest-job-token\0" + owner.uid.encode(), "sha256")[
        :16].hex()


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
    if not SETTINGS.signing_key_file:
        logging.getLogger(__name__).warning(
            "RAVNEST_SIGNING_KEY_FILE is not set: the jobs' identities come from a key made now, "
            "so a job planned before this operator restarts cannot grow after it")
    monitoring.serve(SETTINGS.metrics_port)
    TICKER.start()
    LEADERSHIP.start(on_leading=TICKER.tick)  # (followers watch, and make no pass)


@kopf.on.cleanup()
def stop_ticking(**_: Any) -> None:
    TICKER.stop()


@kopf.on.probe(id="apiserver")
def apiserver_reachable(**_: Any) -> str:
    """Part of `kopf run --liveness=http://0.0.0.0:8081/healthz`: the API answers us."""
    return str(kubernetes.client.VersionApi().get_code().git_version)


def _core() -> kubernetes.client.CoreV1Api:
    return kubernetes.client.CoreV1Api()


class Refused(Exception):
    """The apiserver refused an object of the pass (`refusals.refusal`): the pass ends, and
    `reconcile` fails the job (`deciding.decide_refused`)."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.said())
        self.refusal = refusal


def _refused_or_retried(e: ApiException, kind: str, name: str, doing: str) -> Exception:
    """What an API error on making an object ends the pass with: Refused, or a retry."""
    refused = refusal(kind, name, e.status, e.reason, e.body)
    if refused is not None:
        return Refused(refused)
    return kopf.TemporaryError(f"{doing} {kind} {name}: {e.status} {e.reason}", delay=5)


def _api(kind: str, verb: str) -> Any:
    """The client method that does `verb` (create, delete) to the job's objects of `kind`
    (named one by one: tests/integration/deriving_rbac.py reads the chart's RBAC off them)."""
    core = _core()
    net = kubernetes.client.NetworkingV1Api(core.api_client)
    policy = kubernetes.client.PolicyV1Api(core.api_client)
    methods: dict[str, dict[str, Any]] = {
        "create": {"Service": core.create_namespaced_service,
                   "Secret": core.create_namespaced_secret,
                   "ConfigMap": core.create_namespaced_config_map,
                   "Pod": core.create_namespaced_pod,
                   "NetworkPolicy": net.create_namespaced_network_policy,
                   "PodDisruptionBudget": policy.create_namespaced_pod_disruption_budget},
        "delete": {"Service": core.delete_namespaced_service,
                   "Pod": core.delete_namespaced_pod,
                   "ConfigMap": core.delete_namespaced_config_map,
                   "NetworkPolicy": net.delete_namespaced_network_policy,
                   "PodDisruptionBudget": policy.delete_namespaced_pod_disruption_budget}}
    return methods[verb][kind]


def _create(obj: dict[str, Any], made: list[tuple[str, str]]) -> bool:
    """Create an object (noted in `made`); False if it already exists (idempotent)."""
    kind, name = obj["kind"], obj["metadata"]["name"]
    try:
        _api(kind, "create")(obj["metadata"]["namespace"], obj)
    except ApiException as e:
        if e.status == 409:
            return False
        raise _refused_or_retried(e, kind, name, "creating") from e
    made.append((kind, name))
    return True


def _delete(kind: str, name: str, namespace: str) -> None:
    """Delete an object of the job (a pod with its own grace period); one already gone is not
    an error."""
    try:
        _api(kind, "delete")(name, namespace)
    except ApiException as e:
        if e.status != 404:
            raise kopf.TemporaryError(f"deleting {kind} {name}: {e.status} {e.reason}",
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


def _grow(owner: resources.Owner, action: GrowJob, made: list[tuple[str, str]]) -> None:
    """The new nodes' ConfigMaps; the running nodes' replaced with the grown plan (a pod made
    again, alone or with the whole job, takes the new nodes into its rings; a running worker does
    not read it again); last the plan ConfigMap's (a pass that stopped half-way is done again)."""
    authority = _authority(owner)
    for name in action.nodes:
        _create(resources.identity_secret(owner, authority.issue(name)), made)
    for node in action.plan.nodes:
        cm = resources.node_configmap(owner, action.job, action.plan, node)
        if node.name not in action.nodes or not _create(cm, made):
            _replace(cm)
    _replace(resources.plan_configmap(owner, action.plan, action.job, authority.public))


def _replace(cm: dict[str, Any]) -> None:
    update: Any = _core().replace_namespaced_config_map  # (takes the manifest as a dict)
    try:
        update(cm["metadata"]["name"], cm["metadata"]["namespace"], cm)
    except ApiException as e:
        raise _refused_or_retried(e, "ConfigMap", cm["metadata"]["name"],
                                  "growing the plan: replacing") from e


def _delete_job(name: str, namespace: str) -> None:
    try:
        kubernetes.client.CustomObjectsApi().delete_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name)
    except ApiException as e:
        if e.status != 404:
            raise


def _suspend_job(name: str, namespace: str) -> None:
    """spec.suspend: true, as a queue would set it."""
    try:
        kubernetes.client.CustomObjectsApi().patch_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name, {"spec": {"suspend": True}},
            _content_type="application/merge-patch+json")
    except ApiException as e:
        raise kopf.TemporaryError(f"suspending the job: {e.status} {e.reason}", delay=5) from e


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
    if seen.status.get("phase") in FINISHED or not managed_here(seen.spec):
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
    pods = _pods(name, namespace, uid)
    return replace(seen, job=job, plan=plan, changed=changed,
                   removed=removed_providers(now, job, changed), added=added,
                   edited=now if added else None, pods=tuple(pods),
                   disrupted=DISRUPTED.of(uid, pods),
                   signs=not added or issuer == _authority(
                       resources.Owner(name, namespace, uid)).public.hex())


def _carry_out(action: Action, body: dict[str, Any], patch: kopf.Patch,
               owner: resources.Owner, made: list[tuple[str, str]]) -> None:
    """Do one step of a decision (`made`: the objects the pass made, each noted as made)."""
    if isinstance(action, SetStatus):
        patch.status.update(action.fields)
    elif isinstance(action, CreateJobObjects):
        tls = _certificates(owner, action.plan, action.job.spec.security.tls)
        for obj in resources.static_objects(owner, action.job, action.plan, _token(owner),
                                            _authority(owner), tls, SETTINGS.network_policies):
            _create(obj, made)
    elif isinstance(action, RemakeJobObjects):
        again = [f"{o['kind']} {o['metadata']['name']}" for o in resources.remade_objects(
            owner, action.job, action.plan, _token(owner), _authority(owner),
            SETTINGS.network_policies) if _create(o, made)]
        if again:
            _post_event(body, Event("Remade", f"made again, deleted since: {', '.join(again)}",
                                    warning=True))
    elif isinstance(action, Create):
        _create(dict(action.manifest), made)
    elif isinstance(action, DeletePod):
        _delete("Pod", action.name, owner.namespace)
    elif isinstance(action, Delete):
        _delete(action.kind, action.name, owner.namespace)
    elif isinstance(action, GrowJob):
        _grow(owner, action, made)
    elif isinstance(action, AnnotatePod):
        _annotate_pod(action.name, owner.namespace, action.key, action.value)
    elif isinstance(action, DeleteJob):
        _delete_job(owner.name, owner.namespace)
    elif isinstance(action, SuspendJob):
        _suspend_job(owner.name, owner.namespace)
    elif isinstance(action, Event):
        _post_event(body, action)
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


EVENT_CHARS = 1024
"""At most this much of an Event's message is posted (as kopf's poster did)."""
COMPONENT = "ravnest-operator"


def _post_event(body: dict[str, Any], event: Event) -> None:
    """A core v1 Event on the job, posted by the pass itself (its thread may be the ticker's,
    outside kopf's context); one the apiserver does not take is logged, never fatal."""
    meta = body["metadata"]
    now = dt.datetime.now(dt.UTC)
    message = event.message if len(event.message) <= EVENT_CHARS else (
        event.message[:EVENT_CHARS - 3] + "...")
    try:
        _core().create_namespaced_event(meta["namespace"], kubernetes.client.CoreV1Event(
            metadata=kubernetes.client.V1ObjectMeta(generate_name=f"{meta['name']}.",
                                                    namespace=meta["namespace"]),
            involved_object=kubernetes.client.V1ObjectReference(
                api_version=body.get("apiVersion"), kind=body.get("kind"), name=meta["name"],
                namespace=meta["namespace"], uid=meta.get("uid")),
            reason=event.reason, message=message,
            type="Warning" if event.warning else "Normal",
            source=kubernetes.client.V1EventSource(component=COMPONENT),
            reporting_component=COMPONENT, reporting_instance=socket.gethostname()[:128],
            first_timestamp=now, last_timestamp=now, count=1))
    except ApiException as e:
        logging.getLogger(__name__).warning("job %s/%s: Event %s not posted: %s %s",
                                            meta["namespace"], meta["name"], event.reason,
                                            e.status, e.reason)


def reconcile(body: dict[str, Any], spec: dict[str, Any], status: dict[str, Any], name: str,
              namespace: str, uid: str, patch: kopf.Patch) -> None:
    """Move one job one step towards its goal: observe, decide, carry out."""
    observed = _observe(body, spec, status, name, namespace, uid)
    now = dt.datetime.now(dt.UTC)
    decision = decide(observed, now, SETTINGS)
    owner = resources.Owner(name, namespace, uid)
    made: list[tuple[str, str]] = []
    try:
        for action in decision.steps:
            _carry_out(action, body, patch, owner, made)
    except Refused as e:
        logging.getLogger(__name__).warning("job %s/%s: %s", namespace, name, e)
        patch.pop("status", None)  # (the pass's status so far: this decision's replaces it)
        for action in decide_refused(observed, now, SETTINGS, e.refusal, made).steps:
            _carry_out(action, body, patch, owner, [])


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


def _write_status(name: str, namespace: str, status: dict[str, Any],
                  resource_version: str | None = None) -> None:
    """A pass's status fields, merged into the job's status (a field set to None is removed), if
    the job is still the version the pass read (`resource_version`): a status written since, by
    another pass or another replica, is never overwritten by an older pass's (409: the next pass
    decides again, on the newer status)."""
    patch: dict[str, Any] = {"status": status}
    if resource_version:
        patch["metadata"] = {"resourceVersion": resource_version}
    try:
        kubernetes.client.CustomObjectsApi().patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, name, patch,
            _content_type="application/merge-patch+json")
    except ApiException as e:
        if e.status == 409:
            raise kopf.TemporaryError("the job changed since this pass read it; its status is "
                                      "decided again", delay=1) from e
        raise


def _reconcile_once(kwargs: dict[str, Any], wait: bool) -> float | None:
    """Change handlers and the ticker share one lock per job: passes never overlap. Each pass
    reads the job as it is now and writes its status before the next pass begins: the body kopf
    hands a handler can be older than the status the last pass wrote (kopf applies a handler's
    patch after it returns, and sees it only when the watch brings it back), and a pass deciding
    on an older status than its plan and pods would take its own doing for a fault (pods it just
    created as stale, a cluster it just restarted or added as lost) and restart that cluster
    again. Seconds until the job's next timed pass (`deciding.rest`), or None when the job is
    gone (or is another job of its name now)."""
    if not LEADERSHIP.leads():
        return SETTINGS.reconcile_interval  # (a follower: the leader passes over the job)
    lock = _lock(kwargs["uid"])
    if not lock.acquire(blocking=wait):
        return SETTINGS.reconcile_interval
    name, namespace = kwargs["name"], kwargs["namespace"]
    try:
        body = _current(name, namespace, kwargs["uid"])
        if body is None:
            return None  # deleted since
        status = dict(body.get("status") or {})
        spec = dict(body.get("spec") or {})
        patch = kopf.Patch()
        with monitoring.reconciling():
            reconcile(body, spec, status, name, namespace, kwargs["uid"], patch)
            if patch.get("status"):
                _write_status(name, namespace, finite(status, patch["status"]),
                              body["metadata"].get("resourceVersion"))
    finally:
        lock.release()
    after = {**status, **patch.get("status", {})}
    if after.get("phase") in FINISHED:
        SCRAPES.forget(kwargs["uid"])
    monitoring.observe_phase(namespace, name, after.get("phase"))
    return rest(after, spec, dt.datetime.now(dt.UTC), SETTINGS.reconcile_interval)


def _tick(job: Tracked) -> float | None:
    """The ticker's pass over a job (none while another of its passes runs)."""
    kwargs = {"uid": job.uid, "name": job.name, "namespace": job.namespace}
    due = _reconcile_once(kwargs, wait=False)
    if due is None:
        _gone(kwargs)
    return due


TICKER = Ticker(SETTINGS.reconcile_interval, _tick)
"""Every job's pass every reconcile_interval seconds, between its changes (`ticking`: kopf's
timers would put a finalizer on the job, and a job deleted while no operator runs would hang)."""


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
def on_change(**kwargs: Any) -> None:
    TICKER.track(Tracked(kwargs["uid"], kwargs["name"], kwargs["namespace"]))
    if _reconcile_once(kwargs, wait=True) is None:
        _gone(kwargs)


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True)
def on_delete(**kwargs: Any) -> None:
    _gone(kwargs)


DISRUPTED = Disrupted()
"""The job's pods seen disrupted, until its passes have seen them gone (`disruptions`)."""


@kopf.on.event("", "v1", "pods", labels={resources.JOB_LABEL: kopf.PRESENT})
def on_pod(body: kopf.Body, **_: Any) -> None:
    """Every change of a job's pod, its deletion included: a disrupted one (evicted, preempted)
    is noted, and its job's pass runs now, while the pod may still be there to be seen."""
    job = DISRUPTED.note(cast(dict[str, Any], dict(body)))
    if job is not None:
        TICKER.poke(job)


def _gone(kwargs: dict[str, Any]) -> None:
    """Forget a job deleted (or replaced by another of its name): no deletion waits on this
    (no finalizer), so a job deleted while no operator ran is forgotten by its first pass."""
    TICKER.forget(kwargs["uid"])
    SCRAPES.forget(kwargs["uid"])
    DISRUPTED.forget(kwargs["uid"])
    with _locks_guard:
        _locks.pop(kwargs["uid"], None)
    monitoring.forget(kwargs["namespace"], kwargs["name"])  # (a new job's next pass sets it)
