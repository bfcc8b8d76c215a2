"""Ring rounds among the members present (issue 20, item 2), over real gRPC and the TCP data
plane: a ring whose member is lost goes on averaging among the others (their mean, the missing
member recorded), a loss seen while a round waits fails that round at once instead of after the
timeout, and members that disagree for a moment on who is present never mix their pieces."""

from __future__ import annotations

import faulthandler
import logging
import socket
import threading
import time
from collections.abc import Callable, Collection

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2

from ravnest.comm.dataplane import RingLink, RingServer
from ravnest.comm.inboxes import Inbox
from ravnest.comm.transport import Credentials, Peer, Server
from ravnest.plan.plans import ClusterPlan, NodePlan, Plan, RingPlan
from ravnest.run import assembling
from ravnest.run.assembling import Wiring
from ravnest.train.allreducing import FINAL_ROUND, RingReducer, reduce_all

CREDS = Credentials(token="ring-test", fingerprint="ring-plan")
TRANSPORTS = ["grpc", "tcp"]
HANG_GUARD = 60.0
"""Seconds a rank's thread may take before the test says it hangs (the rounds' own timeout is
longer in the tests where only an interruption can end a wait)."""


class Mesh:
    """One inbox and server per member, and from each member a sender to every other one."""

    def __init__(self, members: tuple[str, ...], transport: str) -> None:
        self.members = members
        self.inboxes = {m: Inbox() for m in members}
        self.servers: dict[str, Server | RingServer] = {}
        self.links: dict[str, dict[str, Peer | RingLink]] = {}
        for m in members:
            inbox = self.inboxes[m]
            self.servers[m] = (Server("127.0.0.1:0", CREDS, inbox.deliver) if transport == "grpc"
                               else RingServer("127.0.0.1:0", CREDS.token, CREDS.fingerprint,
                                               inbox.deliver, inbox=inbox))
            self.servers[m].start()
        for m in members:
            self.links[m] = {
                o: (Peer(f"127.0.0.1:{self.servers[o].port}", CREDS) if transport == "grpc"
                    else RingLink(f"127.0.0.1:{self.servers[o].port}", CREDS.token,
                                  CREDS.fingerprint, m, timeout=60))
                for o in members if o != m}

    def reducer(self, ring: RingPlan, me: str, lost: Callable[[int], Collection[str]],
                timeout: float = 600.0) -> RingReducer:
        return RingReducer(ring, me, self.links[me], self.inboxes[me], timeout, piece_bytes=64,
                           lost=lost)

    def close(self) -> None:
        for links in self.links.values():
            for link in links.values():
                link.close()
        for server in self.servers.values():
            server.stop()


def tensors_of(member: str, rows: int = 33, extra: int = 7) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(sum(map(ord, member)))
    return [torch.randn(rows, 3, generator=g), torch.randn(extra, generator=g).double()]


def mean_of(members: Collection[str], **shape: int) -> list[torch.Tensor]:
    return [torch.stack([tensors_of(m, **shape)[j].double() for m in members]).mean(0)
            for j in range(2)]


def run_ranks(body: Callable[[str], None], members: Collection[str]) -> None:
    errors: list[BaseException] = []

    def guarded(m: str) -> None:
        try:
            body(m)
        except BaseException as e:  # reported by the test's thread
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(m,)) for m in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_GUARD)
    assert not any(t.is_alive() for t in threads), "a member still waits on the ring"
    assert not errors, errors


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("lost", [("r1",), ("r0", "r2"), ("r0", "r1", "r3")],
                         ids=["one", "two", "all-but-one"])
def test_a_round_goes_on_among_the_members_present(transport: str, lost: tuple[str, ...]) -> None:
    members = ("r0", "r1", "r2", "r3")
    present = [m for m in members if m not in lost]
    ring = RingPlan(id="ring-0", members=members, state=())
    mesh = Mesh(members, transport)
    held = {m: tensors_of(m) for m in present}
    outcomes: dict[str, list[bool]] = {m: [] for m in present}
    missing: dict[str, tuple[str, ...]] = {}

    def rank(m: str) -> None:
        reducer = mesh.reducer(ring, m, lambda _: set(lost))
        for round_ in (1, 2):
            outcomes[m].append(reducer.average(held[m], round_))
        missing[m] = reducer.missing

    try:
        run_ranks(rank, present)
    finally:
        mesh.close()
    assert outcomes == {m: [True, True] for m in present}
    assert missing == {m: lost for m in present}
    for m in present:  # the mean of those present, in each tensor's own dtype
        for got, want in zip(held[m], mean_of(present), strict=True):
            torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_member_lost_while_a_round_waits_fails_it_at_once_and_the_next_goes_on(
        transport: str, caplog: pytest.LogCaptureFixture) -> None:
    """r2's server runs but its node takes no part (frozen, then gone): r0 and r1 follow it
    through their real Wiring's ring watch, which sees its server stop, fails their waiting round
    (a round timeout of 600 s could not end it within the guard) and leaves it out of the next."""
    members = ("r0", "r1", "r2")
    ring = RingPlan(id="ring-0", members=members, state=())
    plan = Plan(clusters=(), nodes=(), rings=(ring,), model_bytes=0, memory_bytes=0,
                samples_per_second=0.0)
    mesh = Mesh(members, transport)
    # the watch follows each member's gRPC health service (a data plane server has none)
    health = {m: Server("127.0.0.1:0", CREDS, mesh.inboxes[m].deliver) for m in members}
    for server in health.values():
        server.start()
    watch_peers = {m: {o: Peer(f"127.0.0.1:{health[o].port}", CREDS) for o in members if o != m}
                   for m in ("r0", "r1")}
    wirings = {m: Wiring(mesh.inboxes[m], health[m], watch_peers[m], None, {})
               for m in ("r0", "r1")}
    held = {m: tensors_of(m) for m in ("r0", "r1")}
    before = {m: [t.clone() for t in held[m]] for m in held}
    outcomes: dict[str, list[bool]] = {m: [] for m in held}
    both_waiting = threading.Barrier(3)

    def rank(m: str) -> None:
        reducer = mesh.reducer(ring, m, wirings[m].membership.absent)
        both_waiting.wait(HANG_GUARD)
        outcomes[m].append(reducer.average(held[m], 1))
        after_first = [t.clone() for t in held[m]]
        assert all(torch.equal(a, b) for a, b in zip(after_first, before[m], strict=True))
        outcomes[m].append(reducer.average(held[m], 2))
        assert reducer.missing == ("r2",)

    caplog.set_level(logging.WARNING)
    try:
        for m in wirings:  # as a worker does: its peers answer, then their watch begins
            wirings[m].wait_ready(30)
            wirings[m].watch_rings(plan, m)
        stopper = threading.Thread(target=lambda: (both_waiting.wait(HANG_GUARD),
                                                   health["r2"].stop()))
        stopper.start()
        run_ranks(rank, ("r0", "r1"))
        stopper.join(HANG_GUARD)
    finally:
        for w in wirings.values():
            w.stop_watching()
            for p in w.peers.values():
                p.close()
        for m in members:
            if m != "r2":
                health[m].stop()
        mesh.close()
    assert outcomes == {"r0": [False, True], "r1": [False, True]}
    for m in held:
        for got, want in zip(held[m], mean_of(("r0", "r1")), strict=True):
            torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)
    assert "round 1 skipped: ring ring-0 round 1: r2 was lost" in caplog.text
    assert "ring ring-0 from round 2 on: 2 of 3 members (without r2)" in caplog.text


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("views", [
    {"r0": {"r2"}, "r1": set()},  # r2 takes no part; r0 saw it go first
    {"r0": {"r2"}, "r1": set(), "r2": set()},  # r0 alone thinks r2 is gone (cut off from it)
], ids=["one-saw-the-loss-first", "one-thinks-a-live-member-gone"])
def test_members_that_disagree_on_who_is_present_never_mix_their_pieces(
        transport: str, views: dict[str, set[str]]) -> None:
    """Members whose rings differ for a moment send pieces cut for different rings: none may be
    added into the other ring's tensors. A member ends each round with its own tensors (skipped)
    or with the mean of the members it counted (their pieces all reached it).

    96 float32s cut into pieces of 16 make pieces of one shape in a ring of 2 and of 3: only the
    rounds' membership tags tell them apart (without them, r0 completes a round of garbage)."""
    members = ("r0", "r1", "r2")
    ring = RingPlan(id="ring-0", members=members, state=())
    mesh = Mesh(members, transport)
    shape = {"rows": 32, "extra": 0}
    held = {m: tensors_of(m, **shape) for m in views}
    outcomes: dict[str, bool] = {}
    counted: dict[str, tuple[str, ...]] = {}

    def rank(m: str) -> None:
        reducer = mesh.reducer(ring, m, lambda _: views[m], timeout=3.0)
        outcomes[m] = reducer.average(held[m], 1)
        counted[m] = reducer.members

    try:
        run_ranks(rank, views)
    finally:
        mesh.close()
    for m in views:
        want = (mean_of(counted[m], **shape) if outcomes[m]
                else [t.double() for t in tensors_of(m, **shape)])
        for got, expected in zip(held[m], want, strict=True):
            torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-6)
    assert not all(outcomes.values())  # the ones in the bigger ring wait for r0 in vain


@pytest.mark.parametrize("round_", [1, FINAL_ROUND], ids=["a-round", "the-final-round"])
def test_the_final_round_is_not_failed_by_a_member_that_leaves(round_: int) -> None:
    """Members leave once the final round is over for them, while the others may still wait for
    their last pieces, which the one that left had sent: a report of it gone fails the others'
    waits in any round but that one. r2 starts late; r0 and r1 are told of a loss meanwhile."""
    members = ("r0", "r1", "r2")
    ring = RingPlan(id="ring-0", members=members, state=())
    mesh = Mesh(members, "grpc")
    held = {m: tensors_of(m) for m in members}
    outcomes: dict[str, bool] = {}
    told = threading.Event()

    def rank(m: str) -> None:
        # r2 is not told: in a round failed for the others, its wait runs out (3 s)
        reducer = mesh.reducer(ring, m, lambda _: set(), timeout=3.0 if m == "r2" else 600.0)
        if m == "r2":
            told.wait(HANG_GUARD)
        else:
            threading.Timer(0.5, lambda: (mesh.inboxes[m].interrupt_ring(
                "ring-0", "a member left"), told.set())).start()
        outcomes[m] = reducer.average(held[m], round_)

    try:
        run_ranks(rank, members)
    finally:
        mesh.close()
    if round_ == FINAL_ROUND:
        assert outcomes == dict.fromkeys(members, True)
        for m in members:
            for got, want in zip(held[m], mean_of(members), strict=True):
                torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)
    else:
        assert outcomes["r0"] is False and outcomes["r1"] is False


def test_reduce_all_counts_partial_rounds_and_missing_members() -> None:
    """What a node's metrics get: a round done without members is done and partial, and the
    missing members are summed over its rings (here one ring alone, the rest gone)."""
    ring = RingPlan(id="ring-0", members=("a", "b", "c"), state=())
    reducer = RingReducer(ring, "a", {"b": None, "c": None}, Inbox(), 1.0,  # type: ignore[dict-item]
                          lost=lambda _: {"b", "c"})
    t = torch.ones(3)
    rounds = reduce_all([(reducer, lambda: ([t], 0, 0))], 1)
    assert (rounds.done, rounds.skipped, rounds.partial, rounds.missing) == (1, 0, 1, 2)
    assert torch.equal(t, torch.ones(3))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_ring_extended_at_a_round_takes_a_newcomer_in_from_that_round(transport: str) -> None:
    """Growing (issue 20): a node of a cluster added to the job joins a ring at round 3. The
    planned members switch to the grown ring at that round (`extend`), the newcomer runs the
    grown ring from its first round, and round 3 averages all four, with nobody missing."""
    planned = ("r0", "r1", "r2")
    grown = RingPlan(id="ring-0", members=(*planned, "r3"), state=())
    mesh = Mesh(grown.members, transport)
    held = {m: tensors_of(m) for m in grown.members}
    missing: dict[str, tuple[str, ...]] = {}
    round_2_over = threading.Barrier(4)  # (a newcomer starts once it got the state after it)

    def rank(m: str) -> None:
        if m == "r3":
            reducer = mesh.reducer(grown, m, lambda _: set())
            round_2_over.wait(HANG_GUARD)
            assert reducer.average(held[m], 3)
        else:
            reducer = mesh.reducer(RingPlan("ring-0", planned, ()), m, lambda _: set())
            reducer.extend(grown, 3)
            assert reducer.average(held[m], 1) and reducer.average(held[m], 2)
            assert reducer.members == planned
            round_2_over.wait(HANG_GUARD)
            assert reducer.average(held[m], 3)
        missing[m] = reducer.missing

    try:
        run_ranks(rank, grown.members)
    finally:
        mesh.close()
    assert missing == dict.fromkeys(grown.members, ())
    three = mean_of(planned)
    new = [t.double() for t in tensors_of("r3")]
    for m in grown.members:
        for got, a, b in zip(held[m], three, new, strict=True):
            torch.testing.assert_close(got.double(), (3 * a + b) / 4, rtol=0, atol=1e-6)


def _three_clusters_of_one_stage() -> Plan:
    """x0, x1, x2: one node per cluster, all in ring x."""
    def node(c: int) -> NodePlan:
        return NodePlan(name=f"x{c}", provider=c, cluster=c, stage=0, role="root-leaf",
                        start=0, end=1, first_layer="a", last_layer="a", state=("w",), params=1,
                        memory_bytes=1, ram_gb=1.0, seconds_per_microbatch=0.1)
    return Plan(clusters=tuple(ClusterPlan(id=c, nodes=(f"x{c}",), seconds_per_batch=0.1)
                               for c in range(3)),
                nodes=tuple(node(c) for c in range(3)),
                rings=(RingPlan(id="x", members=("x0", "x1", "x2"), state=("w",)),),
                model_bytes=4, memory_bytes=4, samples_per_second=1.0)


@pytest.mark.parametrize("others", ["late", "late-and-dead", "dead"])
def test_a_restarted_node_waits_for_a_ring_member_that_answers_late(
        others: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A restarted node (x1) asks the members of its ring in the other clusters whether they
    answer before it rejoins. A member that answers only after the short wait
    (REJOIN_READY_SECONDS, 1 s here; on a loaded machine the first answer can take longer) is
    waited for, not given up: it is the one the node can take its state from. Once one answered,
    one that never does is left out (lost); when none answers within the peer timeout, all are."""
    monkeypatch.setattr(assembling, "REJOIN_READY_SECONDS", 1.0)
    plan = _three_clusters_of_one_stage()
    inbox = Inbox()
    mine = Server("127.0.0.1:0", CREDS, inbox.deliver)
    late = Server("127.0.0.1:0", CREDS, Inbox().deliver)  # bound; it answers once started
    with socket.socket() as s:  # a port nobody listens on: the member that never answers
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    ports = {"x0": late.port if others != "dead" else dead_port,
             "x2": dead_port if others != "late" else late.port}
    peers = {m: Peer(f"127.0.0.1:{p}", CREDS) for m, p in ports.items()}
    wiring = Wiring(inbox, mine, peers, None, {})
    starter = threading.Timer(3.0, late.start)
    caplog.set_level(logging.INFO)
    try:
        mine.start()
        starter.start()
        wiring.wait_ready(8.0 if others == "dead" else 60.0, plan, "x1")
    finally:
        starter.cancel()
        for p in peers.values():
            p.close()
        mine.stop()
        late.stop()
    answered = {m for m, p in ports.items() if p == late.port}
    assert wiring.ready == answered
    assert wiring.membership.absent(0) == set(ports) - answered
    for m in set(ports) - answered:
        assert f"ring member {m} does not answer" in caplog.text


class _Moved(Peer):
    """A Peer to a node whose process was lost and started again elsewhere, seen from a node whose
    training channel still goes to the lost process's address (on Kubernetes the restarted pod
    has a new address behind the same DNS name, and that channel took seconds to connect to it),
    while its watch channel is connected to the new process already."""

    def __init__(self, address: str, stale: str) -> None:
        super().__init__(address, CREDS)
        self._stale = grpc.insecure_channel(stale)

    @property
    def channel(self) -> grpc.Channel:
        return self._stale

    def close(self, timeout: float = 5.0) -> None:
        self._stale.close()
        super().close(timeout)


@pytest.mark.parametrize("restarted", [True, False])
def test_a_member_that_answers_again_is_kept_out_until_it_rejoins_only_if_restarted(
        restarted: bool, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """x0 watches the other members of its ring. x1's server stops (x1 is lost), and a server
    answers at its address again: a restarted node still rejoining (its REJOIN_SERVICE serving)
    stays out of x0's rounds until it asks to come back in, and its ring link is not used, even
    though x0's training channel to it cannot connect yet; once its rejoin is over and x0 was
    never told it joins, it is taken in again (kept out, every round of the ring would be
    skipped from then on: x1 counts x0 in). One that never restarted (no such service: a
    network cut healed) is taken in again at once."""
    plan = _three_clusters_of_one_stage()
    inbox = Inbox()
    mine = Server("127.0.0.1:0", CREDS, inbox.deliver)
    old = Server("127.0.0.1:0", CREDS, Inbox().deliver)
    other = Server("127.0.0.1:0", CREDS, Inbox().deliver)
    with socket.socket() as s:  # the lost process's address: nothing listens there any more
        s.bind(("127.0.0.1", 0))
        stale = f"127.0.0.1:{s.getsockname()[1]}"
    peers = {"x1": _Moved(f"127.0.0.1:{old.port}", stale),
             "x2": Peer(f"127.0.0.1:{other.port}", CREDS)}
    wiring = Wiring(inbox, mine, peers, None, {})
    caplog.set_level(logging.INFO)
    new: Server | None = None
    try:
        for server in (mine, old, other):
            server.start()
        wiring.wait_ready(30.0)
        wiring.watch_rings(plan, "x0")
        old.stop(grace=0.5)
        _wait_until(lambda: wiring.membership.absent(0) == {"x1"}, "x1 to be lost",
                    lambda: _watch_state(wiring, caplog))
        new = Server(f"127.0.0.1:{old.port}", CREDS, Inbox().deliver)
        if restarted:
            new.health.set(assembling.REJOIN_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        new.start()
        _wait_until(lambda: "peer x1 is back" in caplog.text, "x1 to answer again",
                    lambda: _watch_state(wiring, caplog))
        _wait_until(lambda: "was restarted" in caplog.text or not wiring.membership.absent(0),
                    "x0 to decide whether x1 restarted", lambda: _watch_state(wiring, caplog))
        if restarted:
            time.sleep(3 * assembling.REJOIN_FOLLOW_SECONDS)  # (asked meanwhile: rejoining)
            assert wiring.membership.absent(10**6) == {"x1"}  # until it rejoins (`admit`)
            assert "ring member x1 was restarted: it comes back in when it rejoins" in caplog.text
            # its rejoin is over, and x0 was never told it joins (its `join` lost, or the loss
            # of its old process reported after it): taken in again, not kept out for good
            monkeypatch.setattr(assembling, "REJOIN_SETTLE_SECONDS", 2.0)
            new.health.set(assembling.REJOIN_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
            time.sleep(1.0)  # (seen over, not for long enough yet)
            assert wiring.membership.absent(10**6) == {"x1"}
            _wait_until(lambda: not wiring.membership.absent(0), "x1 to be taken in again",
                        lambda: _watch_state(wiring, caplog))
            assert "ring member x1 rejoined without telling this node" in caplog.text
    finally:
        wiring.stop_watching()
        for p in peers.values():
            p.close()
        for server in (mine, other, *([new] if new else [])):
            server.stop()
    if not restarted:
        assert wiring.membership.absent(0) == set()
        assert "was restarted" not in caplog.text


def _wait_until(done: Callable[[], bool], what: str,
                describe: Callable[[], str] = lambda: "") -> None:
    """Wait for `done`; past HANG_GUARD, fail saying what was awaited and what `describe` says
    (what a rare miss under CI's load needs to be understood), with every thread's stack."""
    deadline = time.monotonic() + HANG_GUARD
    while not done():
        if time.monotonic() >= deadline:
            faulthandler.dump_traceback(all_threads=True)
            pytest.fail(f"timed out waiting for {what}; {describe()}")
        time.sleep(0.05)


def _watch_state(wiring: Wiring, caplog: pytest.LogCaptureFixture) -> str:
    """The ring watch's view of each peer, and what was logged."""
    watch = wiring.ring_watch
    peers = getattr(watch, "_peers", {})
    state = {n: (w.seen, w.watchable, w.ended, w.call is not None,
                 w.thread is not None and w.thread.is_alive()) for n, w in peers.items()}
    return (f"lost {watch.lost if watch else None}; (seen, watchable, ended, streaming, "
            f"alive) {state}; log:\n{caplog.text}")
