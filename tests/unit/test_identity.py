"""Node identities (issue 40, item 1 without TLS): a job's authority issues each node a key and a
certificate; a proof made with one node's identity shows that node and no other, to the node it
was made for and no other, in its plan and no other."""

from __future__ import annotations

import json
import stat

import pytest

from ravnest.comm.identity import (
    PROOF_HEADER,
    Authority,
    NodeIdentity,
    Verifier,
)
from ravnest.errors import RavnestError

JOB = Authority.fresh()
OTHER_JOB = Authority.fresh()
FP = "plan-0123abcd"


def _proof(identity: NodeIdentity, recipient: str = "node_0", fingerprint: str = FP) -> bytes:
    proof = dict(identity.call_proof(recipient, fingerprint))[PROOF_HEADER]
    assert isinstance(proof, bytes)
    return proof


def test_a_node_proves_itself_to_the_node_it_speaks_to() -> None:
    assert Verifier(JOB.public).call_sender("node_1", _proof(JOB.issue("node_1")), "node_0",
                                            FP) is None


def _flip_last(proof: bytes) -> bytes:
    """`proof` with its last byte changed (the signature's): always another byte, where setting
    it to 0 left one proof in 256 as it was."""
    return proof[:-1] + bytes([proof[-1] ^ 1])


@pytest.mark.parametrize(("claimed", "proof", "me", "fingerprint", "why"), [
    ("node_2", lambda: _proof(JOB.issue("node_1")), "node_0", FP, "no identity from this job"),
    ("node_1", lambda: _proof(JOB.issue("node_1"), "node_3"), "node_0", FP, "not signed"),
    ("node_1", lambda: _proof(JOB.issue("node_1"), fingerprint="other"), "node_0", FP,
     "not signed"),
    ("node_1", lambda: _proof(OTHER_JOB.issue("node_1")), "node_0", FP,
     "no identity from this job"),
    ("node_1", lambda: _flip_last(_proof(JOB.issue("node_1"))), "node_0", FP, "not signed"),
    ("node_1", lambda: b"", "node_0", FP, "gives no proof"),
    ("", lambda: _proof(JOB.issue("node_1")), "node_0", FP, "names no node"),
    ("node_1", lambda: b"\0" * 160, "node_0", FP, "no identity from this job"),
])
def test_no_other_claim_passes(claimed, proof, me, fingerprint, why) -> None:
    """Another node's name, a proof made for another recipient (what the node it was sent to
    could replay elsewhere) or another plan, another job's identity, a tampered or missing
    proof: each refused, saying why."""
    problem = Verifier(JOB.public).call_sender(claimed, proof(), me, fingerprint)
    assert problem is not None and why in problem


def test_a_checked_proof_is_remembered_but_only_for_what_it_was_checked_for() -> None:
    verifier = Verifier(JOB.public)
    proof = _proof(JOB.issue("node_1"))
    assert verifier.call_sender("node_1", proof, "node_0", FP) is None
    assert verifier.call_sender("node_1", proof, "node_0", FP) is None
    assert verifier.call_sender("node_1", proof, "node_3", FP) is not None
    assert verifier.call_sender("node_2", proof, "node_0", FP) is not None


def test_issuing_is_repeatable_and_derived_authorities_are_per_job() -> None:
    """The operator issues a node's identity again (a pass done twice, a node that joins after
    a restart) and gets the same one; its key derives another authority for every job."""
    assert JOB.issue("node_4") == JOB.issue("node_4")
    secret = b"k" * 32
    a, b = Authority.derived(secret, "uid-1"), Authority.derived(secret, "uid-1")
    assert a.public == b.public and a.issue("node_0").cert == b.issue("node_0").cert
    assert Authority.derived(secret, "uid-2").public != a.public
    assert Authority.derived(b"j" * 32, "uid-1").public != a.public


def test_an_identity_file_is_its_owners_only_and_read_back_checked(tmp_path) -> None:
    me = JOB.issue("node_3")
    me.save(tmp_path / "id" / "node_3.json")
    path = tmp_path / "id" / "node_3.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    back = NodeIdentity.load(path)
    assert back == me and "key" not in repr(back)
    assert Verifier(JOB.public).check("node_3", back.sign(b"x"), b"x") is None
    doc = json.loads(path.read_text())
    doc["node"] = "node_0"  # a certificate of node_3 given as node_0's
    path.write_text(json.dumps(doc))
    with pytest.raises(RavnestError, match=r"node_3\.json: 'node_0' has no identity"):
        NodeIdentity.load(path)
    path.write_text("{not json")
    with pytest.raises(RavnestError, match=r"node_3\.json: not a node identity"):
        NodeIdentity.load(path)
    with pytest.raises(RavnestError, match=r"not readable at .*missing"):
        NodeIdentity.load(tmp_path / "missing")
