"""The planner's cost model (`estimate`) against hand arithmetic, and plans of large pools."""

from __future__ import annotations

import dataclasses
import itertools
import random
from pathlib import Path

import pytest
import torch
import yaml
from models import skipnet

from ravnest.errors import PlanError
from ravnest.plan.costs import Workload
from ravnest.plan.partitioning import Layer, Profile, profile
from ravnest.plan.planning import estimate, make_plan
from ravnest.plan.plans import GB, ProviderInfo, RingPlan
from ravnest.spec import parse_job

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "digits.yaml"


def _layer(name: str, gflops: float, param_bytes: int) -> Layer:
    return Layer(name=name, op="call_module", target=name, state=(f"{name}.weight",),
                 params=param_bytes // 4, param_bytes=param_bytes, buffer_bytes=0,
                 flops=int(gflops * 1e9), out_bytes=0)


@pytest.fixture
def three_layers() -> Profile:
    """Forward GFLOPs 10, 20, 10; 1, 2 and 1 kB of parameters; 1 MB crosses the first cut and
    2 MB the second; example batch 4."""
    return Profile(layers=(_layer("a", 10, 1000), _layer("b", 20, 2000), _layer("c", 10, 1000)),
                   inputs=("x",), cut_ok=(True, True, False), cut_bytes=(10**6, 2 * 10**6, 0),
                   example_batch=4,
                   state_names=("a.weight", "b.weight", "c.weight"))


# batch 8 in 2 microbatches of 4 (the profile's batch): times as profiled; SGD: 3 x parameters.
WORK = Workload(batch_size=8, microbatches=2, optimizer="SGD")
FAST = ProviderInfo(ram_gb=1, bandwidth_mbps=80, compute=1)  # 10 MB/s; 20 GFLOP/s
SLOW_LINK = ProviderInfo(ram_gb=1, bandwidth_mbps=8, compute=2)  # 1 MB/s; 40 GFLOP/s


def test_estimate_of_one_pipeline_equals_hand_arithmetic(three_layers):
    e = estimate(three_layers, [FAST, SLOW_LINK], WORK, [[0, 1]], [[0, 1, 3]])
    # stage 0 on FAST: 3 x 10 GFLOP / 20 GFLOP/s = 1.5 s, plus 1 MB there and back at 1 MB/s
    # (the slower end of the link) = 2 s; stage 1 on SLOW_LINK: 3 x 30 / 40 = 2.25 s.
    # Pipeline of 2 microbatches over 2 stages: (2 + 2 - 1) x 3.5 s.
    assert e.cluster_seconds == pytest.approx((10.5,))
    assert e.ring_seconds == 0 and e.step_seconds == pytest.approx(10.5)
    assert e.samples_per_second == pytest.approx(8 / 10.5)
    assert e.fits
    # without bounds the planner's own split is used: the same cut is the best one here
    # (cutting after b would cost 4.5 s + 2 x 2 MB at 1 MB/s)
    assert estimate(three_layers, [FAST, SLOW_LINK], WORK, [[0, 1]]) == e


def test_estimate_of_two_clusters_adds_the_ring(three_layers):
    e = estimate(three_layers, [FAST, SLOW_LINK], WORK, [[0], [1]])
    # whole model: 6 s on FAST, 3 s on SLOW_LINK, each x (2 + 1 - 1); the ring moves
    # 2 (k-1)/k x 4000 bytes over the slowest link (1 MB/s)
    assert e.cluster_seconds == pytest.approx((12.0, 6.0))
    assert e.ring_seconds == pytest.approx(0.004)
    assert e.samples_per_second == pytest.approx(2 * 8 / 12.004)


def test_estimate_reports_a_stage_that_overflows_its_provider(three_layers):
    tiny = ProviderInfo(ram_gb=2000 / GB, bandwidth_mbps=8, compute=2)  # 2000 bytes of RAM
    e = estimate(three_layers, [FAST, tiny], WORK, [[0, 1]], [[0, 1, 3]])
    # b and c with SGD: 3 x 3000 bytes > 2000: still timed, but flagged
    assert not e.fits
    assert e.overflows == ("cluster 0 stage 1 (provider 1): 8.38e-06 GB > 1.86265e-06 GB",)
    assert e.step_seconds == pytest.approx(10.5)
    with pytest.raises(PlanError, match="cannot hold the model"):  # no layer fits tiny
        estimate(three_layers, [FAST, tiny], WORK, [[1, 0]])


@pytest.mark.parametrize(("clusters", "bounds", "message"), [
    ([[0, 1]], [[0, 1, 2]], r"bounds\[0\]: \[0, 1, 2\] must run from 0 to 3 in 2 non-empty"),
    ([[0, 1]], [[0, 3]], r"bounds\[0\]: .* in 2 non-empty stages"),
    ([[0], [0]], None, r"clusters\[1\]: provider 0 is out of range or in two clusters"),
    ([[0], []], None, r"clusters\[1\]: a cluster needs at least one provider"),
    ([[0], [1]], [[0, 3]], r"bounds: one list per cluster, got 1 for 2"),
])
def test_estimate_rejects_a_malformed_plan(three_layers, clusters, bounds, message):
    with pytest.raises(PlanError, match=message):
        estimate(three_layers, [FAST, SLOW_LINK], WORK, clusters, bounds)


def test_estimate_cuts_only_where_the_model_may_be_cut(three_layers):
    no_second_cut = dataclasses.replace(three_layers, cut_ok=(True, False, False))
    with pytest.raises(PlanError, match=r"bounds\[0\]: .* cutting only at \[0, 1, 3\]"):
        estimate(no_second_cut, [FAST, SLOW_LINK], WORK, [[0, 1]], [[0, 2, 3]])


def _skipnet_profile() -> Profile:
    torch.manual_seed(0)
    return profile(skipnet(), [torch.randn(8, 16)])[1]


def _pool(n: int, seed: int, scale: float = 1.0) -> list[ProviderInfo]:
    rng = random.Random(seed)
    return [ProviderInfo(rng.uniform(2, 32) * scale, rng.uniform(10, 1000), rng.uniform(0.5, 2))
            for _ in range(n)]


def test_estimate_agrees_with_the_plan_it_scores():
    prof = _skipnet_profile()
    pool = _pool(12, seed=1, scale=1e-5)  # 20-330 kB: the model (~31 kB to train) must be split
    work = Workload(batch_size=8, microbatches=2)
    plan = make_plan(prof, pool, work)
    assert any(len(c.nodes) > 1 for c in plan.clusters)
    groups = [[plan.node(n).provider for n in c.nodes] for c in plan.clusters]
    bounds = [[plan.node(n).start for n in c.nodes] + [plan.node(c.nodes[-1]).end]
              for c in plan.clusters]
    e = estimate(prof, pool, work, groups, bounds)
    assert e.fits
    assert e.cluster_seconds == pytest.approx([c.seconds_per_batch for c in plan.clusters])
    assert e.samples_per_second == pytest.approx(plan.samples_per_second, abs=1e-3)


def test_a_plan_of_a_thousand_providers_uses_each_once_within_its_ram():
    prof = _skipnet_profile()
    pool = _pool(1000, seed=2, scale=1e-5)
    plan = make_plan(prof, pool, Workload(batch_size=8, microbatches=2))
    assert sorted(n.provider for n in plan.nodes) == list(range(1000))
    for n in plan.nodes:
        assert n.memory_bytes <= pool[n.provider].ram_gb * GB, n
    for c in plan.clusters:
        nodes = plan.cluster_nodes(c.id)
        assert nodes[0].start == 0 and nodes[-1].end == len(prof.layers)
        assert all(a.end == b.start for a, b in itertools.pairwise(nodes))
    owned = {name for layer in prof.layers for name in layer.state}
    for name in owned:  # every parameter is averaged by one ring over one holder per cluster
        (ring,) = [r for r in plan.rings if name in r.state]
        assert [plan.node(m).cluster for m in ring.members] == list(range(len(plan.clusters)))
    assert make_plan(prof, pool, Workload(batch_size=8, microbatches=2)) == plan  # deterministic


def test_ring_successor_wraps_around_and_a_ring_of_one_sends_to_itself() -> None:
    ring = RingPlan(id="ring-0", members=("a", "b", "c"), state=())
    assert [ring.successor(m) for m in ring.members] == ["b", "c", "a"]
    assert RingPlan(id="ring-1", members=("a",), state=()).successor("a") == "a"
    with pytest.raises(ValueError):
        ring.successor("z")


def test_workload_is_read_from_the_spec_and_defaults_to_the_specs_defaults() -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["data"] = {"entrypoint": doc["spec"]["data"]["entrypoint"]}
    del doc["spec"]["training"]
    assert Workload.from_spec(parse_job(doc).spec) == Workload()
    doc["spec"]["data"].update(batchSize=32, microbatches=4)
    doc["spec"]["training"] = {"optimizer": {"name": "SGD"}, "maxInFlight": 2, "reduceFactor": 3}
    assert Workload.from_spec(parse_job(doc).spec) == Workload(
        batch_size=32, microbatches=4, max_in_flight=2, optimizer="SGD", reduce_factor=3)
