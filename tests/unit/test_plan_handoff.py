"""A planner pod hands its plan back as a termination message (`ravnest.plan.handoff`): it fits the
kubelet's 4096 bytes for large plans, comes back equal, and the operator refuses, as data and with
a PlanError naming what, anything that is not this job's plan: garbage, a bomb, wrong types, nodes
that are not the job's providers, broken clusters or rings, another job's fingerprint."""

from __future__ import annotations

import base64
import dataclasses
import zlib
from pathlib import Path

import pytest
import yaml

from ravnest import parse_job, plan_job
from ravnest.errors import PlanError
from ravnest.plan.handoff import HEADER, MESSAGE_LIMIT, decode, encode
from ravnest.plan.plans import Plan, fingerprint

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sorter():
    doc = yaml.safe_load((ROOT / "examples" / "sorter.yaml").read_text())
    job = parse_job(doc)
    return doc, job, plan_job(job)[0]


def test_a_plan_comes_back_equal(sorter):
    _, job, plan = sorter
    message = encode(plan)
    assert message.startswith(HEADER + "\n") and len(message) <= MESSAGE_LIMIT
    assert decode(message, job.spec) == plan


def test_a_large_plan_fits_the_termination_message(sorter):
    doc, _, _ = sorter
    spec = {**doc["spec"], "model": {**doc["spec"]["model"], "kwargs": {"layers": 48}},
            "providers": [{"ram": 4, "bandwidth": 1000, "replicas": 16}], "plan": {"clusters": 2}}
    job = parse_job({**doc, "spec": spec})
    plan = plan_job(job)[0]
    assert len(plan.nodes) == 16 and len(plan.to_json()) > 40_000
    assert decode(encode(plan), job.spec) == plan


def test_a_plan_too_large_to_hand_back_is_refused_by_the_planner(sorter):
    _, _, plan = sorter
    noise = tuple(base64.b64encode(bytes([i % 256, i // 256, 7, 9, 1])).decode() * 3
                  for i in range(4000))
    huge = dataclasses.replace(plan, nodes=(dataclasses.replace(plan.nodes[0], state=noise),
                                            *plan.nodes[1:]))
    with pytest.raises(PlanError, match="more than the 4096 bytes of a termination message"):
        encode(huge)


def _packed(raw: bytes) -> str:
    return f"{HEADER}\n{base64.b64encode(zlib.compress(raw)).decode()}"


@pytest.mark.parametrize(("message", "says"), [
    ("Traceback ...", "does not start with 'ravnest-plan/v1'"),
    (f"{HEADER}\n%%%", "is not a compressed plan"),
    (f"{HEADER}\n{base64.b64encode(b'not zlib').decode()}", "is not a compressed plan"),
    (_packed(b"[1, 2]"), "malformed"),
    (_packed(b'{"clusters": "x"}'), "malformed: plan.clusters"),
    (_packed(b" " * (600 << 10)), "larger than 524288 bytes"),
])
def test_what_is_not_a_plan_is_refused(sorter, message, says):
    _, job, _ = sorter
    with pytest.raises(PlanError, match=says.replace("(", r"\(").replace(".", r"\.")):
        decode(message, job.spec)


def _tampered(plan: Plan, job, **changes) -> str:
    """The plan changed, with a fingerprint recomputed as an honest planner would."""
    changed = dataclasses.replace(plan, **changes)
    from ravnest.plan.handoff import identity

    return encode(dataclasses.replace(changed, fingerprint=fingerprint(changed,
                                                                       identity(job.spec))))


def _nodes(plan: Plan, i: int, **changes) -> tuple:
    return tuple(dataclasses.replace(n, **changes) if k == i else n
                 for k, n in enumerate(plan.nodes))


@pytest.mark.parametrize(("change", "says"), [
    (lambda p: {"nodes": _nodes(p, 0, name="../../etc")}, "is not node_<provider>"),
    (lambda p: {"nodes": _nodes(p, 1, provider=0, name="node_0")},
     "provider 0 is a node or spare already"),
    (lambda p: {"nodes": _nodes(p, 0, provider=9, name="node_9")},
     "is not one of the job's 4 providers"),
    (lambda p: {"nodes": _nodes(p, 0, role="boss")}, "is not one of root, stem, leaf"),
    (lambda p: {"nodes": _nodes(p, 0, first_layer="x" * 300)}, "longer than 256 characters"),
    (lambda p: {"nodes": _nodes(p, 0, end=p.nodes[0].start)}, "are not a range"),
    (lambda p: {"nodes": _nodes(p, 1, start=p.nodes[1].start + 1)}, "do not follow on"),
    (lambda p: {"clusters": p.clusters[:1]}, "1 clusters where spec.plan.clusters asks for 2"),
    (lambda p: {"rings": (dataclasses.replace(p.rings[0], members=("node_0", "node_77")),
                          *p.rings[1:])}, "plan.rings[0].members: not nodes of the plan"),
    (lambda p: {"rings": (dataclasses.replace(p.rings[0], id="r" * 200_000), *p.rings[1:])},
     "plan.rings[0].id: 'rrrrrrrrrrrrrrrrrrrr' is not ring<number>"),
    (lambda p: {"rings": (dataclasses.replace(p.rings[0], members=()), *p.rings[1:])},
     "plan.rings[0].members: none"),
    (lambda p: {"rings": (dataclasses.replace(p.rings[0], members=p.rings[0].members[::-1]),
                          *p.rings[1:])}, "not one node per cluster, in cluster order"),
    (lambda p: {"rings": (dataclasses.replace(p.rings[0], state=("not.a.weight",)),
                          *p.rings[1:])}, "plan.rings[0].state: not state its members hold"),
    (lambda p: {"nodes": _nodes(p, 0, state=("w",) * 2)}, "plan.nodes[0].state: a name"),
    (lambda p: {"planned_clusters": -1}, "plan.planned_clusters: -1"),
    (lambda p: {"planned_clusters": 99}, "plan.planned_clusters: 99"),
    (lambda p: {"samples_per_second": float("nan")}, "plan.samples_per_second: nan"),
    (lambda p: {"nodes": _nodes(p, 1, ram_gb=float("inf"))}, "plan.nodes[1].ram_gb: inf"),
    (lambda p: {"nodes": _nodes(p, 1, params=-5)}, "plan.nodes[1].params: -5"),
])
def test_a_plan_that_does_not_fit_the_job_is_refused(sorter, change, says):
    _, job, plan = sorter
    with pytest.raises(PlanError, match="does not fit the job") as e:
        decode(_tampered(plan, job, **change(plan)), job.spec)
    assert says in str(e.value)


def test_a_plan_for_another_model_is_refused(sorter):
    doc, _, plan = sorter
    other = parse_job({**doc, "spec": {**doc["spec"], "model": {
        **doc["spec"]["model"], "kwargs": {"dim": 64}}}})
    with pytest.raises(PlanError, match="is not this job's plan's"):
        decode(encode(plan), other.spec)
