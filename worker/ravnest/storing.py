"""Storing: the folders a job writes that must outlive its processes and pods (checkpoints, the
trained model), on any storage fsspec knows.

A location is a local path, ``file://…``, ``s3://bucket/prefix`` (s3fs; an S3-compatible store
with ``spec.storage.s3.endpointUrl``; credentials from the standard AWS environment variables,
which the operator fills from ``spec.storage.s3.credentialsSecret``), ``pvc://claim/path`` (a
PersistentVolumeClaim the operator mounts in the job's pods, resolved under `PVC_ROOT`), or
another fsspec protocol whose package is installed (``gs://`` with gcsfs, ``az://`` with adlfs).

Writes are atomic either way: locally a file is written under a temporary name, synced and
renamed; an object store's PUT makes an object appear whole or not at all. Readers can therefore
tell a complete file by its presence, which checkpointing builds on (its checksum is written last).
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ravnest.errors import RavnestError, SpecError

if TYPE_CHECKING:  # fsspec is imported when a location is opened: validating a spec needs none
    import fsspec

PVC_ROOT = "/mnt/ravnest/pvc"
"""Where a job's pods mount the claims its ``pvc://`` locations name: ``<PVC_ROOT>/<claim>``."""
PVC_ROOT_ENV = "RAVNEST_PVC_ROOT"
"""Overrides `PVC_ROOT` (read at the worker's entry only)."""

REMOTE = ("s3", "gs", "gcs", "az", "abfs")
"""Object-store protocols a location may name: storage that outlives the node that wrote it."""
PROTOCOLS = ("file", "pvc", *REMOTE)
"""Every protocol a location may name; a plain path is a local one."""
_SCHEME = re.compile(r"^([a-z][a-z0-9+.-]*)://(.*)$")
_CLAIM = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


class StorageError(RavnestError):
    """A location cannot be read or written."""


def scheme(uri: str) -> str:
    """The protocol a location names: ``s3``, ``pvc``…; ``file`` for a plain path."""
    m = _SCHEME.match(uri)
    return m.group(1) if m else "file"


def is_durable(uri: str) -> bool:
    """Whether the location names storage that outlives a pod: an object store or a claim."""
    return scheme(uri) in (*REMOTE, "pvc")


def check(uri: str) -> str | None:
    """What is wrong with the form of location `uri`, or None (spec validation: nothing is
    opened, no package imported)."""
    m = _SCHEME.match(uri)
    if not m:
        return None if uri.strip() else "must not be empty"
    proto, rest = m.groups()
    if proto not in PROTOCOLS:
        return f"unknown storage protocol {proto!r}: use one of {', '.join(PROTOCOLS)} or a path"
    if proto == "file":
        return None if rest.startswith("/") else "a file:// location must be absolute (file:///…)"
    head, _, tail = rest.partition("/")
    if not head:
        return f"a {proto}:// location names its {'claim' if proto == 'pvc' else 'bucket'} first"
    if proto == "pvc" and not _CLAIM.match(head):
        return f"{head!r} is not a PersistentVolumeClaim name (lowercase DNS subdomain)"
    if ".." in tail.split("/"):
        return "must not contain '..'"
    return None


def pvc_claim(uri: str) -> str | None:
    """The claim a ``pvc://claim/path`` location names, else None."""
    m = _SCHEME.match(uri)
    return m.group(2).split("/", 1)[0] if m and m.group(1) == "pvc" else None


@dataclass(frozen=True)
class Options:
    """How to reach the job's storage (`spec.storage`): what a location alone does not say."""

    endpoint_url: str | None = None
    """An S3-compatible store's endpoint (e.g. ``http://minio.storage:9000``); None: AWS's."""
    region: str | None = None
    """The S3 region; None: from the environment (``AWS_DEFAULT_REGION``), else the default."""
    pvc_root: str = PVC_ROOT
    """Where ``pvc://`` claims are mounted."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """More fsspec storage options for remote protocols (tests: credentials)."""

    def for_protocol(self, proto: str) -> dict[str, Any]:
        opts = dict(self.extra)
        if proto == "s3":
            # bounded waits: an unreachable store fails in about a minute, not after botocore's
            # default 60 s connect timeout times its retries
            opts.setdefault("config_kwargs", {"connect_timeout": 10, "read_timeout": 60,
                                              "retries": {"max_attempts": 3}})
            client = dict(opts.pop("client_kwargs", {}))
            if self.endpoint_url:
                client.setdefault("endpoint_url", self.endpoint_url)
            if self.region:
                client.setdefault("region_name", self.region)
            if client:
                opts["client_kwargs"] = client
        return opts


class Location:
    """A folder on some storage; names below it are ``/``-separated."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, uri: str) -> None:
        """`fs`: the filesystem; `root`: this folder's path in it; `uri`: how to show it."""
        self.fs = fs
        self.root = root.rstrip("/") or "/"
        self.uri = uri.rstrip("/") or uri

    def __repr__(self) -> str:
        return f"Location({self.uri!r})"

    def __str__(self) -> str:
        return self.uri

    @property
    def local(self) -> bool:
        protocols = self.fs.protocol
        return "file" in (protocols if isinstance(protocols, tuple) else (protocols,))

    def path(self, name: str = "") -> str:
        """The filesystem path of `name` below this folder."""
        return posixpath.join(self.root, name) if name else self.root

    def child(self, name: str) -> Location:
        return Location(self.fs, self.path(name), f"{self.uri}/{name}")

    @contextlib.contextmanager
    def _failing(self, what: str) -> Iterator[None]:
        """Any failure of the storage (an OSError, or a client library's own error such as an
        unreachable endpoint) as a StorageError saying `what` failed; FileNotFoundError stays."""
        try:
            yield
        except FileNotFoundError:
            raise
        except Exception as e:  # fsspec backends raise their client's errors as they come
            raise StorageError(f"cannot {what}: {type(e).__name__}: {e}") from e

    def read(self, name: str) -> bytes:
        with self._failing(f"read {self.uri}/{name}"):
            data: bytes = self.fs.cat_file(self.path(name))
        return data

    def write(self, name: str, data: bytes) -> None:
        """Write `name` whole or not at all (a reader never sees part of it)."""
        target = self.path(name)
        with self._failing(f"write {self.uri}/{name}"):
            if self.local:
                _atomic_local(Path(target), data)
            else:
                self.fs.pipe_file(target, data)

    def exists(self, name: str) -> bool:
        with self._failing(f"look for {self.uri}/{name}"):
            return bool(self.fs.exists(self.path(name)))

    def folders(self) -> list[str]:
        """Names of the folders directly below this one (none if it does not exist)."""
        return [posixpath.basename(e["name"].rstrip("/")) for e in self._entries()
                if e["type"] == "directory"]

    def files(self) -> list[str]:
        """Names of the files directly below this one."""
        return [posixpath.basename(e["name"]) for e in self._entries() if e["type"] == "file"]

    def _entries(self) -> list[dict[str, Any]]:
        try:
            with self._failing(f"list {self.uri}"):
                self.fs.invalidate_cache(self.root)
                entries: list[dict[str, Any]] = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return []
        return entries

    def remove(self, name: str) -> None:
        """Delete file or folder `name` and what it holds; gone already is fine."""
        try:
            with self._failing(f"delete {self.uri}/{name}"):
                self.fs.rm(self.path(name), recursive=True)
        except FileNotFoundError:
            pass

    def rename(self, old: str, new: str) -> None:
        """Move folder `old` to `new` (on an object store: copied, then deleted; not atomic)."""
        with self._failing(f"move {self.uri}/{old} to {new}"):
            if self.local:
                os.rename(self.path(old), self.path(new))
            else:
                self.fs.mv(self.path(old), self.path(new), recursive=True)

    def probe(self, field_name: str) -> None:
        """Write and delete a file here; a SpecError naming `field_name` if that fails."""
        name = f".ravnest-probe-{os.getpid()}"
        try:
            if self.local:
                Path(self.root).mkdir(parents=True, exist_ok=True)
            self.write(name, b"probe")
            self.remove(name)
        except (OSError, StorageError) as e:
            raise SpecError([f"{field_name}: {self.uri!r} is not writable ({e}); give a location "
                             f"this job can create and write"]) from e


def _atomic_local(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def open_location(where: str | Path | Location, options: Options | None = None,
                  base: str | Path | None = None) -> Location:
    """The location `where` names: a URI, or a path (relative ones below `base`, else the
    current folder). Raises StorageError when its protocol's package is missing or its form is
    wrong."""
    if isinstance(where, Location):
        return where
    uri, options = str(where), options or Options()
    proto = scheme(uri)
    problem = check(uri)
    if problem:
        raise StorageError(f"storage location {uri!r}: {problem}")
    if proto == "pvc":
        claim_path = uri[len("pvc://"):]
        return _local(posixpath.join(options.pvc_root, claim_path), uri)
    if proto == "file":
        path = uri[len("file://"):] if uri.startswith("file://") else uri
        if base is not None and not os.path.isabs(path):
            path = str(Path(base) / path)
        return _local(os.path.abspath(path), uri if uri.startswith("file://") else path)
    import fsspec

    try:
        fs = fsspec.filesystem(proto, **options.for_protocol(proto))
    except ImportError as e:
        raise StorageError(f"storage location {uri!r}: the {proto}:// protocol needs a package "
                           f"this image lacks ({e})") from e
    return Location(fs, uri.split("://", 1)[1], uri)


def _local(path: str, uri: str) -> Location:
    from fsspec.implementations.local import LocalFileSystem

    return Location(LocalFileSystem(), path, uri)
