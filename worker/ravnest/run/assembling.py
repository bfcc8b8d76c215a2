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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ravnest.comm.dataplane import RingLink, RingServer
from ravnest.comm.framing import Frame
from ravnest.comm.inboxes import Inbox
from ravnest.comm.tls import TlsMaterial, identity
from ravnest.comm.transport import Credentials, Peer, Server
from ravnest.comm.watching import PeerWatch
from ravnest.errors import PeerFailed, PlanError, RavnestError
from ravnest.plan.partitioning import Profile, Stage, build_stage
from ravnest.plan.plans import Plan
from ravnest.run.metadata import NodeMetadata
from ravnest.storing import Location, open_location
from ravnest.train.messages import Kind, Op
from ravnest.train.metrics import WorkerMetrics
from ravnest.train.runtime import Batches, NodeRuntime
from ravnest.train.settings import Settings
from ravnest.train.targets import Targets


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
    failure it was told of away from where it came. Clusters do not abort each other: a ring
    round without a member is skipped."""

    inbox: Inbox
    server: Server
    peers: dict[str, Peer]
    ring_server: RingServer | None
    ring_links: dict[str, RingLink]
    watch: PeerWatch | None = None
    ready: set[str] = field(default_factory=set)
    """The peers that answered `wait_ready`: their watch counts them as up from the start."""

    def start(self) -> None:
        self.server.start()
        if self.ring_server is not None:
            self.ring_server.start()

    def wait_ready(self, timeout: float) -> None:
        """Wait until every peer's server answers, or until this node was told that training is
        over: a run resumed at its end finishes at once, and a neighbour that passed its own
        wait and sent `finish` may be gone before this node asks it (the wait would run out)."""
        for name, peer in self.peers.items():
            if peer.wait_ready(timeout, stop=lambda: Op.FINISH in self.inbox.control_ops):
                self.ready.add(name)

    def watch_neighbours(self, plan: Plan, node: str) -> None:
        """Report a pipeline neighbour whose process is gone, or that fell silent, to this node's
        loop, in seconds."""
        neighbours = {n: self.peers[n] for n in plan.neighbours(node) if n}

        def lost(name: str, reason: str) -> None:
            self.inbox.deliver(Frame(Kind.CONTROL, sender=name, control={
                "op": Op.ABORT, "node": name, "error": f"it was lost: {reason}"}))

        if neighbours:
            self.watch = PeerWatch.started(neighbours, lost, up=self.ready)

    def stop_watching(self) -> None:
        if self.watch is not None:
            self.watch.stop()
            self.watch = None

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
                    self.peers[n].post(Frame(Kind.CONTROL, sender=node, control={
                        "op": Op.ABORT, "node": origin, "error": text}))

    def close(self) -> None:
        self.stop_watching()
        for peer in self.peers.values():
            peer.close()
        for link in self.ring_links.values():
            link.close()
        if self.ring_server is not None:
            self.ring_server.stop()
        self.server.stop()


def connect(meta: NodeMetadata, token: str, metrics: WorkerMetrics, *, tls: bool,
            tcp_ring: bool, compression: str, reduce_timeout: float,
            inbox_capacity: int) -> Wiring:
    """The wiring of `meta.node` (nothing started yet). With `tls`, the metadata's tlsDir must
    hold the node's certificate; with `tcp_ring`, ring pieces go on the data plane to the
    metadata's ringAddresses, else over gRPC to the peers."""
    node, plan = meta.node, meta.plan
    material = _tls(meta) if tls else None
    data_plane = tcp_ring and bool(plan.rings_of(node))
    ring_addresses = _ring_addresses(meta) if data_plane else {}
    creds = Credentials(token, plan.fingerprint)
    inbox = Inbox(capacity=inbox_capacity)
    server = Server(meta.listen, creds, inbox.deliver, on_bytes=metrics.received, tls=material)
    peers = {n: Peer(meta.addresses[n], creds, compression, on_bytes=metrics.sent, tls=material,
                     server_name=identity(n)) for n in peer_names(plan, node)}
    ring_server = None
    if data_plane:
        ring_server = RingServer(meta.ring_listen, token, plan.fingerprint, inbox.deliver,
                                 on_bytes=metrics.received, tls=material, inbox=inbox)
    links = {n: RingLink(a, token, plan.fingerprint, node, compression, timeout=reduce_timeout,
                         on_bytes=metrics.sent, tls=material, server_name=identity(n))
             for n, a in ring_addresses.items()}
    return Wiring(inbox, server, peers, ring_server, links)


def _tls(meta: NodeMetadata) -> TlsMaterial:
    if not meta.tls_dir:
        raise RavnestError(f"{meta.node}: spec.security.tls is on but the node metadata "
                           f"names no tlsDir with the node's certificate")
    return TlsMaterial.load(meta.tls_dir)


def _ring_addresses(meta: NodeMetadata) -> dict[str, str]:
    """Where this node's ring successors' data planes listen (rings of two or more nodes)."""
    if meta.ring_addresses is None:
        raise RavnestError(f"{meta.node}: spec.training.ringTransport is tcp but the node "
                           f"metadata names no ringAddresses")
    successors = sorted({r.successor(meta.node) for r in meta.plan.rings_of(meta.node)
                         if len(r.members) > 1})
    for n in successors:
        if n not in meta.ring_addresses:
            raise RavnestError(f"{meta.node}: ringAddresses has no address for {n}")
    return {n: meta.ring_addresses[n] for n in successors}


def assemble(wiring: Wiring, meta: NodeMetadata, stage: Stage, settings: Settings,
             metrics: WorkerMetrics, optimizer: torch.optim.Optimizer | None, scheduler: Any,
             criterion: Callable[..., torch.Tensor] | None,
             batches: Batches | None, targets: Targets | None = None) -> NodeRuntime:
    """The runtime of `meta.node` over its wiring: ring pieces on the data plane where the
    wiring has ring links, else over gRPC. `targets`: where a leaf's criterion gets its
    targets (default: the labels its root sends)."""
    return NodeRuntime(meta.node, meta.plan, stage, settings, optimizer, scheduler, criterion,
                       wiring.inbox, wiring.peers, metrics, batches,
                       ring_peers=wiring.ring_links or None, targets=targets)


def save_stage(runtime: NodeRuntime, folder: str | Path | Location) -> None:
    """Write the stage file the fusing step reads, ``<folder>/<node>.pt``: this node's cluster
    and stage, its trained state and its best (lowest smoothed validation loss) state."""
    buf = io.BytesIO()
    torch.save({"cluster": runtime.me.cluster, "stage": runtime.me.stage,
                "state": runtime.stage.stage_state_dict(), "best": runtime.best_state}, buf)
    open_location(folder).write(f"{runtime.me.name}.pt", buf.getvalue())
