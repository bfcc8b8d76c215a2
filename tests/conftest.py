"""Shared fixtures: job documents built from the shipped example, and an environment in which
worker processes can import the test models."""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

if TYPE_CHECKING:
    from minio_server import S3Server

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent


@pytest.fixture
def digits_doc() -> dict[str, Any]:
    """The shipped examples/digits.yaml as a mutable document."""
    return copy.deepcopy(yaml.safe_load((ROOT / "examples" / "digits.yaml").read_text()))


@pytest.fixture
def worker_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let worker subprocesses import tests/models.py."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]))


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One MinIO (tests/minio_server.py) for the session; tests make buckets of their own."""
    from minio_server import minio_server  # imported here: s3fs takes seconds to import

    with minio_server() as server:
        yield server
