"""Helpers of the cluster tier (see conftest.py for which cluster it uses): a kubeconfig,
kubectl and helm, waits with diagnostics, and the image in the local Docker Engine."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import project_image
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
TOOLS = Path(os.environ.get("RAVNEST_TOOLS") or Path.home() / ".cache" / "ravnest-tools")
BIN = TOOLS / "bin"
IMAGE = os.environ.get("RAVNEST_E2E_IMAGE", "ravnest-k8s:test")
BYO_IMAGE = os.environ.get("RAVNEST_E2E_BYO_IMAGE", "ravnest-byo:test")
"""A user's image FROM ours with their own model package (tests/e2e/byo)."""
MINIO_IMAGE = os.environ.get("RAVNEST_E2E_MINIO_IMAGE", "ravnest-minio:test")
"""MinIO's binary alone (tests/e2e/minio): the S3-compatible store the jobs write to."""
RELEASE = "ravnest"
SYSTEM_NS = "ravnest-e2e-system"
JOBS_NS = "ravnest-e2e"
TIMINGS: dict[str, float] = {}


def tool(name: str) -> str:
    """The cached build of `name` (scripts/k8s-tools), else the one on PATH."""
    cached = BIN / name
    if cached.is_file() and os.access(cached, os.X_OK):
        return str(cached)
    found = shutil.which(name)
    if not found:
        pytest.fail(f"`{name}` is neither in {BIN} nor on PATH: run scripts/k8s-tools --kind")
    return found


@dataclass
class Cluster:
    """A kubeconfig and the CLIs that talk to it."""

    kubeconfig: str
    hostpath: str = "/tmp"
    """A node folder for hostPath volumes that every node mounts (one node: any folder)."""
    nodes: list[str] = field(default_factory=list)
    """The node containers of a kind cluster made here, whose kubelet logs go in diagnostics."""
    env: dict[str, str] = field(default_factory=dict)

    def run(self, argv: list[str], *, check: bool = True, timeout: float = 120,
            stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                                input=stdin, env={**os.environ, **self.env,
                                                  "KUBECONFIG": self.kubeconfig})
        if check and result.returncode != 0:
            pytest.fail(f"`{' '.join(argv)}` exited {result.returncode}:\n"
                        f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        return result

    def kubectl(self, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return self.run([tool("kubectl"), *args], **kwargs)

    def helm(self, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return self.run([tool("helm"), *args], **kwargs)

    def get(self, kind: str, name: str | None = None, *, namespace: str = JOBS_NS,
            selector: str | None = None) -> Any:
        args = ["get", kind, "-n", namespace, "-o", "json"]
        if name:
            args.insert(2, name)
        if selector:
            args += ["-l", selector]
        result = self.kubectl(*args, check=False)
        if result.returncode != 0:
            if "NotFound" in result.stderr:
                return None
            pytest.fail(f"kubectl {' '.join(args)}: {result.stderr[-2000:]}")
        return json.loads(result.stdout)

    def apply(self, doc: dict[str, Any], namespace: str = JOBS_NS) -> None:
        self.kubectl("apply", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(doc))

    def diagnostics(self, namespace: str = JOBS_NS) -> str:
        """What to print when a wait fails: nodes, pods, events, the operator's log tail."""
        parts = []
        for args in (["get", "nodes", "-o", "wide"],
                     ["describe", "nodes"],
                     ["get", "rj,pods", "-n", namespace, "-o", "wide"],
                     ["describe", "pods", "-n", namespace],
                     ["get", "events", "-n", namespace, "--sort-by=.lastTimestamp"],
                     ["logs", "-n", SYSTEM_NS, "deploy/ravnest", "--tail=40"]):
            r = self.kubectl(*args, check=False)
            parts.append(f"$ kubectl {' '.join(args)}\n{r.stdout[-4000:]}{r.stderr[-1000:]}")
        for node in self.nodes:
            for unit in ("kubelet", "containerd"):
                r = project_image.docker("exec", node, "journalctl", "-u", unit, "-n", "25",
                                         "--no-pager", check=False, timeout=60)
                parts.append(f"--- {node}: journalctl -u {unit} (tail)\n{r.stdout}{r.stderr}")
        return "\n".join(parts)

    def job_report(self, name: str, namespace: str = JOBS_NS) -> str:
        """What to print when a job's test fails, before its pods are deleted: the job's status
        and events, the operator's log, and each of its pods' logs (and their containers' last
        run, where one restarted). The diagnostics above are about nodes and scheduling."""
        parts = []
        for args in (["get", "rj", name, "-n", namespace, "-o", "yaml"],
                     ["get", "pods", "-n", namespace, "-o", "wide"],
                     ["get", "events", "-n", namespace, "--sort-by=.lastTimestamp"],
                     ["logs", "-n", SYSTEM_NS, "deploy/ravnest", "--tail=300"]):
            r = self.kubectl(*args, check=False)
            parts.append(f"$ kubectl {' '.join(args)}\n{r.stdout[-20000:]}{r.stderr[-1000:]}")
        pods = self.get("pods", namespace=namespace, selector=f"ravnest.io/job={name}") or {}
        for pod in pods.get("items", []):
            pod_name = pod["metadata"]["name"]
            for previous in ([], ["--previous"]):
                r = self.kubectl("logs", "-n", namespace, pod_name, "--tail=150", *previous,
                                 check=False)
                if r.stdout or not previous:
                    parts.append(f"--- {pod_name} {' '.join(previous)}\n"
                                 f"{r.stdout}{r.stderr[-500:]}")
        return "\n".join(parts)

    def wait_for(self, what: str, predicate: Callable[[], Any], timeout: float,
                 namespace: str = JOBS_NS, interval: float = 2) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n"
                            + self.diagnostics(namespace))
            time.sleep(interval)


def ensure_docker_image(log_dir: Path) -> None:
    """The image in the local Docker Engine: the image tier's build of these sources, made here
    when that tier did not run first (tests/project_image.py)."""
    if IMAGE != project_image.IMAGE:
        project_image.check_engine()
        if project_image.image_id(IMAGE) is None:
            pytest.fail(f"{IMAGE} is not in the Docker Engine (only {project_image.IMAGE} is "
                        "built here)")
        return
    project_image.ensure_image(log_dir)


def build_test_images() -> None:
    """The images the tests run besides ours, built offline (`docker build --network none`) in the
    local Docker Engine: the user image of tests/e2e/byo, FROM ours with a model package of its
    own, and MinIO's binary (scripts/k8s-tools' build) alone in an image FROM scratch, the S3 store
    the jobs write to. A cluster given by kubeconfig must have them already (scripts/kind-e2e
    builds and loads them)."""
    _build(BYO_IMAGE, ROOT / "tests" / "e2e" / "byo", "--build-arg", f"RAVNEST_IMAGE={IMAGE}")
    project_image.prune_replaced()
    binary = BIN / "minio"
    if not binary.is_file():
        pytest.fail(f"no MinIO binary at {binary}: run scripts/k8s-tools")
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy2(binary.resolve(), Path(tmp) / "minio")
        shutil.copy2(ROOT / "tests" / "e2e" / "minio" / "Dockerfile", Path(tmp) / "Dockerfile")
        _build(MINIO_IMAGE, Path(tmp))


def _build(image: str, context: Path, *args: str) -> None:
    project_image.docker("build", "--network", "none", "-q", "-t", image, *args, str(context),
                         timeout=900)


def minio_objects(user: str, password: str) -> list[dict[str, Any]]:
    """A MinIO server in JOBS_NS (Service `minio`, port 9000) on an emptyDir, hardened as the
    job's pods are, and the Secret with its credentials under the names the jobs read."""
    labels = {"app.kubernetes.io/name": "minio"}
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s3-credentials"},
              "stringData": {"AWS_ACCESS_KEY_ID": user, "AWS_SECRET_ACCESS_KEY": password}}
    env = [{"name": "MINIO_ROOT_USER", "valueFrom": {"secretKeyRef": {
                "name": "s3-credentials", "key": "AWS_ACCESS_KEY_ID"}}},
           {"name": "MINIO_ROOT_PASSWORD", "valueFrom": {"secretKeyRef": {
                "name": "s3-credentials", "key": "AWS_SECRET_ACCESS_KEY"}}},
           {"name": "MINIO_BROWSER", "value": "off"}]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "minio", "labels": labels},
           "spec": {"securityContext": {"runAsNonRoot": True, "runAsUser": 10001,
                                        "fsGroup": 10001,
                                        "seccompProfile": {"type": "RuntimeDefault"}},
                    "automountServiceAccountToken": False,
                    "containers": [{
                        "name": "minio", "image": MINIO_IMAGE, "env": env,
                        "args": ["server", "/data", "--address", ":9000", "--certs-dir",
                                 "/data/.certs"],
                        "ports": [{"containerPort": 9000}],
                        "readinessProbe": {"httpGet": {"path": "/minio/health/ready",
                                                       "port": 9000}, "periodSeconds": 2},
                        "securityContext": {"allowPrivilegeEscalation": False,
                                            "readOnlyRootFilesystem": True,
                                            "capabilities": {"drop": ["ALL"]}},
                        "volumeMounts": [{"name": "data", "mountPath": "/data"}]}],
                    "volumes": [{"name": "data", "emptyDir": {}}]}}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "minio"},
               "spec": {"selector": labels, "ports": [{"port": 9000, "targetPort": 9000}]}}
    return [secret, pod, service]


def run_pod(cluster: Cluster, name: str, image: str, script: str,
            env: list[dict[str, Any]], timeout: float = 300) -> str:
    """Run `python -c script` once in a pod of `image` in JOBS_NS; its log, or a failed test
    with the log when it fails."""
    cluster.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
                   "spec": {"restartPolicy": "Never", "automountServiceAccountToken": False,
                            "securityContext": {"runAsNonRoot": True,
                                                "seccompProfile": {"type": "RuntimeDefault"}},
                            "containers": [{
                                "name": "main", "image": image, "env": env,
                                "command": ["python", "-c", script],
                                "securityContext": {"allowPrivilegeEscalation": False,
                                                    "capabilities": {"drop": ["ALL"]}}}]}})

    def done() -> str | None:
        phase = ((cluster.get("pod", name) or {}).get("status") or {}).get("phase")
        return phase if phase in ("Succeeded", "Failed") else None

    phase = cluster.wait_for(f"pod {name} to finish", done, timeout)
    log = cluster.kubectl("logs", "-n", JOBS_NS, name, check=False).stdout
    if phase != "Succeeded":
        pytest.fail(f"pod {name} failed:\n{log[-3000:]}")
    return log
