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
import fcntl
import os
import posixpath
import re
from collections.abc import Callable, Iterator, Mapping
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


class Contended(StorageError):
    """`Location.update` lost every try to writers changing the same file."""


UPDATE_TRIES = 20
"""How often `Location.update` reads and writes again after another writer changed the file."""


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

    def _speaks(self, protocol: str) -> bool:
        protocols = self.fs.protocol
        return protocol in (protocols if isinstance(protocols, tuple) else (protocols,))

    @property
    def local(self) -> bool:
        return self._speaks("file")

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

    def update(self, name: str, change: Callable[[bytes | None], bytes | None]) -> bytes | None:
        """Read-modify-write small file `name` atomically against other writers (processes,
        pods, machines): `change` gets its content (None: absent) and returns the new content
        (None: delete it; the content it got: leave it), or raises to leave it as it is.
        Returns what the file holds now.

        Locally (a path, a mounted claim) under an flock of ``.<name>.lock`` beside it; on S3 as
        a conditional write (If-None-Match for a new file, If-Match on the version read for an
        existing one), read and tried again when another writer came first. Other object stores
        (gs, az) take an unconditional write: there two writers at once can both succeed."""
        if self.local:
            return self._update_local(name, change)
        path, s3 = self.path(name), self._speaks("s3")
        for _ in range(UPDATE_TRIES):
            with self._failing(f"read {self.uri}/{name}"):
                try:
                    tag = self.fs.info(path, refresh=True).get("ETag") if s3 else None
                    old: bytes | None = self.fs.cat_file(path)
                except FileNotFoundError:
                    tag, old = None, None
            new = change(old)
            if new == old:  # (nothing to write)
                return new
            try:
                with self._failing(f"write {self.uri}/{name}"):
                    if new is None:
                        self.fs.rm_file(path)
                    elif not s3:
                        self.fs.pipe_file(path, new)
                    elif tag is None:
                        self.fs.pipe_file(path, new, mode="create")
                    else:
                        self.fs.pipe_file(path, new, IfMatch=tag)
                return new
            except StorageError as e:
                if not _precondition_failed(e):
                    raise
        raise Contended(f"cannot update {self.uri}/{name}: other writers changed it "
                        f"{UPDATE_TRIES} times while this one tried")

    def _update_local(self, name: str, change: Callable[[bytes | None], bytes | None]
                      ) -> bytes | None:
        target = Path(self.path(name))
        with self._failing(f"update {self.uri}/{name}"):
            target.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(target.with_name(f".{target.name}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                old: bytes | None = target.read_bytes()
            except FileNotFoundError:
                old = None
            new = change(old)
            if new != old:
                with self._failing(f"write {self.uri}/{name}"):
                    if new is None:
                        target.unlink(missing_ok=True)
                    else:
                        _atomic_local(target, new)
            return new
        finally:
            os.close(fd)  # (drops the lock)

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


def _precondition_failed(e: BaseException) -> bool:
    """Whether a conditional write was refused because another writer came first (S3's 412
    PreconditionFailed, or 409 ConditionalRequestConflict while one was under way)."""
    seen: BaseException | None = e
    while seen is not None:
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            code = str(response.get("Error", {}).get("Code", ""))
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409,
                                                                                          412):
                return True
        if "pre-condition" in str(seen) or "PreconditionFailed" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


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
