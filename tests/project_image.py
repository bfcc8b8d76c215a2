"""The project image in the local Docker Engine, built once from these sources and shared by the
image tier (tests/integration/test_image.py) and the cluster tier (tests/e2e).

No image registry is reachable here, so the base is the local Debian image that
`scripts/docker-engine --base` makes, and the build is offline: torch and the project's dependencies
come from a wheelhouse downloaded once on the host into a cache (RAVNEST_WHEELS, default
~/.cache/ravnest-wheels). A container with no network serves that folder read-only over HTTP on its
own loopback, and the build's RUN steps share that container's network (`--network container:`),
so pip reaches the wheelhouse and nothing else, and no wheel is copied into a build context or a
layer (the image is GBs; the disk it is built on is shared and can be short).

PyPI's Linux torch is the CUDA build, so the image is the `cuda` variant (several GB); it runs on
the CPU. The image is labelled with a digest of what goes into it, and a build from the same
sources is reused; an older one is replaced and pruned.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IMAGE = "ravnest-k8s:test"
BASE_IMAGE = "ravnest-base:bookworm"
# Marks the images these tests build, so that the stale ones can be pruned.
LABEL = "io.ravnest.test-image=1"
SOURCE_LABEL = "io.ravnest.source"
# The base's interpreter and C library (Debian bookworm's), which the wheelhouse is resolved for.
BASE_PYTHON = "3.11"
BASE_GLIBC_MINOR = 36


@dataclass(frozen=True)
class Built:
    """The image under test and what its build measured (seconds is None when a build of these
    very sources was already there)."""

    image: str
    seconds: float | None
    size: int


def docker(*args: str, timeout: float = 300, check: bool = True,
           **kwargs) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout,
                            **kwargs)
    if check and result.returncode != 0:
        pytest.fail(f"`docker {' '.join(args)}` exited {result.returncode}:\n"
                    f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def image_id(ref: str) -> str | None:
    result = docker("image", "inspect", "-f", "{{.Id}}", ref, check=False, timeout=60)
    return result.stdout.strip() if result.returncode == 0 else None


def torch_version() -> str:
    return version("torch").split("+")[0]


def requirements() -> list[str]:
    """What the image installs besides torch: the project's and the operator's dependencies,
    setuptools to build the project, and the host's torch version (the one the tests ran with)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [f"torch=={torch_version()}", "setuptools>=68",
            *project["dependencies"], *project["optional-dependencies"]["operator"]]


def platforms() -> list[str]:
    """The manylinux tags the base's glibc runs (pip does not widen one `--platform` itself)."""
    return [*(f"manylinux_2_{minor}_x86_64" for minor in range(BASE_GLIBC_MINOR, 4, -1)),
            "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]


def wheelhouse() -> Path:
    """The cached wheelhouse, downloaded when the requirements changed since the last time; the
    folders of other requirements are deleted once this one is complete (each is GBs)."""
    wanted = requirements()
    key = hashlib.sha256(json.dumps([BASE_PYTHON, BASE_GLIBC_MINOR, wanted]).encode()
                         ).hexdigest()[:16]
    cache = Path(os.environ.get("RAVNEST_WHEELS", Path.home() / ".cache" / "ravnest-wheels"))
    folder = cache / f"cp{BASE_PYTHON.replace('.', '')}-{key}"
    stamp = folder / ".complete"
    if not stamp.exists():
        _download(folder, wanted)
        stamp.write_text("\n".join(wanted) + "\n")
    for other in cache.glob(f"cp{BASE_PYTHON.replace('.', '')}-*"):
        if other != folder and other.is_dir():
            shutil.rmtree(other, ignore_errors=True)
    return folder


def _download(folder: Path, wanted: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
         "--only-binary=:all:", "--python-version", BASE_PYTHON, "--implementation", "cp",
         *(f"--platform={tag}" for tag in platforms()), "--dest", str(folder), *wanted],
        capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        pytest.fail(f"downloading the wheelhouse into {folder} failed:\n{result.stderr[-3000:]}"
                    + disk_report())


def source_digest() -> str:
    """A digest of what goes into the image: the engine, the operator and how they are built."""
    h = hashlib.sha256()
    files = [ROOT / "Dockerfile", ROOT / ".dockerignore", ROOT / "pyproject.toml",
             ROOT / "README.md",
             *sorted(p for d in ("worker", "operator") for p in (ROOT / d).rglob("*")
                     if p.is_file() and "__pycache__" not in p.parts)]
    for path in files:
        h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:32]


def disk_report() -> str:
    """Free space where the builds write, for a failure's message (a full disk is the usual
    cause of a build that worked before)."""
    root = docker("info", "-f", "{{.DockerRootDir}}", check=False, timeout=60).stdout.strip()
    lines = []
    for path in dict.fromkeys([root or "/var/lib/docker", str(Path.home()), "/tmp"]):
        try:
            usage = shutil.disk_usage(path)
        except OSError:
            continue
        lines.append(f"  {path}: {usage.free / 1e9:.1f} GB free of {usage.total / 1e9:.0f} GB")
    return "\nfree disk (the image needs about 7 GB, its wheelhouse 3 GB):\n" + "\n".join(lines)


@contextmanager
def wheel_server(folder: Path) -> Iterator[str]:
    """A container with no network serving `folder` read-only on its loopback; yields its name
    (for `docker build --network container:<name>`)."""
    name = f"ravnest-wheelhouse-{uuid.uuid4().hex[:8]}"
    docker("run", "--detach", "--rm", "--name", name, "--network", "none",
           "--volume", f"{folder}:/wheels:ro", BASE_IMAGE,
           "python3", "-m", "http.server", "--directory", "/wheels", "--bind", "127.0.0.1", "8000")
    try:
        probe = "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/', timeout=2)"
        deadline = time.monotonic() + 60
        while docker("exec", name, "python3", "-c", probe, check=False).returncode != 0:
            if time.monotonic() > deadline:
                logs = docker("logs", name, check=False)
                pytest.fail(f"the wheelhouse server {name} did not answer in 60 s:\n"
                            f"{logs.stdout[-2000:]}{logs.stderr[-2000:]}")
            time.sleep(0.5)
        yield name
    finally:
        docker("rm", "--force", name, check=False)


def docker_build(log: Path, server: str, *args: str) -> None:
    with log.open("a") as out:
        result = subprocess.run(
            ["docker", "build", "--network", f"container:{server}", "--label", LABEL,
             "--build-arg", f"BASE_IMAGE={BASE_IMAGE}", "--build-arg", "TORCH_VARIANT=cuda",
             "--build-arg", f"TORCH_VERSION={torch_version()}", "--build-arg", "PIP_NO_INDEX=1",
             "--build-arg", "PIP_FIND_LINKS=http://127.0.0.1:8000/",
             *args, str(ROOT)],
            stdout=out, stderr=subprocess.STDOUT, timeout=1800)
    if result.returncode != 0:
        lines = log.read_text().splitlines()
        pytest.fail(f"docker build exited {result.returncode}; the last lines of {log}:\n"
                    + "\n".join(lines[-60:]) + disk_report())


def check_engine() -> None:
    if shutil.which("docker") is None:
        pytest.fail("no `docker` on PATH: run scripts/docker-engine (installs and starts Docker)")
    info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60)
    if info.returncode != 0:
        pytest.fail("the Docker Engine does not answer `docker info`: run scripts/docker-engine "
                    f"(installs and starts dockerd).\n{info.stderr[-2000:]}")


def ensure_image(log_dir: Path) -> Built:
    """The image built from these sources: reused when the Engine has it, else built offline
    (build log under `log_dir`), and the test images it replaces pruned."""
    check_engine()
    source = source_digest()
    have = docker("image", "inspect", "-f", f'{{{{index .Config.Labels "{SOURCE_LABEL}"}}}}',
                  IMAGE, check=False, timeout=60)
    seconds = None
    if have.returncode != 0 or have.stdout.strip() != source:
        if image_id(BASE_IMAGE) is None:
            made = subprocess.run(["bash", str(ROOT / "scripts" / "docker-engine"), "--base"],
                                  capture_output=True, text=True, timeout=1800)
            if made.returncode != 0:
                pytest.fail(f"scripts/docker-engine --base failed:\n{made.stderr[-3000:]}")
        wheels = wheelhouse()
        log_dir.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        with wheel_server(wheels) as server:
            docker_build(log_dir / "build.log", server, "--tag", IMAGE,
                         "--label", f"{SOURCE_LABEL}={source}")
        seconds = time.monotonic() - start
        prune_replaced()
    size = int(docker("image", "inspect", "-f", "{{.Size}}", IMAGE).stdout)
    return Built(IMAGE, seconds, size)


def prune_replaced() -> None:
    """Delete the test images a rebuild left untagged (the builds' label, inherited by images
    FROM ours): each is GBs, and a machine that rebuilds keeps every old one otherwise."""
    docker("image", "prune", "--force", "--filter", f"label={LABEL}", timeout=600)


if __name__ == "__main__":
    # `python tests/project_image.py`: the image built (or found) outside pytest, as scripts/test
    # and scripts/kind-e2e do; the build's log goes to a temporary folder.
    print(ensure_image(Path(tempfile.mkdtemp(prefix="ravnest-image-"))))
