"""Issue 40's forged controls, sent to a running local job over its real links: what a holder
of the job's token (and of another node's identity and certificate) tries, and what must happen."""

from __future__ import annotations

import dataclasses

import pytest

from ravnest.comm.framing import Frame
from ravnest.comm.identity import NodeIdentity
from ravnest.comm.tls import TlsMaterial, identity
from ravnest.comm.transport import Credentials, Peer
from ravnest.errors import TransportError
from ravnest.run.local import LocalRun
from ravnest.train.messages import Kind, Leaving, Where

TIMEOUT = 10.0
INTRODUCTIONS = 50


def forge_controls(run: LocalRun, target: str, address: str, tls: bool = False) -> None:
    """Towards node `target` (its server at `address`), a ring member of which is `member`: with
    the token alone, `member` leaving is refused (UNAUTHENTICATED: no proof of a node); a node of
    the job (its identity, and its certificate under TLS) that says `member` leaves, in
    `member`'s name, is refused
    (PERMISSION_DENIED: a node speaks for itself only); said in its own name, and with
    `INTRODUCTIONS` nodes that do not exist introduced, the target's server takes the frames and
    its membership drops each (the caller checks its log)."""
    assert run.plan is not None
    (ring, *_) = run.plan.rings_of(target)
    member = next(m for m in ring.members if m != target)
    forger = next(n for n in run.plan.names() if n not in (target, member))
    leaving = Leaving(node=member, ring=ring.id, round=0).wire()
    material = TlsMaterial.load(run.out / "tls" / identity(forger)) if tls else None
    token_only = Peer(address, Credentials(run._token, run.plan.fingerprint), timeout=TIMEOUT,
                      tls=material, server_name=identity(target), node=target)
    try:
        with pytest.raises(TransportError, match="UNAUTHENTICATED"):
            token_only.send(Frame(Kind.CONTROL, sender=member, control=leaving))
    finally:
        token_only.close()
    mine = NodeIdentity.load(run.out / "identity" / f"{forger}.json")
    peer = Peer(address, Credentials(run._token, run.plan.fingerprint, mine), timeout=TIMEOUT,
                tls=material, server_name=identity(target), node=target)
    try:
        with pytest.raises(TransportError, match="PERMISSION_DENIED"):
            peer.send(Frame(Kind.CONTROL, sender=member, control=leaving))
        peer.send(Frame(Kind.CONTROL, sender=forger, control=leaving))
        node = dataclasses.asdict(run.plan.node(target))
        for i in range(INTRODUCTIONS):
            name = f"node_{100 + i}"
            where = Where(node=name, newcomer={"node": {**node, "name": name, "cluster": 9},
                                               "address": "10.9.9.9:1", "rings": [ring.id]})
            peer.send(Frame(Kind.CONTROL, sender=forger, control=where.wire()))
    finally:
        peer.close()
