"""Checkpoints on disk: a truncated, corrupted or half-written newest checkpoint is detected by its
checksum, one that does not load (garbage with a matching checksum) by loading it, and the previous
complete one is used; a folder holding another plan's checkpoints is refused, never loaded; pruning
never deletes the one a resume needs."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import pytest
import torch

from ravnest.train import checkpointing
from ravnest.train.metrics import Identity, WorkerMetrics
from ravnest.train.resuming import Checkpoints
from ravnest.train.settings import Settings

NODES = ["node_0", "node_1"]


def _state(step: int) -> dict[str, object]:
    return {"step": step, "weight": torch.full((64, 64), float(step))}


def _write(root: Path, *steps: int) -> None:
    for step in steps:
        for node in NODES:
            checkpointing.save(root, step, node, _state(step))


def _file(root: Path, step: int, name: str) -> Path:
    return root / f"step-{step:08d}" / name


def test_newest_intact_step_is_resumed_with_its_own_state(tmp_path):
    _write(tmp_path, 10, 20)
    assert checkpointing.latest(tmp_path, NODES) == 20
    state = checkpointing.load(tmp_path, 20, "node_1")
    assert state["step"] == 20
    torch.testing.assert_close(state["weight"], torch.full((64, 64), 20.0))
    assert not list(tmp_path.rglob("*.tmp-*"))  # atomic writes leave no temporary files


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_truncate, _flip_a_byte], ids=["truncated", "flipped byte"])
def test_damaged_newest_checkpoint_is_detected_and_the_previous_one_used(tmp_path, caplog,
                                                                          damage):
    _write(tmp_path, 10, 20)
    damage(_file(tmp_path, 20, "node_1.pt"))
    with caplog.at_level(logging.WARNING, logger="ravnest.train.checkpointing"):
        assert checkpointing.latest(tmp_path, NODES) == 10
    assert checkpointing.load(tmp_path, 10, "node_1")["step"] == 10
    message = caplog.text
    assert "step-00000020 is corrupt" in message
    assert "node_1.pt" in message and "does not match node_1.sha256" in message
    assert "node_0" not in message  # the intact file of that step is not blamed
    # set aside, not deleted: the next resume does not re-check it, and it can be inspected
    assert not (tmp_path / "step-00000020").exists()
    assert (tmp_path / "corrupt-step-00000020" / "node_1.pt").exists()
    caplog.clear()
    assert checkpointing.latest(tmp_path, NODES) == 10
    assert "corrupt" not in caplog.text


def test_a_step_without_a_checksum_is_incomplete_and_skipped(tmp_path):
    _write(tmp_path, 10, 20)
    _file(tmp_path, 20, "node_0.sha256").unlink()  # the writer died between file and checksum
    assert checkpointing.complete_steps(tmp_path, NODES) == [10]
    assert checkpointing.latest(tmp_path, NODES) == 10


def test_a_step_missing_a_node_is_incomplete(tmp_path):
    _write(tmp_path, 10)
    checkpointing.save(tmp_path, 20, "node_0", _state(20))
    assert checkpointing.latest(tmp_path, NODES) == 10
    assert checkpointing.latest(tmp_path, ["node_0"]) == 20


def test_a_wrong_checksum_file_is_detected(tmp_path):
    _write(tmp_path, 10, 20)
    _file(tmp_path, 20, "node_0.sha256").write_text("0" * 64)
    assert checkpointing.latest(tmp_path, NODES) == 10


def test_nothing_usable_means_start_from_scratch(tmp_path):
    assert checkpointing.latest(tmp_path / "absent", NODES) is None
    _write(tmp_path, 10)
    _truncate(_file(tmp_path, 10, "node_0.pt"))
    assert checkpointing.latest(tmp_path, NODES) is None


def test_corrupt_step_set_aside_twice_keeps_both(tmp_path):
    _write(tmp_path, 20)
    _flip_a_byte(_file(tmp_path, 20, "node_0.pt"))
    assert checkpointing.latest(tmp_path, NODES) is None
    _write(tmp_path, 20)
    _flip_a_byte(_file(tmp_path, 20, "node_1.pt"))
    assert checkpointing.latest(tmp_path, NODES) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corrupt-step-00000020",
                                                          "corrupt-step-00000020.1"]


def test_prune_keeps_the_newest_resumable_steps_and_drops_older_corrupt_ones(tmp_path):
    _write(tmp_path, 10)
    _flip_a_byte(_file(tmp_path, 10, "node_0.pt"))
    _write(tmp_path, 5)
    assert checkpointing.latest(tmp_path, NODES) == 5  # sets step 10 aside
    _write(tmp_path, 20, 30, 40)
    checkpointing.prune(tmp_path, NODES, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000030", "step-00000040"]
    # a step still being written (no checksum from every node yet) is not counted as kept
    checkpointing.save(tmp_path, 50, "node_0", _state(50))
    checkpointing.prune(tmp_path, NODES, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000040", "step-00000050"]
    assert checkpointing.latest(tmp_path, NODES) == 40


def _garbage_with_matching_checksum(path: Path) -> None:
    data = b"not a checkpoint " * 100
    path.write_bytes(data)
    path.with_suffix(".sha256").write_text(hashlib.sha256(data).hexdigest())


def test_newest_step_that_does_not_load_is_set_aside_and_the_previous_one_used(tmp_path, caplog):
    _write(tmp_path, 10, 20)
    _garbage_with_matching_checksum(_file(tmp_path, 20, "node_1.pt"))
    with caplog.at_level(logging.WARNING, logger="ravnest.train.checkpointing"):
        assert checkpointing.latest(tmp_path, NODES) == 10
    assert checkpointing.load(tmp_path, 10, "node_0")["step"] == 10  # every node takes step 10
    assert "step-00000020 is corrupt" in caplog.text
    assert "node_1.pt does not load" in caplog.text and "node_0" not in caplog.text
    assert not (tmp_path / "step-00000020").exists()
    assert (tmp_path / "corrupt-step-00000020" / "node_1.pt").exists()


PLAN, OTHER = "a1b2c3d4e5f60718", "ffff0000eeee1111"


def _write_plan(root: Path, plan: str, *steps: int, nodes: list[str] = NODES) -> None:
    for step in steps:
        for node in nodes:
            checkpointing.save(root, step, node, _state(step), plan)


def test_checkpoints_of_this_plan_resume_and_unrecorded_ones_are_not_judged(tmp_path):
    _write(tmp_path, 10)  # written before checkpoints recorded their plan
    _write_plan(tmp_path, PLAN, 20)
    assert (_file(tmp_path, 20, "node_0.plan")).read_text() == PLAN
    assert checkpointing.latest(tmp_path, NODES, PLAN) == 20


def _assert_refused(root: Path, excinfo: pytest.ExceptionInfo[checkpointing.ForeignCheckpoint],
                    ) -> None:
    message = str(excinfo.value)
    assert f"checkpoint folder {root} holds checkpoints of another plan" in message
    assert f"plan {OTHER}" in message and f"this job's plan is {PLAN}" in message
    assert "Choose another checkpoint path (spec.checkpoint.path)" in message


def test_a_folder_of_another_plan_is_refused_and_left_as_it_was(tmp_path):
    _write_plan(tmp_path, OTHER, 10, 20)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(checkpointing.ForeignCheckpoint) as excinfo:
        checkpointing.latest(tmp_path, NODES, PLAN)
    _assert_refused(tmp_path, excinfo)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_another_plan_with_other_nodes_is_refused_too(tmp_path):
    # a plan of more providers: the old steps are not complete for its nodes, yet starting over
    # there would overwrite them
    _write_plan(tmp_path, OTHER, 10)
    with pytest.raises(checkpointing.ForeignCheckpoint) as excinfo:
        checkpointing.latest(tmp_path, [*NODES, "node_2"], PLAN)
    _assert_refused(tmp_path, excinfo)


def _checkpoints(root: Path, node: str, plan: str) -> Checkpoints:
    return Checkpoints(Settings(checkpoint_dir=str(root)), node, NODES,
                       WorkerMetrics(Identity("j", "ns", node, "root", 0, 0)), plan)


def test_a_node_records_its_plan_and_refuses_to_resume_another(tmp_path):
    for node in NODES:
        _checkpoints(tmp_path, node, OTHER).save(10, _state(10))
    resumed = _checkpoints(tmp_path, "node_1", OTHER).newest()
    assert resumed is not None and resumed[0] == 10
    with pytest.raises(checkpointing.ForeignCheckpoint) as excinfo:
        _checkpoints(tmp_path, "node_1", PLAN).newest()
    _assert_refused(tmp_path, excinfo)
