"""Mutual TLS between workers over real gRPC on 127.0.0.1: frames pass between peers holding
certificates of the job's CA, and anything else (no certificate, another job's CA, plaintext, a
server that is not the node asked for) is refused in the handshake. A local digits job with
`spec.security.tls` trains over TLS, and its outputs leak no private key."""

from __future__ import annotations

import stat
import time
from collections.abc import Iterator
from dataclasses import replace

import grpc
import pytest
import torch
from forging import forge_controls
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ravnest import parse_job
from ravnest.comm.framing import Frame
from ravnest.comm.inboxes import Inbox
from ravnest.comm.tls import TlsMaterial, issue, make_authority
from ravnest.comm.transport import Credentials, Peer, Server
from ravnest.errors import RavnestError, TransportError
from ravnest.run.local import LocalRun

CREDS = Credentials(token="s3cret-token", fingerprint="plan-0123abcd")
TIMEOUT = 10.0
JOB_CA = make_authority("job-a")
OTHER_CA = make_authority("job-b")


class Served:
    def __init__(self, tls: TlsMaterial) -> None:
        self.inbox = Inbox()
        self.server = Server("127.0.0.1:0", CREDS, self.inbox.deliver, threads=4, tls=tls)
        self.address = f"127.0.0.1:{self.server.port}"


@pytest.fixture
def served() -> Iterator[Served]:
    s = Served(issue(JOB_CA, "node_0"))
    s.server.start()
    try:
        yield s
    finally:
        s.server.stop(grace=0)


def _frame(step: int, sender: str = "node_1") -> Frame:
    return Frame("forward", {"x": torch.arange(6.0)}, step=step, sender=sender)


def _send(address: str, tls: TlsMaterial, server_name: str = "node-0",
          creds: Credentials = CREDS, timeout: float = TIMEOUT, step: int = 1,
          sender: str = "node_1") -> None:
    peer = Peer(address, creds, timeout=timeout, tls=tls, server_name=server_name)
    try:
        peer.send(_frame(step, sender))
    finally:
        peer.close()


def _health(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.RpcError | None:
    """The error of one health check over a fresh channel, None if it answered."""
    channel = (grpc.insecure_channel(address) if credentials is None
               else grpc.secure_channel(address, credentials,
                                        options=[("grpc.ssl_target_name_override", "node-0")]))
    try:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    except grpc.RpcError as e:
        return e
    finally:
        channel.close()
    return None


def test_frames_pass_between_peers_of_the_job_ca(served: Served) -> None:
    _send(served.address, issue(JOB_CA, "node_1"), step=7)
    got = served.inbox.pipeline.get(timeout=TIMEOUT)
    assert got.step == 7 and torch.equal(got.tensors["x"], torch.arange(6.0))


def test_a_node_speaks_for_itself_only(served: Served) -> None:
    """A frame's sender is the node its connection's certificate names, whatever the frame says
    (issue 40: a `leaving` said for node_1 by another node dropped node_1 from a ring); one
    that names another node, or none, is refused, and the server keeps serving."""
    for sender in ("node_2", ""):
        with pytest.raises(TransportError, match="PERMISSION_DENIED: a frame that says it is "
                                                 f"from '{sender}' came over the connection of "
                                                 "'node-1''s certificate"):
            _send(served.address, issue(JOB_CA, "node_1"), sender=sender)
    _send(served.address, issue(JOB_CA, "node_2"), sender="node_2", step=5)
    got = served.inbox.pipeline.get(timeout=TIMEOUT)
    assert (got.sender, got.step) == ("node_2", 5)
    assert served.inbox.pipeline.empty()


def test_the_token_is_still_checked_over_tls(served: Served) -> None:
    with pytest.raises(TransportError, match="UNAUTHENTICATED"):
        _send(served.address, issue(JOB_CA, "node_1"), creds=Credentials("wrong", "plan-0123abcd"))
    assert served.inbox.pipeline.empty()


def test_clients_without_a_certificate_of_the_job_ca_are_refused(served: Served) -> None:
    ca = JOB_CA.cert_pem
    stranger = issue(OTHER_CA, "node_1")
    refused = {
        "plaintext": _health(served.address, None),
        "no client certificate": _health(served.address, grpc.ssl_channel_credentials(ca)),
        "another job's CA": _health(served.address, grpc.ssl_channel_credentials(
            ca, stranger.key, stranger.cert)),
    }
    for what, error in refused.items():
        assert error is not None, f"{what}: the server answered"
        assert error.code() == grpc.StatusCode.UNAVAILABLE, (what, error.details())
    mine = issue(JOB_CA, "node_1")
    assert _health(served.address, grpc.ssl_channel_credentials(ca, mine.key, mine.cert)) is None
    # a worker of another job cannot feed frames either, and the server keeps serving
    with pytest.raises(TransportError):
        _send(served.address, stranger, timeout=2)
    _send(served.address, mine, step=3)
    assert served.inbox.pipeline.get(timeout=TIMEOUT).step == 3
    assert served.inbox.pipeline.empty()


def test_clients_check_the_server_is_the_node_they_asked_for(served: Served) -> None:
    with pytest.raises(TransportError):
        _send(served.address, issue(JOB_CA, "node_1"), server_name="node-2", timeout=2)
    impostor = Served(issue(OTHER_CA, "node_0"))
    impostor.server.start()
    try:
        with pytest.raises(TransportError):
            _send(impostor.address, issue(JOB_CA, "node_1"), timeout=2)
        assert impostor.inbox.pipeline.empty()
    finally:
        impostor.server.stop(grace=0)
    assert served.inbox.pipeline.empty()


def test_certificates_name_the_node_and_keys_stay_private(tmp_path) -> None:
    from cryptography import x509

    m = issue(JOB_CA, "node_3", ["node-3.j-workers.ns.svc"], ["127.0.0.1"])
    cert = x509.load_pem_x509_certificate(m.cert)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["node-3", "node-3.j-workers.ns.svc"]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert cert.issuer == JOB_CA.cert.subject
    cert.verify_directly_issued_by(JOB_CA.cert)
    assert "PRIVATE KEY" not in repr(m) and "PRIVATE" not in repr(JOB_CA)
    m.save(tmp_path / "n")
    assert stat.S_IMODE((tmp_path / "n" / "tls.key").stat().st_mode) == 0o600
    assert TlsMaterial.load(tmp_path / "n") == m
    (tmp_path / "n" / "tls.crt").unlink()
    with pytest.raises(RavnestError, match=r"tls\.crt"):
        TlsMaterial.load(tmp_path / "n")


def test_a_local_job_with_tls_trains_over_tls(tmp_path, digits_doc, gate) -> None:
    """Digits, 2 clusters x 2 stages, 1 epoch, `security.tls: true`: a worker answers only TLS
    clients holding a certificate of the run's CA, the job trains, and no private key leaks
    into logs, node metadata, status or summary."""
    digits_doc["spec"]["providers"] = [{"ram": 2, "bandwidth": 1000, "replicas": 4}]
    digits_doc["spec"]["training"]["epochs"] = 1
    # The leaves wait at their first micro-batch until the probes and forged controls are done:
    # on a fast machine the 1-epoch job otherwise ended before the first probe answered
    digits_doc["spec"]["training"]["criterion"] = {"name": "gated_loss:criterion"}
    digits_doc["spec"]["security"] = {"tls": True}
    run = LocalRun(parse_job(digits_doc), tmp_path, progress=False)
    metas = run.prepare()
    assert all(m.tls_dir for m in metas)
    gate.touch()
    try:
        run.start(metas)
        mine = TlsMaterial.load(tmp_path / "tls" / "node-1")
        credentials = grpc.ssl_channel_credentials(mine.ca, mine.key, mine.cert)
        deadline = time.monotonic() + 600  # the worker imports torch and builds its stage
        while (error := _health(metas[0].listen, credentials)) is not None:
            assert run.procs[0].popen.poll() is None, run.procs[0].log.read_text()[-3000:]
            assert time.monotonic() < deadline, error.details()
            time.sleep(1)
        error = _health(metas[0].listen, None)
        assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE
        forge_controls(run, "node_0", metas[0].listen, tls=True)
        gate.unlink()
        assert run.wait().done, "a worker died"
    finally:
        run.stop()
        run.release()  # (its fork server, lock and lease: what `ravnest run` lets go of)
    summary = run.finish(1.0)
    assert summary["clusters"] == 2 and summary["nodes"] == 4
    assert summary["fused_val_metric"] >= 0.8
    log0 = (tmp_path / "logs" / "node_0.log").read_text()
    assert "dropped: a node speaks for itself only" in log0
    assert "skipped" not in log0 and "introduced itself" not in log0
    keys = [p.read_bytes() for p in (tmp_path / "tls").glob("*/tls.key")]
    assert len(keys) == 4
    secrets = [k.split(b"-----")[2].strip() for k in keys]  # the base64 body of each key
    for path in [*tmp_path.glob("logs/*.log"), *tmp_path.glob("nodes/*.json"),
                 tmp_path / "summary.json", tmp_path / "plan.txt"]:
        text = path.read_bytes()
        assert not any(s in text for s in secrets) and b"PRIVATE KEY" not in text, path


def test_a_worker_of_a_tls_job_without_its_certificate_does_not_start(tmp_path,
                                                                      digits_doc) -> None:
    from ravnest.run.worker import Worker

    digits_doc["spec"]["providers"] = [{"ram": 2, "bandwidth": 1000, "replicas": 2}]
    digits_doc["spec"]["security"] = {"tls": True}
    run = LocalRun(parse_job(digits_doc), tmp_path, progress=False)
    meta = run.prepare()[0]
    with pytest.raises(RavnestError, match="names no tlsDir"):
        Worker(replace(meta, tls_dir=None), "s3cret-token")
    (tmp_path / "tls" / "node-0" / "tls.key").unlink()
    with pytest.raises(RavnestError, match=r"not readable in .*tls\.key"):
        Worker(meta, "s3cret-token")
