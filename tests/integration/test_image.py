"""The container image built from the Dockerfile: one image for the operator and the workers, run as
the workers' non-root user, carrying the CLI, the operator and torch but nothing to build with, and
training an example job inside a container.

How the image is built here (offline, from a wheelhouse, shared with the cluster tier) is
tests/project_image.py's; the first build takes minutes, later runs reuse the image.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from project_image import BASE_IMAGE, Built, docker, ensure_image, torch_version

from ravnest import __version__
from ravnest_operator.resources import WORKER_UID

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.tools, pytest.mark.timeout(2400)]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return ensure_image(tmp_path_factory.mktemp("image"))


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
    built_in = ("reused (built from these sources before)" if built.seconds is None
                else f"built in {built.seconds:.0f} s")
    if built.seconds is not None:
        record_property("build_seconds", round(built.seconds, 1))
    line = (f"image {built.image} (torch {torch_version()}, cuda variant, base {BASE_IMAGE}): "
            f"{built.size / 1e9:.2f} GB ({built.size} bytes), {built_in}")
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
    """No compilers, pip cache, package lists, sources, wheels or build venv in the image (looked
    for as root, who can see everywhere)."""
    script = """
        for tool in gcc cc c++ g++ clang make; do
            command -v "$tool" >/dev/null && echo "compiler: $tool"
        done
        for dir in /root/.cache /home/ravnest/.cache /wheels /src /dist /tmp/dist \\
                   /tmp/ravnest /opt/build; do
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
