"""A real Prometheus (Debian's `prometheus`) scrapes a digits RavnestJob's workers and the operator
while the operator tier's cluster (real apiserver, harness kubelet, real workers) trains it; then
every PromQL expression of both Grafana dashboards returns data, and the chart's alert rules pass
`promtool check rules` and evaluate without error inside that Prometheus.

No Prometheus Operator runs here, so the test writes the scrape configuration it would generate
from the chart's PodMonitor and ServiceMonitor, read from `helm template`: worker targets are the
Running pods its selector matches (file service discovery, refreshed from the apiserver while the
job runs), on the container port its endpoint names, with `job` taken from the pod label named by
`jobLabel` and the scraped labels kept when `honorLabels` is set; the operator's target has the
metrics Service's name as `job`, as a ServiceMonitor gives it.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml
from kube import find_binary, free_port, stop_process
from operator_harness import ROOT, apply, get, job_doc, operator_cluster, wait_for

pytestmark = pytest.mark.tools  # (scripts/test runs it once the tools are there)

CHART = ROOT / "charts" / "ravnest"
RELEASE, RELEASE_NS = "rel", "ravnest-system"
JOB = "watched"
SCRAPE_S = 1
# Grafana's $__rate_interval: max($__interval + scrape interval, 4 x scrape interval), with the
# datasource's scrape interval set to the 1 s used here and a 1 s step.
RATE_INTERVAL = f"{4 * SCRAPE_S}s"
VARIABLE = re.compile(r"label_values\((?P<match>.+),\s*(?P<label>\w+)\)$")


def prometheus_binary(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"`{name}` is not installed: scripts/docker-engine installs Debian's "
                    "prometheus package (scripts/test runs it)", pytrace=False)
    return found


def rendered_chart() -> list[dict[str, Any]]:
    """The chart with the monitors and the rules on, as the real Helm renders it."""
    out = subprocess.run(
        [find_binary("helm"), "template", RELEASE, str(CHART), "--namespace", RELEASE_NS,
         "--set", "metrics.serviceMonitor.enabled=true", "--set", "metrics.podMonitor.enabled=true",
         "--set", "metrics.prometheusRule.enabled=true"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


class WorkerDiscovery(threading.Thread):
    """What the PodMonitor's Kubernetes service discovery does: keeps a file_sd file listing the
    matching Running pods (the Prometheus Operator drops Succeeded and Failed ones)."""

    def __init__(self, kubeconfig: Path, podmonitor: dict[str, Any], out: Path) -> None:
        super().__init__(name="worker-discovery", daemon=True)
        spec = podmonitor["spec"]
        self.selector = ",".join(f"{k}={v}" for k, v in spec["selector"]["matchLabels"].items())
        endpoint, = spec["podMetricsEndpoints"]
        self.port_name = endpoint["port"]
        self.job_label = spec["jobLabel"]
        self.out = out
        self.api = kubernetes.client.CoreV1Api(
            kubernetes.config.new_client_from_config(config_file=str(kubeconfig)))
        self.stopped = threading.Event()
        self.seen: set[str] = set()
        self.write([])

    def write(self, groups: list[dict[str, Any]]) -> None:
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups))
        tmp.replace(self.out)  # one rename: Prometheus never reads half a file

    def run(self) -> None:
        while not self.stopped.wait(0.5):
            groups = []
            for pod in self.api.list_pod_for_all_namespaces(label_selector=self.selector).items:
                if pod.status.phase != "Running" or not pod.status.pod_ip:
                    continue
                for c in pod.spec.containers:
                    for port in c.ports or []:
                        if port.name == self.port_name:
                            self.seen.add(pod.metadata.name)
                            groups.append({
                                "targets": [f"{pod.status.pod_ip}:{port.container_port}"],
                                "labels": {"namespace": pod.metadata.namespace,
                                           "pod": pod.metadata.name, "container": c.name,
                                           "endpoint": self.port_name,
                                           "job": pod.metadata.labels[self.job_label]}})
            self.write(groups)


@dataclass
class Prometheus:
    url: str
    start: float
    end: float
    workers: set[str]
    operator_job: str

    def api(self, path: str, **params: Any) -> Any:
        query = urllib.parse.urlencode(params, doseq=True)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=30) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def over_the_run(self, expr: str) -> list[dict[str, Any]]:
        return self.api("query_range", query=expr, start=self.start, end=self.end, step=SCRAPE_S)[
            "result"]


def scrape_config(podmonitor: dict[str, Any], servicemonitor: dict[str, Any],
                  operator_target: str, operator_job: str, sd_file: Path,
                  rules: Path) -> dict[str, Any]:
    pm, sm = podmonitor["metadata"], servicemonitor["metadata"]
    pm_endpoint, = podmonitor["spec"]["podMetricsEndpoints"]
    sm_endpoint, = servicemonitor["spec"]["endpoints"]
    return {
        "global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
        "rule_files": [str(rules)],
        "scrape_configs": [
            {"job_name": f"podMonitor/{pm['namespace']}/{pm['name']}/0",
             "honor_labels": bool(pm_endpoint.get("honorLabels", False)),
             "metrics_path": pm_endpoint.get("path", "/metrics"),
             "file_sd_configs": [{"files": [str(sd_file)], "refresh_interval": "1s"}]},
            {"job_name": f"serviceMonitor/{sm['namespace']}/{sm['name']}/0",
             "honor_labels": bool(sm_endpoint.get("honorLabels", False)),
             "metrics_path": sm_endpoint.get("path", "/metrics"),
             "static_configs": [{"targets": [operator_target], "labels": {
                 "namespace": sm["namespace"], "service": operator_job, "job": operator_job,
                 "endpoint": sm_endpoint["port"], "container": "operator"}}]},
        ]}


def wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"prometheus exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    pytest.fail(f"prometheus not ready in 60 s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def chart() -> list[dict[str, Any]]:
    return rendered_chart()


@pytest.fixture(scope="module")
def rules_file(chart: list[dict[str, Any]], tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("rules") / "ravnest-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": one(chart, "PrometheusRule")["spec"]["groups"]}))
    return path


@pytest.fixture(scope="module")
def prometheus(chart: list[dict[str, Any]], rules_file: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    binary = prometheus_binary("prometheus")
    work = tmp_path_factory.mktemp("prometheus")
    podmonitor, servicemonitor = one(chart, "PodMonitor"), one(chart, "ServiceMonitor")
    service = one(chart, "Service")
    assert service["spec"]["selector"].items() >= servicemonitor["spec"]["selector"][
        "matchLabels"].items(), "the ServiceMonitor does not select the metrics Service"
    # the operator's environment as the chart sets it with the PodMonitor on: finished workers
    # stay until a scrape has read their final metrics
    deployed = {e["name"]: e["value"] for e in one(chart, "Deployment")["spec"]["template"][
        "spec"]["containers"][0]["env"] if e["name"] == "RAVNEST_FINAL_SCRAPE_SECONDS"}
    assert deployed, "the chart does not make finished workers wait for a final scrape"
    with operator_cluster(work / "cluster", env=deployed) as (kube, _kubelet, operator):
        discovery = WorkerDiscovery(kube.kubeconfig, podmonitor, work / "workers.json")
        config = work / "prometheus.yml"
        config.write_text(yaml.safe_dump(scrape_config(
            podmonitor, servicemonitor, f"127.0.0.1:{operator.metrics_port}",
            service["metadata"]["name"], discovery.out, rules_file)))
        url = f"http://127.0.0.1:{free_port()}"
        log = work / "prometheus.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [binary, f"--config.file={config}", f"--storage.tsdb.path={work / 'tsdb'}",
                 f"--web.listen-address={url.removeprefix('http://')}"],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_ready(url, proc, log)
            discovery.start()
            start = time.time()
            assert apply(kube, job_doc(JOB, epochs=3), work).returncode == 0
            wait_for(f"{JOB} to succeed",
                     lambda: (get(kube, "rj", JOB) or {}).get("status", {}).get("phase")
                     == "Succeeded", 400, kube, operator)
            time.sleep(5 * SCRAPE_S)  # the operator's last observations get scraped too
            discovery.stopped.set()
            discovery.join()
            yield Prometheus(url, start, time.time(), discovery.seen,
                             service["metadata"]["name"])
        finally:
            discovery.stopped.set()
            stop_process(proc, 30)


def dashboard(name: str) -> dict[str, Any]:
    return json.loads((CHART / "dashboards" / f"{name}.json").read_text())


def expressions(board: dict[str, Any]) -> list[tuple[str, str]]:
    def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for p in items:
            yield p
            yield from panels(p.get("panels", []))
    return [(f"{p.get('title')} [{t.get('refId', i)}]", t["expr"])
            for p in panels(board["panels"]) for i, t in enumerate(p.get("targets", []))
            if t.get("expr")]


def resolve_variables(prom: Prometheus, board: dict[str, Any]) -> dict[str, list[str]]:
    """Each query variable's values, found the way Grafana's label_values() finds them."""
    values: dict[str, list[str]] = {}
    for var in board["templating"]["list"]:
        if var.get("type") != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = VARIABLE.match(query)
        assert m, f"variable {var['name']}: {query!r} is not label_values(...)"
        match = substitute(m["match"], {k: "|".join(v) for k, v in values.items()}, prom)
        series = prom.api("series", **{"match[]": match, "start": prom.start, "end": prom.end})
        values[var["name"]] = sorted({s[m["label"]] for s in series if m["label"] in s})
    return values


def substitute(expr: str, variables: dict[str, str], prom: Prometheus) -> str:
    out = expr.replace("$__rate_interval", RATE_INTERVAL)
    out = out.replace("$__range", f"{math.ceil(prom.end - prom.start)}s")
    for name, value in sorted(variables.items(), key=lambda kv: -len(kv[0])):
        out = out.replace(f"${name}", value)
    assert "$" not in out, f"unresolved variable in {out}"
    return out


def finite_points(result: list[dict[str, Any]]) -> int:
    return sum(1 for series in result for _, v in series["values"] if math.isfinite(float(v)))


def test_prometheus_scraped_every_worker_and_the_operator(prometheus: Prometheus):
    assert len(prometheus.workers) == 6
    up = prometheus.api("query", query=f'max_over_time(up{{job="{JOB}"}}[1h])',
                        time=prometheus.end)["result"]
    assert {s["metric"]["pod"]: s["value"][1] for s in up} == dict.fromkeys(prometheus.workers,
                                                                             "1")
    # honorLabels: the workers' own labels survive the scrape
    steps = prometheus.api("query", query=f'max_over_time(ravnest_step{{job="{JOB}"}}[1h])',
                           time=prometheus.end)["result"]
    assert {s["metric"]["namespace"] for s in steps} == {"default"}
    assert {s["metric"]["role"] for s in steps} >= {"root", "leaf"}
    assert max(float(s["value"][1]) for s in steps) == 66  # 3 epochs of the digits example
    up = prometheus.api("query", query=f'min_over_time(up{{job="{prometheus.operator_job}"}}'
                                       f'[1h])', time=prometheus.end)["result"]
    assert [s["value"][1] for s in up] == ["1"]


@pytest.mark.parametrize("board", ["training", "operator"])
def test_every_dashboard_expression_returns_data(prometheus: Prometheus, board: str):
    spec = dashboard(board)
    values = resolve_variables(prometheus, spec)
    assert values["namespace"] == ["default" if board == "training" else RELEASE_NS]
    expected_job = JOB if board == "training" else prometheus.operator_job
    assert values["job"] == [expected_job]
    variables = {k: "|".join(v) for k, v in values.items()}
    empty = []
    for title, expr in expressions(spec):
        query = substitute(expr, variables, prometheus)
        if finite_points(prometheus.over_the_run(query)) == 0:
            empty.append(f"{title}: {query}")
    assert not empty, f"{len(empty)} panel queries of the {board} dashboard returned no data:\n" \
        + "\n".join(empty)


def test_alert_rules_pass_promtool_and_evaluate(prometheus: Prometheus, rules_file: Path):
    check = subprocess.run([prometheus_binary("promtool"), "check", "rules", str(rules_file)],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS: 4 rules found" in check.stdout
    groups = prometheus.api("rules")["groups"]
    rules = {r["name"]: r for g in groups for r in g["rules"]}
    assert set(rules) == {"RavnestJobFailed", "RavnestJobStalled", "RavnestRingRoundsSkipped",
                          "RavnestWorkerDown"}
    bad = {n: r.get("lastError") for n, r in rules.items() if r["health"] != "ok"}
    assert not bad, bad
    # A job that succeeded with every worker answering fires none of them.
    assert not {n for n, r in rules.items() if r["state"] == "firing"}
