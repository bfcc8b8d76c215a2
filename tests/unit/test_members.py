"""A node's ring membership (`train.members`) as the members of its rings in other clusters
come and go, on the in-process harness's nodes (tests/inprocess.py): real runtimes and loopback
links; what a node answers is what lands in the asker's inbox."""

from __future__ import annotations

import dataclasses
import queue
import time

import pytest
import torch
from inprocess import SEED, build, data, make_plan
from models import DeepMLP

from ravnest.comm.framing import Frame
from ravnest.plan.partitioning import profile
from ravnest.train.allreducing import FINAL_ROUND
from ravnest.train.members import PENDING_NEWCOMERS, Outside
from ravnest.train.messages import Join, Kind, Leaving, Op, Where, parse
from ravnest.train.rejoining import RingMembership, pack_state
from ravnest.train.runtime import NodeRuntime


@pytest.fixture
def two_clusters():
    """Two clusters of two stages: node `a` (cluster 0's root) and `b` (cluster 1's root) are
    the two members of one ring; `c` is cluster 1's other stage (another ring)."""
    torch.manual_seed(SEED)
    gm, prof = profile(DeepMLP(), (torch.zeros(8, 1, 8, 8),))
    plan = make_plan(prof, 2)
    xs, ys = data(2)
    runtimes, links = build(plan, gm, xs, ys)
    by = {rt.name: rt for rt in runtimes}
    a, b = (by[plan.clusters[c].nodes[0]] for c in (0, 1))
    c = by[plan.clusters[1].nodes[1]]
    yield a, b, c
    for link in links:
        link.close()


def _answers(sender: NodeRuntime, rt: NodeRuntime) -> list[tuple[str, Frame]]:
    """The controls `sender` sent that reached `rt` (op, frame), in order."""
    for link in sender.peers.values():
        link.flush(5)
    out = []
    while True:
        try:
            frame = rt.inbox.pipeline.get_nowait()
        except queue.Empty:
            return out
        out.append((frame.control["op"], frame))


def _ring(a: NodeRuntime) -> str:
    (ring,) = a.plan.rings_of(a.name)
    return ring.id


def test_a_join_after_a_round_already_over_is_answered_late_and_changes_nothing(two_clusters):
    a, b, _ = two_clusters
    a.members.round_done(3, {0, 1}, 6)
    a.members.join(Join(node=b.name, ring=_ring(a), round=2, serve=True))
    (op, frame), = _answers(a, b)
    assert op == Op.LATE and (frame.control["round"], frame.control["last"]) == (2, 3)
    a.members.round_done(4, {0, 1}, 8)
    assert _answers(a, b) == []  # no state sent for a join refused


def test_a_node_taken_in_gets_its_rings_state_once_its_join_round_is_over(two_clusters):
    a, b, _ = two_clusters
    a.members.join(Join(node=b.name, ring=_ring(a), round=5, serve=True))
    a.members.round_done(4, {0}, 8)
    assert _answers(a, b) == []
    a.members.round_done(5, {0}, 10)
    (op, frame), = _answers(a, b)
    state = parse(frame.control)
    assert op == Op.STATE and (state.ring, state.round, state.updates, state.final) == (
        _ring(a), 5, 10, False)
    ring = a.plan.rings_of(a.name)[0]
    sent, _ = pack_state(a.stage, a.optimization, ring.state)
    assert sorted(frame.tensors) == sorted(sent)
    assert all(torch.equal(frame.tensors[k], sent[k]) for k in sent)


def test_the_final_round_serves_every_join_still_waiting_and_counts_its_cluster(two_clusters):
    a, b, _ = two_clusters
    a.members.join(Join(node=b.name, ring=_ring(a), round=None, serve=True))
    a.members.round_done(FINAL_ROUND, {0}, 12)
    (op, frame), = _answers(a, b)
    assert op == Op.STATE and frame.control["final"] is True
    assert a.final_clusters == {0, 1}


@pytest.mark.parametrize("what", ["join", "leave"])
def test_a_join_or_leave_from_a_node_not_in_that_ring_is_dropped(two_clusters, what, caplog):
    a, b, c = two_clusters
    a.members.membership = membership = RingMembership()
    if what == "join":
        a.members.join(Join(node=c.name, ring=_ring(a), round=7, serve=True))
        a.members.round_done(8, {0, 1}, 16)
    else:
        a.members.leaving(Leaving(node=c.name, ring=_ring(a), round=7))
    assert f"a {what} of {c.name} for ring {_ring(a)} that is not its, dropped" in caplog.text
    assert _answers(a, b) == [] and membership.leaving() == set()
    # the ring's own member is heard
    a.members.leaving(Leaving(node=b.name, ring=_ring(a), round=7))
    assert membership.leaving() == {b.name}


@pytest.mark.parametrize("op", [Op.LEAVING, Op.JOIN, Op.WHERE])
def test_a_control_about_a_node_is_heard_from_that_node_only(two_clusters, op, caplog):
    """Issue 40: a `leaving` said for a ring member by another node dropped it from the ring
    (its rounds then waited for nobody, and the final one was skipped). Controls about a node
    (leaving, join, where) are heard from that node only: a frame's sender is its connection's
    (with TLS, its certificate's node: test_tls.py)."""
    a, b, c = two_clusters
    a.members.membership = membership = RingMembership()
    control = {Op.LEAVING: Leaving(node=b.name, ring=_ring(a), round=7),
               Op.JOIN: Join(node=b.name, ring=_ring(a), round=9, serve=True),
               Op.WHERE: Where(node=b.name)}[op]
    a.handle(Frame(Kind.CONTROL, sender=c.name, control=control.wire()))
    a.members.round_done(8, {0, 1}, 16)
    assert (f"a {op} for {b.name!r} sent by {c.name!r}, dropped: a node speaks for itself "
            f"only") in caplog.text
    assert _answers(a, b) == [] and membership.leaving() == set()
    assert membership.absent(9) == set()
    a.handle(Frame(Kind.CONTROL, sender=b.name, control=control.wire()))  # (b's own: heard)
    a.members.round_done(9, {0, 1}, 18)
    heard = {Op.LEAVING: lambda: membership.leaving() == {b.name},
             Op.JOIN: lambda: [o for o, _ in _answers(a, b)] == [Op.STATE],
             Op.WHERE: lambda: [o for o, _ in _answers(a, b)] == [Op.HERE]}[op]
    assert heard()


def test_introductions_are_bounded_and_a_newcomer_that_never_joins_is_forgotten(
        two_clusters, caplog):
    """Issue 40: 300 introductions of nodes that never came took a node from 39 to 2,448 threads
    and its end waited for each of their links in turn. A node takes in `PENDING_NEWCOMERS` (16)
    at once and `NEWCOMERS` in all; one that does not join within twice the peer timeout is
    forgotten (its link closed in the background), and linked again if it comes after all."""
    a, _, _ = two_clusters
    welcomed: list[str] = []
    forgotten: list[str] = []
    a.members.outside = Outside(welcome=lambda name, address, ring: welcomed.append(name),
                                forget=forgotten.append)
    a.members.membership = RingMembership()
    ring = _ring(a)

    def where(i: int) -> Where:
        name = f"node_{100 + i}"
        node = {**dataclasses.asdict(a.plan.node(a.name)), "name": name, "cluster": 2}
        return Where(node=name, newcomer={"node": node, "address": "10.9.9.9:1",
                                          "rings": [ring]})

    for i in range(40):
        a.members.welcome(where(i))
    assert welcomed == [f"node_{100 + i}" for i in range(PENDING_NEWCOMERS)]
    assert (f"{PENDING_NEWCOMERS} newcomers wait to join and {PENDING_NEWCOMERS} came in all "
            f"(at most {PENDING_NEWCOMERS}") in caplog.text
    a.members.join(Join(node="node_100", ring=ring, round=None))  # one joins: a slot is free
    a.members.welcome(where(40))
    assert welcomed[-1] == "node_140" and len(welcomed) == PENDING_NEWCOMERS + 1
    later = time.monotonic() + 2 * a.members.s.peer_timeout + 1
    a.members.forget_newcomers(later)
    assert forgotten == [f"node_{100 + i}" for i in (*range(1, PENDING_NEWCOMERS), 40)]
    assert "never joined: forgotten" in caplog.text
    a.members.welcome(where(5))  # back after all: linked again, in the plan once
    assert welcomed[-1] == "node_105" and a.plan.names().count("node_105") == 1
    assert a.members.membership.absent(0) >= {"node_105", "node_101"}


def test_a_draining_node_tells_the_members_elsewhere_and_takes_part_in_no_later_round(
        two_clusters):
    a, b, _ = two_clusters
    a.members.leave(6)
    (op, frame), = _answers(a, b)
    assert op == Op.LEAVING and (frame.control["node"], frame.control["round"]) == (a.name, 6)
    assert a.leave_after == 6
