"""The kind cluster the cluster tier makes here (see conftest.py): made by the tier itself, or ahead
of it by scripts/test, in the background while the integration tests that need the tools run.

Making it is mostly waiting on the disk: `scripts/kind-cluster up --offline` (about 30 s) and the
project image's load onto the workers (about 175 s: a docker save of GBs, imported and unpacked on
each worker), nearly 4 minutes in which the tier trained nothing. `python tests/e2e/kind_tier.py
prepare DIR` makes it and writes DIR/result.json (what `make` returns, or the error); the tier,
given RAVNEST_E2E_PREPARED=DIR, waits for that file instead of making the cluster again, and
deletes the cluster when it is done, as it deletes one it made itself. `python
tests/e2e/kind_tier.py down` deletes it too (scripts/test on its way out, when the tier did not).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # as a script: tests/ on the path, as pytest puts it (project_image)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import project_image
from e2e_cluster import (
    BYO_IMAGE,
    IMAGE,
    MINIO_IMAGE,
    ROOT,
    build_test_images,
    ensure_docker_image,
)

# The cluster this tier makes (not scripts/kind-e2e's, which a user may keep), and the folder
# scripts/kind-cluster mounts on every node.
KIND_CLUSTER = "ravnest-e2e-tier"
KIND_SHARED = "/mnt/ravnest-shared"
RESULT = "result.json"
SCRIPT = ["bash", str(ROOT / "scripts" / "kind-cluster")]


class NotMade(Exception):
    """The cluster could not be made; the message says why (and what the scripts printed)."""


def _script(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SCRIPT, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "KIND_CLUSTER": KIND_CLUSTER})


def make(log_dir: Path) -> dict[str, Any]:
    """Our image (built when missing), the test images, the cluster and the images on its
    workers: {"kubeconfig", "nodes", "timings"}. Raises NotMade saying why."""
    try:
        ensure_docker_image(log_dir)
        build_test_images()
    except BaseException as e:  # (pytest.fail's outcome, when the image cannot be built)
        raise NotMade(f"the images: {e}") from None
    timings: dict[str, float] = {}
    start = time.monotonic()
    up = _script("up", "--offline", timeout=3600)
    timings["cluster_up_s"] = time.monotonic() - start
    if up.returncode != 0:
        raise NotMade(f"scripts/kind-cluster up --offline exited {up.returncode}:\n"
                      f"{up.stdout[-2000:]}\n{up.stderr[-6000:]}")
    start = time.monotonic()
    load = _script("load", IMAGE, BYO_IMAGE, MINIO_IMAGE, timeout=3600)
    timings["image_load_s"] = time.monotonic() - start
    if load.returncode != 0:
        raise NotMade(f"scripts/kind-cluster load exited {load.returncode}:\n"
                      f"{load.stderr[-4000:]}")
    nodes = project_image.docker("ps", "--filter", f"label=io.x-k8s.kind.cluster={KIND_CLUSTER}",
                                 "--format", "{{.Names}}", check=False, timeout=60)
    return {"kubeconfig": up.stdout.strip().splitlines()[-1],
            "nodes": sorted(nodes.stdout.split()), "timings": timings}


def down() -> str | None:
    """Delete the cluster (and its shared folder); what went wrong, if it did."""
    gone = _script("down", timeout=600)
    if gone.returncode != 0:
        return f"scripts/kind-cluster down exited {gone.returncode}:\n{gone.stderr[-3000:]}"
    return None


def prepare(folder: Path) -> None:
    """`make` into folder/result.json, written whole (the tier waits for it to appear)."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        result: dict[str, Any] = {"ok": True, **make(folder)}
    except NotMade as e:
        result = {"ok": False, "error": str(e)}
    except BaseException as e:  # (whatever it was, the tier must hear of it)
        result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    tmp = folder / (RESULT + ".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(folder / RESULT)


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, ended and not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def prepared(folder: Path, timeout: float = 3600, pid: int | None = None) -> dict[str, Any]:
    """The result `prepare` wrote into folder, waited for (`pid`: the process making it, whose
    end without a result is an error at once). Raises NotMade with its error."""
    deadline = time.monotonic() + timeout
    said = False
    log = f"scripts/test's background kind_tier.py prepare; its log: {folder / 'log'}"
    while not (folder / RESULT).is_file():
        if pid is not None and not _alive(pid) and not (folder / RESULT).is_file():
            raise NotMade(f"the kind cluster's making (pid {pid}) ended without a result "
                          f"({log})")
        if time.monotonic() > deadline:
            raise NotMade(f"no {RESULT} in {folder} after {timeout:.0f} s ({log})")
        if not said:
            print(f"waiting for the kind cluster scripts/test is making ({folder})",
                  file=sys.stderr)
            said = True
        time.sleep(2)
    result: dict[str, Any] = json.loads((folder / RESULT).read_text())
    if not result.get("ok"):
        raise NotMade(str(result.get("error")))
    if not Path(result["kubeconfig"]).is_file():  # (kubectl would talk to localhost:8080)
        raise NotMade(f"the kind cluster was made, but its kubeconfig {result['kubeconfig']} is "
                      f"gone (`scripts/kind-cluster down` deletes it with the cluster)")
    return result


if __name__ == "__main__":
    if sys.argv[1:2] == ["down"] and len(sys.argv) == 2:
        sys.exit(down())
    if len(sys.argv) != 3 or sys.argv[1] != "prepare":
        sys.exit("usage: python tests/e2e/kind_tier.py prepare DIR | down")
    prepare(Path(sys.argv[2]))
