"""The cluster tier: the chart and a real training job on a real Kubernetes, from any kubeconfig.

RAVNEST_E2E_KUBECONFIG set: that cluster is used as it is (kind in a user's CI, see
scripts/kind-e2e); the images RAVNEST_E2E_IMAGE (default ravnest-k8s:test), RAVNEST_E2E_BYO_IMAGE
and RAVNEST_E2E_MINIO_IMAGE must already be on its nodes, and RAVNEST_E2E_HOSTPATH (default /tmp)
names a node folder for hostPath volumes that every node mounts. Unset: the tier makes a kind
cluster of one control-plane and two worker nodes here, offline (scripts/kind-cluster up --offline:
a node image built here, dockerd through scripts/runc-bounded), builds the images in the local
Docker Engine (our image by tests/project_image.py, the same build as the image tier's) and puts
them on the workers (scripts/kind-cluster load), and deletes the cluster when the tier is done
(kind_tier.py). RAVNEST_E2E_PREPARED set (scripts/test sets it): scripts/test began making that
cluster in the background before the unit tier, and the tier waits for it to be ready.

Nothing here skips: a missing tool or a cluster that does not come up fails with the reason.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kind_tier
import pytest
from e2e_cluster import IMAGE, JOBS_NS, RELEASE, ROOT, SYSTEM_NS, TIMINGS, Cluster


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
    ahead = os.environ.get("RAVNEST_E2E_PREPARED")
    try:
        pid = os.environ.get("RAVNEST_E2E_PREPARED_PID")
        made = (kind_tier.prepared(Path(ahead), pid=int(pid) if pid else None) if ahead
                else kind_tier.make(tmp_path_factory.mktemp("image")))
        TIMINGS.update(made["timings"])
        yield Cluster(made["kubeconfig"], hostpath=kind_tier.KIND_SHARED, nodes=made["nodes"])
    except kind_tier.NotMade as e:
        pytest.fail(str(e))
    finally:
        if (failed := kind_tier.down()) is not None:
            print(failed)


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
