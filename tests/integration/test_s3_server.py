"""The MinIO fixture really stores objects: what s3fs writes, a fresh client reads back and lists,
a restarted server on the same folder still has, and wrong credentials cannot reach."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest
import s3fs
from minio_server import S3Server, minio_server

pytestmark = pytest.mark.tools  # (scripts/test runs it once the tools are there)


def _fs(server: S3Server) -> s3fs.S3FileSystem:
    return s3fs.S3FileSystem(**server.storage_options(), skip_instance_cache=True)


def _bucket() -> str:
    return f"test-{secrets.token_hex(4)}"


def test_written_objects_are_read_back_and_listed_by_a_fresh_client(s3_server: S3Server) -> None:
    bucket = _bucket()
    s3_server.make_bucket(bucket)
    payload = secrets.token_bytes(3 * 1024 * 1024 + 17)
    writer = _fs(s3_server)
    writer.pipe(f"{bucket}/run-1/stage-0.pt", payload)
    with writer.open(f"{bucket}/run-1/stage-1.pt", "wb") as f:
        f.write(b"second")
    writer.pipe(f"{bucket}/run-2/stage-0.pt", b"other run")

    reader = _fs(s3_server)
    assert reader.cat(f"{bucket}/run-1/stage-0.pt") == payload
    assert reader.cat(f"{bucket}/run-1/stage-1.pt") == b"second"
    assert sorted(reader.ls(f"{bucket}/run-1", detail=False)) == [
        f"{bucket}/run-1/stage-0.pt", f"{bucket}/run-1/stage-1.pt"]
    assert reader.info(f"{bucket}/run-1/stage-0.pt")["size"] == len(payload)
    assert (s3_server.data_dir / bucket / "run-1").is_dir()


def test_objects_survive_a_restart_on_the_same_data_dir(tmp_path: Path) -> None:
    data = tmp_path / "data"
    key, secret = f"restart-{secrets.token_hex(4)}", secrets.token_urlsafe(24)
    with minio_server(data_dir=data, access_key=key, secret_key=secret) as first:
        first.make_bucket("ckpt")
        _fs(first).pipe("ckpt/step-100/model.pt", b"weights at step 100")
    with minio_server(data_dir=data, access_key=key, secret_key=secret) as second:
        assert second.data_dir == data
        assert _fs(second).cat("ckpt/step-100/model.pt") == b"weights at step 100"


def test_wrong_credentials_are_refused(s3_server: S3Server) -> None:
    bucket = _bucket()
    s3_server.make_bucket(bucket)
    _fs(s3_server).pipe(f"{bucket}/secret.bin", b"not for strangers")
    for key, secret in [(s3_server.access_key, "wrong-secret-0123456789"),
                        ("nobody-here", s3_server.secret_key)]:
        options = {**s3_server.storage_options(), "key": key, "secret": secret}
        stranger = s3fs.S3FileSystem(**options, skip_instance_cache=True)
        with pytest.raises(PermissionError):
            stranger.cat(f"{bucket}/secret.bin")
