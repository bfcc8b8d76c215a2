"""The seed API's rules that need no provider process: how `clusterize` forms clusters (one unless
told otherwise, with advice when one cannot be formed) and prints them, and when the rings average
(`reduce_factor=None`: once per epoch; `reduce_factor=k`: every k updates; always at the end),
checked on `NodeRuntime`s in threads linked by loopback senders, with recording ring reducers."""

from __future__ import annotations

import copy
import io
import json
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ravnest import clusterize, set_seed
from ravnest.comm.inboxes import Inbox
from ravnest.comm.loopback import Loopback
from ravnest.errors import PlanError
from ravnest.examples.digits import build_model
from ravnest.plan.partitioning import build_stage, profile
from ravnest.plan.plans import Plan
from ravnest.train.allreducing import FINAL_ROUND, RingReducer
from ravnest.train.metrics import Identity, WorkerMetrics
from ravnest.train.runtime import Batch, Batches, NodeRuntime
from ravnest.train.settings import Settings

EXAMPLE = (torch.rand(8, 1, 8, 8),)


def _stdout(monkeypatch: pytest.MonkeyPatch) -> io.StringIO:
    """Standard output from now on, captured (the seed console writes to whatever sys.stdout
    is). Not capsys: the console's handler flushes the stream it wrote to last when sys.stdout
    changes, and capsys closes its stream after the test, so the next test that prints would
    raise ValueError: I/O operation on closed file."""
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    return out


def _configs(folder: Path, n: int) -> Path:
    node_data = folder / "node_data"
    node_data.mkdir()
    (node_data / "node_configs.json").write_text(json.dumps({
        str(i): {"IP": f"127.0.0.1:{41000 + 2 * i}", "benchmarks": {"ram": 8, "bandwidth": 100}}
        for i in range(n)}))
    return node_data


def test_equal_providers_form_one_cluster_and_it_is_printed(tmp_path: Path, monkeypatch) -> None:
    node_data = _configs(tmp_path, 3)
    set_seed(0)
    shown = _stdout(monkeypatch)
    plan = clusterize(model=build_model(), example_args=EXAMPLE, node_data=node_data)
    out = shown.getvalue()
    assert len(plan.clusters) == 1 and len(plan.clusters[0].nodes) == 3 and not plan.rings
    for n in plan.nodes:
        i = n.name.removeprefix("node_")
        assert f"Node({i}, Cluster(0)) {n.role}" in out
        assert f"self.IP(127.0.0.1:{41000 + 2 * int(i)})" in out
    assert "CLUSTER" in out and "ROLE" in out and "1 cluster(s), 3 node(s), 0 ring(s)" in out
    assert sorted(p.name for p in (node_data / "nodes").glob("*.json")) == [
        f"node_{i}.json" for i in range(3)]


def test_clusters_n_forms_n_clusters(tmp_path: Path, monkeypatch) -> None:
    node_data = _configs(tmp_path, 4)
    set_seed(0)
    shown = _stdout(monkeypatch)
    plan = clusterize(model=build_model(), example_args=EXAMPLE, node_data=node_data,
                      clusters=2)
    out = shown.getvalue()
    assert len(plan.clusters) == 2 and len(plan.nodes) == 4 and plan.rings
    for n in plan.nodes:
        assert f"Node({n.name.removeprefix('node_')}, Cluster({n.cluster}))" in out
    assert {n.cluster for n in plan.nodes} == {0, 1}
    assert "2 cluster(s), 4 node(s)" in out


def test_more_providers_than_layers_asks_for_clusters(tmp_path: Path) -> None:
    # the digits model has 16 layers: 20 providers cannot form one cluster
    node_data = _configs(tmp_path, 20)
    with pytest.raises(PlanError) as caught:
        clusterize(model=build_model(), example_args=EXAMPLE, node_data=node_data)
    text = str(caught.value)
    assert "pass clusters=N" in text and "one cluster of all 20 providers" in text
    assert not (node_data / "nodes").exists() or not list((node_data / "nodes").iterdir())
    # told to, it forms the clusters
    plan = clusterize(model=build_model(), example_args=EXAMPLE, node_data=node_data,
                      clusters=2)
    assert len(plan.clusters) == 2


# --------------------------------------------------------------------------- averaging rounds

BATCH, BATCHES = 8, 4


class Recording(RingReducer):
    """A ring reducer that notes each round it is asked to average."""

    def __init__(self, *args, rounds: list[int], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rounds = rounds

    def average(self, tensors, round_: int, movable: int = 0,  # type: ignore[override]
                quantized: int = 0) -> bool:
        self.rounds.append(round_)
        return super().average(tensors, round_, movable, quantized)


def _batches(cluster: int, epochs: int) -> Batches:
    gen = torch.Generator().manual_seed(cluster)
    xs = torch.rand(epochs, BATCHES, BATCH, 1, 8, 8, generator=gen)
    ys = torch.randint(0, 10, (epochs, BATCHES, BATCH), generator=gen)

    def train(epoch: int) -> Iterator[Batch]:
        for b in range(BATCHES):
            yield (xs[epoch, b],), ys[epoch, b]

    def validation() -> Iterator[Batch]:
        yield (xs[0, 0],), ys[0, 0]

    return Batches(train=train, per_epoch=BATCHES, validation=validation)


def _rounds(plan: Plan, settings: Settings) -> dict[str, list[int]]:
    """Train `plan` in threads of this process; the rounds each node's reducers averaged."""
    set_seed(0)
    gm, _ = profile(build_model(), list(EXAMPLE))
    models = [copy.deepcopy(gm) for _ in plan.clusters]
    inboxes = {n: Inbox() for n in plan.names()}
    rounds: dict[str, list[int]] = {n: [] for n in plan.names()}
    runtimes, links = [], []
    for me in plan.nodes:
        stage = build_stage(models[me.cluster], me.start, me.end)
        params = [p for p in stage.parameters() if p.requires_grad]
        optimizer = torch.optim.SGD(params, lr=0.01) if params else None
        to = {n for n in plan.neighbours(me.name) if n} | {r.successor(me.name)
                                                           for r in plan.rings_of(me.name)}
        peers = {n: Loopback(inboxes[n].deliver, f"{me.name}->{n}") for n in sorted(to)}
        links += peers.values()
        reducers = [Recording(r, me.name, peers, inboxes[me.name], settings.reduce_timeout,
                              rounds=rounds[me.name]) for r in plan.rings_of(me.name)]
        metrics = WorkerMetrics(Identity("rules", "default", me.name, me.role, me.cluster,
                                         me.stage))
        runtimes.append(NodeRuntime(
            me.name, plan, stage, settings, optimizer, None,
            torch.nn.functional.cross_entropy if me.is_leaf else None, inboxes[me.name], peers,
            metrics, _batches(me.cluster, settings.epochs) if me.is_root else None,
            reducers=reducers))
    errors: list[BaseException] = []

    def loop(rt: NodeRuntime) -> None:
        try:
            rt.drive() if rt.me.is_root else rt.serve()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=loop, args=(rt,), name=rt.name) for rt in runtimes]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not [t.name for t in threads if t.is_alive()], "nodes still running"
    finally:
        for link in links:
            link.close()
    if errors:
        raise errors[0]
    assert all(rt.updates == settings.epochs * BATCHES for rt in runtimes)
    assert sum(rt.rounds_skipped for rt in runtimes) == 0
    return rounds


@pytest.fixture(scope="module")
def two_clusters(tmp_path_factory) -> Plan:
    node_data = _configs(tmp_path_factory.mktemp("rounds"), 4)
    set_seed(0)
    plan = clusterize(model=build_model(), example_args=EXAMPLE, node_data=node_data,
                      clusters=2)
    assert len(plan.clusters) == 2 and plan.rings
    return plan


def _settings(**kw) -> Settings:
    return Settings(batch_size=BATCH, microbatches=1, update_frequency=1, schedule="sync",
                    peer_timeout=30.0, reduce_timeout=30.0, **kw)


def test_reduce_factor_none_averages_once_per_epoch(two_clusters: Plan) -> None:
    # what Node(reduce_factor=None) asks for: reduce_each_epoch, and no averaging by updates
    rounds = _rounds(two_clusters, _settings(epochs=3, reduce_each_epoch=True,
                                             reduce_factor=2**62))
    for n in two_clusters.names():
        rings = len(two_clusters.rings_of(n))
        assert rings
        assert rounds[n] == [r for r in (1, 2, FINAL_ROUND) for _ in range(rings)], n


def test_reduce_factor_k_averages_every_k_updates(two_clusters: Plan) -> None:
    rounds = _rounds(two_clusters, _settings(epochs=2, reduce_each_epoch=False,
                                             reduce_factor=2))
    expected = [*range(1, 2 * BATCHES // 2 + 1), FINAL_ROUND]  # 8 updates: rounds 1..4
    for n in two_clusters.names():
        rings = len(two_clusters.rings_of(n))
        assert rounds[n] == [r for r in expected for _ in range(rings)], n
