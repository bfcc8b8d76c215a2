"""Mutual TLS between workers: a certificate authority per job and one certificate per node.

A job with ``spec.security.tls`` gets its own CA, made by whoever starts the job (the local runner
or the operator) and never shared with another job. Each worker gets a certificate signed by it for
both server and client use; servers require a client certificate from that same CA, so anything
without one, or with one from another job's CA, is refused during the handshake, before a byte of
payload. Clients check the server's certificate against the peer node they meant to reach (its
`identity`), whatever address it was reached at. The job token is checked on top.

The CA's private key only lives in memory while the node certificates are issued: nothing needs
it afterwards, so nothing stores it.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ravnest.errors import RavnestError

CA_FILE = "ca.crt"
CERT_FILE = "tls.crt"
KEY_FILE = "tls.key"

_CLOCK_SKEW = datetime.timedelta(minutes=5)


def identity(node: str) -> str:
    """The DNS name every node certificate carries and clients verify: `node_3` -> `node-3`."""
    return node.replace("_", "-")


@dataclass(frozen=True)
class TlsMaterial:
    """What one worker needs, as PEM bytes: the job's CA certificate, its certificate, its key."""

    ca: bytes
    cert: bytes
    key: bytes = field(repr=False)

    @classmethod
    def load(cls, directory: str | Path) -> TlsMaterial:
        """Read `ca.crt`, `tls.crt` and `tls.key` (a Secret mount or a local run's folder)."""
        d = Path(directory)
        try:
            return cls(ca=(d / CA_FILE).read_bytes(), cert=(d / CERT_FILE).read_bytes(),
                       key=(d / KEY_FILE).read_bytes())
        except OSError as e:
            raise RavnestError(f"spec.security.tls is on but the worker's TLS files are not "
                               f"readable in {d}: {e.strerror} ({e.filename})") from e

    def save(self, directory: str | Path) -> None:
        """Write the three files; the key readable by its owner only."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        (d / CA_FILE).write_bytes(self.ca)
        (d / CERT_FILE).write_bytes(self.cert)
        fd = os.open(d / KEY_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(self.key)


@dataclass(frozen=True)
class Authority:
    """A job's certificate authority (in memory only)."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey = field(repr=False)

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)


def _validity(days: int) -> tuple[datetime.datetime, datetime.datetime]:
    now = datetime.datetime.now(datetime.UTC)
    return now - _CLOCK_SKEW, now + datetime.timedelta(days=days)


def make_authority(job: str, days: int = 365) -> Authority:
    """A fresh CA for one job (P-256 key, valid for `days`)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "ravnest"),
                      x509.NameAttribute(NameOID.COMMON_NAME, f"ravnest job {job} CA")])
    start, end = _validity(days)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=False, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .sign(key, hashes.SHA256()))
    return Authority(cert, key)


def issue(ca: Authority, node: str, dns_names: Sequence[str] = (), ips: Sequence[str] = (),
          days: int = 365) -> TlsMaterial:
    """A certificate for `node`, for server and client use, naming its `identity` and the given
    DNS names and IP addresses."""
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.DNSName(n) for n in dict.fromkeys(
        [identity(node), *dns_names])]
    names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
    start, end = _validity(days)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "ravnest"),
                                     x509.NameAttribute(NameOID.COMMON_NAME, identity(node))]))
            .issuer_name(ca.cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=True, key_cert_sign=False,
                crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                ca.key.public_key()), critical=False)
            .sign(ca.key, hashes.SHA256()))
    pem_key = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return TlsMaterial(ca=ca.cert_pem, cert=cert.public_bytes(serialization.Encoding.PEM),
                       key=pem_key)
