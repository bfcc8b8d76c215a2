"""A small stand-in for the kubelet (and cluster DNS) for the operator's integration tier.

It watches the job pods the operator creates in a real kube-apiserver, runs one real
`ravnest worker` process per pod (forked by a fork server, `ravnest.run.spawning`, as the local
runner's workers are) from the pod's own spec (its ConfigMap volume, its Secret env
and Secret volumes), and writes pod phase, IP and exit code back through the API, as a kubelet
would; a pod's downward-API volumes are files kept up to date with its annotations, as the
kubelet refreshes them (a drain order). Each pod gets its own loopback address (127.1.x.y),
which also plays the headless Service's DNS: the worker's peer addresses are rewritten from DNS
names to those addresses. The job's data volume is a folder per job and claim when it is a
persistentVolumeClaim (shared, as a ReadWriteMany volume would be), and the pod's own when it is
an emptyDir (gone with the pod); the claims of ``pvc://`` locations are folders per namespace and
claim. Planner and finishing pods run `ravnest plan` / `ravnest finish` the same way.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import kubernetes
from kubernetes.client.rest import ApiException

from ravnest.run import spawning
from ravnest.run.metadata import NodeMetadata
from ravnest.storing import PVC_ROOT_ENV
from ravnest.termination import TERMINATION_LOG_ENV
from ravnest_operator.resources import JOB_FILE, METADATA_DIR, dns_label

MAX_PLANNERS = 2
Process = subprocess.Popen[bytes] | spawning.Forked


@dataclass
class _Running:
    pod: str
    namespace: str
    uid: str
    proc: Process
    termination: Path
    downward: dict[Path, Any]
    """A downward-API volume's folder -> its items."""


class FakeKubelet(threading.Thread):
    def __init__(self, kubeconfig: str, workdir: Path, namespace: str = "default") -> None:
        super().__init__(daemon=True, name="fake-kubelet")
        client = kubernetes.config.new_client_from_config(config_file=kubeconfig)
        self.api = kubernetes.client.CoreV1Api(client)
        self.workdir = workdir
        self.namespace = namespace
        self.running: dict[str, _Running] = {}
        self.started: list[str] = []
        self._halt = threading.Event()
        self._jobs: dict[str, int] = {}
        self.errors: list[str] = []
        self.held: set[str] = set()
        """Pods whose next container is slow to come up (`hold`)."""
        self.spawner: spawning.Spawner | None = None

    # ------------------------------------------------------------------ addresses ("DNS")
    def ip(self, job: str, node: str) -> str:
        j = self._jobs.setdefault(job, len(self._jobs) + 1)
        return f"127.1.{j}.{10 + int(node.rsplit('-', 1)[1])}"

    def kill(self, pod: str, sig: int = signal.SIGKILL) -> None:
        """Kill a worker process (a crashed container)."""
        r = self.running[pod]
        os.killpg(r.proc.pid, sig)

    def hold(self, *pods: str) -> None:
        """The next container of each of `pods` runs, but its process is stopped as soon as it
        starts (SIGSTOP), as a container still importing from a big image seems to its peers."""
        self.held.update(pods)

    # ------------------------------------------------------------------ loop
    def run(self) -> None:
        while not self._halt.is_set():
            try:
                self._tick()
            except Exception as e:  # keep playing the kubelet; the test reads .errors
                self.errors.append(repr(e))
            time.sleep(0.3)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=10)
        for r in list(self.running.values()):
            if r.proc.poll() is None:
                os.killpg(r.proc.pid, signal.SIGKILL)
                r.proc.wait()
        if self.spawner is not None:
            self.spawner.close()

    def _tick(self) -> None:
        pods = self.api.list_namespaced_pod(
            self.namespace, label_selector="app.kubernetes.io/managed-by=ravnest-operator").items
        live = {p.metadata.name: p for p in pods}
        for name, r in list(self.running.items()):
            p = live.get(name)
            if p is None or p.metadata.uid != r.uid or p.metadata.deletion_timestamp:
                if r.proc.poll() is None:
                    os.killpg(r.proc.pid, signal.SIGTERM)
                    try:
                        r.proc.wait(5)
                    except subprocess.TimeoutExpired:
                        os.killpg(r.proc.pid, signal.SIGKILL)
                        r.proc.wait()
                del self.running[name]
                if p is not None and p.metadata.deletion_timestamp:
                    self._finalize_delete(p)
                continue
            code = r.proc.poll()
            if code is not None and (p.status.phase or "Pending") == "Running":
                self._terminated(p, code, r)
            for folder, items in r.downward.items():
                _project(p, folder, items)
        for name, p in live.items():
            if p.metadata.deletion_timestamp:
                if name not in self.running:
                    self._finalize_delete(p)
                continue
            if name not in self.running and (p.status.phase or "Pending") == "Pending" \
                    and self._room_for(p):
                self._start(p)

    def _room_for(self, p: Any) -> bool:
        """At most MAX_PLANNERS planner pods run at once; the others wait, Pending, as a
        scheduler would keep them for their CPU requests (each plans a model with torch)."""
        if p.metadata.labels.get("app.kubernetes.io/component") != "planner":
            return True
        busy = sum(1 for r in self.running.values()
                   if r.pod.endswith("-planner") and r.proc.poll() is None)
        return busy < MAX_PLANNERS

    def _finalize_delete(self, p: Any) -> None:
        try:
            self.api.delete_namespaced_pod(p.metadata.name, p.metadata.namespace,
                                           grace_period_seconds=0)
        except ApiException as e:
            if e.status != 404:
                raise

    def _start(self, p: Any) -> None:
        job = p.metadata.labels["ravnest.io/job"]
        container = p.spec.containers[0]
        pod_dir = self.workdir / "pods" / p.metadata.name / p.metadata.uid
        pod_dir.mkdir(parents=True, exist_ok=True)
        component = p.metadata.labels.get("app.kubernetes.io/component")
        if component == "planner":
            ip, mounted = self._planner_files(p, pod_dir)
        elif component in ("finisher", "spare"):
            ip, mounted = self._finisher_files(p, pod_dir), "node.json"
        else:
            ip, mounted = self._worker_files(p, job, pod_dir), "node.json"
        # claims of pvc:// locations: one folder per namespace and claim, as a claim is
        claims = self.workdir / p.metadata.namespace / "claims"
        env = {**os.environ, TERMINATION_LOG_ENV: str(pod_dir / "termination-log"),
               PVC_ROOT_ENV: str(claims)}
        downward = self._downward_volumes(p, pod_dir)
        mounts = {m.mount_path: pod_dir / m.name for m in container.volume_mounts or []
                  if pod_dir / m.name in downward}
        for e in container.env or []:
            if e.value_from and e.value_from.secret_key_ref:
                ref = e.value_from.secret_key_ref
                secret = self.api.read_namespaced_secret(ref.name, p.metadata.namespace)
                if ref.key in (secret.data or {}) or not ref.optional:
                    env[e.name] = base64.b64decode(secret.data[ref.key]).decode()
            elif e.value is not None:
                env[e.name] = str(mounts.get(e.value, e.value))
        args = [a.replace(f"{METADATA_DIR}/{mounted}", str(pod_dir / mounted))
                for a in container.args]
        proc = self._process(args, env, pod_dir / "worker.log")
        if p.metadata.name in self.held:
            self.held.discard(p.metadata.name)
            os.killpg(proc.pid, signal.SIGSTOP)
        self.running[p.metadata.name] = _Running(p.metadata.name, p.metadata.namespace,
                                                 p.metadata.uid, proc,
                                                 pod_dir / "termination-log", downward)
        self.started.append(p.metadata.name)
        self._patch_status(p, {
            "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
            "startTime": _now(),
            "conditions": [{"type": "Ready", "status": "True"}],
            "containerStatuses": [{"name": container.name, "image": container.image,
                                   "imageID": "", "ready": True, "restartCount": 0,
                                   "started": True,
                                   "state": {"running": {"startedAt": _now()}}}]})

    def _process(self, args: list[str], env: dict[str, str], log: Path) -> Process:
        """`ravnest <args>` in a session of its own, its output in `log`: forked by the fork
        server as the local runner's workers are (torch imported once), unless `env` changes what
        a process reads as it starts."""
        argv = [sys.executable, "-m", "ravnest", *args]
        if self.spawner is None:
            self.spawner = spawning.Spawner()
        with open(log, "ab") as out:
            if self.spawner.forks(env):
                return self.spawner.spawn(args, env, out.fileno(), title=argv)
            return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env, start_new_session=True)

    def _worker_files(self, p: Any, job: str, pod_dir: Path) -> str:
        """A worker pod's node metadata, rewritten for this host: its IP."""
        container = p.spec.containers[0]
        meta = self._metadata_of(p)
        ip = self.ip(job, p.spec.hostname)
        # the gRPC addresses, and the ring data plane's (training.ringTransport: tcp)
        meta = meta.rehosted({n: self.ip(job, dns_label(n)) for n in meta.addresses}, ip)
        data = self._data_volume(p, job, pod_dir)
        data.mkdir(parents=True, exist_ok=True)
        meta = replace(meta, output_dir=str(data))
        mounts = {m.name: m.mount_path for m in container.volume_mounts or []}
        for v in p.spec.volumes:
            if v.secret and v.name in mounts:  # a Secret volume: its items as files
                folder = self._secret_volume(v.secret, p.metadata.namespace, pod_dir / v.name)
                if meta.tls_dir == mounts[v.name]:
                    meta = replace(meta, tls_dir=str(folder))
                if meta.identity_file and Path(meta.identity_file).parent == Path(mounts[v.name]):
                    meta = replace(meta, identity_file=str(folder / Path(meta.identity_file).name))
        meta.save(pod_dir / "node.json")
        return ip

    def _finisher_files(self, p: Any, pod_dir: Path) -> str:
        """A finishing pod's node metadata (the cluster-0 root's, from its ConfigMap), or a spare
        pod's, with an output folder of its own; it serves nothing, so it needs no address of its
        own."""
        meta = self._metadata_of(p)
        (pod_dir / "data").mkdir(exist_ok=True)
        replace(meta, output_dir=str(pod_dir / "data")).save(pod_dir / "node.json")
        return "127.0.0.1"

    def _downward_volumes(self, p: Any, pod_dir: Path) -> dict[Path, Any]:
        """The pod's downward-API volumes, as folders in `pod_dir` (by volume name), written."""
        out = {}
        for v in p.spec.volumes or []:
            if v.downward_api:
                folder = pod_dir / v.name
                folder.mkdir(exist_ok=True)
                _project(p, folder, v.downward_api.items or [])
                out[folder] = v.downward_api.items or []
        return out

    def _configmap_of(self, p: Any) -> dict[str, str]:
        """The data of the ConfigMap the pod mounts (its node metadata, or a planner's job)."""
        name = next(v.config_map.name for v in p.spec.volumes if v.config_map)
        return dict(self.api.read_namespaced_config_map(name, p.metadata.namespace).data)

    def _metadata_of(self, p: Any) -> NodeMetadata:
        """A pod's node metadata, its plan and job read from the ConfigMaps the pod mounts where
        the metadata names them (the plan ConfigMap's, at its mount path), as in a real pod."""
        mounts = {m.mount_path: m.name for m in p.spec.containers[0].volume_mounts or []}
        volumes = {v.name: v.config_map.name for v in p.spec.volumes if v.config_map}

        def read(path: str) -> str:
            folder, key = path.rsplit("/", 1)
            data = self.api.read_namespaced_config_map(volumes[mounts[folder]],
                                                       p.metadata.namespace).data
            return str(data[key])

        return NodeMetadata.from_dict(json.loads(self._configmap_of(p)["node.json"]), read=read)

    def _data_volume(self, p: Any, job: str, pod_dir: Path) -> Path:
        """The folder behind the pod's data volume: a claim's is one per job and claim, shared by
        its pods as a ReadWriteMany volume would be and kept across restarts; an emptyDir is the
        pod's own and goes with it."""
        (volume,) = [v for v in p.spec.volumes if v.name == "data"]
        claim = volume.persistent_volume_claim
        if claim is not None:
            return self.workdir / p.metadata.namespace / job / claim.claim_name
        return pod_dir / "data"

    def _planner_files(self, p: Any, pod_dir: Path) -> tuple[str, str]:
        """A planner pod's job file, from its ConfigMap volume; it gets no address of its own."""
        (pod_dir / JOB_FILE).write_text(self._configmap_of(p)[JOB_FILE])
        return "127.0.0.1", JOB_FILE

    def _secret_volume(self, source: Any, namespace: str, folder: Path) -> Path:
        secret = self.api.read_namespaced_secret(source.secret_name, namespace)
        folder.mkdir(exist_ok=True)
        for item in source.items or [kubernetes.client.V1KeyToPath(key=k, path=k)
                                     for k in secret.data]:
            fd = os.open(folder / item.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(base64.b64decode(secret.data[item.key]))
        return folder

    def _terminated(self, p: Any, code: int, r: _Running) -> None:
        # the kubelet keeps the first 4096 bytes of a termination message
        message = r.termination.read_bytes()[:4096].decode(errors="replace") \
            if r.termination.exists() else ""
        term = {"exitCode": code if code >= 0 else 128 - code,
                "reason": "Completed" if code == 0 else "Error",
                "startedAt": _now(), "finishedAt": _now()}
        if message:
            term["message"] = message
        self._patch_status(p, {
            "phase": "Succeeded" if code == 0 else "Failed",
            "conditions": [{"type": "Ready", "status": "False"}],
            "containerStatuses": [{"name": p.spec.containers[0].name,
                                   "image": p.spec.containers[0].image, "imageID": "",
                                   "ready": False, "restartCount": 0,
                                   "state": {"terminated": term}}]})

    def _patch_status(self, p: Any, status: dict[str, Any]) -> None:
        """Set these fields of the pod's status, if it is still the pod `p` (a JSON patch whose
        first operation tests its uid): the operator may have deleted it meanwhile and created
        another of the same name, which must not be given this one's end (a real kubelet
        reports by uid). A pod of that name that is another one is left alone."""
        try:
            if "conditions" in status:  # (set by type, as a kubelet does: DisruptionTarget kept)
                now = self.api.read_namespaced_pod(p.metadata.name, p.metadata.namespace)
                setting = {c["type"] for c in status["conditions"]}
                status = {**status, "conditions": [
                    *(self.api.api_client.sanitize_for_serialization(c)
                      for c in now.status.conditions or [] if c.type not in setting),
                    *status["conditions"]]}
            ops = [{"op": "test", "path": "/metadata/uid", "value": p.metadata.uid},
                   *({"op": "add", "path": f"/status/{k}", "value": v}
                     for k, v in status.items())]
            self.api.patch_namespaced_pod_status(p.metadata.name, p.metadata.namespace, ops,
                                                 _content_type="application/json-patch+json")
        except ApiException as e:
            if e.status not in (404, 409, 422):
                raise

    def log_of(self, pod: str) -> str:
        logs = sorted((self.workdir / "pods" / pod).glob("*/worker.log"))
        return "".join(p.read_text(errors="replace") for p in logs)


def _project(p: Any, folder: Path, items: Any) -> None:
    """Write a downward-API volume's files from the pod's metadata (annotations and labels; a
    missing key: an empty file), each replaced at once when it changed, as the kubelet does."""
    fields = {"annotations": p.metadata.annotations or {}, "labels": p.metadata.labels or {}}
    for item in items:
        path = item.field_ref.field_path
        kind, _, key = path.partition("[")
        value = fields[kind.removeprefix("metadata.")].get(key.strip("]'\"")) if key else None
        target = folder / item.path
        text = value if value is not None else ""
        if target.exists() and target.read_text() == text:
            continue
        tmp = folder / f"..{item.path}.tmp"
        tmp.write_text(text)
        tmp.replace(target)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
