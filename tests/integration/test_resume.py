"""A worker killed mid-training with no restarts allowed (backoffLimit 0): the run fails loudly, and
running it again resumes from the last complete checkpoint instead of starting over; a job of
another plan pointed at that checkpoint folder is refused at once. (Restarts within one run:
test_faults.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml
from processes import worker_pid

from ravnest.plan import building
from ravnest.spec import parse_job
from ravnest.train import checkpointing

ROOT = Path(__file__).resolve().parents[2]


def test_kill_a_worker_then_resume_from_checkpoint(tmp_path, digits_doc):
    digits_doc["spec"]["checkpoint"] = {"everySteps": 10, "keep": 2}
    digits_doc["spec"]["runPolicy"] = {"backoffLimit": 0, "recovery": "job"}
    digits_doc["spec"]["training"]["epochs"] = 6
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(digits_doc))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "ravnest", "run", str(job), "-o", str(out), "--no-progress"]
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ckpt = out / "checkpoints"
    deadline = time.monotonic() + 300
    done: list[int] = []
    while time.monotonic() < deadline:
        # a step's directory appears with its first node's file: wait until step 30 or later is
        # complete for all six nodes, or the kill may land before node_3 wrote it
        names = [p.stem for p in (out / "nodes").glob("node_*.json")]
        done = checkpointing.complete_steps(ckpt, names) if len(names) == 6 else []
        if done and done[-1] >= 30:
            break
        assert first.poll() is None, first.communicate()[1]
        time.sleep(0.2)
    assert done and done[-1] >= 30, f"no complete checkpoint at step 30 or later: {done}"
    victim = worker_pid(out / "nodes" / "node_3.json")
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    _, err = first.communicate(timeout=120)
    assert first.returncode == 1
    assert "worker node_3 exited with code -9" in err

    second = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    logs = "".join(p.read_text() for p in (out / "logs").glob("*.log"))
    resumed = [int(line.split("at step ")[1].split()[0]) for line in logs.splitlines()
               if "resumed from checkpoint at step" in line]
    assert len(resumed) == 6 and len(set(resumed)) == 1 and resumed[0] >= done[-1]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["updates"] == 6 * 22  # 1437 samples // (2 clusters x 32) per epoch
    assert summary["val_metric"] >= 0.95
    _another_job_is_refused_the_folder(tmp_path, digits_doc, ckpt)


def _another_job_is_refused_the_folder(tmp_path: Path, doc: dict, ckpt: Path) -> None:
    """Issue 40: a job of another name, learning rate and epoch count pointed at the folder
    resumed from its newest step and pruned the older ones; it is refused before any worker
    starts now, as is the same job with those settings changed, and the folder keeps its files."""
    files = {p.relative_to(ckpt): p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}
    doc["spec"]["checkpoint"]["path"] = str(ckpt)
    doc["spec"]["training"]["epochs"] = 9
    doc["spec"]["training"]["optimizer"]["params"]["lr"] = 0.01
    job = tmp_path / "changed.yaml"
    for name, said in (("other", f"spec.checkpoint.path: {ckpt} holds the checkpoints of job "
                                 f"'digits' of {tmp_path / 'job.yaml'}, not of job 'other'"),
                       ("digits", f"spec.checkpoint.path: {ckpt} was written by an earlier job "
                                  f"'digits' of {tmp_path / 'job.yaml'}")):
        doc["metadata"]["name"] = name
        job.write_text(yaml.safe_dump(doc))
        run = subprocess.run([sys.executable, "-m", "ravnest", "run", str(job), "-o",
                              str(tmp_path / name), "--no-progress"],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 2, run.stderr[-3000:]
        assert said in run.stderr, run.stderr[-3000:]
        assert not (tmp_path / name / "nodes").exists()
    assert "spec.training.optimizer.params.lr: 0.003 then, 0.01 now" in run.stderr
    assert "spec.training.epochs: 6 then, 9 now" in run.stderr
    assert "set resume: force" in run.stderr
    assert {p.relative_to(ckpt): p.read_bytes() for p in ckpt.rglob("*") if p.is_file()} == files


def test_a_job_of_another_plan_is_refused_at_once_by_a_checkpoint_folder(tmp_path, digits_doc):
    """The folder holds checkpoints a six-provider digits run wrote; the same job on three
    providers plans other stages, so their state would not fit: the run is refused before any
    worker starts (no crash loop on "Missing key(s)"), and those checkpoints stay as they were."""
    digits_doc["spec"]["checkpoint"] = {"everySteps": 10, "keep": 2}
    theirs, _, _ = building.plan_job(parse_job(digits_doc))
    out = tmp_path / "out"
    for node in theirs.names():
        checkpointing.save(out / "checkpoints", 40, node, {"stage": {}}, theirs.fingerprint)
    before = sorted(p.name for p in (out / "checkpoints" / "step-00000040").iterdir())
    digits_doc["spec"]["providers"] = digits_doc["spec"]["providers"][:3]
    digits_doc["spec"]["plan"] = {"clusters": 1}
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(digits_doc))
    run = subprocess.run([sys.executable, "-m", "ravnest", "run", str(job), "-o", str(out),
                          "--no-progress"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stderr[-3000:]
    assert (f"checkpoint folder {out.resolve() / 'checkpoints'} holds checkpoints of another plan"
            in run.stderr)
    assert f"written by plan {theirs.fingerprint}; this job's plan is " in run.stderr
    assert "Choose another checkpoint path (spec.checkpoint.path)" in run.stderr
    assert "Traceback" not in run.stderr
    assert not (out / "logs").exists() and not (out / "nodes").exists()  # no worker started
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000040"]
    assert sorted(p.name for p in (out / "checkpoints" / "step-00000040").iterdir()) == before
