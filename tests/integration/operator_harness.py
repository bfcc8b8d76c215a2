"""What the operator tiers share: `kopf run` of the operator as a restartable subprocess, kubectl
against the test apiserver, and waiting with the jobs table and the operator's log on timeout."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml
from kube import LocalApiserver, free_port, local_apiserver, stop_process
from kubelet import FakeKubelet

ROOT = Path(__file__).resolve().parents[2]


class Operator:
    """`kopf run` of ravnest_operator as a subprocess, restartable."""

    def __init__(self, kube: LocalApiserver, workdir: Path,
                 env: dict[str, str] | None = None) -> None:
        self.kube = kube
        self.env = env or {}
        self.log = workdir / "operator.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.metrics_port = free_port()
        self.liveness_port = free_port()
        self.kubelet_errors: list[str] = []

    def start(self) -> None:
        env = {**os.environ, "KUBECONFIG": str(self.kube.kubeconfig),
               "RAVNEST_RECONCILE_INTERVAL": "1",
               # per-job NetworkPolicies, as the chart's networkPolicy.enabled asks: the real
               # apiserver validates them (no network plugin here enforces them)
               "RAVNEST_NETWORK_POLICIES": "true",
               "RAVNEST_OPERATOR_METRICS_PORT": str(self.metrics_port), **self.env}
        with open(self.log, "ab") as fh:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kopf", "run", "--standalone", "--namespace", "default",
                 f"--liveness=http://127.0.0.1:{self.liveness_port}/healthz",
                 "-m", "ravnest_operator.handling"],
                stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def stop(self, kill: bool = False) -> None:
        if self.proc:
            stop_process(self.proc, 15, kill=kill)

    def running(self) -> bool:
        """Whether its `kopf run` was started and has not ended."""
        return self.proc is not None and self.proc.poll() is None


def kctl(kube: LocalApiserver, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """kubectl against the test apiserver, returning the whole result."""
    result = subprocess.run(["kubectl", "--kubeconfig", str(kube.kubeconfig), *args],
                            capture_output=True, text=True, timeout=120)
    if check and result.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)}: {result.stderr}")
    return result


def get(kube: LocalApiserver, kind: str, name: str = "", selector: str = "") -> Any:
    args = ["get", kind, "-o", "json"]
    if name:
        args.insert(2, name)
    if selector:
        args += ["-l", selector]
    out = kctl(kube, *args, check=False)
    if out.returncode != 0:
        return None
    return json.loads(out.stdout)


def wait_for(what: str, check: Callable[[], Any], timeout: float, kube: LocalApiserver,
             operator: Operator) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.5)
    jobs = kctl(kube, "get", "rj", "-o", "wide", check=False).stdout
    raise AssertionError(f"timed out waiting for {what}\njobs:\n{jobs}\nkubelet errors: "
                         f"{operator.kubelet_errors[-5:]}\noperator log:\n"
                         f"{operator.log.read_text()[-4000:]}")


def job_doc(name: str, epochs: int = 3, **changes: Any) -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "examples" / "digits.yaml").read_text())
    doc["metadata"]["name"] = name
    doc["spec"]["training"]["epochs"] = epochs
    for path, value in changes.items():
        node = doc["spec"]
        *parents, last = path.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return doc


def apply(kube: LocalApiserver, doc: dict[str, Any], tmp_path: Path) -> subprocess.CompletedProcess:
    f = tmp_path / f"{doc['metadata']['name']}.yaml"
    f.write_text(yaml.safe_dump(doc))
    return kctl(kube, "apply", "-f", str(f), check=False)


def phase_of(kube: LocalApiserver, name: str) -> str | None:
    rj = get(kube, "rj", name)
    return (rj or {}).get("status", {}).get("phase")


@contextlib.contextmanager
def operator_cluster(work: Path, env: dict[str, str] | None = None
                     ) -> Iterator[tuple[LocalApiserver, FakeKubelet, Operator]]:
    """etcd + kube-apiserver + kube-controller-manager with the CRD installed, the harness kubelet
    and the operator (with `env` added to its environment), all stopped on exit."""
    with local_apiserver(work / "kube", controller_manager=True) as kube:
        kctl(kube, "apply", "-f", str(ROOT / "crds" / "ravnestjob.yaml"))
        kctl(kube, "wait", "--for=condition=Established", "crd/ravnestjobs.ravnest.io",
             "--timeout=60s")
        kubelet = FakeKubelet(str(kube.kubeconfig), work / "kubelet")
        kubelet.start()
        operator = Operator(kube, work, env)
        operator.kubelet_errors = kubelet.errors
        operator.start()
        try:
            yield kube, kubelet, operator
        finally:
            operator.stop()
            kubelet.stop()


@contextlib.contextmanager
def module_cluster(stack: tuple[LocalApiserver, FakeKubelet, Operator]
                   ) -> Iterator[tuple[LocalApiserver, FakeKubelet, Operator]]:
    """The session's operator stack (conftest's `operator_stack`) for one test module, with the
    operator running (a module before may have killed it); when the module is done, its jobs are
    deleted and waited for, with their pods and the objects they own, so that the next module
    starts with none of them."""
    kube, _kubelet, operator = stack
    if not operator.running():
        operator.start()
    try:
        yield stack
    finally:
        if not operator.running():
            operator.start()  # (it removes the jobs' finalizers)
        kctl(kube, "delete", "rj", "--all", "--wait=true", "--timeout=180s", check=False)
        wait_for("the module's jobs and pods gone", lambda: not (get(kube, "rj") or {}).get(
            "items") and not (get(kube, "pods") or {}).get("items"), 180, kube, operator)
