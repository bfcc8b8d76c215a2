"""One node's elastic membership: the members of its rings in other clusters coming and going
(`join`, `leave`, a newcomer's introduction), and its own way back into a running job when its
cluster was restarted alone (`rejoin`). The protocol is `rejoining`'s; `NodeRuntime` is given a
`Members` and routes these controls to it, and tells it when each of its rounds is over.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ravnest.comm.framing import Frame
from ravnest.errors import PeerFailed, PeerTimeout, RavnestError, shown
from ravnest.plan.partitioning import Stage
from ravnest.plan.plans import Plan, RingPlan
from ravnest.train.allreducing import FINAL_ROUND, RingReducer
from ravnest.train.averaging import RingTensors
from ravnest.train.messages import (
    Control,
    Here,
    Join,
    Kind,
    Late,
    Leaving,
    Op,
    Rejoin,
    State,
    Where,
)
from ravnest.train.optimizing import Optimization
from ravnest.train.outer import OuterStep
from ravnest.train.rejoining import (
    NEWCOMER,
    RingMembership,
    RoundClock,
    join_round,
    newcomer_plan,
    pack_state,
    resume_position,
    unpack_state,
)
from ravnest.train.resuming import Checkpoints
from ravnest.train.routing import Routes
from ravnest.train.settings import Settings

log = logging.getLogger(__name__)

PENDING_NEWCOMERS = 16
"""Newcomers (nodes of clusters added to the running job) a node takes in at once between their
introduction and their join: each costs a link (a few threads) and a watch. More are dropped."""
NEWCOMERS = 256
"""Introductions a node takes in over the whole job; more are dropped."""


@dataclass(frozen=True)
class Outside:
    """A node's ways to the world outside its pipeline, given to its runtime when it is made
    (none is set on it afterwards)."""

    welcome: Callable[[str, str, str | None], None] | None = None
    """Link to a newcomer (name, address, ring data plane address), and watch it."""
    introduction: dict[str, Any] | None = None
    """At a node of a cluster added to the running job: how it introduces itself to the
    members of its rings (`NEWCOMER`: its node plan, addresses and rings)."""
    drain_asked: Callable[[], bool] | None = None
    """At a root: whether its cluster was told to drain (asked at each round boundary until it
    says yes)."""
    forget: Callable[[str], None] | None = None
    """Drop the link to and the watch of a newcomer that never joined (in the background)."""


@dataclass(frozen=True)
class Parts:
    """What of its node's runtime a `Members` acts on: its stage and optimizer (a ring's state
    goes out and comes in through them), its rings' reducers (a member taken in again is added
    to them), its checkpoints (a drained cluster's nodes leave them), its frames' routes, and the
    runtime's own handling of a frame and parsing of a control (`handle`, `parse`)."""

    stage: Stage
    optimization: Optimization
    reducers: Sequence[tuple[RingReducer, RingTensors]]
    checkpoints: Checkpoints
    routes: Routes
    handle: Callable[[Frame], None]
    parse: Callable[[Frame], Control | None]
    outer: Mapping[str, OuterStep] = field(default_factory=dict)
    """The outer step of each ring that has one (training.outer), by ring id."""


class Members:
    """The membership of one node's rings, as that node sees and changes it."""

    leave_after: int | None
    """The round after which this node's cluster leaves the job (it drains), once known."""
    final_clusters: set[int] | None
    """The clusters whose nodes this node's final round held, or that it sent the final state
    to (a restarted cluster that asked in time); None: it had no final round (no rings). A
    cluster in no finished node's is past rejoining (`run.elastic.missed_final`)."""

    def __init__(self, name: str, plan: Plan, settings: Settings, parts: Parts,
                 membership: RingMembership | None, outside: Outside) -> None:
        """`membership`: who of its rings' members is there (None: no watch, all are)."""
        self.name = name
        self.cluster = plan.node(name).cluster
        self.plan = plan
        """This node's plan, with the nodes of clusters added to the running job that
        introduced themselves (`welcome`)."""
        self.s = settings
        self.p = parts
        self.membership = membership
        self.outside = outside
        self.rounds = RoundClock()
        self.leave_after = None
        self.final_clusters = None
        self._joins: list[tuple[str, str, int | None]] = []  # (node, ring, round) to serve
        self._newcomers: dict[str, float] = {}
        """Newcomers introduced and not joined yet: when (`PENDING_NEWCOMERS` at most)."""
        self._forgotten: set[str] = set()
        self._introduced = 0
        self._refused = 0

    # ------------------------------------------------------------------ the others come and go

    def where(self, c: Where, updates: int) -> None:
        """A restarted root asks where training is: answer with this node's last round."""
        self.welcome(c)
        self.p.routes.answer(c.node, Here(updates=updates, round=self.rounds.last,
                                          seconds_per_round=self.rounds.seconds or 0.0))

    def _from_member(self, c: Join | Leaving, what: str, round_ok: bool) -> str | None:
        """The node that sent `c` (a `what` for its `ring`), if it is another member of that
        ring of this node's and its `round` is `round_ok`; else None, and `c` is dropped."""
        who, ring_id = c.node, c.ring
        ring = next((r for r in self.plan.rings_of(self.name) if r.id == ring_id), None)
        if ring is None or who not in ring.members or who == self.name or not round_ok:
            log.warning("%s: a %s of %s for ring %s that is not its, dropped", self.name, what,
                        who, ring_id)
            return None
        return who

    def join(self, c: Join) -> None:
        """A restarted node asks to come back into a ring after a round (`rejoining`)."""
        self.welcome(c)
        ring_id, round_ = c.ring, c.round
        who = self._from_member(c, "join", True)
        if who is None:
            return
        if round_ is not None and round_ <= self.rounds.last:
            self.p.routes.answer(who, Late(ring=ring_id, round=round_, last=self.rounds.last))
            return
        first = FINAL_ROUND + 1 if round_ is None else round_ + 1
        self._newcomers.pop(who, None)
        if self.membership is not None:
            self.membership.admit(who, first)
        for reducer, _ in self.p.reducers:
            if reducer.ring.id == ring_id and who not in reducer.ring.members:
                reducer.extend(next(r for r in self.plan.rings if r.id == ring_id), first)
        log.info("%s: %s rejoins ring %s after round %s", self.name, who, ring_id,
                 "final" if round_ is None else round_)
        if c.serve:
            self._joins.append((who, ring_id, round_))

    def welcome(self, c: Where | Join) -> None:
        """A node of a cluster added to the running job (`growing`) introduces itself: it joins
        this node's plan (its cluster, its rings) and links, out of the rounds until it joins
        (`join`). Its node plan is checked against the rings it names; a bad one is dropped."""
        info = c.newcomer
        if info is None or (c.node in self.plan.names() and c.node not in self._forgotten):
            return
        if len(self._newcomers) >= PENDING_NEWCOMERS or self._introduced >= NEWCOMERS:
            self._refused += 1
            if self._refused & (self._refused - 1) == 0:  # (said at the 1st, 2nd, 4th...)
                log.warning("%s: an introduction of %s dropped: %d newcomers wait to join and "
                            "%d came in all (at most %d and %d); %d dropped so far", self.name,
                            shown(c.node), len(self._newcomers), self._introduced,
                            PENDING_NEWCOMERS, NEWCOMERS, self._refused)
            return
        if c.node in self._forgotten:  # (back after all: linked again)
            node = self.plan.node(c.node)
            self._forgotten.discard(c.node)
        else:
            try:
                node = newcomer_plan(self.plan, c.node, info)
            except (RavnestError, KeyError, TypeError, ValueError) as e:
                log.warning("%s: an introduction of %s dropped: %s", self.name, shown(c.node), e)
                return
            self.plan = self.plan.joined(node, tuple(info["rings"]))
            log.warning("%s: %s of cluster %d, added to the running job, introduced itself "
                        "(rings %s)", self.name, node.name, node.cluster,
                        ", ".join(info["rings"]))
        if self.membership is not None:
            self.membership.lost(node.name)  # (out of the rounds until it joins)
        self._newcomers[node.name] = time.monotonic()
        self._introduced += 1
        if self.outside.welcome is not None:
            ring = info.get("ringAddress")
            self.outside.welcome(node.name, str(info["address"]), str(ring) if ring else None)

    def forget_newcomers(self, now: float) -> None:
        """Forget the newcomers introduced longer ago than twice the peer timeout that did not
        join since: their links and watches go (in the background), their slots are free, and
        one that comes back after all is linked again."""
        late = [n for n, at in self._newcomers.items() if now - at > 2 * self.s.peer_timeout]
        for name in late:
            del self._newcomers[name]
            self._forgotten.add(name)
            if self.outside.forget is not None:
                self.outside.forget(name)
        if late:
            log.warning("%s: %s introduced themselves and never joined: forgotten", self.name,
                        ", ".join(late[:5]) + (f" and {len(late) - 5} more" if len(late) > 5
                                               else ""))

    def _intro(self) -> dict[str, Any]:
        """What a control to a ring member says of this node, a newcomer's introduction."""
        intro = self.outside.introduction
        return {NEWCOMER: intro} if intro is not None else {}

    def leave(self, round_: int) -> None:
        """This node's cluster drains: tell the other members of its rings to go without it
        after `round_` (`rejoining`, draining)."""
        self.leave_after = round_
        for ring in self.plan.rings_of(self.name):
            for m in self._elsewhere(ring):
                self.p.routes.answer(m, Leaving(node=self.name, ring=ring.id, round=round_))
        log.warning("%s drains: it leaves its rings after round %d", self.name, round_)

    def leaving(self, c: Leaving) -> None:
        """A member of one of this node's rings drains: the rounds after `round` go without it."""
        ring_id, round_ = c.ring, c.round
        who = self._from_member(c, "leave", self.membership is not None)
        if who is None:
            return
        assert self.membership is not None
        self.membership.leave(who, round_ + 1)
        cluster = self.plan.node(who).cluster
        self.p.checkpoints.without({n.name for n in self.plan.cluster_nodes(cluster)})
        log.info("%s: %s leaves ring %s after round %d%s", self.name, who, ring_id, round_,
                 f" (this node is at round {self.rounds.last} already)"
                 if self.rounds.last > round_ else "")

    def round_done(self, round_: int, present: set[int], updates: int) -> None:
        """This node's ring round `round_` is over, held by the nodes of clusters `present`,
        after its update `updates`: send each restarted node waiting for this round its ring's
        state (at the final round, every one still waiting)."""
        final = round_ == FINAL_ROUND
        if final:
            self.final_clusters = present
        else:
            now = time.monotonic()
            self.rounds.done(round_, now)
            self.forget_newcomers(now)
        due = [j for j in self._joins if final or (j[2] is not None and j[2] <= round_)]
        for who, ring_id, _ in due:
            self._joins.remove((who, ring_id, _))
            ring = next(r for r in self.plan.rings_of(self.name) if r.id == ring_id)
            tensors, extra = pack_state(self.p.stage, self.p.optimization, ring.state,
                                        self.p.outer.get(ring_id))
            self.p.routes.answer(who, State(ring=ring_id, round=round_, updates=updates,
                                            final=final, **extra), tensors)
            log.info("%s: sent %s ring %s's state after round %s (%d tensors)", self.name, who,
                     ring_id, "final" if final else round_, len(tensors))
            if final and self.final_clusters is not None:
                self.final_clusters.add(self.plan.node(who).cluster)

    # ------------------------------------------------------------------ this node comes back

    def await_controls(self, ops: tuple[Op, ...], timeout: float,
                       from_: Collection[str] = ()) -> tuple[Control, Frame]:
        """The next control of one of `ops` in the pipeline queue, and its frame (who sent it,
        its tensors); controls for this node (abort, where, join) are acted on, other frames
        kept for later, in order. Raises if a node it is awaited `from_` is lost meanwhile."""
        routes = self.p.routes
        deadline = time.monotonic() + timeout
        while True:
            gone = self._lost_now() & set(from_)
            if gone:
                why = self.membership.why(gone) if self.membership is not None else ""
                raise PeerFailed(", ".join(sorted(gone)), "it was lost while this node was "
                                 "rejoining" + (f" ({why})" if why else ""), via=self.name)
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise queue.Empty
                frame = routes.inbox.pipeline.get(timeout=min(left, 0.5))
            except queue.Empty:
                if left > 0.5:
                    continue
                raise PeerTimeout(f"{self.name}: rejoining, no {'/'.join(ops)} within "
                                  f"{timeout:.0f}s") from None
            op = frame.control.get("op") if frame.kind == Kind.CONTROL else None
            if op in ops:
                c = self.p.parse(frame)
                if c is not None:
                    return c, frame
                continue
            if op == Op.ABORT and routes.finish_kept():
                # an upstream neighbour that passed on `finish` (a root that took the final
                # state) and then ended is not lost: this node finishes once its state is in
                log.info("%s: %s ended after training was over", self.name, frame.sender)
            elif op in (Op.ABORT, Op.WHERE, Op.JOIN):
                self.p.handle(frame)
            else:
                routes.kept.append(frame)

    def _lost_now(self) -> set[str]:
        """The members of this node's rings known to be lost (or restarted and not back), or
        drained."""
        m = self.membership
        return m.absent(0) | m.leaving() if m is not None else set()

    def _elsewhere(self, ring: RingPlan) -> list[str]:
        """The members of `ring` in other clusters that are there, in the plan's order."""
        lost = self._lost_now()
        return [m for m in ring.members if m not in lost
                and self.plan.node(m).cluster != self.cluster]

    def last_round_of_job(self, per_epoch: int) -> int:
        """The job's last ring round by updates, `per_epoch` batches an epoch."""
        per = -(-per_epoch // self.s.update_frequency)
        return self.s.epochs * per // self.s.reduce_factor

    def choose_join(self, per_epoch: int) -> Rejoin:
        """The root of a restarted cluster: ask a ring member where training is, and pick the
        round its cluster rejoins after and where its data resumes."""
        asked = next((m for r in self.plan.rings_of(self.name) for m in self._elsewhere(r)),
                     None)
        if asked is None:
            raise RavnestError(f"{self.name}: cannot rejoin: no member of its rings in another "
                               f"cluster is there to take the state from")
        asked_at = time.monotonic()
        self.p.routes.answer(asked, Where(node=self.name, **self._intro()))
        here, _ = self.await_controls((Op.HERE,), self.s.peer_timeout, (asked,))
        assert isinstance(here, Here)
        waited = time.monotonic() - asked_at
        last = self.last_round_of_job(per_epoch)
        rf = self.s.reduce_factor
        pace = here.seconds_per_round or 1.0
        round_ = join_round(here.round, pace, last, waited=waited)
        log.info("%s: %s was at round %s (%.3f s a round), its answer took %.2f s: the cluster "
                 "joins after round %s", self.name, asked, here.round, pace, waited,
                 "final" if round_ is None else round_)
        if round_ is None:
            return Rejoin(round=None, final=True, updates=last * rf, epoch=self.s.epochs,
                          next_batch=0, asked=asked)
        epoch, next_batch = resume_position(round_ * rf, per_epoch, self.s.update_frequency)
        return Rejoin(round=round_, final=False, updates=round_ * rf, epoch=epoch,
                      next_batch=next_batch, asked=asked)

    def take_states(self, c: Rejoin) -> tuple[int, int, list[str]]:
        """Ask the members of this node's rings in other clusters to take it in after `c`'s
        round, and load the state of each ring from the first of them there: the updates to
        resume from (the members' own after a final join), the bytes loaded, and from whom."""
        wanted: dict[str, str] = {}
        for ring in self.plan.rings_of(self.name):
            there = self._elsewhere(ring)
            if not there:
                continue
            wanted[ring.id] = there[0]
            for m in there:
                self.p.routes.answer(m, Join(node=self.name, ring=ring.id, round=c.round,
                                             serve=m == there[0], **self._intro()))
        updates, nbytes = self._load_states(wanted, c)
        self.rounds.last = updates // self.s.reduce_factor
        return updates, nbytes, sorted(set(wanted.values()))

    def _load_states(self, wanted: dict[str, str], c: Rejoin) -> tuple[int, int]:
        """Load the state of each ring in `wanted` (ring -> the member asked for it) once it
        comes; the updates to resume from (the members' own after a final join) and the bytes
        loaded."""
        updates, nbytes, round_ = c.updates, 0, c.round
        rings = {r.id: r for r in self.plan.rings_of(self.name)}
        got: set[str] = set()
        while got != set(wanted):
            reply, frame = self.await_controls((Op.STATE, Op.LATE), self.s.peer_timeout,
                                               set(wanted.values()))
            assert isinstance(reply, State | Late)
            ring_id = reply.ring
            if ring_id not in wanted or frame.sender != wanted[ring_id] or ring_id in got:
                continue
            if isinstance(reply, Late):
                raise RavnestError(f"{self.name}: {frame.sender} was past round {round_} "
                                   f"(at {reply.last}) when asked to take this node in "
                                   f"again; its cluster must be restarted again")
            nbytes += unpack_state(self.p.stage, self.p.optimization, rings[ring_id].state,
                                   frame.tensors, reply, self.p.outer.get(ring_id))
            if c.final:
                updates = reply.updates
            got.add(ring_id)
        return updates, nbytes
