"""Storage locations: the forms a job may name, local folders, and checkpoints on a filesystem
that is not local (fsspec's in-memory one: objects, no rename, no mmap), as on an object store."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

from ravnest import storing
from ravnest.errors import SpecError
from ravnest.spec import parse_job
from ravnest.storing import Location, Options, StorageError, open_location
from ravnest.train import checkpointing


@pytest.mark.parametrize("uri", ["checkpoints", "/abs/path", "file:///abs", "s3://bucket",
                                 "s3://bucket/a/b", "pvc://my-claim/runs/x", "gs://b/p"])
def test_forms_a_job_may_name(uri):
    assert storing.check(uri) is None


@pytest.mark.parametrize(("uri", "says"), [
    ("ftp://host/x", "unknown storage protocol 'ftp'"),
    ("s3://", "names its bucket first"),
    ("pvc:///x", "names its claim first"),
    ("pvc://Not_A_Claim/x", "not a PersistentVolumeClaim name"),
    ("file://relative", "must be absolute"),
    ("s3://b/../etc", "must not contain '..'"),
    ("", "must not be empty"),
])
def test_forms_refused_say_why(uri, says):
    assert says in storing.check(uri)


def test_a_bad_location_in_a_job_is_refused_naming_its_field(digits_doc):
    doc = digits_doc
    doc["spec"]["checkpoint"] = {"path": "ftp://x/y"}
    doc["spec"]["output"] = {"uri": "s3://"}
    doc["spec"]["storage"] = {"s3": {"endpointUrl": "minio:9000"}}
    with pytest.raises(SpecError) as e:
        parse_job(doc)
    text = str(e.value)
    assert "spec.checkpoint.path: unknown storage protocol 'ftp'" in text
    assert "spec.output.uri: a s3:// location names its bucket first" in text
    assert "spec.storage.s3.endpointUrl" in text


def test_durable_means_outliving_the_pod():
    assert storing.is_durable("s3://b/p") and storing.is_durable("pvc://c/p")
    assert not storing.is_durable("checkpoints") and not storing.is_durable("/data/ckpt")
    assert storing.pvc_claim("pvc://claim-1/a/b") == "claim-1"
    assert storing.pvc_claim("s3://claim-1/a") is None


def test_paths_and_claims_open_as_local_folders(tmp_path):
    rel = open_location("ckpt", base=tmp_path)
    assert rel.local and rel.root == str(tmp_path / "ckpt")
    claim = open_location("pvc://data/runs/a", Options(pvc_root=str(tmp_path / "pvc")))
    assert claim.local and claim.root == str(tmp_path / "pvc" / "data" / "runs" / "a")
    assert str(claim) == "pvc://data/runs/a"
    with pytest.raises(StorageError, match="unknown storage protocol"):
        open_location("ftp://x/y")


def test_a_protocol_whose_package_is_missing_is_named():
    with pytest.raises(StorageError, match="the az:// protocol needs a package"):
        open_location("az://container/prefix")


def test_s3_options_carry_the_endpoint_and_region():
    opts = Options(endpoint_url="http://127.0.0.1:9000", region="eu-west-1",
                   extra={"key": "k", "secret": "s"})
    s3 = opts.for_protocol("s3")
    assert (s3["key"], s3["secret"]) == ("k", "s")
    assert s3["client_kwargs"] == {"endpoint_url": "http://127.0.0.1:9000",
                                   "region_name": "eu-west-1"}
    assert s3["config_kwargs"]["connect_timeout"] == 10  # an unreachable store fails soon
    assert "client_kwargs" not in Options().for_protocol("s3")
    assert Options(endpoint_url="http://x").for_protocol("gs") == {}


def test_local_writes_are_whole_and_leave_no_temporary_files(tmp_path):
    loc = open_location(tmp_path / "a")
    loc.child("step-1").write("x.pt", b"data")
    assert loc.child("step-1").read("x.pt") == b"data"
    assert loc.folders() == ["step-1"] and loc.child("step-1").files() == ["x.pt"]
    assert os.listdir(tmp_path / "a" / "step-1") == ["x.pt"]
    loc.rename("step-1", "corrupt-step-1")
    assert loc.folders() == ["corrupt-step-1"]
    loc.remove("corrupt-step-1")
    loc.remove("never-there")
    assert loc.folders() == []


def test_a_folder_that_cannot_be_written_is_a_spec_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(SpecError, match=r"spec\.checkpoint\.path: .* is not writable"):
        open_location(blocker / "ckpt").probe("spec.checkpoint.path")


@pytest.fixture
def memory() -> Iterator[Location]:
    """A folder on fsspec's in-memory filesystem: not local, so checkpoints take the object-store
    paths (PUTs, copies for renames, loads from bytes)."""
    root = f"/ckpt-{uuid.uuid4().hex}"
    loc = Location(MemoryFileSystem(), root, f"memory://{root}")
    yield loc
    if loc.fs.exists(root):
        loc.fs.rm(root, recursive=True)


def _state(step: int) -> dict:
    return {"stage": {"w": torch.full((3,), float(step))}, "step": step}


def test_checkpoints_round_trip_on_a_remote_filesystem(memory):
    nodes = ["node_0", "node_1"]
    for step in (10, 20, 30):
        for n in nodes:
            checkpointing.save(memory, step, n, _state(step), plan="p1")
        checkpointing.prune(memory, nodes, keep=2)
    assert checkpointing.complete_steps(memory, nodes) == [20, 30]
    assert checkpointing.latest(memory, nodes, "p1") == 30
    state = checkpointing.load(memory, 30, "node_1")
    assert torch.equal(state["stage"]["w"], torch.full((3,), 30.0))
    with pytest.raises(checkpointing.ForeignCheckpoint):
        checkpointing.latest(memory, nodes, "another-plan")


def test_a_corrupt_remote_step_is_set_aside_and_the_one_before_used(memory):
    nodes = ["node_0"]
    for step in (10, 20):
        checkpointing.save(memory, step, "node_0", _state(step))
    memory.child("step-00000020").write("node_0.pt", b"truncated")
    assert checkpointing.latest(memory, nodes) == 10
    assert sorted(memory.folders()) == ["corrupt-step-00000020", "step-00000010"]
    assert memory.child("corrupt-step-00000020").read("node_0.pt") == b"truncated"


def test_a_planner_checks_the_locations_that_outlive_the_pods(tmp_path, digits_doc):
    from ravnest.plan.building import probe_storage

    digits_doc["spec"]["checkpoint"] = {"path": "pvc://ckpt/digits"}
    digits_doc["spec"]["output"] = {"uri": "relative/not/probed"}
    spec = parse_job(digits_doc).spec
    probe_storage(spec, str(tmp_path / "pvc"))
    assert (tmp_path / "pvc" / "ckpt" / "digits").is_dir()
    assert list((tmp_path / "pvc" / "ckpt" / "digits").iterdir()) == []  # the probe is gone
    assert not (tmp_path / "relative").exists()
    (tmp_path / "file").write_text("a file where the claims should be")
    with pytest.raises(SpecError, match=r"spec\.checkpoint\.path: 'pvc://ckpt/digits' is not "
                                        r"writable"):
        probe_storage(spec, str(tmp_path / "file"))


class _PrunedWhileRead(Location):
    """A checkpoint folder in which another node is pruning step 20 while this one checks it (the
    race a reader of a live folder meets): its first read there finds the state file deleted."""

    def child(self, name: str) -> Location:
        return _PrunedWhileRead(self.fs, self.path(name), f"{self.uri}/{name}")

    def read(self, name: str) -> bytes:
        pruned = f"{self.root}/node_0.pt"
        if self.root.endswith("step-00000020") and self.fs.exists(pruned):
            self.fs.rm(pruned)
        return super().read(name)


def test_a_step_pruned_while_it_is_checked_is_passed_over_not_set_aside(memory):
    """Found by test_faults: a reader took a step another node was pruning for corrupt and set
    it aside (and the one before, pruned too), so it found no checkpoint at all."""
    for step in (10, 20):
        checkpointing.save(memory, step, "node_0", _state(step))
    racing = _PrunedWhileRead(memory.fs, memory.root, memory.uri)
    assert checkpointing.latest(racing, ["node_0"]) == 10
    assert "corrupt-step-00000020" not in memory.folders()
