"""A real S3-compatible server (MinIO) on 127.0.0.1, so tests exercise object-store code through
s3fs against a server that stores what it is sent, instead of against a fake.

The binary is the one `scripts/k8s-tools` builds from MinIO's Go module and caches in
`${RAVNEST_TOOLS:-~/.cache/ravnest-tools}/bin/minio` (env RAVNEST_MINIO names another one).

    with minio_server() as s3:
        s3.make_bucket("ckpt")
        fs = s3fs.S3FileSystem(**s3.storage_options(), skip_instance_cache=True)

Each server gets random root credentials, its own ports, and a data folder of its own unless one
is given (pass the same `data_dir` and credentials again to restart a server on what it stored).
A missing binary or a server that does not become ready fails the test: it is never skipped.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import s3fs
from integration.kube import MissingBinary, find_binary, free_port, stop_process

REGION = "us-east-1"


@dataclass(frozen=True)
class S3Server:
    """Where a running MinIO answers, and the root credentials it accepts."""

    endpoint_url: str
    """http://127.0.0.1:PORT"""
    access_key: str
    secret_key: str
    data_dir: Path
    """The folder MinIO stores buckets and objects in."""
    log: Path
    """MinIO's stdout and stderr."""

    def storage_options(self) -> dict[str, Any]:
        """Keyword arguments for s3fs.S3FileSystem (and fsspec's storage_options)."""
        return {"key": self.access_key, "secret": self.secret_key,
                "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": REGION}}

    def env(self) -> dict[str, str]:
        """Environment variables that point AWS SDKs (boto3, aiobotocore) at this server."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_ENDPOINT_URL": self.endpoint_url, "AWS_DEFAULT_REGION": REGION}

    def make_bucket(self, name: str) -> None:
        """Create bucket `name` through s3fs."""
        s3fs.S3FileSystem(**self.storage_options(), skip_instance_cache=True).mkdir(name)


def minio_binary() -> str:
    """$RAVNEST_MINIO, else the cached build (or one on PATH); fails the test when there is none."""
    path = os.environ.get("RAVNEST_MINIO")
    if path:
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            pytest.fail(f"RAVNEST_MINIO={path} is not an executable file", pytrace=False)
        return path
    try:
        return find_binary("minio")
    except MissingBinary as e:
        pytest.fail(str(e), pytrace=False)


@contextlib.contextmanager
def minio_server(data_dir: Path | None = None, access_key: str | None = None,
                 secret_key: str | None = None, timeout: float = 60) -> Iterator[S3Server]:
    """Run `minio server` until the block ends; yields once /minio/health/ready answers 200."""
    binary = minio_binary()
    with tempfile.TemporaryDirectory(prefix="ravnest-minio-") as tmp:
        work = Path(tmp)
        port, console = free_port(), free_port()
        server = S3Server(endpoint_url=f"http://127.0.0.1:{port}",
                          access_key=access_key or f"ravnest-{secrets.token_hex(8)}",
                          secret_key=secret_key or secrets.token_urlsafe(24),
                          data_dir=data_dir or work / "data", log=work / "minio.log")
        env = {**os.environ, "MINIO_ROOT_USER": server.access_key,
               "MINIO_ROOT_PASSWORD": server.secret_key, "MINIO_BROWSER": "off"}
        argv = [binary, "server", str(server.data_dir), "--address", f"127.0.0.1:{port}",
                "--console-address", f"127.0.0.1:{console}", "--certs-dir", str(work / "certs")]
        with open(server.log, "wb") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, cwd=work, env=env)
        try:
            _wait_ready(server, proc, timeout)
            yield server
        finally:
            stop_process(proc)


def _wait_ready(server: S3Server, proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Poll the readiness endpoint; fail the test (with MinIO's log) on exit or timeout."""
    url = f"{server.endpoint_url}/minio/health/ready"
    deadline = time.monotonic() + timeout
    last = "no answer"
    while proc.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
                last = f"HTTP {resp.status}"
        except urllib.error.HTTPError as e:
            last = f"HTTP {e.code}"
            e.close()
        except OSError as e:
            last = repr(e)
        if time.monotonic() > deadline:
            pytest.fail(f"minio not ready at {url} after {timeout:.0f}s (last: {last}); "
                        f"its log ends:\n{_tail(server.log)}", pytrace=False)
        time.sleep(0.2)
    pytest.fail(f"minio exited {proc.returncode} before it was ready at {url}; "
                f"its log ends:\n{_tail(server.log)}", pytrace=False)


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
