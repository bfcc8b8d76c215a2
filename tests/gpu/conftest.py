"""CUDA tests: they run where torch sees a CUDA device, and are reported as not run, with the
reason, everywhere else (CI has none). `RAVNEST_TEST_DEVICE=cpu` runs the same tests on the CPU
(a dry run of their code, not a check of the GPU path)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

DEVICE = os.environ.get("RAVNEST_TEST_DEVICE", "cuda")


def _why_not() -> str | None:
    if DEVICE == "cpu" or torch.cuda.is_available():
        return None
    return (f"no CUDA device here (torch {torch.__version__}, CUDA build "
            f"{torch.version.cuda or 'none'}): tests/gpu runs where one is")


def pytest_collection_modifyitems(config: Any, items: list[pytest.Item]) -> None:
    why = _why_not()
    if why is None:
        return
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture
def device() -> str:
    return DEVICE
