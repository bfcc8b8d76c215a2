"""A checkpoint folder belongs to one job (issue 40, item 3): its record names the job and the
training settings its steps were written with, its lease the run that writes it now. Another job is
refused; the same job with changed settings, or an earlier one of the same name, only with
`checkpoint.resume: force`; a live lease of another run keeps every other run out, a lease whose
process is gone or whose time ran out does not. Racing claims come from processes of their own."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from claimers import Claimers

from ravnest.errors import RavnestError, SpecError
from ravnest.run import owning
from ravnest.spec import parse_job
from ravnest.storing import StorageError, open_location
from ravnest.train.metrics import Identity, WorkerMetrics
from ravnest.train.resuming import Checkpoints
from ravnest.train.settings import Settings


def _doc(name: str = "digits", lr: float = 1e-3, epochs: int = 2, **training: Any
         ) -> dict[str, Any]:
    return {"apiVersion": "ravnest.io/v1alpha1", "kind": "RavnestJob",
            "metadata": {"name": name},
            "spec": {"model": {"entrypoint": "ravnest.examples.digits:build_model",
                               "exampleInput": {"shape": [32, 1, 8, 8], "dtype": "float32"}},
                     "data": {"entrypoint": "ravnest.examples.digits:datasets"},
                     "providers": [{"ram": 4}],
                     "training": {"epochs": epochs,
                                  "optimizer": {"name": "Adam", "params": {"lr": lr}},
                                  **training}}}


def _job(doc: dict[str, Any], resume: str = "auto", uid: str | None = None) -> Any:
    doc = json.loads(json.dumps(doc))
    doc["spec"]["checkpoint"] = {"resume": resume}
    if uid:
        doc["metadata"].update(namespace="team", uid=uid)
    return parse_job(doc)


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def test_a_folder_of_another_job_is_refused_whatever_resume_says(tmp_path: Path) -> None:
    where = open_location(tmp_path)
    owning.claim(where, _job(_doc("first")), "/jobs/first.yaml").release()
    record = (tmp_path / owning.RECORD).read_bytes()
    for resume in ("auto", "force"):
        with pytest.raises(SpecError) as e:
            owning.claim(where, _job(_doc("second", lr=0.1, epochs=9), resume),
                         "/jobs/second.yaml")
        (problem,) = e.value.problems
        assert problem.startswith(f"spec.checkpoint.path: {tmp_path} holds the checkpoints of "
                                  f"job 'first' of /jobs/first.yaml, not of job 'second'")
        assert (tmp_path / owning.RECORD).read_bytes() == record
        assert not (tmp_path / owning.LEASE).exists()  # (nothing held after a refusal)


def test_changed_training_settings_are_refused_unless_resume_force(tmp_path: Path) -> None:
    where = open_location(tmp_path)
    owning.claim(where, _job(_doc()), "job.yaml").release()
    record = (tmp_path / owning.RECORD).read_bytes()
    changed = _doc(lr=0.01, epochs=5, gradientClipping={"maxNorm": 1.0})
    with pytest.raises(SpecError) as e:
        owning.claim(where, _job(changed), "job.yaml")
    where_said = f"spec.checkpoint.path: {tmp_path} was written with other training settings: "
    assert e.value.problems[:-1] == [
        where_said + "spec.training.epochs: 2 then, 5 now",
        where_said + "spec.training.gradientClipping: None then, {'maxNorm': 1.0} now",
        where_said + "spec.training.optimizer.params.lr: 0.001 then, 0.01 now"]
    assert "set resume: force" in e.value.problems[-1]
    assert (tmp_path / owning.RECORD).read_bytes() == record

    # what does not change a step's meaning changes nothing here
    owning.claim(where, _job(_doc(validationFrequency=3, compression="fp16")), "job.yaml"
                 ).release()
    owning.claim(where, _job(changed, "force"), "job.yaml").release()
    assert json.loads((tmp_path / owning.RECORD).read_text())["settings"]["epochs"] == 5
    owning.claim(where, _job(changed), "job.yaml").release()  # (the record says 5 now)


def test_an_earlier_job_of_the_same_name_needs_resume_force(tmp_path: Path) -> None:
    """On Kubernetes a RavnestJob deleted and made again has another uid; locally, a job of the
    same name from another file."""
    where = open_location(tmp_path)
    owning.claim(where, _job(_doc(), uid="uid-1")).release()
    with pytest.raises(SpecError) as e:
        owning.claim(where, _job(_doc(), uid="uid-2"))
    assert e.value.problems[0] == (
        f"spec.checkpoint.path: {tmp_path} was written by an earlier RavnestJob team/digits "
        f"(uid uid-1); this is RavnestJob team/digits (uid uid-2)")
    owning.claim(where, _job(_doc(), "force", uid="uid-2")).release()
    other = open_location(tmp_path / "local")
    owning.claim(other, _job(_doc()), "a/job.yaml").release()
    with pytest.raises(SpecError, match="was written by an earlier job 'digits' of "):
        owning.claim(other, _job(_doc()), "b/job.yaml")


def test_a_live_lease_keeps_other_runs_out_and_a_gone_or_late_one_does_not(
        tmp_path: Path) -> None:
    where = open_location(tmp_path)
    job = _job(_doc())
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lease = {"holder": "ravnest run of job 'digits', pid elsewhere", "host":
                 socket.gethostname(), "pid": sleeper.pid, "expires": time.time() + 300}
        (tmp_path / owning.LEASE).write_text(json.dumps(lease))
        with pytest.raises(SpecError) as e:
            owning.claim(where, job)
        (problem,) = e.value.problems
        assert problem.startswith(f"spec.checkpoint.path: {tmp_path} is in use by ravnest run "
                                  f"of job 'digits', pid elsewhere (its lease runs until ")
        assert "two jobs never write one checkpoint folder" in problem
        assert not (tmp_path / owning.RECORD).exists()  # (nothing written)
    finally:
        sleeper.kill()
        sleeper.wait()
    owning.claim(where, job).release()  # its process is gone from this machine: taken over

    # a pod's lease (no pid) holds until its time runs out
    pod = {"holder": "RavnestJob team/other (uid 7)", "expires": time.time() + 300}
    (tmp_path / owning.LEASE).write_text(json.dumps(pod))
    with pytest.raises(SpecError, match="is in use by RavnestJob team/other"):
        owning.claim(where, job)
    (tmp_path / owning.LEASE).write_text(json.dumps({**pod, "expires": time.time() - 1}))
    lease = owning.claim(where, job)
    assert json.loads((tmp_path / owning.LEASE).read_text())["holder"] == lease.holder
    lease.release()
    assert not (tmp_path / owning.LEASE).exists()


def test_a_lease_taken_by_another_run_stops_this_one_writing(tmp_path: Path) -> None:
    """Renewed in a thread; once another run holds it (this one's ran out meanwhile), the run
    learns so, and a checkpoint guarded by it is refused."""
    where = open_location(tmp_path)
    said: list[str] = []
    lease = owning.claim(where, _job(_doc())).keep(every=0.05, on_lost=said.append)
    renewed = json.loads((tmp_path / owning.LEASE).read_text())["expires"]
    deadline = time.monotonic() + 10
    while json.loads((tmp_path / owning.LEASE).read_text())["expires"] == renewed:
        assert time.monotonic() < deadline, "never renewed"
        time.sleep(0.02)
    lease.check()  # (still this run's)
    (tmp_path / owning.LEASE).write_text(json.dumps(
        {"holder": "RavnestJob team/other (uid 7)", "expires": time.time() + 300}))
    while not said:
        assert time.monotonic() < deadline, "the loss went unnoticed"
        time.sleep(0.02)
    assert said == [lease.lost] and "is in use by RavnestJob team/other" in said[0]
    with pytest.raises(RavnestError, match="is in use by RavnestJob team/other"):
        lease.check()
    checkpoints = Checkpoints(Settings(checkpoint_dir=str(tmp_path)), "node_0", ["node_0"],
                              WorkerMetrics(Identity("digits", "ns", "node_0", "root", 0, 0)))
    checkpoints.guard = lease.check  # (as a root's on Kubernetes)
    with pytest.raises(RavnestError, match="is in use by RavnestJob team/other"):
        checkpoints.save(10, {"stage": {}})
    assert not list(tmp_path.glob("step-*"))
    lease.release()  # (another's: left as it is)
    assert "team/other" in (tmp_path / owning.LEASE).read_text()


def test_a_lease_is_kept_through_a_storage_outage(tmp_path: Path) -> None:
    """Renewals that fail on the storage (down for a while) are tried again; only another run
    holding the lease loses it."""
    where = open_location(tmp_path)
    lease = owning.claim(where, _job(_doc()))
    update, calls = where.update, []

    def flaky(name: str, change: Any) -> Any:
        calls.append(name)
        if len(calls) <= 2:
            raise StorageError("the store is down")
        return update(name, change)

    where.update = flaky  # type: ignore[method-assign]
    renewed = json.loads((tmp_path / owning.LEASE).read_text())["expires"]
    lease.keep(every=0.05)
    deadline = time.monotonic() + 10
    while json.loads((tmp_path / owning.LEASE).read_text())["expires"] == renewed:
        assert time.monotonic() < deadline, "never renewed after the outage"
        time.sleep(0.02)
    assert len(calls) >= 3 and lease.lost is None
    lease.check()
    lease.release()


ROUNDS = 8


def test_claims_made_at_once_give_the_folder_to_one_run(tmp_path: Path) -> None:
    """Four runs of one job (as `ravnest run job.yaml -o` four folders, one checkpoint path)
    claim it at once, eight times: each time exactly one holds it and the others are told who."""
    with Claimers(str(tmp_path / "ckpt"), [_doc()] * 4) as claimers:
        for _ in range(ROUNDS):
            done = claimers.race()
            assert sorted(d["won"] for d in done) == [False, False, False, True], done
            for d in done:
                assert d["won"] or "is in use by ravnest run of job 'digits'" in d["why"], d
            claimers.release()
    assert not (tmp_path / "ckpt" / owning.LEASE).exists()
