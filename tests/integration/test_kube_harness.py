"""The Kubernetes harness itself: a real etcd + kube-apiserver answer kubectl.

Fails (does not skip) when the binaries are missing: build them with scripts/k8s-tools."""

from __future__ import annotations

import pytest
from kube import MissingBinary, find_binary, local_apiserver

pytestmark = pytest.mark.tools  # (scripts/test runs it once the tools are there)


def test_local_apiserver_lists_namespaces(tmp_path):
    missing = []
    for name in ("etcd", "kube-apiserver", "kubectl"):
        try:
            find_binary(name)
        except MissingBinary as e:
            missing.append(str(e))
    if missing:
        pytest.fail("\n".join(missing), pytrace=False)
    with local_apiserver(tmp_path) as kube:
        assert kube.server.startswith("https://127.0.0.1:")
        names = kube.kubectl("get", "ns", "-o", "name").split()
        assert {"namespace/default", "namespace/kube-system"} <= set(names), names
        assert kube.kubectl("auth", "can-i", "*", "*").strip() == "yes"
        procs = list(kube.processes.values())
    assert all(p.poll() is not None for p in procs), "etcd/kube-apiserver still running"
