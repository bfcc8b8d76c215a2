"""Growing a running job (issue 20, grow), the parts that decide: the plan a job grows into
(`growth.grow`), what a newcomer's introduction must hold (`newcomer_plan`, `Plan.joined`), which
edit of a job is an addition (`growing.added_providers`), the data a new cluster trains, and the
versioned membership once it joined."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import yaml
from torch.utils.data import TensorDataset

from ravnest import parse_job, plan_job
from ravnest.errors import PlanError, RavnestError, SpecError
from ravnest.plan.growth import grow
from ravnest.plan.handoff import identity
from ravnest.plan.plans import Plan, ProviderInfo, as_planned, fingerprint
from ravnest.run import elastic
from ravnest.run.growing import added_providers
from ravnest.run.worker import cluster_batches
from ravnest.train.rejoining import newcomer_plan

DIGITS = Path(__file__).resolve().parents[2] / "examples" / "digits.yaml"


@pytest.fixture(scope="module")
def planned() -> tuple:
    doc = yaml.safe_load(DIGITS.read_text())
    job = parse_job(doc)
    plan, _, _ = plan_job(job)
    assert len(plan.clusters) == 2
    return job, plan


def _like(plan: Plan, cluster: int, extra_gb: float = 0.0) -> list[tuple[int, ProviderInfo]]:
    """Providers (indexed after the plan's) with the RAM of `cluster`'s nodes, in stage order."""
    first = len(plan.nodes) + len(plan.spares)
    return [(first + i, ProviderInfo(n.ram_gb + extra_gb, 1000.0))
            for i, n in enumerate(plan.cluster_nodes(cluster))]


def test_a_new_cluster_takes_a_planned_clusters_stages_and_joins_its_rings(planned) -> None:
    job, plan = planned
    added = _like(plan, 0)
    grown = grow(plan, added)
    assert len(grown.clusters) == 3 and grown.planned == 2 and grown.grown(2)
    assert not grown.grown(1)
    new = grown.cluster_nodes(2)
    assert [n.name for n in new] == [f"node_{i}" for i, _ in added]
    for n, mirror in zip(new, plan.cluster_nodes(0), strict=True):
        assert (n.stage, n.role, n.start, n.end, n.state) == (
            mirror.stage, mirror.role, mirror.start, mirror.end, mirror.state)
        assert n.cluster == 2
        # its rings are the mirror's, with it appended (one member per cluster, in order)
        assert [r.id for r in grown.rings_of(n.name)] == [r.id for r in plan.rings_of(
            mirror.name)]
        for r in grown.rings_of(n.name):
            assert r.members[-1] == n.name and len(r.members) == 3
    # nothing the running clusters hold changes, and the job keeps its fingerprint
    assert as_planned(grown) == plan
    assert fingerprint(grown, identity(job.spec)) == plan.fingerprint == grown.fingerprint
    assert Plan.from_dict(grown.to_dict()) == grown
    assert "planned_clusters" not in plan.to_dict()  # (plans that never grew, as before)
    # grown again: a fourth cluster, the planned count the same
    again = grow(grown, [(i + 2, p) for i, p in _like(plan, 0)])
    assert len(again.clusters) == 4 and again.planned == 2 and as_planned(again) == plan


def test_providers_that_cannot_form_a_cluster_are_refused_naming_them(planned) -> None:
    _, plan = planned
    small = [(i, dataclasses.replace(p, ram_gb=1e-6)) for i, p in _like(plan, 0)]
    with pytest.raises(PlanError, match=rf"spec.providers\[{small[0][0]}\]: the providers added "
                                        r"from here on cannot form a cluster"):
        grow(plan, small)
    ok = _like(plan, 0)
    with pytest.raises(PlanError, match=rf"spec.providers\[{ok[-1][0] + 1}\]"):
        grow(plan, [*ok, (ok[-1][0] + 1, ProviderInfo(1e-6))])  # one left over, too small
    with pytest.raises(PlanError, match=r"spec.providers\[0\] runs in the job already"):
        grow(plan, [(0, ProviderInfo(64.0))])
    one = dataclasses.replace(as_planned(plan), clusters=plan.clusters[:1], rings=())
    with pytest.raises(PlanError, match="planned with one cluster has no rings"):
        grow(one, ok)


def _introduction(grown: Plan, node: str) -> dict:
    return {"node": dataclasses.asdict(grown.node(node)), "address": "127.0.0.1:5000",
            "rings": [r.id for r in grown.rings_of(node)]}


def test_an_introduction_is_checked_and_joins_the_plan_in_stage_order(planned) -> None:
    _, plan = planned
    grown = grow(plan, _like(plan, 0))
    first, last = grown.clusters[2].nodes[0], grown.clusters[2].nodes[-1]
    # the leaf introduces itself first: the cluster is there with it alone, then the root
    node = newcomer_plan(plan, last, _introduction(grown, last))
    mine = plan.joined(node, tuple(_introduction(grown, last)["rings"]))
    assert mine.clusters[2].nodes == (last,) and mine.grown(2)
    mine = mine.joined(newcomer_plan(mine, first, _introduction(grown, first)),
                       tuple(_introduction(grown, first)["rings"]))
    assert mine.clusters[2].nodes[0] == first and mine.clusters[2].nodes[-1] == last
    for r in mine.rings:
        if r.id in _introduction(grown, first)["rings"]:
            assert r.members[-1] == first

    bad = _introduction(grown, first)
    with pytest.raises(RavnestError, match="names"):
        newcomer_plan(plan, "node_99", bad)  # (a control from another node than it names)
    with pytest.raises(RavnestError, match="address"):
        newcomer_plan(plan, first, {**bad, "address": "nowhere"})
    with pytest.raises(RavnestError, match="is not one added to the job"):
        newcomer_plan(plan, first, {**bad, "node": {**bad["node"], "cluster": 1}})
    with pytest.raises(RavnestError, match="is not one added to the job"):
        newcomer_plan(plan, first, {**bad, "node": {**bad["node"], "cluster": 5}})
    with pytest.raises(RavnestError, match="not rings of the job whose state it holds"):
        newcomer_plan(plan, first, {**bad, "node": {**bad["node"], "state": []}})
    with pytest.raises(RavnestError, match="not rings of the job"):
        newcomer_plan(plan, first, {**bad, "rings": ["ring99"]})


def test_only_providers_added_after_the_running_ones_are_an_addition(planned) -> None:
    job, _ = planned
    doc = job.to_dict()
    more = {**doc, "spec": {**doc["spec"], "providers": [*doc["spec"]["providers"],
                                                         {"ram": 4}, {"ram": 2}]}}
    n = len(job.spec.expanded_providers())
    assert added_providers(job, parse_job(more)) == [n, n + 1]
    with pytest.raises(SpecError, match=r"spec.providers: a running job grows by providers "
                                        rf"listed after its {n}"):
        added_providers(job, job)
    changed = {**more, "spec": {**more["spec"], "providers": [
        {**more["spec"]["providers"][0], "ram": 99}, *more["spec"]["providers"][1:]]}}
    with pytest.raises(SpecError, match=r"spec\.providers"):
        added_providers(job, parse_job(changed))
    other = {**more, "spec": {**more["spec"], "training": {**more["spec"]["training"],
                                                           "epochs": 99}}}
    with pytest.raises(SpecError, match="everything else must stay as it runs"):
        added_providers(job, parse_job(other))


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_new_cluster_trains_its_own_shard_and_the_planned_ones_keep_theirs(
        planned, shuffle: bool) -> None:
    job, _ = planned
    doc = job.to_dict()
    doc["spec"]["data"]["shuffle"] = shuffle
    spec = parse_job(doc).spec
    xs = torch.arange(600, dtype=torch.float32).unsqueeze(1)
    train = TensorDataset(xs, torch.zeros(600, dtype=torch.long))

    def samples(cluster: int, epoch: int) -> list[list[int]]:
        b = cluster_batches(train, train, spec, cluster, 2)
        return [batch[0][0].flatten().int().tolist() for batch in b.train(epoch)]

    planned_0, planned_1, new = samples(0, 0), samples(1, 0), samples(2, 0)
    assert len(new) == len(planned_0) == len(planned_1)  # as many batches: the same rounds
    assert samples(2, 0) == new and samples(2, 1) != new  # deterministic, per epoch
    assert new != planned_0 and new != planned_1
    seen = [x for batch in new for x in batch]
    assert len(seen) == len(set(seen))  # no sample twice in an epoch
    assert samples(3, 0) != new  # a second new cluster: a permutation of its own


def test_the_membership_gets_a_version_when_a_new_cluster_joins(planned) -> None:
    _, plan = planned
    grown = grow(plan, _like(plan, 0))
    assert elastic.membership(grown, []) == {"plan": plan.fingerprint, "versions": [
        {"version": 1, "fromRound": 1, "clusters": [0, 1]}]}
    got = elastic.membership(grown, [{"cluster": 0, "round": 50}],
                             [{"cluster": 2, "round": 20}, {"cluster": 3, "round": None}])
    assert got["versions"] == [{"version": 1, "fromRound": 1, "clusters": [0, 1]},
                               {"version": 2, "fromRound": 21, "clusters": [0, 1, 2]},
                               {"version": 3, "fromRound": 51, "clusters": [1, 2]}]
