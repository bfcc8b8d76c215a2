"""Jobs that cannot work fail at `ravnest plan` / `ravnest run` before any worker starts, with an
error that names the field and no Python traceback (issue 19 items 6, 7 and 9).

Each case runs the command line on the shipped digits example with one field changed; user code
that misbehaves lives in fixture modules written next to the job file. `ravnest plan` runs in
this process (`cli.main`, its stderr and log captured: the same code, without the 5 s a Python
process with torch takes to start), `ravnest run` in a subprocess, as a user's (it sets signal
handlers and starts processes of its own).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from ravnest import cli
from ravnest.run.local import WORKER_BASE_BYTES, memory_warning

FIXTURES = {
    "planfix.py": (
        "def raises(**kwargs):\n"
        "    raise RuntimeError('factory exploded')\n\n\n"
        "def bad_data(**kwargs):\n"
        "    raise RuntimeError('dataset shard missing')\n"),
    "planfix_boom.py": "raise RuntimeError('module exploded at import')\n",
    "planfix_syntax.py": "def build(:\n",
}

Edit = Callable[[dict[str, Any]], None]


def _set(path: str, value: Any) -> Edit:
    """An edit of the job's spec: `path` is dotted below `spec`."""
    *parents, last = path.split(".")

    def edit(spec: dict[str, Any]) -> None:
        for key in parents:
            spec = spec.setdefault(key, {})
        spec[last] = value
    return edit


def _write(tmp_path: Path, doc: dict[str, Any]) -> None:
    for name, text in FIXTURES.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))


def ravnest(tmp_path: Path, doc: dict[str, Any], *args: str) -> subprocess.CompletedProcess[str]:
    """`python -m ravnest <args> job.yaml` on `doc`, with the fixture modules importable."""
    _write(tmp_path, doc)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, "-m", "ravnest", *args, str(tmp_path / "job.yaml")],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)


PLAN_ERRORS = [
    ("import-raises", _set("model.entrypoint", "planfix_boom:build"),
     "spec.model.entrypoint", "RuntimeError: module exploded at import"),
    ("import-syntax", _set("model.entrypoint", "planfix_syntax:build"),
     "spec.model.entrypoint", "SyntaxError"),
    ("factory-raises", _set("model.entrypoint", "planfix:raises"),
     "spec.model.entrypoint", "RuntimeError: factory exploded"),
    ("negative-width", _set("model.kwargs", {"width": -4}),
     "spec.model.kwargs", "negative dimension -4"),
    ("huge-seed", _set("data.seed", 10**400), "spec.data.seed", "must be at most"),
    ("huge-batch", _set("data.batchSize", 10**400), "spec.data.batchSize", "must be at most"),
    ("huge-dim", _set("model.exampleInput.shape", [10**400, 1, 8, 8]),
     "spec.model.exampleInput.shape", "1 GiB"),
    ("512-GB-example", _set("model.exampleInput.shape", [2_000_000_000, 1, 8, 8]),
     "spec.model.exampleInput.shape", "477 GiB"),
]
PREFLIGHT_ERRORS = [
    ("negative-lr", _set("training.optimizer.params", {"lr": -1}),
     "spec.training.optimizer", "Invalid learning rate: -1"),
    ("batch-over-training-set", _set("data.batchSize", 5000),
     "spec.data.batchSize", "1438 training samples"),
    ("data-raises", _set("data.entrypoint", "planfix:bad_data"),
     "spec.data.entrypoint", "RuntimeError: dataset shard missing"),
]

ALL_ERRORS = PLAN_ERRORS + PREFLIGHT_ERRORS


def _refused(result: subprocess.CompletedProcess[str], field: str, cause: str) -> None:
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stderr, result.stderr
    assert f"{field}" in result.stderr and cause in result.stderr, result.stderr


@pytest.mark.parametrize(("edit", "field", "cause"), [c[1:] for c in ALL_ERRORS],
                         ids=[c[0] for c in ALL_ERRORS])
def test_plan_names_the_field_without_a_traceback(tmp_path, digits_doc, edit, field, cause,
                                                  monkeypatch, capsys, caplog):
    edit(digits_doc["spec"])
    _write(tmp_path, digits_doc)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    try:
        code = cli.main(["plan", str(tmp_path / "job.yaml")])
    finally:
        for name in [m for m in sys.modules if m.startswith("planfix")]:
            del sys.modules[name]
    said = capsys.readouterr()
    _refused(subprocess.CompletedProcess([], code, said.out, said.err + caplog.text), field,
             cause)


def _no_worker_started(out: Path) -> None:
    assert not list(out.glob("logs/*.log")) and not list(out.glob("nodes/*.json"))


@pytest.mark.parametrize(("edit", "field", "cause"), [c[1:] for c in PREFLIGHT_ERRORS],
                         ids=[c[0] for c in PREFLIGHT_ERRORS])
def test_run_fails_before_any_worker_starts(tmp_path, digits_doc, edit, field, cause):
    edit(digits_doc["spec"])
    result = ravnest(tmp_path, digits_doc, "run", "--no-progress", "-o", str(tmp_path / "out"))
    _refused(result, field, cause)
    _no_worker_started(tmp_path / "out")


def test_run_refuses_an_unwritable_checkpoint_folder_and_leaves_it_alone(tmp_path, digits_doc):
    (tmp_path / "a-file").write_text("not a folder")
    digits_doc["spec"]["checkpoint"]["path"] = str(tmp_path / "a-file" / "checkpoints")
    result = ravnest(tmp_path, digits_doc, "run", "--no-progress", "-o", str(tmp_path / "out"))
    _refused(result, "spec.checkpoint.path", "is not writable")
    _no_worker_started(tmp_path / "out")
    assert (tmp_path / "a-file").read_text() == "not a folder"


def test_plan_caps_the_clusters_it_chooses_to_what_the_data_feeds(tmp_path, digits_doc):
    """200 providers, 1438 training samples, batches of 32: at most 44 clusters get a batch."""
    del digits_doc["spec"]["plan"]
    digits_doc["spec"]["providers"] = [{"ram": 1, "replicas": 200}]
    result = ravnest(tmp_path, digits_doc, "plan")
    assert result.returncode == 0, result.stderr
    assert "44 cluster(s), 200 node(s)" in result.stdout.splitlines()[-1]


def test_plan_refuses_fixed_clusters_that_get_no_batch(tmp_path, digits_doc):
    digits_doc["spec"]["plan"] = {"clusters": 46}
    digits_doc["spec"]["providers"] = [{"ram": 1, "replicas": 46}]
    result = ravnest(tmp_path, digits_doc, "plan")
    _refused(result, "spec.plan.clusters", "46 clusters x batchSize 32 need 1472 training samples")
    assert "the training set has 1438: at most 44 cluster(s)" in result.stderr


def test_memory_warning_when_the_workers_exceed_the_machine(digits_doc):
    from ravnest import parse_job, plan_job

    plan, _, _ = plan_job(parse_job(digits_doc))
    need = sum(n.memory_bytes for n in plan.nodes) + 6 * WORKER_BASE_BYTES
    assert memory_warning(plan, need) is None
    warning = memory_warning(plan, need - 1)
    assert warning is not None and "6 workers need an estimated" in warning
    assert "spec.providers" in warning
