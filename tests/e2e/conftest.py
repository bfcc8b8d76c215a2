"""The cluster tier: the chart and real training jobs on a real Kubernetes, from any kubeconfig.

RAVNEST_E2E_KUBECONFIG set: that cluster is used as it is (kind in a user's CI, see
scripts/kind-e2e); the images RAVNEST_E2E_IMAGE (default ravnest-k8s:test) and the BYO and MinIO
ones must already be on its nodes. Unset: the session brings up a kind cluster of one control-plane
and two workers here, offline (scripts/kind-cluster up --offline: a node image built here, see
scripts/kind-node-image), builds the images (the project image by tests/project_image.py, the same
build as the image tier's; the BYO and MinIO images FROM it and FROM scratch), loads them onto the
workers, and deletes the cluster at the end.

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
    BYO_IMAGE,
    IMAGE,
    JOBS_NS,
    MINIO_IMAGE,
    RELEASE,
    ROOT,
    SHARED_IN_NODE,
    SYSTEM_NS,
    TIMINGS,
    Cluster,
    build_byo_image,
    build_minio_image,
    ensure_docker_image,
    load_images,
)


# Module scope: the cluster goes when this tier's one module is done, not at the end of the whole
# run (its three nodes would idle through the other tiers, a quarter of a core and GBs of disk).
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
        pytest.fail("the session's kind cluster (scripts/kind-cluster up --offline) needs root; or "
                    "set RAVNEST_E2E_KUBECONFIG to a cluster's kubeconfig")
    ensure_docker_image(tmp_path_factory.mktemp("image"))
    build_byo_image()
    build_minio_image()
    script = ROOT / "scripts" / "kind-cluster"
    start = time.monotonic()
    up = subprocess.run(["bash", str(script), "up", "--offline"], capture_output=True, text=True,
                        timeout=3600)
    TIMINGS["cluster_up_s"] = time.monotonic() - start
    try:
        if up.returncode != 0:
            pytest.fail(f"scripts/kind-cluster up --offline exited {up.returncode}:\n"
                        f"{up.stdout[-2000:]}\n{up.stderr[-6000:]}")
        c = Cluster(up.stdout.strip().splitlines()[-1], local=True, shared=SHARED_IN_NODE)
        start = time.monotonic()
        load_images(c, IMAGE, BYO_IMAGE, MINIO_IMAGE)
        TIMINGS["image_load_s"] = time.monotonic() - start
        yield c
    finally:
        down = subprocess.run(["bash", str(script), "down"], capture_output=True, text=True,
                              timeout=600)
        if down.returncode != 0:
            print(f"scripts/kind-cluster down exited {down.returncode}:\n{down.stderr[-3000:]}")


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
