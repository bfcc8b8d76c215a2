"""The termination message, the one channel from a worker, planner or finishing pod to its
supervisor: where it is written, how much of it is kept, and how the operator and the local runner
read it back (ravnest.termination)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ravnest import termination
from ravnest.termination import LIMIT, TERMINATION_LOG_ENV, Ending


def test_only_where_the_kubelet_made_its_file_is_a_workers_message_left(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kubelet = tmp_path / "termination-log"
    monkeypatch.setattr(termination, "KUBELET_PATH", kubelet)
    termination.write("RavnestError: lost", env={})  # outside a pod (or run as root there)
    assert not kubelet.exists()
    kubelet.touch()  # the kubelet's, in a pod
    termination.write("RavnestError: " + "x" * 5000, env={})
    assert kubelet.read_text() == ("RavnestError: " + "x" * 5000)[:LIMIT]


def test_a_pods_answer_fails_loudly_where_it_cannot_be_written(tmp_path: Path) -> None:
    env = {TERMINATION_LOG_ENV: str(tmp_path / "no-such-folder" / "log")}
    termination.write("lost", env)  # a worker: logged, its exit code still says it
    with pytest.raises(OSError):
        termination.write("ravnest-plan/v1\n...", env, in_pod=True)


def test_a_message_keeps_the_kubelets_bytes_and_whole_characters(tmp_path: Path) -> None:
    out = tmp_path / "said"
    termination.write("é" * LIMIT, {TERMINATION_LOG_ENV: str(out)})
    kept = out.read_bytes()
    assert len(kept) == LIMIT and kept.decode() == "é" * (LIMIT // 2)


def test_figures_and_errors_read_back_as_written(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "node_0.log"
    log.parent.mkdir()
    termination.beside(log).write_text("stale")
    env = termination.local_env({"A": "1"}, log)
    assert env["A"] == "1" and not termination.beside(log).exists()  # none left from before
    termination.write_figures({"node": "node_0", "updates": 12, "val_loss": 0.25}, env)
    ended = termination.of_local(log, 0)
    assert ended.figures == {"node": "node_0", "updates": 12, "val_loss": 0.25}
    assert ended.said.startswith('{"node":"node_0"')
    termination.write_error(ValueError("bad\nshape " + "y" * 400), env)
    failed = termination.of_local(log, termination.SPEC_ERROR_EXIT)
    assert failed.figures == {} and failed.spec_error
    assert failed.said == "shape " + "y" * (termination.SHOWN - 9) + "..."
    assert termination.of_local(tmp_path / "none.log", None) == Ending(None)


@pytest.mark.parametrize("message", ["", "[1, 2]", "ravnest-plan/v1\nabc", "null", '{"a": '])
def test_a_message_that_is_no_json_object_holds_no_figures(message: str) -> None:
    assert Ending(0, message=message).figures == {}


def _pod(*statuses: dict, containers: tuple[str, ...] = ("ravnest",)) -> dict:
    return {"spec": {"containers": [{"name": n} for n in containers]},
            "status": {"containerStatuses": list(statuses)}}


def test_a_pods_ending_is_its_own_containers_not_a_sidecars() -> None:
    ours = {"name": "ravnest", "state": {"terminated": {
        "exitCode": 0, "reason": "Completed", "finishedAt": "2026-11-28T04:00:00Z",
        "message": json.dumps({"samples": 640})}}}
    sidecar = {"name": "istio-proxy", "state": {"terminated": {"exitCode": 1, "reason": "Error",
                                                                "message": "boom"}}}
    ended = termination.of_pod(_pod(sidecar, ours, containers=("ravnest", "istio-proxy")))
    assert ended == Ending(0, "Completed", json.dumps({"samples": 640}), "2026-11-28T04:00:00Z")
    assert ended.figures == {"samples": 640}
    # a container still running has not ended; one under another name is taken when ours is not
    assert termination.of_pod(_pod({"name": "ravnest", "state": {"running": {}}})) == Ending(None)
    assert termination.of_pod(_pod(sidecar)) == Ending(1, "Error", "boom")
    assert termination.of_pod({"status": {}}) == Ending(None)


def test_a_hostile_status_reads_as_data() -> None:
    odd = _pod({"name": "ravnest", "state": {"terminated": {
        "exitCode": "2", "reason": "", "message": ["not", "text"]}}})
    ended = termination.of_pod(odd)
    assert ended != termination.NOT_ENDED  # (its terminated state was read, as data)
    assert ended.exit_code is None and ended.reason is None
    assert ended.figures == {} and not ended.spec_error
