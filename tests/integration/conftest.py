"""Fixtures the integration tests share."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gated_loss import GATE_ENV


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The gate of `gated_loss` (closed while this file exists) for the workers that a test
    starts after asking for it (locally, or as a test kubelet's pods): they import that module
    from this folder."""
    monkeypatch.setenv(GATE_ENV, str(tmp_path / "gate"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [
        str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH")])))
    return tmp_path / "gate"


@pytest.fixture(scope="session")
def operator_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, ...]]:
    """One apiserver (with etcd and the controller manager), test kubelet and operator for the
    whole session, shared by the operator tier's modules (test_operator, test_operator_faults,
    test_operator_security): each takes it through `operator_harness.module_cluster`, which
    deletes the module's jobs when it is done, so that the next module starts with none, instead
    of each module starting and stopping its own."""
    from operator_harness import operator_cluster

    with operator_cluster(tmp_path_factory.mktemp("operator")) as parts:
        yield parts
