"""Assembling a node: one path from node metadata to a node that trains, for `ravnest worker` and
for the seed API's `Node` and `Trainer`.

Both get the same peer set (pipeline neighbours and ring members), the same check of the stage
against the plan, mutual TLS when the metadata names the node's certificates, the ring data plane
when it names ring addresses, the same runtime and the same stage file. The steps are separate
because the seed API spreads them over two calls: `Node(...)` connects (its server must be up for
its neighbours), `Trainer.train()` builds the runtime once the loaders are known.
"""

from __future__ import annotations

import contextlib
import io
import logging
import threading
import time
from collections.abc import Callable, Collection
from concurrent import futures
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from torch import nn

from ravnest.comm.dataplane import RingLink, RingServer
from ravnest.comm.framing import Frame
from ravnest.comm.identity import NodeIdentity
from ravnest.comm.inboxes import Inbox
from ravnest.comm.tls import TlsMaterial, identity
from ravnest.comm.transport import Credentials, Peer, Server
from ravnest.comm.watching import PeerWatch
from ravnest.errors import PeerFailed, PeerTimeout, PlanError, RavnestError, shown
from ravnest.plan.partitioning import Profile, Stage, build_stage
from ravnest.plan.plans import Plan
from ravnest.run.metadata import NodeMetadata
from ravnest.storing import Location, open_location
from ravnest.train.devices import on_host
from ravnest.train.members import Outside
from ravnest.train.messages import Abort, Kind, Op
from ravnest.train.metrics import WorkerMetrics
from ravnest.train.rejoining import RingMembership
from ravnest.train.runtime import Batches, NodeRuntime
from ravnest.train.settings import Settings
from ravnest.train.targets import Targets

log = logging.getLogger(__name__)

REJOIN_READY_SECONDS = 10.0
"""How long a restarted node waits for all the members of its rings in other clusters to answer
once each of its rings has one that did (until then it waits for them up to its peer timeout)."""
FAILED_CLOSE_SECONDS = 1.0
"""How long each link of a failing node may take to deliver what it posted (its abort)."""

REJOIN_SERVICE = "ravnest.rejoin"
"""The health service a restarted node's server says SERVING for until it rejoined: a ring
member that sees it answer again keeps it out of the rounds until it asks to come back in,
instead of taking it in at once as a member back from a network cut."""
REJOIN_CHECKS = 3
REJOIN_CHECK_SECONDS = 5.0
"""How often, and for how long each time, a peer that answers again is asked whether it restarted
(`_rejoining`)."""
REJOIN_FOLLOW_SECONDS = 1.0
"""How often a restarted ring member is asked whether its rejoin is over, until this node was
told it joins (`Wiring.watch_rings`)."""
REJOIN_SETTLE_SECONDS = 10.0
"""How long a restarted ring member's rejoin must have been over, this node still not told that it
joins, before it is taken in without its join: that join, sent before the rejoin ended, may still
wait in this node's queue behind a training step, and taken in earlier the member would be counted
in rounds before its join round (those rounds skipped, the others holding them without it)."""


def peer_names(plan: Plan, node: str) -> list[str]:
    """The nodes `node` sends to: its pipeline neighbours and the other members of its rings."""
    up, down = plan.neighbours(node)
    wanted = {n for n in (up, down) if n} | {m for r in plan.rings_of(node)
                                             for m in r.members if m != node}
    return sorted(wanted)


def cut_stage(gm: nn.Module, prof: Profile, plan: Plan, node: str,
              hint: str) -> Stage:
    """This node's stage of a traced model, once the model is checked to match the plan (`hint`
    says what to check when it does not)."""
    me = plan.node(node)
    if me.end > len(prof.layers) or prof.layers[me.start].name != me.first_layer or \
            prof.layers[me.end - 1].name != me.last_layer:
        raise PlanError(f"{node}: the model built here does not match the plan (stage "
                        f"{me.first_layer}..{me.last_layer}); {hint}")
    return build_stage(gm, me.start, me.end)


@dataclass
class Wiring:
    """A node's side of the network: its gRPC server and inbox, its peers, and with the ring data
    plane its ring server and the links to its ring successors.

    A failure stops the whole cluster within seconds: `watch_neighbours` turns a pipeline
    neighbour that vanishes into an abort control in this node's own inbox (its loop raises
    PeerFailed naming it), and `abort` tells the neighbours why this node stops, passing on a
    failure it was told of away from where it came. Clusters do not abort each other:
    `watch_rings` follows the other members of this node's rings, and a round goes on among the
    members present (train/allreducing.py); a restarted one comes back in when it rejoins
    (train/rejoining.py)."""

    inbox: Inbox
    server: Server
    peers: dict[str, Peer]
    ring_server: RingServer | None
    ring_links: dict[str, RingLink]
    watch: PeerWatch | None = None
    ring_watch: PeerWatch | None = None
    ready: set[str] = field(default_factory=set)
    """The peers that answered `wait_ready`: their watches count them as up from the start."""
    membership: RingMembership = field(default_factory=RingMembership)
    """Who this node's ring rounds go without."""
    dial: Callable[[str, str], Peer] | None = None
    """A link to another node (name, its gRPC address), as this node's others are made."""
    reach: Callable[[str, str], RingLink] | None = None
    """A data-plane link to another node (name, its ring address), with the ring data plane."""
    unwatched: threading.Event = field(default_factory=threading.Event)
    """Set once the watches stopped (`stop_watching`): what follows a peer for them stops too."""

    def welcome(self, name: str, address: str, ring_address: str | None) -> None:
        """Link to `name`, a node of a cluster added to the running job that introduced itself
        (train/runtime.py), and follow it as a member of this node's rings."""
        if name not in self.peers and self.dial is not None:
            self.peers[name] = self.dial(name, address)
        if ring_address and name not in self.ring_links and self.reach is not None:
            self.ring_links[name] = self.reach(name, ring_address)
        if self.ring_watch is not None and name in self.peers:
            self.ring_watch.add(name, self.peers[name])

    def forget(self, name: str) -> None:
        """Drop the link to and the watch of `name`, a newcomer that never joined; its links
        close in the background (one to an address that never answers takes seconds)."""
        if self.ring_watch is not None:
            self.ring_watch.expect_exit(name)
        peer, link = self.peers.pop(name, None), self.ring_links.pop(name, None)

        def close() -> None:
            if peer is not None:
                peer.close(1.0)
            if link is not None:
                link.close()

        threading.Thread(target=close, daemon=True, name=f"forget-{name}").start()

    def rejoining(self, on: bool) -> None:
        """Say (`REJOIN_SERVICE`) whether this node is a restarted one not back in its rings."""
        status = health_pb2.HealthCheckResponse
        self.server.health.set(REJOIN_SERVICE, status.SERVING if on else status.NOT_SERVING)

    def start(self) -> None:
        self.server.start()
        if self.ring_server is not None:
            self.ring_server.start()

    def wait_ready(self, timeout: float, plan: Plan | None = None, node: str = "") -> None:
        """Wait until every peer's server answers, or until this node was told that training is
        over: a run resumed at its end finishes at once, and a neighbour that passed its own
        wait and sent `finish` may be gone before this node asks it (the wait would run out).

        Given `plan` and `node` (a restarted node that rejoins), the members of its rings in the
        other clusters, which train on, are waited for together (`_await_members`)."""
        members: set[str] = set()
        if plan is not None:
            members = {m for r in plan.rings_of(node) for m in r.members} - set(
                plan.neighbours(node)) - {node}
        gone = self.membership.leaving()  # drained before this worker started
        for name, peer in sorted(self.peers.items()):
            if name in gone or name in members:
                continue
            if peer.wait_ready(timeout, stop=self._finished):
                self.ready.add(name)
        waited = {m: self.peers[m] for m in sorted(members - gone) if m in self.peers}
        if plan is not None and waited:
            rings = [set(r.members) & set(waited) for r in plan.rings_of(node)]
            self._await_members(waited, [r for r in rings if r], timeout)

    def _finished(self) -> bool:
        return Op.FINISH in self.inbox.control_ops

    def _await_members(self, members: dict[str, Peer], rings: list[set[str]],
                       timeout: float) -> None:
        """Ask the ring members of a restarted node (`members`, each ring's among them in
        `rings`) all at once whether they answer. Once every ring has one that did, the others
        get what is left of `REJOIN_READY_SECONDS` and count as lost if they have not answered by
        then (the node rejoins without them); until then all are waited for, up to `timeout`:
        the node can only rejoin from a member that answers, and on a loaded machine the first
        answer may take longer than the short wait (a member that is there is not given up)."""
        started = time.monotonic()
        short = started + min(timeout, REJOIN_READY_SECONDS)
        settled = threading.Event()

        def stop() -> bool:
            return settled.is_set() or self._finished()

        answered: set[str] = set()
        with futures.ThreadPoolExecutor(len(members), thread_name_prefix="ready") as pool:
            asks = {pool.submit(peer.wait_ready, timeout, stop): name
                    for name, peer in members.items()}
            pending = set(asks)
            while pending and not self._finished() and not (
                    time.monotonic() >= short and all(r & answered for r in rings)):
                done, pending = futures.wait(pending, timeout=0.2,
                                             return_when=futures.FIRST_COMPLETED)
                answered |= {asks[f] for f in done if f.exception() is None and f.result()}
            settled.set()  # the asks still waiting end within a Check's timeout
        for f, name in asks.items():
            error = f.exception()
            if error is None and f.result():
                answered.add(name)
            elif error is not None and not isinstance(error, PeerTimeout):
                # a failed ask counts as no answer, and says why
                log.error("asking ring member %s whether it answers failed", name, exc_info=error)
        self.ready.update(answered)
        if answered:
            log.info("ring members %s answered within %.1fs", ", ".join(sorted(answered)),
                     time.monotonic() - started)
        if self._finished():
            return
        for name in sorted(set(members) - answered):
            log.warning("ring member %s does not answer: this node rejoins without it", name)
            self.membership.lost(name)

    def watch_peers(self, plan: Plan, node: str) -> None:
        """Follow the pipeline neighbours (`watch_neighbours`) and the other ring members
        (`watch_rings`)."""
        self.watch_neighbours(plan, node)
        self.watch_rings(plan, node)

    def watch_neighbours(self, plan: Plan, node: str) -> None:
        """Report a pipeline neighbour whose process is gone, or that fell silent, to this node's
        loop, in seconds."""
        neighbours = {n: self.peers[n] for n in plan.neighbours(node) if n}

        def lost(name: str, reason: str) -> None:
            self.inbox.deliver(Frame(Kind.CONTROL, sender=name, control=Abort(
                node=name, error=f"it was lost: {reason}").wire()))

        if neighbours:
            self.watch = PeerWatch.started(neighbours, lost, up=self.ready)

    def watch_rings(self, plan: Plan, node: str) -> None:
        """Follow the other members of this node's rings: one that is lost fails the round that
        waits for it at once, and the rounds after go on without it (`membership`) until it
        answers again. Back from a network cut, the round under way is given up and the rounds
        after take it in again; restarted (`REJOIN_SERVICE`), it stays out until it rejoins."""
        rings = [r for r in plan.rings_of(node) if len(r.members) > 1]
        gone = self.membership.leaving()
        members = {m: self.peers[m] for r in rings for m in r.members
                   if m != node and m not in gone}

        def interrupt(name: str, why: str) -> None:
            # (a newcomer, `welcome`, is in none of the rings as planned: all are interrupted)
            for r in [r for r in rings if name in r.members] or rings:
                self.inbox.interrupt_ring(r.id, why)

        def lost(name: str, reason: str) -> None:
            if name in self.membership.leaving():
                log.info("ring member %s drained and ended", name)
                return  # the rounds go without it already: none waits for it
            self.membership.lost(name, reason)
            interrupt(name, f"{name} was lost: {reason}")

        def back(name: str) -> None:
            if _rejoining(self.peers[name]):
                log.warning("ring member %s was restarted: it comes back in when it rejoins",
                            name)
                # the link to it still holds the connection to the process that was lost: the
                # first piece sent after the rejoin would go there and the round would wait a
                # whole reduceTimeoutSeconds for it. No round uses the link while it is out.
                link = self.ring_links.get(name)
                if link is not None:
                    link.abort()
                self._follow_rejoin(name, interrupt)
                return
            # the round under way was formed without it, and it may be waiting for this node
            # in a round formed with it: both are given up, and the next rounds take it in
            self.membership.back(name)
            interrupt(name, f"{name} is back (the ring takes it in again from the next round)")

        if members:
            self.ring_watch = PeerWatch.started(
                members, lost, up=self.ready, on_back=back,
                restarted=lambda name: _rejoining(self.peers[name]))

    def _follow_rejoin(self, name: str, interrupt: Callable[[str, str], None]) -> None:
        """Ask a restarted ring member, in the background, whether its rejoin is over, until
        this node was told that it joins (`RingMembership.awaiting` turns False). Over for
        `REJOIN_SETTLE_SECONDS` without that (its `join` never came here, or the loss of its old
        process was reported after the join), it is taken in from the next round, as one back
        from a cut: it trains with every member it found there, and kept out here it would be
        kept out for good, each round of the ring skipped after waiting out its timeout on one
        side or the other."""
        peer = self.peers[name]

        def follow() -> None:
            over: float | None = None  # since when its rejoin is seen over
            while not self.unwatched.wait(REJOIN_FOLLOW_SECONDS):
                if not self.membership.awaiting(name):
                    return  # it joins (or is back): the rounds take it in as they were told
                try:
                    status = _rejoin_status(peer)
                except (grpc.RpcError, ValueError):
                    continue  # (not answering: its watch says whether it is lost again)
                if status != health_pb2.HealthCheckResponse.NOT_SERVING:
                    over = None
                    continue
                over = time.monotonic() if over is None else over
                if time.monotonic() - over >= REJOIN_SETTLE_SECONDS \
                        and self.membership.awaiting(name):
                    log.warning("ring member %s rejoined without telling this node: the ring "
                                "takes it in again from the next round", name)
                    self.membership.back(name)
                    interrupt(name, f"{name} rejoined (the ring takes it in again from the "
                                    "next round)")
                    return

        threading.Thread(target=follow, daemon=True, name=f"rejoin-{name}").start()

    def stop_watching(self) -> None:
        self.unwatched.set()
        for watch in (self.watch, self.ring_watch):
            if watch is not None:
                watch.stop()
        self.watch = self.ring_watch = None

    def abort(self, plan: Plan, node: str, error: BaseException) -> None:
        """Tell the pipeline neighbours that `node` stops because of `error` (delivered when
        `close` lets the links finish), except the node that failed and the one that said so."""
        self.stop_watching()
        if isinstance(error, PeerFailed):
            origin, text, skip = error.node, error.error, {error.node, error.via}
        else:
            origin, text, skip = node, f"{type(error).__name__}: {error}", set()
        for n in plan.neighbours(node):
            if n and n not in skip:
                with contextlib.suppress(Exception):
                    self.peers[n].post(Frame(Kind.CONTROL, sender=node, control=Abort(
                        node=origin, error=text).wire()))

    def close(self, failed: bool = False, neighbours: Collection[str] = ()) -> None:
        """Let the links deliver what was posted, then stop the servers. `failed`: this node
        stops on an error (or a signal): the links to its pipeline `neighbours` get
        FAILED_CLOSE_SECONDS to deliver the aborts they carry, not 5 s each for frames to peers
        that may be gone; then its server stops, so that the watches of its other peers (the
        members of its rings in other clusters) know at once (NOT_SERVING). The aborts go first:
        a neighbour that saw this node shut down before its abort arrived would name this node
        as the one that failed, not the one it was told of."""
        self.stop_watching()
        timeout = FAILED_CLOSE_SECONDS if failed else 5.0
        if failed:
            for name in neighbours:
                if name in self.peers:
                    self.peers[name].close(timeout)
            self.server.stop(grace=0.5)
        # together: links to peers that are gone (a newcomer that never joined, a lost member)
        # each take their timeout, and a node's end waits for the slowest, not for their sum
        closing = [threading.Thread(target=peer.close, args=(timeout,), daemon=True)
                   for name, peer in self.peers.items() if not failed or name not in neighbours]
        closing += [threading.Thread(target=link.close, daemon=True)
                    for link in self.ring_links.values()]
        for thread in closing:
            thread.start()
        for thread in closing:
            thread.join()
        if self.ring_server is not None:
            self.ring_server.stop()
        if not failed:
            self.server.stop()


def _rejoin_status(peer: Peer, wait_for_ready: bool = False) -> int:
    """The status of the peer's `REJOIN_SERVICE`, asked on its watch channel (one Check of
    `REJOIN_CHECK_SECONDS`); raises grpc.RpcError, or ValueError once the channel is closed."""
    stub = health_pb2_grpc.HealthStub(peer.watch_channel)
    answer = stub.Check(health_pb2.HealthCheckRequest(service=REJOIN_SERVICE),
                        timeout=REJOIN_CHECK_SECONDS, wait_for_ready=wait_for_ready)
    return int(answer.status)


def _rejoining(peer: Peer) -> bool:
    """Whether a peer that answers again is a restarted node still rejoining (`REJOIN_SERVICE`
    serving); NOT_FOUND is a server that never restarted (a network cut healed).

    Asked on the peer's watch channel, the connection its watch was just answered on. Its
    training channel may still be connecting to the lost process: on Kubernetes the restarted
    pod has a new address behind the same DNS name, and a Check there failed at once. The node was
    then taken for one back from a cut, and every ring round waited reduceTimeoutSeconds for a
    node that was not in it yet. A Check that fails otherwise than NOT_FOUND is asked again, up to
    `REJOIN_CHECKS` times; after that the peer is taken for back (the round then finds out)."""
    failure = ""
    for _ in range(REJOIN_CHECKS):
        try:
            status = _rejoin_status(peer, wait_for_ready=True)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return False
            failure = f"{e.code()}: {e.details()}"
            continue
        except ValueError:  # the channel is closed: the peer is being closed
            return False
        return bool(status == health_pb2.HealthCheckResponse.SERVING)
    log.warning("could not ask %s whether it was restarted (%s): taken for back", peer.address,
                failure)
    return False


def connect(meta: NodeMetadata, token: str, metrics: WorkerMetrics, *, tls: bool,
            tcp_ring: bool, compression: str, reduce_timeout: float,
            inbox_capacity: int, pinned: bool = False) -> Wiring:
    """The wiring of `meta.node` (nothing started yet). With `tls`, the metadata's tlsDir must
    hold the node's certificate; with `tcp_ring`, ring pieces go on the data plane to the
    metadata's ringAddresses, else over gRPC to the peers; with `pinned` (a worker on a CUDA
    device), frames are received into pinned memory."""
    node, plan = meta.node, meta.plan
    material = _tls(meta) if tls else None
    me = _identity(meta)
    data_plane = tcp_ring and bool(plan.rings_of(node))
    ring_addresses = _ring_addresses(meta) if data_plane else {}
    creds = Credentials(token, plan.fingerprint, me)
    inbox = Inbox(capacity=inbox_capacity)
    server = Server(meta.listen, creds, inbox.deliver, on_bytes=metrics.received, tls=material,
                    pinned=pinned)

    def dial(n: str, address: str) -> Peer:
        return Peer(address, creds, compression, on_bytes=metrics.sent, tls=material,
                    server_name=identity(n), node=n)

    def reach(n: str, address: str) -> RingLink:
        return RingLink(address, token, plan.fingerprint, node, compression,
                        timeout=reduce_timeout, on_bytes=metrics.sent, tls=material,
                        server_name=identity(n), identity=me, recipient=n)

    peers = {n: dial(n, meta.addresses[n]) for n in peer_names(plan, node)}
    ring_server = None
    if data_plane:
        ring_server = RingServer(meta.ring_listen, token, plan.fingerprint, inbox.deliver,
                                 on_bytes=metrics.received, tls=material, inbox=inbox,
                                 identity=me)
    links = {n: reach(n, a) for n, a in ring_addresses.items()}
    return Wiring(inbox, server, peers, ring_server, links, dial=dial,
                  reach=reach if data_plane else None)


def _identity(meta: NodeMetadata) -> NodeIdentity:
    """The node's own identity (the file its metadata names), by which its peers know it."""
    if not meta.identity_file:
        raise RavnestError(f"{meta.node}: the node metadata names no identityFile (the node's "
                           f"key and certificate, issued by whoever started the job)")
    me = NodeIdentity.load(meta.identity_file)
    if me.node != meta.node:
        raise RavnestError(f"{meta.identity_file} is {shown(me.node)}'s identity, not "
                           f"{meta.node}'s")
    return me


def _tls(meta: NodeMetadata) -> TlsMaterial:
    if not meta.tls_dir:
        raise RavnestError(f"{meta.node}: spec.security.tls is on but the node metadata "
                           f"names no tlsDir with the node's certificate")
    return TlsMaterial.load(meta.tls_dir)


def _ring_addresses(meta: NodeMetadata) -> dict[str, str]:
    """Where the data planes of the other members of this node's rings listen (rings of two or
    more nodes): each may become this node's successor while the members between are missing.
    A link connects when it is first used."""
    if meta.ring_addresses is None:
        raise RavnestError(f"{meta.node}: spec.training.ringTransport is tcp but the node "
                           f"metadata names no ringAddresses")
    members = sorted({m for r in meta.plan.rings_of(meta.node) if len(r.members) > 1
                      for m in r.members if m != meta.node})
    for n in members:
        if n not in meta.ring_addresses:
            raise RavnestError(f"{meta.node}: ringAddresses has no address for {n}")
    return {n: meta.ring_addresses[n] for n in members}


def assemble(wiring: Wiring, meta: NodeMetadata, stage: Stage, settings: Settings,
             metrics: WorkerMetrics, optimizer: torch.optim.Optimizer | None, scheduler: Any,
             criterion: Callable[..., torch.Tensor] | None,
             batches: Batches | None, targets: Targets | None = None,
             drain_asked: Callable[[], bool] | None = None) -> NodeRuntime:
    """The runtime of `meta.node` over its wiring: ring pieces on the data plane where the
    wiring has ring links, else over gRPC. `targets`: where a leaf's criterion gets its
    targets (default: the labels its root sends). `drain_asked`: at a root, whether its
    cluster was told to drain."""
    me = meta.plan.node(meta.node)
    introduction = None
    if meta.plan.grown(me.cluster):
        ring = (meta.ring_addresses or {}).get(meta.node)
        introduction = {"node": asdict(me), "address": meta.addresses[meta.node],
                        "rings": [r.id for r in meta.plan.rings_of(meta.node)],
                        **({"ringAddress": ring} if ring else {})}
    return NodeRuntime(meta.node, meta.plan, stage, settings, optimizer, scheduler,
                       criterion, wiring.inbox, wiring.peers, metrics, batches,
                       ring_peers=wiring.ring_links if wiring.reach is not None else None,
                       targets=targets, membership=wiring.membership,
                       outside=Outside(wiring.welcome, introduction, drain_asked,
                                       wiring.forget))


def save_stage(runtime: NodeRuntime, folder: str | Path | Location) -> None:
    """Write the stage file the fusing step reads, ``<folder>/<node>.pt``: this node's cluster
    and stage, its trained state and its best (lowest smoothed validation loss) state."""
    buf = io.BytesIO()
    torch.save({"cluster": runtime.me.cluster, "stage": runtime.me.stage,
                "state": on_host(runtime.stage.stage_state_dict()),
                "best": on_host(runtime.best_state)}, buf)  # (host tensors: load anywhere)
    open_location(folder).write(f"{runtime.me.name}.pt", buf.getvalue())
