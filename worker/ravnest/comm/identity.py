"""Who a peer is: one signing key per job and one key pair per node, with or without TLS.

Every worker of a job holds the job's token, so the token alone cannot tell one node from another:
with it, any node could write another's name into a frame. So whoever starts a job (the local
runner, the operator, the seed API's `clusterize`) makes the job an `Authority`, an Ed25519 key
kept by that supervisor only, and issues each node a `NodeIdentity`: a key pair of its own and a
certificate (the authority's signature over the node's name and public key), together with the
authority's public key, which every node uses to check the others'. A node's identity file is
given to that node alone (mode 0600 locally; on Kubernetes a Secret only its pod mounts).

A node proves itself by signing, with its own key:

- on gRPC, once per link: the plan fingerprint, the node it speaks to and its own name
  (`call_proof`, sent as call metadata and checked by the receiving server, which answers
  UNAUTHENTICATED to a missing or wrong proof). Bound to the receiver, a proof one node received
  is worth nothing towards another. Without TLS anyone who reads the wire reads it, as they read
  the token; with TLS nobody else sees it;
- on the ring's data plane, in the handshake: both nonces too (`sign`), so it is good for that one
  connection only.

Then a frame's sender must be the node its connection proved to be, and a control message about
a node (`leaving`, `join`, an introduction) is only taken from that node (`train/members.py`).

A node's keys are derived from the authority's (HMAC-SHA256 over its name), so issuing a node
again gives it the same identity: an operator that creates a node's Secret twice creates one.
The operator derives each job's authority from its own key and the job's uid (`Authority.derived`)
so that it can still issue identities to nodes that join a running job after it restarted,
without reading any Secret back.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ravnest.errors import RavnestError, shown

PROOF_BYTES = 32 + 64 + 64
"""A proof: the node's public key, its certificate and its signature."""
NODE_HEADER = "x-ravnest-node"
"""The gRPC call metadata naming the calling node; its proof goes in `PROOF_HEADER`."""
PROOF_HEADER = "x-ravnest-proof-bin"
_VERIFIED = 4096
"""Proofs a Verifier remembers as checked (a job's links make a few per node)."""


def _framed(*parts: bytes) -> bytes:
    """`parts` as one message that no other sequence of parts gives (each length-prefixed)."""
    return b"".join(struct.pack("<I", len(p)) + p for p in parts)


def _certified(node: str, public: bytes) -> bytes:
    return _framed(b"ravnest-node", node.encode(), public)


def _call(fingerprint: str, recipient: str, node: str) -> tuple[bytes, ...]:
    return b"ravnest-call", fingerprint.encode(), recipient.encode(), node.encode()


class Authority:
    """A job's signing key: issues its nodes' identities. Whoever starts the job holds it; no
    worker ever does."""

    def __init__(self, seed: bytes) -> None:
        if len(seed) != 32:
            raise ValueError("an authority's seed is 32 bytes")
        self._seed = seed
        self._key = Ed25519PrivateKey.from_private_bytes(seed)
        self.public = self._key.public_key().public_bytes_raw()

    @classmethod
    def fresh(cls) -> Authority:
        return cls(secrets.token_bytes(32))

    @classmethod
    def derived(cls, secret: bytes, job: str) -> Authority:
        """The authority of job `job` (a uid) under a supervisor's `secret`: the same each time."""
        return cls(hmac.digest(secret, b"ravnest-job-authority\0" + job.encode(), "sha256"))

    def issue(self, node: str) -> NodeIdentity:
        """`node`'s identity (the same every time it is asked for)."""
        key = Ed25519PrivateKey.from_private_bytes(
            hmac.digest(self._seed, b"ravnest-node-key\0" + node.encode(), "sha256"))
        public = key.public_key().public_bytes_raw()
        return NodeIdentity(node, self.public, key, self._key.sign(_certified(node, public)))


@dataclass(frozen=True)
class NodeIdentity:
    """What one node proves itself with (its key, its certificate) and checks others against (the
    authority's public key)."""

    node: str
    authority: bytes
    key: Ed25519PrivateKey = field(repr=False, compare=False)  # (the cert names its public key)
    cert: bytes
    _proofs: dict[tuple[str, str], bytes] = field(default_factory=dict, repr=False,
                                                  compare=False)

    def sign(self, *parts: bytes) -> bytes:
        """A proof (`PROOF_BYTES`) that this node says `parts`."""
        return self.key.public_key().public_bytes_raw() + self.cert + self.key.sign(
            _framed(*parts))

    def call_proof(self, recipient: str, fingerprint: str) -> tuple[tuple[str, str | bytes], ...]:
        """The gRPC call metadata by which this node speaks to `recipient` in the plan
        `fingerprint` (made once per recipient)."""
        proof = self._proofs.get((recipient, fingerprint))
        if proof is None:
            proof = self._proofs[(recipient, fingerprint)] = self.sign(
                *_call(fingerprint, recipient, self.node))
        return (NODE_HEADER, self.node), (PROOF_HEADER, proof)

    def verifier(self) -> Verifier:
        return Verifier(self.authority)

    def dumps(self) -> str:
        return json.dumps({"node": self.node, "authority": self.authority.hex(),
                           "key": self.key.private_bytes_raw().hex(), "cert": self.cert.hex()})

    @classmethod
    def loads(cls, text: str, where: str = "identity") -> NodeIdentity:
        try:
            d = json.loads(text)
            key = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(d["key"]))
            made = cls(str(d["node"]), bytes.fromhex(d["authority"]), key,
                       bytes.fromhex(d["cert"]))
        except (ValueError, KeyError, TypeError) as e:
            raise RavnestError(f"{where}: not a node identity ({type(e).__name__}: {e})") from e
        problem = Verifier(made.authority).check(made.node, made.sign(b"self"), b"self")
        if problem:
            raise RavnestError(f"{where}: {problem}")
        return made

    def save(self, path: str | Path) -> None:
        """Write it readable by its owner only."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(self.dumps())

    @classmethod
    def load(cls, path: str | Path) -> NodeIdentity:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise RavnestError(f"the node's identity is not readable at {path}: "
                               f"{e.strerror}") from e
        return cls.loads(text, str(path))


class Verifier:
    """Checks proofs against a job's authority (thread-safe; checked call proofs remembered)."""

    def __init__(self, authority: bytes) -> None:
        self._authority = Ed25519PublicKey.from_public_bytes(authority)
        self._verified: set[tuple[str, bytes, str]] = set()
        self._lock = threading.Lock()

    def check(self, node: str, proof: bytes, *parts: bytes) -> str | None:
        """Why `proof` does not show that `node` of this job says `parts`, or None."""
        if len(proof) != PROOF_BYTES:
            return f"{shown(node)} gave no proof of who it is ({len(proof)} bytes)"
        public, cert, signature = proof[:32], proof[32:96], proof[96:]
        try:
            self._authority.verify(cert, _certified(node, public))
        except InvalidSignature:
            return f"{shown(node)} has no identity from this job (a forged or another job's)"
        try:
            Ed25519PublicKey.from_public_bytes(public).verify(signature, _framed(*parts))
        except InvalidSignature:
            return f"{shown(node)}'s proof is not signed by its key"
        return None

    def call_sender(self, node: str, proof: bytes, me: str, fingerprint: str) -> str | None:
        """Why a gRPC call that says it is `node`'s, with `proof`, is not, to node `me` in the
        plan `fingerprint`; or None."""
        if not node or not proof:
            return ("the call names no node or gives no proof of it: a worker proves which node "
                    "it is (the job's token alone is not enough)")
        key = (node, proof, f"{me}\0{fingerprint}")
        with self._lock:
            if key in self._verified:
                return None
        problem = self.check(node, proof, *_call(fingerprint, me, node))
        if problem is None:
            with self._lock:
                if len(self._verified) >= _VERIFIED:
                    self._verified.clear()
                self._verified.add(key)
        return problem

