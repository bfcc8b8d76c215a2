"""Pure builders of the Kubernetes objects of a RavnestJob: spec + plan in, manifests out.

Every object is labelled with the job (and node, role, cluster, stage where it applies) and owned
by the RavnestJob, so deleting the job garbage-collects everything. Pods get a stable hostname
under a headless Service, so each worker knows its peers' DNS names before any pod exists.
With `spec.security.tls`, one Secret holds the job CA's certificate and every node's certificate
and key, and each pod mounts only its own. Each node's identity (`ravnest.comm.identity`: the
key and certificate by which it proves to its peers which node it is) is a Secret of its own,
which only its pod mounts. With network policies on, a per-job NetworkPolicy lets
only the job's own worker pods reach its workers' gRPC port.
"""

from __future__ import annotations

import base64
import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ravnest.comm.identity import Authority, NodeIdentity
from ravnest.comm.tls import CA_FILE, CERT_FILE, KEY_FILE, TlsMaterial
from ravnest.plan.plans import NodePlan, Plan, spare_name
from ravnest.run.metadata import (
    DEVICE_ENV,
    DRAIN_DIR_ENV,
    FINAL_SCRAPE_ENV,
    GONE_ENV,
    GRPC_PORT,
    METRICS_PORT,
    REJOIN_ENV,
    RING_PORT,
    TOKEN_ENV,
    TORCH_THREADS_ENV,
    NodeMetadata,
    endpoint,
    listen_all,
)
from ravnest.spec import Job, Provider
from ravnest.storing import PVC_ROOT, pvc_claim

from .crds import GROUP, KIND, VERSION
from .templating import merged

DATA_DIR = "/ravnest"
METADATA_DIR = "/etc/ravnest"
PLAN_DIR = "/etc/ravnest-plan"
"""Where the job's pods mount the plan ConfigMap's plan and job (stored once for all nodes: the
node metadata names the files, `NodeMetadata.to_dict`)."""
PLAN_VOLUME = "ravnest-plan"
TLS_DIR = "/etc/ravnest-tls"
IDENTITY_DIR = "/etc/ravnest-identity"
"""Where a worker pod mounts its node's identity (`identity_secret`), `identity.json`."""
IDENTITY_FILE = "identity.json"
AUTHORITY_KEY = "authority"
"""In the plan ConfigMap: the public key of the job's authority, which issued its nodes'
identities (a grow checks that the operator's key still derives it)."""
DRAIN_DIR = "/etc/ravnest-drain"
"""Where a worker pod's downward-API volume shows its drain order (`DRAIN_ANNOTATION`)."""
WORKER_UID = 10001
POD_SECURITY: dict[str, Any] = {"runAsNonRoot": True, "runAsUser": WORKER_UID,
                                "runAsGroup": WORKER_UID, "fsGroup": WORKER_UID,
                                "seccompProfile": {"type": "RuntimeDefault"}}
"""The pod security context of every pod of a job, workers and planner."""
CONTAINER_SECURITY: dict[str, Any] = {"allowPrivilegeEscalation": False,
                                      "readOnlyRootFilesystem": True,
                                      "capabilities": {"drop": ["ALL"]}}
"""The container security context of every pod of a job."""
PLANNER_RESOURCES: dict[str, Any] = {"requests": {"cpu": "500m", "memory": "1Gi"},
                                     "limits": {"memory": "4Gi"}}
"""The planner pod's resources unless spec.plan.resources says otherwise."""
JOB_FILE = "job.json"
ATTEMPT_ANNOTATION = "ravnest.io/attempt"
"""A worker pod's attempt: the job's restarts when it was created."""
RECOVERY_ANNOTATION = "ravnest.io/recovery"
"""A worker pod's cluster recovery in its attempt (absent: 0, the cluster as first started)."""
PROVIDER_ANNOTATION = "ravnest.io/provider"
"""The provider (index into the expanded spec.providers) whose placement a pod has: a worker pod's
node's own, or the spare's that took its stage over."""
PLAN_FILE = "plan.json"
"""In the plan ConfigMap: the plan."""
PLANNED_JOB = "job.json"
"""In the plan ConfigMap: the job as it was planned."""
JOB_LABEL = "ravnest.io/job"
"""The label every object of a job carries, its value the job's name."""
SPARE_LABEL = "ravnest.io/spare"
"""On a spare pod: the provider it holds."""
DRAIN_ANNOTATION = "ravnest.io/drain"
"""On the root pod of a cluster told to drain (providers removed from a running job): the order,
JSON; the worker reads it from its downward-API volume as `cluster_<c>` in `DRAIN_DIR`."""


@dataclass(frozen=True)
class Owner:
    """The RavnestJob that owns the objects."""

    name: str
    namespace: str
    uid: str

    def reference(self) -> dict[str, Any]:
        return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": self.name,
                "uid": self.uid, "controller": True, "blockOwnerDeletion": True}


def dns_label(node: str) -> str:
    """`node_3` -> `node-3` (DNS labels have no underscores)."""
    return node.replace("_", "-")


def service_name(job: str) -> str:
    return f"{job}-workers"


def pod_name(job: str, node: str) -> str:
    return f"{job}-{dns_label(node)}"


def plan_configmap_name(job: str) -> str:
    return f"{job}-plan"


def planner_name(job: str) -> str:
    """The planner pod."""
    return f"{job}-planner"


def planner_configmap_name(owner: Owner) -> str:
    """The ConfigMap that hands the planner pod the job: named for this job's uid, so that one
    left by an earlier job of the same name, not yet garbage-collected, is never planned."""
    return f"{owner.name}-planner-{owner.uid[:8]}"


def token_secret_name(job: str) -> str:
    return f"{job}-token"


def identity_secret_name(job: str, node: str) -> str:
    """One Secret per node (a node that joins later gets its own, with `create` alone)."""
    return f"{pod_name(job, node)}-identity"


def tls_secret_name(job: str) -> str:
    return f"{job}-tls"


def network_policy_name(job: str) -> str:
    return f"{job}-workers"


def address(owner: Owner, node: str, port: int = GRPC_PORT) -> str:
    return endpoint(f"{dns_label(node)}.{service_name(owner.name)}.{owner.namespace}.svc", port)


def _tcp_ring(job: Job) -> bool:
    return job.spec.training.ring_transport == "tcp"


def tls_dns_names(owner: Owner, node: str) -> list[str]:
    """The names a node's certificate carries besides its identity: its pod's DNS names under
    the headless Service."""
    short = f"{dns_label(node)}.{service_name(owner.name)}"
    return [short, f"{short}.{owner.namespace}", f"{short}.{owner.namespace}.svc",
            f"{short}.{owner.namespace}.svc.cluster.local"]


def job_labels(job: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "ravnest", "app.kubernetes.io/component": "worker",
            "app.kubernetes.io/managed-by": "ravnest-operator", "ravnest.io/job": job}


def node_labels(job: str, node: NodePlan) -> dict[str, str]:
    return {**job_labels(job), "ravnest.io/node": dns_label(node.name),
            "ravnest.io/role": node.role, "ravnest.io/cluster": str(node.cluster),
            "ravnest.io/stage": str(node.stage)}


def _meta(owner: Owner, name: str, labels: dict[str, str],
          annotations: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": owner.namespace, "labels": labels,
                            "ownerReferences": [owner.reference()]}
    if annotations:
        meta["annotations"] = annotations
    return meta


def service(owner: Owner) -> dict[str, Any]:
    """Headless Service giving each worker pod a stable DNS name."""
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": _meta(owner, service_name(owner.name), job_labels(owner.name)),
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                 "selector": {"ravnest.io/job": owner.name},
                 "ports": [{"name": "grpc", "port": GRPC_PORT, "targetPort": GRPC_PORT},
                           {"name": "metrics", "port": METRICS_PORT, "targetPort": METRICS_PORT}]},
    }


def disruption_budget(owner: Owner, plan: Plan) -> dict[str, Any]:
    """The job's PodDisruptionBudget: voluntary disruptions (a drain's evictions) take its
    worker pods one at a time, and none while one of them is not ready (a pipeline stalls on any
    lost worker: each eviction restarts a cluster, or the job, from what it holds). An eviction is
    a disruption, not a failure: backoffLimit does not count it. minAvailable, a count of the
    plan's workers (a percentage or maxUnavailable needs the pods' owner to have a scale
    subresource: without one the disruption controller counts no pod, and the budget holds
    nothing back)."""
    return {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": _meta(owner, f"{owner.name}-workers", job_labels(owner.name)),
        "spec": {"minAvailable": max(len(plan.nodes) - 1, 0),
                 "selector": {"matchLabels": {JOB_LABEL: owner.name,
                                              "app.kubernetes.io/component": "worker"}}},
    }


def token_secret(owner: Owner, token: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": _meta(owner, token_secret_name(owner.name), job_labels(owner.name)),
        "data": {"token": base64.b64encode(token.encode()).decode()},
    }


def identity_secret(owner: Owner, identity: NodeIdentity) -> dict[str, Any]:
    """A node's identity (`ravnest.comm.identity`), which only that node's pod mounts."""
    return {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": _meta(owner, identity_secret_name(owner.name, identity.node),
                          job_labels(owner.name)),
        "data": {IDENTITY_FILE: base64.b64encode(identity.dumps().encode()).decode()},
    }


def tls_secret(owner: Owner, certificates: dict[str, TlsMaterial]) -> dict[str, Any]:
    """The job CA's certificate and, per node, `<node>.crt` and `<node>.key` (see `pod`)."""
    data = {CA_FILE: next(iter(certificates.values())).ca}
    for node, m in sorted(certificates.items()):
        data.update({f"{node}.crt": m.cert, f"{node}.key": m.key})
    return {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": _meta(owner, tls_secret_name(owner.name), job_labels(owner.name)),
        "data": {k: base64.b64encode(v).decode() for k, v in data.items()},
    }


def network_policy(owner: Owner, ring: bool = False) -> dict[str, Any]:
    """Ingress to the job's workers' gRPC port (and with `ring`, the ring data port) from the
    job's own worker pods only.

    Policies add up: the chart's namespace-wide policy lets the operator and Prometheus reach the
    workers' metrics port. A pod that copies the job's labels still needs the job's token (and,
    with TLS, a certificate from the job's CA).
    """
    workers = {"matchLabels": job_labels(owner.name)}
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": _meta(owner, network_policy_name(owner.name), job_labels(owner.name)),
        "spec": {"podSelector": workers, "policyTypes": ["Ingress"],
                 "ingress": [{"from": [{"podSelector": workers}],
                              "ports": [{"protocol": "TCP", "port": port}
                                        for port in (GRPC_PORT, *([RING_PORT] if ring else []))]}]},
    }


def plan_configmap(owner: Owner, plan: Plan, job: Job, authority: bytes = b"") -> dict[str, Any]:
    """The plan, its table, the job as planned (`job.json`: what the job's pods are made from,
    whatever later edits of the spec say; see `deciding.as_planned`) and the public key of the
    authority that issued its nodes' identities."""
    return {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": _meta(owner, plan_configmap_name(owner.name), job_labels(owner.name),
                          {"ravnest.io/plan": plan.fingerprint}),
        "data": {PLAN_FILE: plan.to_json(), "plan.txt": plan.table() + "\n",
                 PLANNED_JOB: json.dumps(job.to_dict(), sort_keys=True),
                 **({AUTHORITY_KEY: authority.hex()} if authority else {})},
    }


def planner_labels(job: str) -> dict[str, str]:
    return {**job_labels(job), "app.kubernetes.io/component": "planner"}


def planner_configmap(owner: Owner, job: Job) -> dict[str, Any]:
    """The job as the planner pod reads it (`ravnest plan job.json --termination-log`)."""
    return {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": _meta(owner, planner_configmap_name(owner), planner_labels(owner.name)),
        "data": {JOB_FILE: json.dumps(job.to_dict(), sort_keys=True)},
    }


def planner_pod(owner: Owner, job: Job, image: str) -> dict[str, Any]:
    """The pod that plans the job in the job's own image (`spec.image`): the only place the
    model's code is imported and traced before the workers start, and where it checks that the
    job's storage can be written (with the workers' credentials and claims). It has no
    service-account token and the workers' hardening; it hands the plan back as its termination
    message
    (`ravnest.plan.handoff`), and spec.plan.timeoutSeconds bounds how long it may run."""
    plan = job.spec.plan
    container = {"name": "planner", "image": job.spec.image or image,
                 "command": ["ravnest"],
                 "args": ["plan", f"{METADATA_DIR}/{JOB_FILE}", "--termination-log"],
                 "env": _s3_credentials(job),
                 "resources": copy.deepcopy(plan.resources or PLANNER_RESOURCES),
                 "volumeMounts": [{"name": "job", "mountPath": METADATA_DIR, "readOnly": True},
                                  *_claim_mounts(job)]}
    spec = _hardened(container, [{"name": "job",
                                  "configMap": {"name": planner_configmap_name(owner)}},
                                 *_claim_volumes(job)],
                     activeDeadlineSeconds=plan.timeout_seconds)
    return merged({"apiVersion": "v1", "kind": "Pod",
                   "metadata": _meta(owner, planner_name(owner.name), planner_labels(owner.name)),
                   "spec": spec}, job.spec.template, resources=False)


GRACE_SECONDS = 10
"""A job's pods' terminationGracePeriodSeconds unless its template says otherwise."""


def _hardened(container: dict[str, Any], volumes: list[dict[str, Any]],
              **fields: Any) -> dict[str, Any]:
    """The spec of a pod of the job (worker or planner) around its one container: it runs once
    (restartPolicy Never), with no service-account token and no service links, as uid 10001 with
    RuntimeDefault seccomp, a read-only root filesystem, no capabilities, no privilege
    escalation, and an emptyDir at /tmp; `fields` are the pod's own. A worker ends on SIGTERM at
    once (its last checkpoint is on storage), so its grace period is short; the template's
    terminationGracePeriodSeconds, which the operator's deletions honour, may make it longer."""
    return {
        **fields,
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": GRACE_SECONDS,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": copy.deepcopy(POD_SECURITY),
        "containers": [{**container,
                        "securityContext": copy.deepcopy(CONTAINER_SECURITY),
                        "volumeMounts": [*container["volumeMounts"],
                                         {"name": "tmp", "mountPath": "/tmp"}]}],
        "volumes": [*volumes, {"name": "tmp", "emptyDir": {}}],
    }


def node_metadata(owner: Owner, job: Job, plan: Plan, node: str,
                  identity: bool = True) -> dict[str, Any]:
    """What `ravnest worker --metadata` reads (`ravnest.run.metadata.NodeMetadata`); `identity`:
    the pod mounts the node's identity (a spare pod joins no peer, and mounts none)."""
    return NodeMetadata(
        job=job, plan=plan, node=node, addresses={n: address(owner, n) for n in plan.names()},
        output_dir=DATA_DIR, listen=listen_all(GRPC_PORT), metrics_port=METRICS_PORT,
        namespace=owner.namespace, tls_dir=TLS_DIR if job.spec.security.tls else None,
        identity_file=f"{IDENTITY_DIR}/{IDENTITY_FILE}" if identity else None,
        ring_addresses=({n: address(owner, n, RING_PORT) for n in plan.names()}
                        if _tcp_ring(job) else None),
        ring_listen=listen_all(RING_PORT)).to_dict(plan_file=f"{PLAN_DIR}/{PLAN_FILE}",
                                                   job_file=f"{PLAN_DIR}/{PLANNED_JOB}")


def _plan_volume(owner: Owner) -> dict[str, Any]:
    """The plan ConfigMap (its plan and job, as the node metadata names them; no items named:
    a plan ConfigMap an earlier operator made, without the job, mounts as well, and its nodes'
    metadata holds the job itself)."""
    return {"name": PLAN_VOLUME, "configMap": {"name": plan_configmap_name(owner.name)}}


PLAN_MOUNT = {"name": PLAN_VOLUME, "mountPath": PLAN_DIR, "readOnly": True}


def node_configmap(owner: Owner, job: Job, plan: Plan, node: NodePlan) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": _meta(owner, pod_name(owner.name, node.name), node_labels(owner.name, node),
                          {"ravnest.io/plan": plan.fingerprint}),
        "data": {"node.json": json.dumps(node_metadata(owner, job, plan, node.name),
                                         sort_keys=True)},
    }


GPU_RESOURCE = "nvidia.com/gpu"
"""What a cuda provider's pod asks for, one of, unless its `resources` say otherwise."""


def _resources(provider: Provider) -> dict[str, Any]:
    """The provider's `resources` as given; else its ram and compute as requests. A cuda
    provider's ram is its GPU's memory, not the pod's: its pod asks for one GPU and its CPU."""
    if provider.resources is not None:
        return dict(provider.resources)
    cpu = f"{max(1, round(provider.compute * 1000))}m"
    if provider.device != "cpu":
        return {"requests": {"cpu": cpu}, "limits": {GPU_RESOURCE: 1}}
    memory = f"{max(1, round(provider.ram * 1024))}Mi"
    return {"requests": {"memory": memory, "cpu": cpu}, "limits": {"memory": memory}}


WORKER_TERMINATION_MESSAGE = "FallbackToLogsOnError"
"""A worker that fails writes why as its termination message (`ravnest worker`); one that dies
without a word (a segfault, the OOM killer) leaves its log's last lines there instead. The
operator repeats either when it replaces the pod, whose log goes with it."""


def _pod_annotations(plan: Plan, provider: Provider, index: int, attempt: int, recovery: int,
                     drain: str | None) -> dict[str, str]:
    annotations = {"ravnest.io/plan": plan.fingerprint, ATTEMPT_ANNOTATION: str(attempt),
                   PROVIDER_ANNOTATION: str(index)}
    if recovery:
        annotations[RECOVERY_ANNOTATION] = str(recovery)
    if drain:
        annotations[DRAIN_ANNOTATION] = drain
    if provider.bandwidth is not None:
        annotations["ravnest.io/bandwidth-mbps"] = f"{provider.bandwidth:g}"
    return annotations


def pod(owner: Owner, job: Job, plan: Plan, node: NodePlan, image: str,
        attempt: int = 0, final_scrape_seconds: float = 0, recovery: int = 0,
        provider_index: int | None = None, gone: Sequence[str] = (),
        drain: str | None = None) -> dict[str, Any]:
    """The worker pod of one provider. With `final_scrape_seconds` (Prometheus scrapes the
    workers) a finished worker stays up to that long for one scrape of its final metrics.
    `recovery` > 0: the pod of a cluster restarted alone for the recovery-th time in this attempt
    (elastic training), whose worker takes its state from the other clusters and rejoins them
    (`REJOIN_ENV`) instead of resuming from a checkpoint. `provider_index`: the provider whose
    placement (image, resources, nodeSelector, tolerations) the pod takes, when a spare took the
    node's stage over (by default the node's own). `gone`: the nodes of the clusters that drained
    (`GONE_ENV`). `drain`: the drain order of the node's cluster, when it was told to drain before
    the pod was made (`DRAIN_ANNOTATION`, which the operator sets on a running root pod); every
    pod reads its cluster's from a downward-API volume (`DRAIN_DIR_ENV`), only a root acts on it."""
    index = node.provider if provider_index is None else provider_index
    provider = job.spec.expanded_providers()[index]
    annotations = _pod_annotations(plan, provider, index, attempt, recovery, drain)
    container = {
        "name": "worker",
        "image": provider.image or job.spec.image or image,
        "command": ["ravnest"],
        "args": ["worker", "--metadata", f"{METADATA_DIR}/node.json"],
        "terminationMessagePolicy": WORKER_TERMINATION_MESSAGE,
        "env": [{"name": TOKEN_ENV, "valueFrom": {"secretKeyRef": {
                    "name": token_secret_name(owner.name), "key": "token"}}},
                {"name": TORCH_THREADS_ENV, "value": str(max(1, round(provider.compute)))},
                *([{"name": FINAL_SCRAPE_ENV, "value": f"{final_scrape_seconds:g}"}]
                  if final_scrape_seconds > 0 else []),
                *([{"name": REJOIN_ENV, "value": "1"}] if recovery else []),
                *([{"name": GONE_ENV, "value": ",".join(gone)}] if gone else []),
                {"name": DRAIN_DIR_ENV, "value": DRAIN_DIR},
                {"name": DEVICE_ENV, "value": provider.device},
                *_s3_credentials(job)],
        "ports": [{"name": "grpc", "containerPort": GRPC_PORT},
                  {"name": "metrics", "containerPort": METRICS_PORT},
                  *([{"name": "ring", "containerPort": RING_PORT}] if _tcp_ring(job) else [])],
        "readinessProbe": {"grpc": {"port": GRPC_PORT}, "periodSeconds": 2},
        "resources": _resources(provider),
        "volumeMounts": [{"name": "node-metadata", "mountPath": METADATA_DIR, "readOnly": True},
                         dict(PLAN_MOUNT), {"name": "data", "mountPath": DATA_DIR},
                         {"name": "drain", "mountPath": DRAIN_DIR, "readOnly": True},
                         *_claim_mounts(job)],
    }
    spec = _hardened(container, [{"name": "node-metadata",
                                  "configMap": {"name": pod_name(owner.name, node.name)}},
                                 _plan_volume(owner), _data_volume(job), _drain_volume(node),
                                 *_claim_volumes(job)],
                     hostname=dns_label(node.name), subdomain=service_name(owner.name))
    if job.spec.security.tls:
        _mount_tls(spec, owner, node.name)
    _mount_identity(spec, owner, node.name)
    _place(spec, provider)
    return merged({"apiVersion": "v1", "kind": "Pod",
                   "metadata": _meta(owner, pod_name(owner.name, node.name),
                                     node_labels(owner.name, node), annotations),
                   "spec": spec}, job.spec.template)


def _data_volume(job: Job) -> dict[str, Any]:
    """A worker pod's data volume: spec.checkpoint.volume, or an emptyDir."""
    return {"name": "data", **(job.spec.checkpoint.volume or {"emptyDir": {}})}


def _drain_volume(node: NodePlan) -> dict[str, Any]:
    """The pod's drain order as a file, `cluster_<c>`: the pod's `DRAIN_ANNOTATION`, empty
    without one; the kubelet updates it when the annotation is set on the running pod."""
    return {"name": "drain", "downwardAPI": {"items": [{
        "path": f"cluster_{node.cluster}",
        "fieldRef": {"fieldPath": f"metadata.annotations['{DRAIN_ANNOTATION}']"}}]}}


def _place(spec: dict[str, Any], provider: Provider) -> None:
    """Put a pod where its provider is: the provider's nodeSelector and tolerations."""
    if provider.node_selector:
        spec["nodeSelector"] = dict(provider.node_selector)
    if provider.tolerations:
        spec["tolerations"] = list(provider.tolerations)


def spare_configmap_name(job: str) -> str:
    return f"{job}-spare"


def spare_configmap(owner: Owner, job: Job, plan: Plan) -> dict[str, Any]:
    """The metadata the spare pods read: the job and its plan (under the node name `spare`)."""
    return {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": _meta(owner, spare_configmap_name(owner.name), job_labels(owner.name),
                          {"ravnest.io/plan": plan.fingerprint}),
        "data": {"node.json": json.dumps(node_metadata(owner, job, plan, "spare", identity=False),
                                         sort_keys=True)},
    }


def spare_labels(job: str, provider: int) -> dict[str, str]:
    return {**job_labels(job), "app.kubernetes.io/component": "spare",
            SPARE_LABEL: str(provider)}


def spare_pod(owner: Owner, job: Job, plan: Plan, provider_index: int,
              image: str) -> dict[str, Any]:
    """The pod of a hot spare (spec.plan.spares): on its provider's placement, with its resources
    held, it builds the job's model (its image pulled, the job's code run once there) and waits,
    training nothing and serving nothing, until the operator deletes it to place a lost node's
    pod there instead (`ravnest worker --spare`). It gets no token: it joins no peer."""
    provider = job.spec.expanded_providers()[provider_index]
    container = {
        "name": "worker",
        "image": provider.image or job.spec.image or image,
        "command": ["ravnest"],
        "args": ["worker", "--spare", "--metadata", f"{METADATA_DIR}/node.json"],
        "env": [{"name": TORCH_THREADS_ENV, "value": "1"}],
        "resources": _resources(provider),
        "volumeMounts": [{"name": "node-metadata", "mountPath": METADATA_DIR, "readOnly": True},
                         dict(PLAN_MOUNT)],
    }
    spec = _hardened(container, [{"name": "node-metadata",
                                  "configMap": {"name": spare_configmap_name(owner.name)}},
                                 _plan_volume(owner)])
    _place(spec, provider)
    name = pod_name(owner.name, spare_name(provider_index))
    return merged({"apiVersion": "v1", "kind": "Pod",
                   "metadata": _meta(owner, name, spare_labels(owner.name, provider_index),
                                     {"ravnest.io/plan": plan.fingerprint,
                                      PROVIDER_ANNOTATION: str(provider_index)}),
                   "spec": spec}, job.spec.template)


S3_CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
"""The keys of spec.storage.s3.credentialsSecret the workers get as environment variables (the
session token optional); the operator only names the Secret and never reads it."""


def _s3_credentials(job: Job) -> list[dict[str, Any]]:
    secret = job.spec.storage.s3.credentials_secret
    if not secret:
        return []
    return [{"name": key, "valueFrom": {"secretKeyRef": {
                "name": secret, "key": key, **({"optional": True} if i == 2 else {})}}}
            for i, key in enumerate(S3_CREDENTIALS)]


def claims(job: Job) -> list[str]:
    """The PersistentVolumeClaims the job's ``pvc://`` locations name, each mounted once in the
    workers at ``<PVC_ROOT>/<claim>`` (volumes claim-0, claim-1)."""
    spec = job.spec
    named = (pvc_claim(uri) for uri in (spec.checkpoint.path, spec.output.uri) if uri)
    return list(dict.fromkeys(c for c in named if c))


def _claim_mounts(job: Job) -> list[dict[str, Any]]:
    return [{"name": f"claim-{i}", "mountPath": f"{PVC_ROOT}/{claim}"}
            for i, claim in enumerate(claims(job))]


def _claim_volumes(job: Job) -> list[dict[str, Any]]:
    return [{"name": f"claim-{i}", "persistentVolumeClaim": {"claimName": claim}}
            for i, claim in enumerate(claims(job))]


def finisher_name(job: str) -> str:
    """The finishing pod."""
    return f"{job}-finish"


def finisher_labels(job: str) -> dict[str, str]:
    return {**job_labels(job), "app.kubernetes.io/component": "finisher"}


def finisher_pod(owner: Owner, job: Job, plan: Plan, image: str) -> dict[str, Any]:
    """The pod that, once every worker succeeded, fuses the stages they left in spec.output.uri
    and writes the trained model, its curve and summary there (`ravnest finish`), in the job's
    own image: it builds the model from the job's code to name the fused weights. It reads the
    cluster-0 root's node metadata (the job and its plan), reaches the storage as the workers do,
    has no service-account token and the workers' hardening, and hands back where the outputs
    are as its termination message; spec.output.timeoutSeconds bounds it."""
    out = job.spec.output
    container = {"name": "finisher", "image": job.spec.image or image,
                 "command": ["ravnest"],
                 "args": ["finish", "--metadata", f"{METADATA_DIR}/node.json"],
                 "env": _s3_credentials(job),
                 "resources": copy.deepcopy(out.resources or PLANNER_RESOURCES),
                 "volumeMounts": [{"name": "node-metadata", "mountPath": METADATA_DIR,
                                   "readOnly": True}, dict(PLAN_MOUNT), *_claim_mounts(job)]}
    root = plan.clusters[0].nodes[0]
    spec = _hardened(container, [{"name": "node-metadata",
                                  "configMap": {"name": pod_name(owner.name, root)}},
                                 _plan_volume(owner), *_claim_volumes(job)],
                     activeDeadlineSeconds=out.timeout_seconds)
    return merged({"apiVersion": "v1", "kind": "Pod",
                   "metadata": _meta(owner, finisher_name(owner.name),
                                     finisher_labels(owner.name)),
                   "spec": spec}, job.spec.template, resources=False)


def _mount_identity(spec: dict[str, Any], owner: Owner, node: str) -> None:
    """Mount the node's identity (its own Secret) at IDENTITY_DIR, readable by the worker."""
    spec["containers"][0]["volumeMounts"].append(
        {"name": "identity", "mountPath": IDENTITY_DIR, "readOnly": True})
    spec["volumes"].append({"name": "identity", "secret": {
        "secretName": identity_secret_name(owner.name, node), "defaultMode": 0o440}})


def _mount_tls(spec: dict[str, Any], owner: Owner, node: str) -> None:
    """Mount the job CA's certificate and this node's own certificate and key (no other node's)
    at TLS_DIR. The kubelet's gRPC probe speaks no TLS, so readiness becomes the port accepting
    connections (what the health service reports before training starts, too)."""
    container = spec["containers"][0]
    container["volumeMounts"].append({"name": "tls", "mountPath": TLS_DIR, "readOnly": True})
    container["readinessProbe"] = {"tcpSocket": {"port": GRPC_PORT}, "periodSeconds": 2}
    spec["volumes"].append({"name": "tls", "secret": {
        "secretName": tls_secret_name(owner.name), "defaultMode": 0o440,
        "items": [{"key": CA_FILE, "path": CA_FILE},
                  {"key": f"{node}.crt", "path": CERT_FILE},
                  {"key": f"{node}.key", "path": KEY_FILE}]}})


def static_objects(owner: Owner, job: Job, plan: Plan, token: str, authority: Authority,
                   certificates: dict[str, TlsMaterial] | None = None,
                   network_policies: bool = False) -> list[dict[str, Any]]:
    """Everything but the pods, in creation order: Service, PodDisruptionBudget, Secrets (the
    token, each node's identity from `authority`), NetworkPolicy, the spare and node ConfigMaps
    (`remade_objects`), the TLS Secret, and last the plan ConfigMap, whose existence marks the
    job planned (so an operator that died half-way creates the rest again). `certificates`:
    node -> its TLS material, when the job uses TLS."""
    objects = remade_objects(owner, job, plan, token, authority, network_policies)
    if job.spec.security.tls:
        if certificates is None or set(certificates) != set(plan.names()):
            raise ValueError("spec.security.tls needs a certificate for every node of the plan")
        objects.append(tls_secret(owner, certificates))
    return [*objects, plan_configmap(owner, plan, job, authority.public)]


def remade_objects(owner: Owner, job: Job, plan: Plan, token: str, authority: Authority,
                   network_policies: bool = False) -> list[dict[str, Any]]:
    """The objects of `static_objects` a job's pods read that can be made again as they were
    (the token and identities derive from the operator's key): all but the TLS Secret (its CA's
    key is not kept) and the plan ConfigMap (read each pass: it marks the job planned)."""
    return [service(owner), disruption_budget(owner, plan), token_secret(owner, token),
            *(identity_secret(owner, authority.issue(n)) for n in plan.names()),
            *([network_policy(owner, ring=_tcp_ring(job))] if network_policies else []),
            *configmaps(owner, job, plan, authority.public)[:-1]]


def configmaps(owner: Owner, job: Job, plan: Plan, authority: bytes = b"") -> list[dict[str, Any]]:
    """The job's ConfigMaps in creation order: the spares', one per node, and last the plan's."""
    return [*([spare_configmap(owner, job, plan)] if plan.spares else []),
            *(node_configmap(owner, job, plan, n) for n in plan.nodes),
            plan_configmap(owner, plan, job, authority)]


CONFIGMAP_BYTES = (1 << 20) - (16 << 10)
"""What one ConfigMap's data may hold: the apiserver refuses more than 1 MiB (a margin kept for
the authority key and the object's metadata)."""


def oversized(owner: Owner, job: Job, plan: Plan) -> str | None:
    """Why the job's ConfigMaps cannot be stored (None: they can), checked before any is made:
    a plan too large to store would leave those made before it and the job stuck planning."""
    for cm in configmaps(owner, job, plan):
        size = sum(len(k) + len(v.encode()) for k, v in cm["data"].items())
        if size > CONFIGMAP_BYTES:
            return (f"ConfigMap {cm['metadata']['name']} would hold {size} bytes, more than the "
                    f"{CONFIGMAP_BYTES} a ConfigMap may")
    return None


def pods(owner: Owner, job: Job, plan: Plan, image: str, attempt: int = 0,
         final_scrape_seconds: float = 0) -> list[dict[str, Any]]:
    return [pod(owner, job, plan, n, image, attempt, final_scrape_seconds) for n in plan.nodes]
