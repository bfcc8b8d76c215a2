"""The Helm chart (charts/ravnest) with the real Helm CLI and a real kube-apiserver.

helm lint and helm template in three configurations (defaults; every optional feature on; that
with the operator restricted to two namespaces), a server-side dry run of every rendered object, a
real install/upgrade/uninstall, the CRD kept equal to crds/ravnestjob.yaml, RBAC derived from the
operator's code (deriving_rbac.py) and compared both ways with what the chart grants (then proven
live: the real operator and the helm-test script run with the chart's ServiceAccounts under RBAC),
the values schema, and dashboards and alerts that only query metrics the code registers.

The ServiceMonitor, PodMonitor and PrometheusRule need the prometheus-operator's CRDs: minimal ones
are vendored in tests/integration/prometheus_operator_crds.yaml (see its header).

Fails (does not skip) when helm, etcd or kube-apiserver is missing: build them with
scripts/k8s-tools.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from deriving_rbac import (
    ADMISSION_NEEDS,
    CLUSTER_SCOPED,
    KOPF_NAMESPACE_NEEDS,
    KOPF_NEEDS,
    LEADER_NEEDS,
    PUBLIC_URLS,
    api_permissions,
    diff,
    granted,
    operator_needs,
)
from kube import (
    LocalApiserver,
    MissingBinary,
    find_binary,
    free_port,
    local_apiserver,
    stop_process,
)
from prometheus_client.metrics import MetricWrapperBase

from ravnest import __version__, podsecurity
from ravnest.spec import parse_job
from ravnest.train.metrics import Identity, WorkerMetrics
from ravnest_operator import monitoring
from ravnest_operator.settings import Settings

pytestmark = pytest.mark.tools  # (scripts/test runs it once the tools are there)

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "ravnest"
MONITORING_CRDS = Path(__file__).resolve().parent / "prometheus_operator_crds.yaml"
RELEASE, NAMESPACE = "rel", "ravnest-system"
WATCHED = ("team-a", "team-b")

ALL_ON = ["--set", "metrics.serviceMonitor.enabled=true",
          "--set", "metrics.podMonitor.enabled=true",
          "--set", "metrics.prometheusRule.enabled=true",
          "--set", "networkPolicy.enabled=true",
          "--set", "dashboards.annotations.grafana_folder=Ravnest",
          "--set-json", 'templatePolicy.allow={"team-a": ["initContainers"], "*": ["hostPath"]}']
NAMESPACED = ["--set", f"operator.watchNamespaces={{{','.join(WATCHED)}}}"]
CONFIGS = {"defaults": [], "all-on": ALL_ON, "namespaced": [*ALL_ON, *NAMESPACED]}


# --- tools -----------------------------------------------------------------------------------

def _binary(name: str) -> str:
    """The binary, or the calling test fails (not skips) saying how to build it."""
    try:
        return find_binary(name)
    except MissingBinary as e:
        message = str(e)
    pytest.fail(message, pytrace=False)


def run_helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([_binary("helm"), *args], capture_output=True, text=True, timeout=120)
    if check and proc.returncode != 0:
        pytest.fail(f"helm {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}",
                    pytrace=False)
    return proc


@functools.cache
def rendered_text(config: str) -> str:
    return run_helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE,
                    *CONFIGS[config]).stdout


def rendered(config: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(rendered_text(config)) if d]


def is_hook(doc: dict[str, Any]) -> bool:
    return "helm.sh/hook" in (doc["metadata"].get("annotations") or {})


def one(docs: Iterable[dict[str, Any]], kind: str, name: str | None = None,
        namespace: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind
             and (name is None or d["metadata"]["name"] == name)
             and (namespace is None or d["metadata"].get("namespace") == namespace)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {len(found)}"
    return found[0]


class Cluster:
    """The module's apiserver (RBAC and OwnerReferencesPermissionEnforcement on, the CRDs applied,
    the configurations' namespaces made), started by the first test that asks for it, so that a
    missing binary fails that test rather than erroring in a fixture."""

    def __init__(self, workdir: Path, stack: contextlib.ExitStack) -> None:
        self.workdir, self.stack = workdir, stack
        self.kube: LocalApiserver | None = None

    def __call__(self) -> LocalApiserver:
        if self.kube is None:
            for name in ("etcd", "kube-apiserver", "kubectl"):
                _binary(name)
            kube = self.stack.enter_context(local_apiserver(self.workdir, extra_args=[
                "--enable-admission-plugins=OwnerReferencesPermissionEnforcement"]))
            kube.kubectl("apply", "--server-side", "-f", str(CHART / "crds"),
                         "-f", str(MONITORING_CRDS))
            kube.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd",
                         "ravnestjobs.ravnest.io", "servicemonitors.monitoring.coreos.com",
                         "podmonitors.monitoring.coreos.com",
                         "prometheusrules.monitoring.coreos.com")
            for ns in (NAMESPACE, *WATCHED):
                kube.kubectl("create", "namespace", ns)
            self.kube = kube
        return self.kube


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with contextlib.ExitStack() as stack:
        yield Cluster(tmp_path_factory.mktemp("kube"), stack)


# --- lint, render, dry run -------------------------------------------------------------------

@pytest.mark.parametrize("config", ["defaults", "all-on", "namespaced"])
def test_lint(config: str) -> None:
    out = run_helm("lint", "--strict", str(CHART), "--namespace", NAMESPACE,
                   *CONFIGS[config]).stdout
    assert "0 chart(s) failed" in out, out
    assert "[ERROR]" not in out and "[WARNING]" not in out, out


@pytest.mark.parametrize("config", ["defaults", "all-on", "namespaced"])
def test_server_side_dry_run(cluster: Cluster, config: str) -> None:
    docs = rendered(config)
    out = cluster().kubectl("apply", "--dry-run=server", "-f", "-", input=rendered_text(config))
    lines = [ln for ln in out.splitlines() if "(server dry run)" in ln]
    assert len(lines) == len(docs), out
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Service",
            "ConfigMap", "Pod"} <= kinds
    if config != "defaults":
        assert {"ServiceMonitor", "PodMonitor", "PrometheusRule", "NetworkPolicy"} <= kinds
    else:
        assert not {"ServiceMonitor", "PodMonitor", "PrometheusRule", "NetworkPolicy"} & kinds


def test_crd_is_the_repository_crd() -> None:
    chart_crd = (CHART / "crds" / "ravnestjob.yaml").read_bytes()
    assert chart_crd == (ROOT / "crds" / "ravnestjob.yaml").read_bytes(), (
        "charts/ravnest/crds/ravnestjob.yaml differs from crds/ravnestjob.yaml: "
        "cp crds/ravnestjob.yaml charts/ravnest/crds/")
    assert sorted(p.name for p in (CHART / "crds").iterdir()) == ["ravnestjob.yaml"]


def test_operator_deployment() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["appVersion"] == __version__
    docs = rendered("defaults")
    deploy = one(docs, "Deployment")
    # leader election: a new replica waits as a follower while the old one leads
    assert deploy["spec"]["replicas"] == 1 and deploy["spec"]["strategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
    pod = deploy["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["image"] == f"ravnest:{__version__}"
    assert c["command"] == ["kopf", "run", "--standalone", "--all-namespaces",
                            "--liveness=http://0.0.0.0:8081/healthz",
                            "-m", "ravnest_operator.handling"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["RAVNEST_WORKER_IMAGE"] == f"ravnest:{__version__}"
    assert env["RAVNEST_OPERATOR_METRICS_PORT"] == "8080"
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"metrics": 8080,
                                                                   "healthz": 8081}
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == 10001
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["securityContext"] == {"allowPrivilegeEscalation": False,
                                    "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}}
    # the signing key (issue 40): a Secret of the chart's, mounted by the operator's pod only,
    # readable by its group; the operator reads no Secret through the API
    key = one(docs, "Secret", f"{RELEASE}-ravnest-signing-key")
    assert len(base64.b64decode(key["data"]["key"])) >= 32
    (mounted,) = [v for v in pod["volumes"] if "secret" in v]
    assert mounted["secret"] == {"secretName": key["metadata"]["name"], "defaultMode": 0o440}
    assert env["RAVNEST_SIGNING_KEY_FILE"].startswith(
        next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == mounted["name"]) + "/")
    assert pod["securityContext"]["fsGroup"] == 10001
    assert not [r for d in docs if d["kind"] in ("Role", "ClusterRole") for r in d["rules"]
                if "secrets" in r["resources"] and set(r["verbs"]) - {"create"}]
    assert pod["serviceAccountName"] == one(docs, "ServiceAccount", f"{RELEASE}-ravnest")[
        "metadata"]["name"]
    namespaced = one(rendered("namespaced"), "Deployment")
    args = namespaced["spec"]["template"]["spec"]["containers"][0]["command"]
    assert [a for a in args if a.startswith("--namespace")] == [f"--namespace={n}"
                                                                for n in WATCHED]
    assert "--all-namespaces" not in args


def test_the_template_policy_reaches_the_operator() -> None:
    """templatePolicy.allow is what the operator reads (RAVNEST_TEMPLATE_ALLOW), and the
    schema's names are the exemptions the operator knows."""
    def settings(config: str) -> Settings:
        (c,) = one(rendered(config), "Deployment")["spec"]["template"]["spec"]["containers"]
        return Settings.from_env({e["name"]: e["value"] for e in c["env"] if "value" in e})

    assert settings("defaults").template_allow == {}
    assert settings("all-on").allowed("team-a") == {"initContainers", "hostPath"}
    assert settings("all-on").allowed("team-b") == {"hostPath"}
    schema = json.loads((CHART / "values.schema.json").read_text())
    allow = schema["properties"]["templatePolicy"]["properties"]["allow"]
    assert allow["additionalProperties"]["items"]["enum"] == list(podsecurity.EXEMPTIONS)


def test_every_pod_runs_unprivileged_on_a_read_only_root() -> None:
    """The operator and the `helm test` pod: non-root, no capabilities, no privilege escalation,
    RuntimeDefault seccomp, a read-only root (the worker pods: test_operator_resources)."""
    pods = {d["metadata"]["name"]: d["spec"]["template"]["spec"] if d["kind"] == "Deployment"
            else d["spec"] for d in rendered("all-on") if d["kind"] in ("Deployment", "Pod")}
    assert len(pods) == 2, sorted(pods)
    for name, pod in pods.items():
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["runAsUser"] != 0, name
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        for c in pod["containers"]:
            assert c["securityContext"] == {"allowPrivilegeEscalation": False,
                                            "readOnlyRootFilesystem": True,
                                            "capabilities": {"drop": ["ALL"]}}, name


CRD_UPGRADE = "kubectl apply --server-side --force-conflicts -f charts/ravnest/crds/"


def test_install_upgrade_uninstall(tmp_path: Path) -> None:
    """On a fresh cluster: `helm install` (every option on) installs the CRD from crds/ and prints
    NOTES with the next steps; the CRD upgrade NOTES and the README give works on the CRD Helm
    created (a changed CRD stands in for a new version); `helm upgrade` applies a new value; the
    CRD outlives `helm uninstall`."""
    for name in ("etcd", "kube-apiserver", "kubectl"):
        _binary(name)
    with local_apiserver(tmp_path / "kube") as kube:
        kube.kubectl("apply", "--server-side", "-f", str(MONITORING_CRDS))
        kube.kubectl("create", "namespace", NAMESPACE)
        base = ["--kubeconfig", str(kube.kubeconfig), "--namespace", NAMESPACE]
        notes = run_helm("install", RELEASE, str(CHART), *base, *ALL_ON).stdout
        notes = notes.split("NOTES:", 1)[-1]
        for step in ("kubectl apply -f examples/digits.yaml", "kubectl get rj",
                     "ravnest status digits", f"helm test {RELEASE}", CRD_UPGRADE):
            assert step in notes, notes
        assert CRD_UPGRADE in (CHART / "README.md").read_text()
        assert "helm" in kube.kubectl("get", "crd", "ravnestjobs.ravnest.io", "-o",
                                      "jsonpath={.metadata.managedFields[*].manager}").split()
        crd = yaml.safe_load((CHART / "crds" / "ravnestjob.yaml").read_text())
        crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["description"] = "next version"
        (tmp_path / "crds").mkdir()
        (tmp_path / "crds" / "ravnestjob.yaml").write_text(yaml.safe_dump(crd))
        kube.kubectl(*CRD_UPGRADE.split()[1:-1], str(tmp_path / "crds"))
        assert kube.kubectl("get", "crd", "ravnestjobs.ravnest.io", "-o", "jsonpath={.spec."
                            "versions[0].schema.openAPIV3Schema.description}") == "next version"
        run_helm("upgrade", RELEASE, str(CHART), *base, *ALL_ON,
                 "--set", "operator.reconcileInterval=5")
        env = kube.kubectl("get", "deploy", f"{RELEASE}-ravnest", "-n", NAMESPACE, "-o",
                           "jsonpath={.spec.template.spec.containers[0].env}")
        assert {"name": "RAVNEST_RECONCILE_INTERVAL", "value": "5"} in json.loads(env)
        run_helm("uninstall", RELEASE, *base)
        assert not kube.kubectl("get", "deploy,clusterrole,configmap", "-A", "-l",
                                f"app.kubernetes.io/instance={RELEASE}", "-o", "name").strip()
        kube.kubectl("get", "crd", "ravnestjobs.ravnest.io")


# --- RBAC ------------------------------------------------------------------------------------

def test_operator_calls_are_found() -> None:
    """The derivation sees the calls handling.py makes (a guard against it silently finding
    nothing)."""
    triples, urls = operator_needs()
    assert {("", "pods", "create"), ("", "pods", "delete"), ("", "pods", "list"),
            ("", "configmaps", "get"), ("", "configmaps", "create"), ("", "services", "create"),
            ("", "secrets", "create"), ("", "events", "create"),
            ("ravnest.io", "ravnestjobs", "delete")} <= triples
    assert urls <= PUBLIC_URLS, f"non-resource URLs the default roles do not grant: {urls}"


def test_cluster_rbac_is_exactly_what_the_operator_uses() -> None:
    needed = set(operator_needs()[0]) | KOPF_NEEDS | ADMISSION_NEEDS
    docs = [d for d in rendered("defaults") if not is_hook(d)]
    role = one(docs, "ClusterRole")
    got = granted(role["rules"])
    assert got == needed, diff(needed, got)
    # the one Role: leader election's, in the release namespace, of the one Lease
    (leader,) = [d for d in docs if d["kind"] == "Role"]
    assert leader["metadata"]["namespace"] == NAMESPACE
    leases = granted(leader["rules"], named=True)
    assert leases == LEADER_NEEDS, diff(LEADER_NEEDS, leases)
    assert [r.get("resourceNames") for r in leader["rules"]] == [None, [f"{RELEASE}-ravnest"]]
    (leading,) = [d for d in docs if d["kind"] == "RoleBinding"]
    assert leading["roleRef"]["name"] == leader["metadata"]["name"]
    binding = one(docs, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": f"{RELEASE}-ravnest",
                                    "namespace": NAMESPACE}]


def test_namespaced_rbac_is_exactly_what_the_operator_uses() -> None:
    needed = set(operator_needs()[0]) | KOPF_NEEDS | ADMISSION_NEEDS
    docs = [d for d in rendered("namespaced") if not is_hook(d)]
    cluster = granted(one(docs, "ClusterRole")["rules"])
    cluster_needed = {t for t in needed | KOPF_NAMESPACE_NEEDS if t[1] in CLUSTER_SCOPED}
    assert cluster == cluster_needed, diff(cluster_needed, cluster)
    for ns in WATCHED:
        got = granted(one(docs, "Role", f"{RELEASE}-ravnest", namespace=ns)["rules"])
        ns_needed = {t for t in needed if t[1] not in CLUSTER_SCOPED}
        assert got == ns_needed, f"Role in {ns}:\n{diff(ns_needed, got)}"
        binding = one(docs, "RoleBinding", namespace=ns)
        assert binding["subjects"][0]["namespace"] == NAMESPACE


def test_helm_test_rbac_is_exactly_what_its_script_uses() -> None:
    needed, urls = api_permissions([CHART / "files" / "smoke.py"], "")
    assert not urls
    (role,) = [d for d in rendered("defaults") if d["kind"] == "Role" and is_hook(d)]
    assert role["metadata"]["namespace"] == NAMESPACE
    assert role["metadata"]["annotations"]["helm.sh/hook"] == "test"
    got = granted(role["rules"])
    assert got == needed == {("ravnest.io", "ravnestjobs", v) for v in ("create", "get",
                                                                        "delete")}, \
        diff(needed, got)


def _token_kubeconfig(kube: LocalApiserver, account: str, namespace: str, path: Path) -> Path:
    """A kubeconfig that authenticates as a ServiceAccount (token from the TokenRequest API)."""
    token = kube.kubectl("create", "token", account, "-n", namespace, "--duration=1h").strip()
    config = yaml.safe_load(kube.kubeconfig.read_text())
    config["users"] = [{"name": "admin", "user": {"token": token}}]
    config["contexts"][0]["context"]["namespace"] = namespace
    path.write_text(yaml.safe_dump(config))
    return path


def _install(kube: LocalApiserver, docs: list[dict[str, Any]], kinds: set[str]) -> None:
    """Create the rendered objects of these kinds for real."""
    chosen = [d for d in docs if d["kind"] in kinds]
    kube.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump_all(chosen))


_REFUSED = re.compile(r"\b403\b|[Ff]orbidden|Not enough permissions")
_STAMP = re.compile(r"^\[[^\]]*\]")
"""kopf's line prefix, `[2026-11-23 11:53:51,403]`: its milliseconds are no status code."""


def _refused(log: Path) -> list[str]:
    """Requests the API server refused, as kopf and the handlers log them (a line's text after
    its timestamp, and the lines of tracebacks)."""
    return [ln for ln in log.read_text().splitlines() if _REFUSED.search(_STAMP.sub("", ln))]


def test_refusal_check_reads_messages_not_timestamps(tmp_path: Path) -> None:
    """A log line stamped at millisecond 403 is no refusal (CI failed on one); a 403 from the
    API server, in kopf's message or in a traceback, is."""
    log = tmp_path / "operator.log"
    ok = "[2026-11-23 11:53:51,403] kopf.activities.auth [INFO    ] Activity succeeded."
    denied = ("[2026-11-23 11:53:52,017] kopf.objects [ERROR   ] APIForbiddenError: "
              "{'kind': 'Status', 'code': 403}")
    log.write_text(f"{ok}\n{denied}\nReason: Forbidden\n")
    assert _refused(log) == [denied, "Reason: Forbidden"]


def _wait(what: str, check: Any, timeout: float, log: Path | None = None) -> Any:
    """Poll check() until truthy; fail at the timeout, or at once when the log shows a 403."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        refused = _refused(log) if log else []
        if refused or time.monotonic() > deadline:
            tail = "\n".join((refused or log.read_text().splitlines())[-40:]) if log else ""
            pytest.fail(f"{'refused' if refused else 'timed out'} waiting for {what}\n{tail}",
                        pytrace=False)
        time.sleep(0.5)


def _play_planner(kube: Any, ns: str, name: str, folder: Path) -> None:
    """What the kubelet would do with the job's planner pod (no kubelet runs here): run its
    command on the job its ConfigMap holds, then report the pod Succeeded with the termination
    message the planner left."""
    job = folder / "job.json"
    pod = json.loads(kube.kubectl("get", "pod", f"{name}-planner", "-n", ns, "-o", "json"))
    (volume,) = [v["configMap"]["name"] for v in pod["spec"]["volumes"] if "configMap" in v]
    job.write_text(kube.kubectl("get", "configmap", volume, "-n", ns, "-o",
                                "jsonpath={.data.job\\.json}"))
    message = folder / "termination-log"
    subprocess.run([sys.executable, "-m", "ravnest", "plan", str(job), "--termination-log"],
                   check=True, timeout=300, capture_output=True,
                   env={**os.environ, "RAVNEST_TERMINATION_LOG": str(message)})
    status = {"status": {"phase": "Succeeded", "containerStatuses": [{
        "name": "planner", "image": "ravnest", "imageID": "", "ready": False, "restartCount": 0,
        "state": {"terminated": {"exitCode": 0, "reason": "Completed",
                                 "message": message.read_text()}}}]}}
    kube.kubectl("patch", "pod", f"{name}-planner", "-n", ns, "--subresource=status",
                 "--type=merge", "-p", json.dumps(status))


def _release_job(kube: Any, ns: str, name: str) -> None:
    """Delete the job while its operator still runs, so kopf's finalizer is released: a job left
    terminating would be deleted under the next test that applies the same name."""
    kube.kubectl("delete", "rj", name, "-n", ns, "--ignore-not-found", "--timeout=30s",
                 check=False, timeout=45)


def _test_job(config: str = "defaults") -> dict[str, Any]:
    cm = one(rendered(config), "ConfigMap", f"{RELEASE}-ravnest-test")
    return dict(yaml.safe_load(cm["data"]["job.yaml"]))


def test_helm_test_job_is_valid() -> None:
    """The helm-test job is a valid RavnestJob, in a namespace the operator serves, where the
    test's Role is."""
    job = _test_job()
    parsed = parse_job(job)
    assert parsed.spec.training.epochs == 1
    assert len(parsed.spec.expanded_providers()) == 2
    assert job["metadata"]["namespace"] == NAMESPACE
    assert _test_job("namespaced")["metadata"]["namespace"] == WATCHED[0]
    hooks = [d for d in rendered("namespaced") if d["kind"] in ("Role", "RoleBinding")
             and is_hook(d)]
    assert {d["metadata"]["namespace"] for d in hooks} == {WATCHED[0]}


RBAC_KINDS = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}


@pytest.mark.parametrize("config", ["defaults", "namespaced"])
def test_operator_runs_under_chart_rbac(cluster: Cluster, tmp_path: Path, config: str) -> None:
    """The real operator, run with the rendered Deployment's command and environment and
    authenticated as the chart's ServiceAccount, takes a job through plan, pods, suspend (pod
    deletion) and TTL deletion with no request refused."""
    kube = cluster()
    docs = [d for d in rendered(config) if d["kind"] in RBAC_KINDS and not is_hook(d)]
    account = one(docs, "ServiceAccount")["metadata"]["name"]
    container = one(rendered(config), "Deployment")["spec"]["template"]["spec"][
        "containers"][0]
    kopf_args = [f"--liveness=http://127.0.0.1:{free_port()}/healthz" if a.startswith(
        "--liveness=") else a for a in container["command"][1:]]
    downward = {"metadata.name": "rel-ravnest-7f9c", "metadata.namespace": NAMESPACE}
    env = {**os.environ, **{e["name"]: e["value"] if "value" in e else downward[
               e["valueFrom"]["fieldRef"]["fieldPath"]] for e in container["env"]},
           "RAVNEST_RECONCILE_INTERVAL": "1", "RAVNEST_OPERATOR_METRICS_PORT": str(free_port())}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    key = one(rendered(config), "Secret", f"{RELEASE}-ravnest-signing-key")["data"]["key"]
    (tmp_path / "signing-key").write_bytes(base64.b64decode(key))  # (the Secret's mount)
    env["RAVNEST_SIGNING_KEY_FILE"] = str(tmp_path / "signing-key")
    job = _test_job()
    ns, name = WATCHED[0], job["metadata"]["name"]
    job["metadata"]["namespace"] = ns
    log = tmp_path / "operator.log"
    installed = yaml.safe_dump_all(docs)
    kube.kubectl("apply", "--server-side", "-f", "-", input=installed)
    env["KUBECONFIG"] = str(_token_kubeconfig(kube, account, NAMESPACE,
                                              tmp_path / "operator.kubeconfig"))

    def status() -> dict[str, Any]:
        out = kube.kubectl("get", "rj", name, "-n", ns, "-o", "json", check=False)
        return dict(json.loads(out).get("status") or {}) if out else {}

    def pods() -> list[str]:
        return kube.kubectl("get", "pods", "-n", ns, "-l", f"ravnest.io/job={name}",
                            "-o", "name").split()

    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "kopf", *kopf_args], stdout=fh,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        kube.kubectl("apply", "-f", "-", input=yaml.safe_dump(job))
        _wait("the planner pod", lambda: pods() == [f"pod/{name}-planner"], 120, log)
        _play_planner(kube, ns, name, tmp_path)
        _wait("the worker pods", lambda: len(pods()) == 2, 180, log)
        assert status().get("phase") == "Planned"
        for obj in (f"service/{name}-workers", f"secret/{name}-token", f"configmap/{name}-plan",
                    f"secret/{name}-node-0-identity", f"secret/{name}-node-1-identity"):
            kube.kubectl("get", obj, "-n", ns)
        kube.kubectl("patch", "rj", name, "-n", ns, "--type=merge",
                     "-p", '{"spec": {"runPolicy": {"suspend": true}}}')
        _wait("Suspended", lambda: status().get("phase") == "Suspended", 60, log)
        _wait("the pods' deletion", lambda: not pods(), 60, log)
        kube.kubectl("patch", "rj", name, "-n", ns, "--type=merge", "--subresource=status", "-p",
                     '{"status": {"phase": "Failed", "completionTime": "2000-01-01T00:00:00Z"}}')
        kube.kubectl("patch", "rj", name, "-n", ns, "--type=merge",
                     "-p", '{"spec": {"runPolicy": {"ttlSecondsAfterFinished": 0}}}')
        _wait("the TTL deletion", lambda: not kube.kubectl(
            "get", "rj", "-n", ns, "-o", "name").strip(), 60, log)
        _wait("the Planned event", lambda: "Planned" in kube.kubectl(
            "get", "events", "-n", ns, "-o", "jsonpath={.items[*].reason}").split(), 30, log)
    finally:
        _release_job(kube, ns, name)
        stop_process(proc, 15)
        kube.kubectl("patch", "rj", name, "-n", ns, "--type=merge",
                     "-p", '{"metadata": {"finalizers": null}}', check=False)
        kube.kubectl("delete", "--wait=false", "--ignore-not-found", "-f", "-", input=installed)
        # no garbage collector runs here: what the job owned goes by hand
        kube.kubectl("delete", "pods,configmaps,services,secrets", "-n", ns, "-l",
                     f"ravnest.io/job={name}", "--wait=false", "--ignore-not-found")
    refused = _refused(log)
    assert not refused, "\n".join(refused)


def test_helm_test_script_under_its_rbac(cluster: Cluster, tmp_path: Path) -> None:
    """files/smoke.py as the test hook's ServiceAccount: it creates the job, sees it succeed (the
    test plays the operator), deletes it and exits 0."""
    kube = cluster()
    docs = rendered("defaults")
    hooks = [d for d in docs if is_hook(d)]
    assert {d["kind"] for d in hooks} == {"ServiceAccount", "Role", "RoleBinding", "ConfigMap",
                                          "Pod"}
    _install(kube, hooks, {"ServiceAccount", "Role", "RoleBinding"})
    account = one(hooks, "ServiceAccount")["metadata"]["name"]
    config = _token_kubeconfig(kube, account, NAMESPACE, tmp_path / "test.kubeconfig")
    job_file = tmp_path / "job.yaml"
    job_file.write_text(one(hooks, "ConfigMap")["data"]["job.yaml"])
    name = yaml.safe_load(job_file.read_text())["metadata"]["name"]
    env = {**os.environ, "KUBECONFIG": str(config), "RAVNEST_TEST_JOB": str(job_file),
           "RAVNEST_TEST_TIMEOUT": "60"}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    proc = subprocess.Popen([sys.executable, str(CHART / "files" / "smoke.py")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait("the test job", lambda: kube.kubectl("get", "rj", name, "-n", NAMESPACE,
                                                   check=False), 30)
        kube.kubectl("patch", "rj", name, "-n", NAMESPACE, "--type=merge",
                     "--subresource=status", "-p", '{"status": {"phase": "Succeeded"}}')
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    assert "succeeded" in out, out
    assert not kube.kubectl("get", "rj", "-n", NAMESPACE, "-o", "name").strip()


# --- values schema ---------------------------------------------------------------------------

def test_replicas_without_leader_election_are_refused() -> None:
    proc = run_helm("template", RELEASE, str(CHART), "--set", "replicaCount=2", "--set",
                    "operator.leaderElection.enabled=false", check=False)
    assert proc.returncode != 0 and "more than 1 replica needs operator.leaderElection.enabled" \
        in proc.stderr, proc.stderr
    one_only = one([d for d in yaml.safe_load_all(run_helm(
        "template", RELEASE, str(CHART), "--set", "operator.leaderElection.enabled=false").stdout)
        if d], "Deployment")
    assert one_only["spec"]["strategy"] == {"type": "Recreate"}
    assert "RAVNEST_LEADER_ELECTION" not in {
        e["name"] for e in one_only["spec"]["template"]["spec"]["containers"][0]["env"]}


@pytest.mark.parametrize(("setting", "message"), [
    ("replicaCount=abc", "/replicaCount': got string, want integer"),
    ("replicaCount=9", "/replicaCount': maximum"),
    ("operator.watchNamespace=x", "additional properties 'watchNamespace' not allowed"),
    ("image.pullPolicy=Sometimes", "/image/pullPolicy"),
    ("metrics.podMonitor.interval=soon", "/metrics/podMonitor/interval"),
    ("operator.watchNamespaces={Team_A}", "/operator/watchNamespaces/0"),
    ("templatePolicy.allow.team-a={hostpath}", "/templatePolicy/allow/team-a/0"),
    ("templatePolicy.allow.Team_A={root}", "invalid propertyName 'Team_A'"),
])
def test_schema_rejects_bad_values(setting: str, message: str) -> None:
    proc = run_helm("template", RELEASE, str(CHART), "--set", setting, check=False)
    assert proc.returncode != 0, f"--set {setting} was accepted"
    assert "values don't meet the specifications of the schema" in proc.stderr, proc.stderr
    assert message in proc.stderr, proc.stderr


# --- dashboards and alerts -------------------------------------------------------------------

def _family_samples(family: Any) -> set[str]:
    """The sample names Prometheus stores for a metric family (prometheus_client's naming)."""
    suffixes = {"counter": ["_total", "_created"], "gauge": [""], "histogram":
                ["_bucket", "_sum", "_count", "_created"], "summary": ["", "_sum", "_count",
                                                                      "_created"]}
    return {family.name + s for s in suffixes[family.type]}


@functools.cache
def known_metrics() -> frozenset[str]:
    """Every metric name a worker or the operator exposes, from their registries, plus `up`
    (the per-target metric Prometheus adds)."""
    worker = WorkerMetrics(Identity("j", "ns", "node_0", "root", 0, 0))
    names = {n for fam in worker.registry.collect() for n in _family_samples(fam)}
    wrappers = [v for v in vars(monitoring).values() if isinstance(v, MetricWrapperBase)]
    assert wrappers, "no metrics found in ravnest_operator.monitoring"
    for metric in wrappers:
        names |= {n for fam in metric.describe() for n in _family_samples(fam)}
    return frozenset(names | {"up"})


_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
             "unless", "offset", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression (with Grafana variables) selects."""
    expr = re.sub(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'', '""', expr)  # strings
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    expr = re.sub(r"\$\{?\w+\}?", "", expr)  # Grafana variables
    names = set()
    for m in re.finditer(r"(?<![\w.])[a-zA-Z_:][\w:]*", expr):
        following = expr[m.end():].lstrip()
        if m.group() not in _KEYWORDS and not following.startswith("("):
            names.add(m.group())
    return names


def test_metric_name_parser() -> None:
    assert metric_names('histogram_quantile(0.9, sum by (job, le) (rate(a_bucket{job=~"$job", '
                        'x="y(z)"}[$__rate_interval]))) / on (job) group_left b > 1e3') == {
        "a_bucket", "b"}
    assert metric_names("-sum(increase(c_total[1h])) and d offset 5m") == {"c_total", "d"}


def _dashboards() -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text())
            for p in sorted((CHART / "dashboards").glob("*.json"))}


def _exprs(board: dict[str, Any]) -> Iterator[tuple[str, str]]:
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            selector = re.fullmatch(r"label_values\((.*),\s*\w+\)", var["definition"])
            assert selector, var["definition"]
            yield f"variable {var['name']}", selector.group(1)


def test_dashboards() -> None:
    boards = _dashboards()
    assert set(boards) == {"training", "operator"}
    assert {b["title"] for b in boards.values()} == {"Ravnest training", "Ravnest operator"}
    assert len({b["uid"] for b in boards.values()}) == 2
    for name, board in boards.items():
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert {"datasource", "namespace", "job"} <= variables.keys(), name
        assert all(v["definition"].startswith("label_values(") for v in variables.values()
                   if v["type"] == "query")
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
        for panel in board["panels"]:
            if panel["type"] != "row":
                assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}"
    docs = rendered("all-on")
    for name, board in boards.items():
        cm = one(docs, "ConfigMap", f"{RELEASE}-ravnest-dashboard-{name}")
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["annotations"] == {"grafana_folder": "Ravnest"}
        assert json.loads(cm["data"][f"ravnest-{name}.json"]) == board
    off = run_helm("template", RELEASE, str(CHART), "--set", "dashboards.enabled=false")
    assert "grafana_dashboard" not in off.stdout


def test_dashboards_cover_the_design() -> None:
    training = " ".join(e for _, e in _exprs(_dashboards()["training"]))
    for metric in ("ravnest_loss", "ravnest_validation_metric", "ravnest_samples_total",
                   "histogram_quantile", "ravnest_step_duration_seconds_bucket",
                   "ravnest_forward_duration_seconds", "ravnest_backward_duration_seconds",
                   "ravnest_allreduce_duration_seconds", "ravnest_sent_bytes_total",
                   "ravnest_received_bytes_total", "ravnest_inflight_microbatches",
                   "ravnest_reduce_rounds_skipped_total", "ravnest_reduce_rounds_partial_total",
                   "ravnest_ring_members_missing", "ravnest_clusters_active",
                   "ravnest_recoveries_total", "ravnest_recovery_bytes_total",
                   "ravnest_recovery_duration_seconds", "up{"):
        assert metric in training, metric
    ops = " ".join(e for _, e in _exprs(_dashboards()["operator"]))
    for metric in ("ravnest_operator_jobs", "ravnest_operator_reconcile_duration_seconds_bucket",
                   "ravnest_operator_time_to_running_seconds_bucket",
                   "ravnest_operator_job_restarts_total",
                   "ravnest_operator_cluster_recoveries_total",
                   "ravnest_operator_spare_takeovers_total",
                   "ravnest_operator_cluster_drains_total"):
        assert metric in ops, metric


def test_queries_use_only_existing_metrics() -> None:
    known = known_metrics()
    assert {"ravnest_steps_total", "ravnest_step_duration_seconds_bucket",
            "ravnest_operator_jobs", "ravnest_operator_job_restarts_total"} <= known
    unknown = []
    for name, board in _dashboards().items():
        for where, expr in _exprs(board):
            unknown += [f"{name} / {where}: {m}" for m in metric_names(expr) - known]
    rule = one(rendered("all-on"), "PrometheusRule")
    alerts = [r for g in rule["spec"]["groups"] for r in g["rules"]]
    assert {r["alert"] for r in alerts} == {"RavnestJobFailed", "RavnestJobStalled",
                                            "RavnestRingRoundsSkipped", "RavnestWorkerDown"}
    for r in alerts:
        unknown += [f"alert {r['alert']}: {m}" for m in metric_names(r["expr"]) - known]
    assert not unknown, "queries of metrics no code registers:\n" + "\n".join(unknown)


def test_monitors_select_the_workers_and_the_operator() -> None:
    docs = rendered("all-on")
    pm = one(docs, "PodMonitor")["spec"]
    assert pm["selector"]["matchLabels"]["app.kubernetes.io/managed-by"] == "ravnest-operator"
    assert pm["podMetricsEndpoints"][0]["port"] == "metrics"
    assert pm["podMetricsEndpoints"][0]["honorLabels"] is True
    assert pm["namespaceSelector"] == {"any": True}
    sm = one(docs, "ServiceMonitor")["spec"]
    svc = one(docs, "Service")
    assert sm["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert svc["spec"]["ports"][0]["name"] == sm["endpoints"][0]["port"] == "metrics"
    deploy = one(docs, "Deployment")
    pod_labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    policy = one(docs, "NetworkPolicy")["spec"]
    (metrics,) = policy["ingress"]  # gRPC: only the operator's per-job policy lets it in
    assert metrics["ports"] == [{"protocol": "TCP", "port": 9400}]
    env = {e["name"]: e.get("value") for e in deploy["spec"]["template"]["spec"][
        "containers"][0]["env"]}
    assert env["RAVNEST_NETWORK_POLICIES"] == "true"
    default_env = {e["name"]: e.get("value") for e in one(rendered("defaults"), "Deployment")[
        "spec"]["template"]["spec"]["containers"][0]["env"]}
    assert default_env["RAVNEST_NETWORK_POLICIES"] == "false"
    # with the PodMonitor on, finished workers wait for one scrape of their final metrics
    assert env["RAVNEST_FINAL_SCRAPE_SECONDS"] == "30"
    assert "RAVNEST_FINAL_SCRAPE_SECONDS" not in default_env
    operator_peer = metrics["from"][0]["podSelector"]["matchLabels"]
    assert operator_peer.items() <= pod_labels.items(), "the operator could not scrape progress"
    namespaced = rendered("namespaced")
    assert {d["metadata"]["namespace"] for d in namespaced
            if d["kind"] == "NetworkPolicy"} == set(WATCHED)
    assert one(namespaced, "PodMonitor")["spec"]["namespaceSelector"] == {
        "matchNames": list(WATCHED)}
