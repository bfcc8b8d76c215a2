"""Fixtures the integration tests share."""

from __future__ import annotations

import os
from pathlib import Path

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
