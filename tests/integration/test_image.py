"""The container image built from the Dockerfile: one image for the operator and the workers, run as
the workers' non-root user, carrying the CLI, the operator and torch but nothing to build with, and
training an example job inside a container.

No image registry is reachable here, so the base is the local Debian image that
`scripts/docker-engine --base` makes, and the build is offline (`--network none`): torch and the
project's dependencies come from a wheelhouse downloaded once on the host into a cache
(RAVNEST_WHEELS, default ~/.cache/ravnest-wheels) and handed over as the context's wheels/ folder.
PyPI's Linux torch is the CUDA build, so the image is the `cuda` variant (several GB); it runs on
the CPU. The first build takes minutes; later ones reuse Docker's layer cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml

from ravnest import __version__
from ravnest_operator.resources import WORKER_UID

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "ravnest-k8s:test"
BASE_IMAGE = "ravnest-base:bookworm"
# Marks the images these tests build, so that the stale ones can be pruned.
LABEL = "io.ravnest.test-image=1"
# The base's interpreter and C library (Debian bookworm's), which the wheelhouse is resolved for.
BASE_PYTHON = "3.11"
BASE_GLIBC_MINOR = 36

pytestmark = pytest.mark.timeout(2400)


@dataclass(frozen=True)
class Built:
    """The image under test and what its build measured."""

    image: str
    seconds: float
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


def requirements() -> list[str]:
    """What the image installs besides torch: the project's and the operator's dependencies,
    setuptools to build the project, and the host's torch version (the one the tests ran with)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [f"torch=={torch_version()}", "setuptools>=68",
            *project["dependencies"], *project["optional-dependencies"]["operator"]]


def torch_version() -> str:
    return version("torch").split("+")[0]


def platforms() -> list[str]:
    """The manylinux tags the base's glibc runs (pip does not widen one `--platform` itself)."""
    return [*(f"manylinux_2_{minor}_x86_64" for minor in range(BASE_GLIBC_MINOR, 4, -1)),
            "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]


def wheelhouse() -> Path:
    """The cached wheelhouse, downloaded when the requirements changed since the last time."""
    wanted = requirements()
    key = hashlib.sha256(json.dumps([BASE_PYTHON, BASE_GLIBC_MINOR, wanted]).encode()
                         ).hexdigest()[:16]
    cache = Path(os.environ.get("RAVNEST_WHEELS", Path.home() / ".cache" / "ravnest-wheels"))
    folder = cache / f"cp{BASE_PYTHON.replace('.', '')}-{key}"
    stamp = folder / ".complete"
    if stamp.exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
         "--only-binary=:all:", "--python-version", BASE_PYTHON, "--implementation", "cp",
         *(f"--platform={tag}" for tag in platforms()), "--dest", str(folder), *wanted],
        capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        pytest.fail(f"downloading the wheelhouse into {folder} failed:\n{result.stderr[-3000:]}")
    stamp.write_text("\n".join(wanted) + "\n")
    return folder


def build_context(dest: Path, wheels: Path) -> Path:
    """The repository without VCS and caches (.dockerignore does the rest, as in a real build),
    with the wheelhouse linked in as wheels/."""
    shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(
        ".git", "wheels", "__pycache__", "*.egg-info", ".*_cache", ".venv", "venv", "runs",
        "node_data", "trained", "build", "dist"))
    (dest / "wheels").mkdir()
    for wheel in wheels.glob("*.whl"):
        try:
            os.link(wheel, dest / "wheels" / wheel.name)
        except OSError:
            shutil.copy2(wheel, dest / "wheels" / wheel.name)
    return dest


def docker_build(context: Path, *args: str) -> None:
    log = context.parent / "build.log"
    with log.open("a") as out:
        result = subprocess.run(
            ["docker", "build", "--network", "none", "--label", LABEL,
             "--build-arg", f"BASE_IMAGE={BASE_IMAGE}", "--build-arg", "TORCH_VARIANT=cuda",
             "--build-arg", f"TORCH_VERSION={torch_version()}", "--build-arg", "PIP_NO_INDEX=1",
             *args, str(context)],
            stdout=out, stderr=subprocess.STDOUT, timeout=1800)
    if result.returncode != 0:
        lines = log.read_text().splitlines()
        pytest.fail(f"docker build exited {result.returncode}; the last lines of {log}:\n"
                    + "\n".join(lines[-60:]))


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    if shutil.which("docker") is None:
        pytest.fail("no `docker` on PATH: run scripts/docker-engine (installs and starts Docker)")
    info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60)
    if info.returncode != 0:
        pytest.fail("the Docker Engine does not answer `docker info`: run scripts/docker-engine "
                    f"(installs and starts dockerd).\n{info.stderr[-2000:]}")
    if image_id(BASE_IMAGE) is None:
        made = subprocess.run(["bash", str(ROOT / "scripts" / "docker-engine"), "--base"],
                              capture_output=True, text=True, timeout=1800)
        if made.returncode != 0:
            pytest.fail(f"scripts/docker-engine --base failed:\n{made.stderr[-3000:]}")

    context = build_context(tmp_path_factory.mktemp("image") / "context", wheelhouse())
    start = time.monotonic()
    # The builder stage is tagged too, so that the layers it caches (torch is most of them) are
    # never dangling; what a build of other sources or versions leaves dangling is pruned below.
    docker_build(context, "--target", "builder", "--tag", f"{IMAGE}-builder")
    docker_build(context, "--tag", IMAGE)
    seconds = time.monotonic() - start
    shutil.rmtree(context / "wheels")
    docker("image", "prune", "--force", "--filter", f"label={LABEL}", timeout=600)
    size = int(docker("image", "inspect", "-f", "{{.Size}}", IMAGE).stdout)
    return Built(IMAGE, seconds, size)


def run_in(built: Built, *args: str, entrypoint: str | None = None, user: str | None = None,
           stdin: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    options = ["--rm", "--network", "none"]
    if entrypoint:
        options += ["--entrypoint", entrypoint]
    if user:
        options += ["--user", user]
    if stdin is not None:
        options.append("--interactive")
    return docker("run", *options, built.image, *args, input=stdin, timeout=timeout)


def test_image_is_the_base_plus_the_venv(built: Built, record_property, capsys, tmp_path_factory):
    """Reports the size, and checks that the image is the base, the venv and a user, nothing more
    (a cache or a copied source tree in the final stage would show up here)."""
    record_property("image_bytes", built.size)
    record_property("build_seconds", round(built.seconds, 1))
    line = (f"image {built.image} (torch {torch_version()}, cuda variant, base {BASE_IMAGE}): "
            f"{built.size / 1e9:.2f} GB ({built.size} bytes), built in {built.seconds:.0f} s")
    (tmp_path_factory.getbasetemp() / "image-size.txt").write_text(line + "\n")
    with capsys.disabled():
        print(f"\n{line}")
    base = int(docker("image", "inspect", "-f", "{{.Size}}", BASE_IMAGE).stdout)
    # the venv's files by their own sizes (du would add every directory's block too)
    venv = int(run_in(built, "-c", "import os; print(sum(os.lstat(os.path.join(d, f)).st_size "
                      "for d, _, fs in os.walk('/opt/venv') for f in fs))",
                      entrypoint="python").stdout)
    extra = built.size - base - venv
    assert abs(extra) < 20_000_000, f"{extra} bytes besides the base ({base}) and venv ({venv})"


def test_runs_as_the_workers_non_root_user(built: Built):
    assert run_in(built, "-u", entrypoint="id").stdout.strip() == str(WORKER_UID)
    assert run_in(built, "-g", entrypoint="id").stdout.strip() == str(WORKER_UID)
    workdir = run_in(built, "-c", 'echo "$HOME"; stat -c %u "$PWD"; touch "$PWD/x" "$HOME/x"',
                     entrypoint="sh").stdout.split()
    assert workdir == ["/home/ravnest", str(WORKER_UID)]


def test_cli_prints_the_package_version(built: Built):
    assert run_in(built, "--version").stdout.strip() == f"ravnest {__version__}"


def test_operator_and_torch_import(built: Built):
    result = run_in(built, "-c", "import ravnest_operator.handling, kopf, torch; "
                    "print(torch.__version__)", entrypoint="python")
    assert result.stdout.strip().split("+")[0] == torch_version()


def test_no_build_tools_sources_or_caches(built: Built):
    """The final stage copies the venv only: no compilers, pip cache, package lists, sources or
    wheels (looked for as root, who can see everywhere)."""
    script = """
        for tool in gcc cc c++ g++ clang make; do
            command -v "$tool" >/dev/null && echo "compiler: $tool"
        done
        for dir in /root/.cache /home/ravnest/.cache /wheels /src /tmp/requirements.txt; do
            [ -e "$dir" ] && echo "leftover: $dir"
        done
        ls /var/lib/apt/lists | grep -v -x -e lock -e partial | sed 's/^/apt list: /'
        echo checked
    """
    assert run_in(built, "-c", script, entrypoint="sh", user="0").stdout == "checked\n"


def test_trains_the_sorter_example_in_a_container(built: Built):
    """`ravnest run` of examples/sorter.yaml, shortened, with its 4 workers inside one container."""
    doc = yaml.safe_load((ROOT / "examples" / "sorter.yaml").read_text())
    doc["spec"]["training"]["epochs"] = 1
    doc["spec"]["data"]["kwargs"] = {"n_train": 512, "n_val": 128}
    script = ('cat > /tmp/job.yaml && ravnest run --no-progress /tmp/job.yaml -o /tmp/out >&2 '
              '&& test -s /tmp/out/model.pt && cat /tmp/out/summary.json')
    result = run_in(built, "-c", script, entrypoint="sh", stdin=yaml.safe_dump(doc), timeout=600)
    summary = json.loads(result.stdout)
    assert summary["job"] == "sorter"
    assert (summary["clusters"], summary["nodes"], summary["samples"]) == (2, 4, 512)
    assert summary["rounds_skipped"] == 0
    assert summary["val_loss"] > 0
