"""The job's status is typed (ravnest.run.jobstatus.JobStatus): the CRD's status schema is generated
from it, every status patch the operator decides is checked against it, and the operator's gauge
of jobs by phase has a series for each of its phases."""

from __future__ import annotations

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
