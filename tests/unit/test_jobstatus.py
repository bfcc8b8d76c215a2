"""The job's status is typed (ravnest.run.jobstatus.JobStatus): the CRD's status schema is generated
from it, every status patch the operator decides is checked against it, and the operator's gauge
of jobs by phase has a series for each of its phases."""

from __future__ import annotations

import json

import pytest
from prometheus_client import REGISTRY

from ravnest.run.jobstatus import FINISHED, JobStatus, Phase, StatusError, check_patch
from ravnest_operator import crds, monitoring
from ravnest_operator.actions import Decision


def test_a_status_patch_the_schema_would_not_keep_is_refused_naming_the_field() -> None:
    with pytest.raises(StatusError, match=r"status\.progres: Extra inputs"):
        check_patch({"phase": "Running", "progres": {"step": 3}})
    with pytest.raises(StatusError, match=r"status\.phase: Input should be 'Created'"):
        Decision().set({"phase": "Runing"})
    with pytest.raises(StatusError, match=r"status\.conditions\.0\.status: "):
        check_patch({"conditions": [{"type": "Running", "status": "yes"}]})
    with pytest.raises(StatusError, match=r"status\.nodes\.node_0\.exitCode: "):
        check_patch({"nodes": {"node_0": {"pod": "p", "phase": "Failed", "exitCode": "one"}}})
    # a field set to None is removed by the merge patch: taken; the workers' figures are free-form
    assert check_patch({"notDrained": None, "result": {"any": [1, {"thing": None}]}}).result


def test_the_crds_status_schema_is_the_models_with_only_the_workers_figures_free_form() -> None:
    schema = crds.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    status = schema["status"]
    assert "x-kubernetes-preserve-unknown-fields" not in status
    assert set(status["properties"]) == set(JobStatus.model_fields)
    assert status["properties"]["phase"]["enum"] == [p.value for p in Phase]
    assert status["properties"]["conditions"]["items"]["properties"]["observedGeneration"][
        "type"] == "integer"
    free = []

    def walk(node: object, path: str) -> None:
        if isinstance(node, dict):
            if node.get("x-kubernetes-preserve-unknown-fields"):
                free.append(path)
            for key, value in node.items():
                walk(value, f"{path}.{key}")

    walk(status, "status")
    assert free == ["status.properties.result"]


def _gauges() -> dict[Phase, float]:
    return {p: REGISTRY.get_sample_value("ravnest_operator_jobs", {"phase": p}) or 0.0
            for p in Phase}


def test_every_phase_has_its_gauge_and_a_job_that_moves_on_leaves_none_behind() -> None:
    # (the registry is the process's: jobs of tests that ran before in it count too, so this
    # compares the gauges against what they were before it)
    before = _gauges()
    monitoring.observe_phase("ns", "new", None)  # (a job without a phase yet: in none)
    assert _gauges() == before
    assert all(REGISTRY.get_sample_value("ravnest_operator_jobs", {"phase": p}) is not None
               for p in Phase)

    def moved(**counts: int) -> dict[Phase, float]:
        return {p: before[p] + counts.get(p.name.lower(), 0) for p in Phase}

    monitoring.observe_phase("ns", "a", Phase.FINISHING)
    assert _gauges() == moved(finishing=1)
    monitoring.observe_phase("ns", "a", Phase.SUCCEEDED)
    assert _gauges() == moved(succeeded=1)
    monitoring.forget("ns", "a")
    assert _gauges() == before
    assert FINISHED == {Phase.SUCCEEDED, Phase.FAILED}


def test_a_local_runs_status_file_is_a_job_status(tmp_path) -> None:
    """`ravnest run` writes status.json as the operator writes a RavnestJob's status: the same
    typed fields (takeovers as node -> provider, spares by name with their phase, a failure as
    a Failed condition), so `ravnest status` reads one shape."""
    import json
    import subprocess
    import sys
    import time
    from pathlib import Path

    import yaml

    from ravnest import parse_job
    from ravnest.plan.plans import SparePlan
    from ravnest.run import local, supervising

    root = Path(__file__).resolve().parents[2]
    job = parse_job(yaml.safe_load((root / "examples" / "digits.yaml").read_text()))
    run = local.LocalRun(job, tmp_path, progress=False)
    run.recoveries = [{"cluster": 1, "node": "node_3", "exitCode": -9, "at": 1.0}]
    run.memory = supervising.Memory(recoveries=1, cluster_failed_as={1: "exit code 1: x"})
    run.takeovers = [{"node": "node_3", "cluster": 1, "spare": "spare_6", "provider": 6,
                      "lost": 3, "at": 2.0}]
    run.spares = [SparePlan("spare_3", 3, 4.0), SparePlan("spare_7", 7, 4.0)]
    spare = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        run.spare_procs = {"spare_3": local._Proc("spare_3", spare, tmp_path / "s.log", 0)}
        run.grown = [{"providers": [8], "clusters": [2], "at": time.time()}]
        run.conditions = [{"type": "Failed", "status": "True", "reason": "Terminated",
                           "message": "stopped by SIGTERM"}]
        run.write_status(Phase.FAILED, {})
    finally:
        spare.kill()
        spare.wait()
    written = json.loads((tmp_path / "status.json").read_text())
    assert JobStatus.model_validate(written)
    assert written["phase"] == "Failed" and written["completionTime"] >= written["startTime"]
    assert written["takeovers"] == {"node_3": 6}
    assert written["spares"] == {"spare_3": "Running", "spare_7": "Missing"}
    assert written["recoveries"] == 1 and written["clusterRecoveries"] == [0, 1]
    assert written["lastFailures"] == {"clusters": [None, "exit code 1: x"]}
    assert written["grown"][0]["at"].endswith("Z") and written["conditions"][0]["reason"] == (
        "Terminated")


def test_a_drain_reads_the_takeovers_of_the_runs_status(tmp_path) -> None:
    """`ravnest drain` finds which provider runs a stage now in the run's status.json (a spare
    that took over): as the runner writes it (a JobStatus: node -> provider) and as older runs
    wrote it (a list)."""
    import json
    from pathlib import Path

    import yaml

    from ravnest import parse_job
    from ravnest.errors import RavnestError
    from ravnest.run import draining, local

    root = Path(__file__).resolve().parents[2]
    job = parse_job(yaml.safe_load((root / "examples" / "digits.yaml").read_text()))
    run = local.LocalRun(job, tmp_path, progress=False)
    run.prepare()
    assert run.plan is not None
    node = run.plan.clusters[1].nodes[0]
    lost = run.plan.node(node).provider
    for takeovers in ({node: 6}, [{"node": node, "provider": 6, "lost": lost}]):
        (tmp_path / "status.json").write_text(json.dumps({"phase": "Running",
                                                          "takeovers": takeovers}))
        with pytest.raises(RavnestError, match=f"provider {lost}"):
            draining.order_drain(tmp_path, [lost], running=True)  # (it runs no stage now)
    assert draining.order_drain(tmp_path, [6], running=True) == [1]


def test_a_local_runs_status_shows_its_drain_orders_as_the_operators_does(tmp_path) -> None:
    """A cluster told to drain (`ravnest drain`) is `draining` while the run goes on, `drained`
    (with its order's providers and time, and the round and update it left after) once its root
    said so, and `notDrained` when the run succeeded first (told too near the end), as a
    RavnestJob's status shows them."""
    import json
    from pathlib import Path

    import yaml

    from ravnest import parse_job
    from ravnest.run import draining, local

    root = Path(__file__).resolve().parents[2]
    job = parse_job(yaml.safe_load((root / "examples" / "digits.yaml").read_text()))
    run = local.LocalRun(job, tmp_path, progress=False)
    run.prepare()
    assert run.plan is not None
    provider = run.plan.node(run.plan.clusters[1].nodes[-1]).provider
    assert draining.order_drain(tmp_path, [provider], running=True) == [1]

    def written(phase: Phase) -> dict:
        run.write_status(phase, {})
        status = json.loads((tmp_path / "status.json").read_text())
        assert JobStatus.model_validate(status)
        return status

    running = written(Phase.RUNNING)
    (order,) = running["draining"]
    assert order["cluster"] == 1 and order["providers"] == [provider]
    assert order["orderedAt"].endswith("Z") and "notDrained" not in running
    late = written(Phase.SUCCEEDED)
    assert late["notDrained"] == [order] and "draining" not in late and "drained" not in late
    draining.acknowledge(tmp_path / draining.DRAIN_DIR, 1, {"round": 7, "updates": 14})
    run._note_drained()
    drained = written(Phase.SUCCEEDED)
    assert drained["drained"] == [{**order, "round": 7, "updates": 14}]
    assert "notDrained" not in drained and "draining" not in drained


def test_a_status_with_nan_or_inf_is_written_with_nulls_and_says_which():
    """JSON has no NaN: the apiserver refuses (400) a status patch holding one, and a job whose
    validation loss is NaN (by design, when it cannot be computed) would never be written again."""
    from ravnest.run.jobstatus import NON_FINITE, condition, finite

    current = {"phase": "Running", "conditions": [
        {"type": "Running", "status": "True", "reason": "AllRunning", "message": ""}]}
    patch = {"phase": "Succeeded",
             "progress": {"step": 12, "loss": 0.5, "validationLoss": float("nan")},
             "result": {"losses": [1.0, float("inf")], "best": float("-inf")}}
    out = finite(current, patch, at="2026-12-04T00:00:00Z")
    json.dumps(out, allow_nan=False)  # what the apiserver takes
    assert out["progress"] == {"step": 12, "loss": 0.5, "validationLoss": None}
    assert out["result"] == {"losses": [1.0, None], "best": None}
    assert out["phase"] == "Succeeded" and patch["progress"]["validationLoss"] != 0  # (a copy)
    said = condition(out["conditions"], NON_FINITE)
    assert said is not None and said["status"] == "True"
    assert said["message"] == ("written as null: status.progress.validationLoss (nan), "
                               "status.result.losses[1] (inf), status.result.best (-inf)")
    assert condition(out["conditions"], "Running") == current["conditions"][0]  # kept
    check_patch(out)
    # the next finite write says so; one with nothing to say adds no condition
    again = finite(out, {"progress": {"validationLoss": 0.25}})
    assert condition(again["conditions"], NON_FINITE)["status"] == "False"
    assert finite(current, {"phase": "Running"}) == {"phase": "Running"}
