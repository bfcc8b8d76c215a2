"""The cluster tier: the chart and a real training job on a real Kubernetes, from any kubeconfig.

RAVNEST_E2E_KUBECONFIG set: that cluster is used as it is (kind in a user's CI, see
scripts/kind-e2e); the images RAVNEST_E2E_IMAGE (default ravnest-k8s:test), RAVNEST_E2E_BYO_IMAGE
and RAVNEST_E2E_MINIO_IMAGE must already be on its nodes, and RAVNEST_E2E_HOSTPATH (default /tmp)
names a node folder for hostPath volumes that every node mounts. Unset: the tier makes a kind
cluster of one control-plane and two worker nodes here, offline (scripts/kind-cluster up --offline:
a node image built here, dockerd through scripts/runc-bounded), builds the images in the local
Docker Engine (our image by tests/project_image.py, the same build as the image tier's) and puts
them on the workers (scripts/kind-cluster load), and deletes the cluster when the tier is done.

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

import project_image
import pytest
from e2e_cluster import (
    BYO_IMAGE,
    IMAGE,
    JOBS_NS,
    MINIO_IMAGE,
    RELEASE,
    ROOT,
    SYSTEM_NS,
    TIMINGS,
    Cluster,
    build_test_images,
    ensure_docker_image,
)

# The cluster this tier makes (not scripts/kind-e2e's, which a user may keep), and the folder
# scripts/kind-cluster mounts on every node.
KIND_CLUSTER = "ravnest-e2e-tier"
KIND_SHARED = "/mnt/ravnest-shared"


# Module scope: the cluster goes when this tier's one module is done, not at the end of the whole
# run (it would idle through the other tiers).
@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    given = os.environ.get("RAVNEST_E2E_KUBECONFIG")
    if given:
        if not Path(given).is_file():
            pytest.fail(f"RAVNEST_E2E_KUBECONFIG={given} is not a file")
        c = Cluster(given, hostpath=os.environ.get("RAVNEST_E2E_HOSTPATH", "/tmp"))
        c.kubectl("get", "--raw", "/readyz")
        yield c
        return
    if os.geteuid() != 0:
        pytest.fail("a kind cluster made here (scripts/kind-cluster up --offline) needs root; or "
                    "set RAVNEST_E2E_KUBECONFIG to a cluster's kubeconfig")
    ensure_docker_image(tmp_path_factory.mktemp("image"))
    build_test_images()
    script = ["bash", str(ROOT / "scripts" / "kind-cluster")]
    env = {**os.environ, "KIND_CLUSTER": KIND_CLUSTER}
    start = time.monotonic()
    up = subprocess.run([*script, "up", "--offline"], capture_output=True, text=True,
                        timeout=3600, env=env)
    TIMINGS["cluster_up_s"] = time.monotonic() - start
    try:
        if up.returncode != 0:
            pytest.fail(f"scripts/kind-cluster up --offline exited {up.returncode}:\n"
                        f"{up.stdout[-2000:]}\n{up.stderr[-6000:]}")
        start = time.monotonic()
        load = subprocess.run([*script, "load", IMAGE, BYO_IMAGE, MINIO_IMAGE],
                              capture_output=True, text=True, timeout=3600, env=env)
        TIMINGS["image_load_s"] = time.monotonic() - start
        if load.returncode != 0:
            pytest.fail(f"scripts/kind-cluster load exited {load.returncode}:\n"
                        f"{load.stderr[-4000:]}")
        nodes = project_image.docker("ps", "--filter",
                                     f"label=io.x-k8s.kind.cluster={KIND_CLUSTER}", "--format",
                                     "{{.Names}}", check=False, timeout=60)
        yield Cluster(up.stdout.strip().splitlines()[-1], hostpath=KIND_SHARED,
                      nodes=sorted(nodes.stdout.split()))
    finally:
        down = subprocess.run([*script, "down"], capture_output=True, text=True, timeout=600,
                              env=env)
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
