"""The checked-in table of invalid RavnestJobs (invalid_jobs.yaml): each gives exactly its errors
through the parser every front door uses (`load_job`), and some through `ravnest validate`."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from ravnest.errors import SpecError
from ravnest.spec import load_job

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "digits.yaml"
TABLE: list[dict[str, Any]] = yaml.safe_load((Path(__file__).parent / "invalid_jobs.yaml")
                                             .read_text())


def _steps(path: str) -> list[str | int]:
    return [int(p) if p.isdigit() else p for p in re.findall(r"[^.\[\]]+", path)]


def job_file(row: dict[str, Any], tmp_path: Path) -> Path:
    """The row's job file: its text, or the example with its changes (each change's parent must
    exist in the example, so a mistyped path in the table fails here instead of testing
    nothing)."""
    path = tmp_path / "job.yaml"
    if "text" in row:
        path.write_text(row["text"])
        return path
    document = yaml.safe_load(EXAMPLE.read_text())
    changes = [(p, v, False) for p, v in (row.get("set") or {}).items()]
    changes += [(p, None, True) for p in row.get("delete") or []]
    assert changes, f"{row['name']}: no set, delete or text"
    for field, value, delete in changes:
        *parents, last = _steps(field)
        node = document
        for step in parents:
            node = node[step]
        if delete:
            del node[last]
        else:
            node[last] = copy.deepcopy(value)
    path.write_text(yaml.safe_dump(document))
    return path


def expected(row: dict[str, Any], path: Path) -> list[str]:
    return [line.replace("{file}", str(path)) for line in row["errors"]]


def test_the_table_has_enough_distinct_entries() -> None:
    names = [row["name"] for row in TABLE]
    assert len(names) >= 15 and len(set(names)) == len(names)
    assert all(row["errors"] for row in TABLE)
    assert sum(bool(row.get("cli")) for row in TABLE) >= 2


def test_the_example_the_table_starts_from_is_valid() -> None:
    assert load_job(EXAMPLE).name == "digits"


@pytest.mark.parametrize("row", TABLE, ids=[row["name"] for row in TABLE])
def test_each_invalid_job_gives_exactly_its_errors(row: dict[str, Any], tmp_path: Path) -> None:
    path = job_file(row, tmp_path)
    with pytest.raises(SpecError) as err:
        load_job(path)
    assert err.value.problems == expected(row, path)


CLI_ROWS = [row for row in TABLE if row.get("cli")]


@pytest.mark.parametrize("row", CLI_ROWS, ids=[row["name"] for row in CLI_ROWS])
def test_ravnest_validate_prints_exactly_those_errors(row: dict[str, Any],
                                                      tmp_path: Path) -> None:
    path = job_file(row, tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        str(ROOT / "worker"), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-m", "ravnest", "validate", str(path)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr == "error: invalid job:\n" + "".join(
        f"  {line}\n" for line in expected(row, path))
