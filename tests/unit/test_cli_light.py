"""Lightweight commands stay light (issue 19 item 11): `ravnest validate`, `ravnest status` and
the parsing step of `ravnest plan` need only the spec, so they never load torch or grpc (which took
764 MB and up to a minute on a loaded machine for a YAML check)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "digits.yaml"
HEAVY = ("torch", "grpc", "numpy")
PROBE = """
import json, runpy, sys
sys.argv = ["ravnest", *sys.argv[1:]]
try:
    runpy.run_module("ravnest", run_name="__main__")
except SystemExit as e:
    code = e.code
# VmHWM is this process's own peak; ru_maxrss would count the parent's memory that a forked
# (or vforked) child shared before it exec'ed
hwm = [line for line in open("/proc/self/status") if line.startswith("VmHWM:")]
print(json.dumps({"code": code, "loaded": sorted(m for m in HEAVY if m in sys.modules),
                  "rss_mb": int(hwm[0].split()[1]) // 1024}))
""".replace("HEAVY", repr(HEAVY))


def ravnest(*args: str, cwd: Path = ROOT) -> dict[str, object]:
    """Run `python -m ravnest ARGS` in a fresh interpreter; what it loaded and its peak RSS."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        str(ROOT / "worker"), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True,
                         timeout=300, env=env, cwd=cwd)
    assert out.returncode == 0, out.stderr
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("example", ["digits.yaml", "sorter.yaml"])
def test_validate_loads_neither_torch_nor_grpc(example: str) -> None:
    result = ravnest("validate", str(ROOT / "examples" / example))
    assert result["code"] == 0
    assert result["loaded"] == []
    assert isinstance(result["rss_mb"], int) and result["rss_mb"] < 250


def test_validate_reports_a_mistake_without_torch(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(EXAMPLE.read_text().replace("batchSize: 32", "batchSize: 0"))
    result = ravnest("validate", str(job))
    assert (result["code"], result["loaded"]) == (2, [])


def test_plan_refuses_an_invalid_file_before_loading_torch(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(EXAMPLE.read_text().replace("batchSize: 32", "batchSize: 0"))
    result = ravnest("plan", str(job))
    assert (result["code"], result["loaded"]) == (2, [])


def test_status_of_a_local_run_loads_neither_torch_nor_grpc(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "digits"
    run.mkdir(parents=True)
    (run / "status.json").write_text(json.dumps({"phase": "Succeeded"}))
    result = ravnest("status", "digits", cwd=tmp_path)
    assert (result["code"], result["loaded"]) == (0, [])


def test_the_names_known_without_torch_are_torch_classes() -> None:
    from ravnest import spec

    assert all(spec.is_torch_optimizer(name) for name in spec.KNOWN_OPTIMIZERS)
    assert all(spec.is_torch_scheduler(name) for name in spec.KNOWN_SCHEDULERS)
    assert all(spec.is_torch_module(name) for name in spec.KNOWN_LOSSES)


def test_the_public_api_still_resolves_every_name_on_use() -> None:
    import ravnest

    assert ravnest.Node.__name__ == "Node"
    assert ravnest.load_job(EXAMPLE).name == "digits"
    with pytest.raises(AttributeError):
        ravnest.no_such_name  # noqa: B018


@pytest.mark.parametrize(("status", "says"), [
    ({"phase": "Running", "spares": ["spare_3"], "takeovers": [
        {"node": "node_3", "cluster": 1, "spare": "spare_4", "provider": 4, "lost": 3}]},
     ["spares: spare_3", "node_3 runs on provider 4 (spare_4 took it over from provider 3)"]),
    ({"phase": "Running", "spares": {"spare_3": "Pending"}, "takeovers": {"node_3": 4}},
     ["spares: spare_3 (Pending)", "node_3 runs on provider 4 (a spare took it over)"]),
    ({"phase": "Running", "clusters": "2/3",
      "membership": {"plan": "ab12", "versions": [
          {"version": 1, "fromRound": 1, "clusters": [0, 1, 2]},
          {"version": 2, "fromRound": 41, "clusters": [0, 1]}]},
      "drained": [{"cluster": 2, "round": 40, "updates": 80, "samples": 2560}]},
     ["clusters: 2/3 (training/planned)", "membership v2 from round 41: clusters 0, 1",
      "cluster 2 drained after round 40 (update 80)"]),
    ({"phase": "Running", "draining": [{"cluster": 1, "providers": [3, 4]}]},
     ["cluster 1 draining: provider(s) 3, 4 removed"]),
    ({"phase": "Succeeded", "notDrained": [{"cluster": 1, "providers": [3]}]},
     ["cluster 1 finished training with the others before it could drain: it stays in the "
      "job's model"]),
    ({"phase": "Running", "clusters": "3/3",
      "membership": {"plan": "ab12", "versions": [
          {"version": 1, "fromRound": 1, "clusters": [0, 1]},
          {"version": 2, "fromRound": 31, "clusters": [0, 1, 2]}]},
      "grown": [{"providers": [6, 7], "clusters": [2], "at": 1.0}],
      "joined": [{"cluster": 2, "round": 30}]},
     ["clusters: 3/3 (training/planned)", "membership v2 from round 31: clusters 0, 1, 2",
      "cluster(s) 2 added: provider(s) 6, 7", "cluster 2 joined after round 30"]),
])
def test_status_shows_the_spares_and_the_stages_they_took_over(tmp_path: Path, capsys, status,
                                                               says) -> None:
    from ravnest.cli import main

    (tmp_path / "status.json").write_text(json.dumps(status))
    assert main(["status", "digits", "-o", str(tmp_path)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert [line.strip() for line in printed[1:]] == says


def test_grow_without_a_run_is_refused_and_orders_nothing(tmp_path: Path, capsys) -> None:
    from ravnest.cli import main

    (tmp_path / "nodes").mkdir()
    assert main(["grow", str(EXAMPLE), "-o", str(tmp_path)]) == 1
    assert f"no run is going on in {tmp_path}" in capsys.readouterr().err
    assert not (tmp_path / "grow").exists()
    probe = ravnest("grow", str(EXAMPLE), "-o", str(tmp_path))
    assert probe["code"] == 1 and probe["loaded"] == []  # a control command: no torch, no grpc


def test_drain_without_a_run_is_refused_and_orders_nothing(tmp_path: Path, capsys) -> None:
    from ravnest.cli import main

    (tmp_path / "nodes").mkdir()
    assert main(["drain", "digits", "-o", str(tmp_path), "--provider", "1"]) == 1
    assert f"no run is going on in {tmp_path}" in capsys.readouterr().err
    assert not (tmp_path / "drain").exists()
    probe = ravnest("drain", "digits", "-o", str(tmp_path), "--provider", "1")
    assert probe["code"] == 1 and probe["loaded"] == []  # a control command: no torch, no grpc
