"""The operator's memory of disrupted pods (`ravnest_operator.disruptions`), fed pods as kopf's
watch hands them over, and the job's PodDisruptionBudget."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from ravnest import parse_job, plan_job
from ravnest_operator import resources
from ravnest_operator.disruptions import KEPT_SECONDS, PER_JOB, Disrupted, job_of

OWNER = resources.Owner("digits", "team-a", "job-uid")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def job_and_plan():
    job = parse_job(yaml.safe_load((ROOT / "examples" / "digits.yaml").read_text()))
    return job, plan_job(job)[0]


def _pod(name: str, uid: str, condition: str | None = "EvictionByEvictionAPI",
         owner: str | None = "job-uid") -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "uid": uid, "namespace": "team-a"}
    if owner:
        meta["ownerReferences"] = [{"apiVersion": "ravnest.io/v1alpha1", "kind": "RavnestJob",
                                    "name": "digits", "uid": owner}]
    status: dict[str, Any] = {"phase": "Running", "conditions": [{"type": "Ready",
                                                                 "status": "True"}]}
    if condition:
        status["conditions"].append({"type": "DisruptionTarget", "status": "True",
                                     "reason": condition})
    return {"metadata": meta, "status": status}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_disrupted_pod_is_noted_for_its_job_until_its_replacement_is_seen():
    notes = Disrupted()
    assert notes.note(_pod("digits-node-1", "p1")) == "job-uid"
    assert notes.note(_pod("digits-node-2", "p2", condition=None)) is None
    assert notes.note(_pod("other-node-1", "p3", owner=None)) is None
    assert notes.of("job-uid", []) == {"digits-node-1": "EvictionByEvictionAPI"}
    # still there, being deleted: the same pod, still noted
    assert notes.of("job-uid", [_pod("digits-node-1", "p1")]) == {
        "digits-node-1": "EvictionByEvictionAPI"}
    # its replacement (same name, another uid): the note goes
    assert notes.of("job-uid", [_pod("digits-node-1", "p9", condition=None)]) == {}
    assert notes.of("job-uid", []) == {}


def test_notes_expire_are_bounded_and_go_with_their_job():
    clock = Clock()
    notes = Disrupted(clock)
    notes.note(_pod("digits-node-1", "p1", "PreemptionByScheduler"))
    clock.now += KEPT_SECONDS + 1
    assert notes.of("job-uid", []) == {}
    for i in range(PER_JOB + 5):
        notes.note(_pod(f"digits-node-{i}", f"p{i}"))
    kept = notes.of("job-uid", [])
    assert len(kept) == PER_JOB and "digits-node-0" not in kept
    notes.forget("job-uid")
    assert notes.of("job-uid", []) == {}


def test_only_a_ravnestjob_owns_a_pod():
    pod = _pod("x", "u")
    pod["metadata"]["ownerReferences"] = [{"kind": "ReplicaSet", "uid": "rs"}, "junk"]
    assert job_of(pod) is None and job_of({}) is None


def test_a_job_has_a_disruption_budget_letting_one_worker_go_at_a_time(job_and_plan):
    _, plan = job_and_plan
    pdb = resources.disruption_budget(OWNER, plan)
    assert pdb["apiVersion"] == "policy/v1" and pdb["kind"] == "PodDisruptionBudget"
    assert pdb["metadata"]["name"] == "digits-workers"
    assert pdb["metadata"]["ownerReferences"] == [OWNER.reference()]
    assert pdb["spec"] == {"minAvailable": len(plan.nodes) - 1, "selector": {"matchLabels": {
        "ravnest.io/job": "digits", "app.kubernetes.io/component": "worker"}}}
