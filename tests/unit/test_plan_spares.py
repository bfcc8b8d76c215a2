"""Hot spares (spec.plan.spares) in the plan and the rules both supervisors follow
(`ravnest.run.elastic`): which providers the planner sets aside, that the plan it gives is the
one the cost model scores, which spare takes over a lost stage, and when a loss costs only its
cluster or the job ends without one."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from ravnest import parse_job, plan_job
from ravnest.errors import PlanError, RavnestError, SpecError
from ravnest.plan.costs import Workload
from ravnest.plan.handoff import decode, encode
from ravnest.plan.planning import SPARE_TOLERANCE, estimate
from ravnest.plan.plans import GB, Plan, ProviderInfo, SparePlan
from ravnest.run import elastic
from ravnest.spec import RunPolicy

DIGITS = Path(__file__).resolve().parents[2] / "examples" / "digits.yaml"


def _job(spares: object):
    doc = yaml.safe_load(DIGITS.read_text())
    doc["spec"]["plan"]["spares"] = spares
    return parse_job(doc)


@pytest.fixture(scope="module")
def plans() -> dict[object, tuple]:
    out = {}
    for spares in (0, "auto", 1):
        job = _job(spares)
        plan, prof, _ = plan_job(job)
        out[spares] = (job, plan, prof)
    return out


def _scored(job, plan: Plan, prof) -> float:
    """The cost model's samples/s of the plan's own grouping and split, over the whole pool."""
    pool = [ProviderInfo(p.ram, p.bandwidth, p.compute) for p in job.spec.expanded_providers()]
    groups = [[plan.node(n).provider for n in c.nodes] for c in plan.clusters]
    bounds = [[plan.node(n).start for n in c.nodes] + [plan.node(c.nodes[-1]).end]
              for c in plan.clusters]
    e = estimate(prof, pool, Workload.from_spec(job.spec), groups, bounds)
    assert e.fits
    return e.samples_per_second


def test_without_spares_every_provider_trains_and_the_plan_is_as_before(plans):
    _, plan, _ = plans[0]
    assert plan.spares == ()
    assert sorted(n.provider for n in plan.nodes) == list(range(6))
    assert "spares" not in plan.to_dict()  # plans (and fingerprints) of jobs without spares
    # the digits plan gives provider 2 (2 GB) a stage of one ReLU: the case spares are for
    assert plan.node("node_2").params == 0


def test_auto_sets_aside_providers_the_plan_does_not_need(plans):
    _, full, prof = plans[0]
    job, plan, _ = plans["auto"]
    assert plan.spares, plan.table()
    used = [n.provider for n in plan.nodes]
    aside = [s.provider for s in plan.spares]
    assert sorted(used + aside) == list(range(6))  # each provider once: node or spare
    assert 2 in aside  # the provider that held a stage of no parameters
    assert len(plan.clusters) == 2  # spec.plan.clusters still holds
    # the plan's figure is the cost model's for its own split, and no worse than the full plan's
    assert plan.samples_per_second == pytest.approx(_scored(job, plan, prof), abs=1e-3)
    assert plan.samples_per_second >= full.samples_per_second * (1 - SPARE_TOLERANCE)
    for s in plan.spares:
        assert s.name == f"spare_{s.provider}"
        assert s.ram_gb == job.spec.expanded_providers()[s.provider].ram
    assert "spare: spare_2 (2 GB)" in plan.table()


def test_a_count_sets_aside_that_many_and_the_plan_round_trips(plans):
    job, plan, prof = plans[1]
    assert len(plan.spares) == 1 and len(plan.nodes) == 5
    assert plan.samples_per_second == pytest.approx(_scored(job, plan, prof), abs=1e-3)
    assert Plan.from_dict(plan.to_dict()) == plan
    assert decode(encode(plan), job.spec) == plan  # as a planner pod hands it back


def test_more_spares_than_the_model_can_spare_is_a_plan_error():
    with pytest.raises(PlanError, match=r"spec\.plan\.spares: 6 spare"):
        plan_job(_job(6))
    with pytest.raises(PlanError, match=r"spec\.plan\.spares: 5 spare"):
        plan_job(_job(5))  # clusters: 2 needs two providers


@pytest.mark.parametrize("bad", [-1, "some", 2.5, True, 1001])
def test_a_bad_spares_field_is_named(bad):
    with pytest.raises(SpecError, match=r"spec\.plan\.spares: must be 'auto' or a count"):
        _job(bad)


def test_a_handed_back_plan_whose_spare_is_a_node_is_refused(plans):
    job, plan, _ = plans[1]
    node = plan.nodes[0].provider
    for spare, says in [(SparePlan(f"spare_{node}", node, 4.0), "is a node or spare already"),
                        (SparePlan("spare_9", 9, 4.0), "is not one of the job's 6 providers"),
                        (SparePlan("x", plan.spares[0].provider, 4.0), "is not spare_<provider>")]:
        bad = dataclasses.replace(plan, spares=(spare,))
        with pytest.raises(PlanError, match=says):
            decode(encode(bad), job.spec)


def test_the_smallest_spare_that_holds_the_stage_takes_it_over(plans):
    _, plan, _ = plans[0]
    stage = plan.node("node_3").memory_bytes
    small = SparePlan("spare_7", 7, stage / GB / 2)
    fits = SparePlan("spare_8", 8, stage / GB * 1.5)
    big = SparePlan("spare_9", 9, 64.0)
    assert elastic.spare_for(plan, "node_3", [big, small, fits]) == fits
    assert elastic.spare_for(plan, "node_3", [small]) is None
    assert elastic.spare_for(plan, "node_3", []) is None
    twin = SparePlan("spare_6", 6, fits.ram_gb)
    assert elastic.spare_for(plan, "node_3", [fits, twin]) == twin  # ties: lowest provider


def test_a_loss_costs_only_its_cluster_when_elasticity_can_absorb_it(plans):
    _, plan, _ = plans[0]
    policy = RunPolicy()
    assert elastic.restart_alone(plan, policy, {1}, [0], 0, False)
    assert not elastic.restart_alone(plan, policy, {1}, [], 0, False)  # no other cluster whole
    assert not elastic.restart_alone(plan, policy, {0, 1}, [], 0, False)  # two lost at once
    assert not elastic.restart_alone(plan, policy, {1}, [0], 0, True)  # a spec error
    assert not elastic.restart_alone(plan, policy, {1}, [0], 10, False)  # recoveryLimit 10
    assert not elastic.restart_alone(plan, RunPolicy(recovery="job"), {1}, [0], 0, False)
    one = dataclasses.replace(plan, clusters=plan.clusters[:1])
    assert not elastic.restart_alone(one, policy, {0}, [], 0, False)


def test_a_job_ends_without_a_cluster_only_once_the_others_finished(plans):
    _, plan, _ = plans[0]
    policy = RunPolicy()
    assert elastic.ended_without(policy, plan, {0}, {1}) == {1}
    assert elastic.ended_without(policy, plan, {0}, set()) == set()  # still training
    assert elastic.ended_without(policy, plan, set(), {0, 1}) == set()  # nobody finished
    assert elastic.ended_without(policy, plan, {0, 1}, set()) == set()  # all finished
    assert elastic.ended_without(RunPolicy(recovery="job"), plan, {0}, {1}) == set()


def test_a_joining_cluster_in_no_finished_node_s_final_round_can_no_longer_join():
    said = [{"final_clusters": [0]}, {"final_clusters": [0]}, {"updates": 3}]
    assert elastic.missed_final({1}, said) == {1}
    assert elastic.missed_final({1}, [*said, {"final_clusters": [0, 1]}]) == set()  # sent it
    assert elastic.missed_final({1, 2}, [{"final_clusters": [0, 2]}]) == {1}
    assert elastic.missed_final(set(), said) == set()  # nobody joining
    # no finished node says (none shares a ring, or an older worker wrote the message): no rule
    assert elastic.missed_final({1}, [{}, {"updates": 3}, {"final_clusters": "0"}]) == set()


def test_the_clusters_that_must_join_are_the_restarted_and_the_added_ones_not_away(plans):
    _, plan, _ = plans[0]
    assert elastic.joining(plan, [1, 1], set()) == {1}
    assert elastic.joining(plan, [1], {1}) == set()  # finished, drained or left out
    assert elastic.joining(plan, [], set()) == set()
    grown = dataclasses.replace(plan, planned_clusters=1)  # cluster 1 added to the running job
    assert elastic.joining(grown, [], set()) == {1} and elastic.joining(grown, [], {1}) == set()


def test_removed_providers_drain_their_clusters_and_one_cluster_at_least_stays(plans):
    _, plan, _ = plans[0]
    runs_on = {n.name: n.provider for n in plan.nodes}
    of = {c.id: [runs_on[n] for n in c.nodes] for c in plan.clusters}
    assert elastic.drain_for(plan, [of[1][-1]], runs_on, set()) == {1}
    assert elastic.drain_for(plan, [of[1][0]], runs_on, {1}) == set()  # already draining
    # a spare that took over a stage of cluster 0: removing it drains cluster 0
    assert elastic.drain_for(plan, [9], {**runs_on, plan.clusters[0].nodes[0]: 9}, set()) == {0}
    with pytest.raises(RavnestError, match="provider 9 runs no stage of this job"):
        elastic.drain_for(plan, [of[0][0], 9], runs_on, set())
    with pytest.raises(RavnestError, match="would leave no cluster to train"):
        elastic.drain_for(plan, [of[0][0]], runs_on, {1})


def test_the_membership_gets_a_version_for_each_round_clusters_left_after(plans):
    _, plan, _ = plans[0]
    three = dataclasses.replace(plan, clusters=(*plan.clusters, dataclasses.replace(
        plan.clusters[0], id=2)))
    assert elastic.membership(three, []) == {"plan": plan.fingerprint, "versions": [
        {"version": 1, "fromRound": 1, "clusters": [0, 1, 2]}]}
    got = elastic.membership(three, [{"cluster": 0, "round": 40}, {"cluster": 2, "round": 12},
                                     {"cluster": 1, "round": 40}])
    assert got["versions"] == [{"version": 1, "fromRound": 1, "clusters": [0, 1, 2]},
                               {"version": 2, "fromRound": 13, "clusters": [0, 1]},
                               {"version": 3, "fromRound": 41, "clusters": []}]


def test_the_spare_search_of_a_large_pool_makes_few_trial_plans(monkeypatch):
    """`auto` on 400 providers: at most SPARE_WORK // 400 = 5 trial plans besides the first (each
    such plan searches all 400 providers), and the providers are still each used once."""
    from test_planning import _pool, _skipnet_profile

    from ravnest.plan import planning

    calls = []
    form = planning._form

    def counted(costs, pool, used, *rest):
        calls.append(len(used))
        return form(costs, pool, used, *rest)

    monkeypatch.setattr(planning, "_form", counted)
    pool = _pool(400, seed=3, scale=1e-5)
    plan = planning.make_plan(_skipnet_profile(), pool, Workload(batch_size=8, microbatches=2),
                              spares="auto")
    assert calls[0] == 400 and len(calls) - 1 <= planning.SPARE_WORK // 400
    assert sorted([n.provider for n in plan.nodes] + [s.provider for s in plan.spares]) == \
        list(range(400))
