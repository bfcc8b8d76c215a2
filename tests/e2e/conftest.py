"""The cluster tier: the chart and a real training job on a real Kubernetes, from any kubeconfig.

RAVNEST_E2E_KUBECONFIG set: that cluster is used as it is (kind in a user's CI, see
scripts/kind-e2e); the image RAVNEST_E2E_IMAGE (default ravnest-k8s:test) must already be on its
nodes. Unset: the session brings up the local single-node cluster of scripts/local-cluster
(etcd, kube-apiserver, controller-manager, scheduler, kube-proxy, kubelet + containerd + runc,
CNI bridge, CoreDNS), importing the image from the local Docker Engine (built offline by
tests/project_image.py when missing, the same build as the image tier's), and tears it down
at the end.

Nothing here skips: a missing tool or a cluster that does not come up fails with the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_cluster import (
    IMAGE,
    JOBS_NS,
    RELEASE,
    ROOT,
    SYSTEM_NS,
    TIMINGS,
    Cluster,
    ensure_docker_image,
)


# Module scope: the cluster goes when this tier's one module is done, not at the end of the whole
# run (it would idle through the other tiers).
@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    given = os.environ.get("RAVNEST_E2E_KUBECONFIG")
    if given:
        if not Path(given).is_file():
            pytest.fail(f"RAVNEST_E2E_KUBECONFIG={given} is not a file")
        c = Cluster(given, local=False)
        c.kubectl("get", "--raw", "/readyz")
        yield c
        return
    if os.geteuid() != 0:
        pytest.fail("the local cluster (scripts/local-cluster) needs root; or set "
                    "RAVNEST_E2E_KUBECONFIG to a cluster's kubeconfig")
    ensure_docker_image(tmp_path_factory.mktemp("image"))
    script = ROOT / "scripts" / "local-cluster"
    state = Path(os.environ.get("RAVNEST_CLUSTER_DIR", "/var/lib/ravnest-cluster"))
    start = time.monotonic()
    up = subprocess.run(["bash", str(script), "up"], capture_output=True, text=True,
                        timeout=3600)
    TIMINGS["cluster_up_s"] = time.monotonic() - start
    try:
        if up.returncode != 0:
            pytest.fail(f"scripts/local-cluster up exited {up.returncode}:\n"
                        f"{up.stdout[-2000:]}\n{up.stderr[-6000:]}")
        yield Cluster(str(state / "admin.kubeconfig"), local=True, logs=state / "logs")
    finally:
        down = subprocess.run(["bash", str(script), "down"], capture_output=True, text=True,
                              timeout=600)
        if down.returncode != 0:
            print(f"scripts/local-cluster down exited {down.returncode}:\n{down.stderr[-3000:]}")


def smoke_test_values(cluster: Cluster) -> list[str]:
    """`helm test`'s job has `tests.providers` (2) pods of compute 1, so 1 CPU requested each, next
    to the operator (100m) and the test pod (10m): on nodes of 2 CPUs (this machine's) they do not
    fit, and the chart has no value for the providers' compute. Then the job gets one provider."""
    nodes = json.loads(cluster.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    cpus = max(_cpu(n["status"]["allocatable"]["cpu"]) for n in nodes)
    return [] if cpus >= 2.2 else ["--set", "tests.providers=1"]


def _cpu(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


@pytest.fixture(scope="module")
def release(cluster: Cluster) -> Iterator[str]:
    """The chart installed with our image; uninstalled at the end (test_uninstall does it too)."""
    repo, _, tag = IMAGE.rpartition(":")
    start = time.monotonic()
    installed = cluster.helm("install", RELEASE, str(ROOT / "charts" / "ravnest"), "-n",
                             SYSTEM_NS, "--create-namespace", "--set", f"image.repository={repo}",
                             "--set", f"image.tag={tag}", "--set", "image.pullPolicy=IfNotPresent",
                             *smoke_test_values(cluster),
                             "--wait", "--timeout", "5m", timeout=400, check=False)
    if installed.returncode != 0:
        pytest.fail(f"helm install exited {installed.returncode}: {installed.stderr[-2000:]}\n"
                    + cluster.diagnostics(SYSTEM_NS))
    TIMINGS["helm_install_s"] = time.monotonic() - start
    cluster.kubectl("create", "namespace", JOBS_NS, check=False)
    yield RELEASE
    # The jobs first, while the operator runs to remove its finalizers (or their namespace hangs).
    cluster.kubectl("delete", "rj", "--all", "-n", JOBS_NS, "--ignore-not-found", "--wait=true",
                    check=False, timeout=300)
    cluster.helm("uninstall", RELEASE, "-n", SYSTEM_NS, "--wait", check=False, timeout=300)
    cluster.kubectl("delete", "namespace", JOBS_NS, SYSTEM_NS, "--ignore-not-found",
                    "--wait=true", check=False, timeout=300)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if TIMINGS:
        terminalreporter.write_line(
            "e2e timings: " + ", ".join(f"{k}={v:.1f}" for k, v in TIMINGS.items()))
