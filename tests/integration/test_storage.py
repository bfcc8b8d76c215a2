"""Checkpoints and outputs on a real S3-compatible store (MinIO, built from its Go module): a
local run writes them there and not in its folder, and a run on another "machine" (a fresh folder,
nothing shared but the bucket) resumes from them."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import uuid

import pytest
import s3fs
import torch
import yaml
from claimers import Claimers
from scoring import digits_accuracy

from ravnest import parse_job, run_job
from ravnest.errors import SpecError
from ravnest.examples.digits import build_model

pytestmark = pytest.mark.tools  # (scripts/test runs it once the tools are there)


@pytest.fixture
def bucket(s3_server, monkeypatch) -> str:
    """A fresh bucket; the run and its workers get the store's credentials the standard way, from
    the environment (the endpoint comes from the job)."""
    name = f"t-{uuid.uuid4().hex[:12]}"
    s3_server.make_bucket(name)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    return name


def _job(doc, s3_server, bucket: str):
    doc["spec"]["training"]["epochs"] = 3
    doc["spec"]["checkpoint"] = {"path": f"s3://{bucket}/ckpt/digits", "everySteps": 10}
    doc["spec"]["output"] = {"uri": f"s3://{bucket}/models/digits"}
    doc["spec"]["storage"] = {"s3": {"endpointUrl": s3_server.endpoint_url}}
    return parse_job(doc)


def test_checkpoints_and_outputs_go_to_s3_and_another_machine_resumes_there(
        tmp_path, digits_doc, s3_server, bucket):
    job = _job(digits_doc, s3_server, bucket)
    summary = run_job(job, tmp_path / "first", progress=False)
    fs = s3fs.S3FileSystem(**s3_server.storage_options(), skip_instance_cache=True)
    names = {p.rsplit("/", 1)[1] for p in fs.ls(f"{bucket}/models/digits")}
    assert {"model.pt", "best_model.pt", "learning_curve.csv", "learning_curve.png",
            "summary.json", "stages", "clusters"} <= names
    stored = json.loads(fs.cat_file(f"{bucket}/models/digits/summary.json"))
    assert stored == summary and summary["model"] == f"s3://{bucket}/models/digits/model.pt"
    model = torch.load(io.BytesIO(fs.cat_file(f"{bucket}/models/digits/model.pt")),
                       weights_only=True)
    assert list(model) == list(build_model().state_dict())
    assert digits_accuracy(model) == pytest.approx(summary["fused_val_metric"], abs=1e-6)
    assert summary["fused_val_metric"] >= 0.9
    assert fs.cat_file(f"{bucket}/models/digits/learning_curve.png")[:8] == b"\x89PNG\r\n\x1a\n"
    names = sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{bucket}/ckpt/digits"))
    assert names[0] == "ravnest-job.json"  # (whose it is; its lease was given back at the end)
    steps = names[1:]
    assert steps and all(s.startswith("step-") for s in steps) and len(steps) <= 2  # keep: 2
    final = int(steps[-1][5:])
    assert final == summary["updates"]
    nodes = {p.rsplit("/", 1)[1] for p in fs.ls(f"{bucket}/ckpt/digits/{steps[-1]}")}
    assert nodes == {f"node_{i}.{ext}" for i in range(6) for ext in ("pt", "plan", "sha256")}
    local = {p.name for p in (tmp_path / "first").iterdir()}
    assert not {"checkpoints", "model.pt", "stages"} & local, local

    again = run_job(job, tmp_path / "second", progress=False)
    assert again["resumed_from_step"] == final and again["samples_trained"] == 0
    assert again["fused_val_metric"] == pytest.approx(summary["fused_val_metric"], abs=1e-6)

    # another job pointed at the folder (issue 40: it resumed from it and pruned its steps) is
    # refused before any worker starts, and the folder keeps what it had
    before = {p: fs.cat_file(p) for p in fs.find(f"{bucket}/ckpt/digits")}
    other = job.model_copy(update={"metadata": job.metadata.model_copy(update={"name": "other"})})
    with pytest.raises(SpecError, match=r"spec\.checkpoint\.path: s3://.*/ckpt/digits holds the "
                                        r"checkpoints of job 'digits', not of job 'other'"):
        run_job(other, tmp_path / "third", progress=False)
    fs.invalidate_cache()
    assert {p: fs.cat_file(p) for p in fs.find(f"{bucket}/ckpt/digits")} == before
    assert not (tmp_path / "third" / "nodes").exists()


def test_runs_claiming_one_s3_folder_at_once_get_it_one_at_a_time(s3_server, bucket, digits_doc):
    """Three runs claim one folder on the store at once (conditional writes: If-None-Match, then
    If-Match), five times: each time exactly one holds it, and the others are told who does."""
    with Claimers(f"s3://{bucket}/ckpt/raced", [digits_doc] * 3,
                  endpoint=s3_server.endpoint_url) as claimers:
        for _ in range(5):
            done = claimers.race()
            assert sorted(d["won"] for d in done) == [False, False, True], done
            assert all(d["won"] or "is in use by ravnest run of job 'digits'" in d["why"]
                       for d in done), done
            claimers.release()


def test_a_claim_has_no_meaning_on_this_machine(tmp_path, digits_doc):
    digits_doc["spec"]["checkpoint"] = {"path": "pvc://ckpt/digits"}
    with pytest.raises(SpecError, match=r"spec\.checkpoint\.path: 'pvc://ckpt/digits' names a "
                                        r"PersistentVolumeClaim"):
        run_job(parse_job(digits_doc), tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_a_store_refusing_the_credentials_stops_the_run_before_it_starts(
        tmp_path, digits_doc, s3_server, bucket):
    """Checked by `ravnest run` itself (a process of its own, as a user runs it: this test's
    process holds a client made with the right credentials)."""
    _job(digits_doc, s3_server, bucket)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(digits_doc))
    env = {**os.environ, "AWS_SECRET_ACCESS_KEY": "not-the-secret"}
    result = subprocess.run([sys.executable, "-m", "ravnest", "run", str(job), "-o",
                             str(tmp_path / "run"), "--no-progress"],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode != 0
    assert re.search(r"spec\.checkpoint\.path: 's3://.*' is not writable", result.stderr), \
        result.stderr[-2000:]
    assert not (tmp_path / "run" / "nodes").exists()
