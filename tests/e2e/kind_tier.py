"""The kind cluster the cluster tier makes here (see conftest.py): made by the tier itself, or ahead
of it by scripts/test, in the background once the tools and the image are there and the unit tier
is done (`prepare DIR --after EXIT_FILE...`), beside the integration tests.

Making it took 333 s here with nothing else running (2026-12-03): `scripts/kind-cluster up
--offline` 48 s and the images' load onto the workers 284 s (a docker save of GBs, imported and
unpacked on each worker), 1.35 of the 2 cores on average, in which the tier trained nothing.
`python tests/e2e/kind_tier.py prepare DIR` makes it and writes DIR/result.json (what `make`
returns, or the error); the tier,
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


def prepare(folder: Path, after: list[Path] | None = None) -> None:
    """`make` into folder/result.json, written whole (the tier waits for it to appear). With
    `after`: once each of those files holds an exit status (scripts/test's tools build and docker
    engine write theirs), and only if each is 0; else the result is that error."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        _wait_for_exits(after or [])
        result: dict[str, Any] = {"ok": True, **make(folder)}
    except NotMade as e:
        result = {"ok": False, "error": str(e)}
    except BaseException as e:  # (whatever it was, the tier must hear of it)
        result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    tmp = folder / (RESULT + ".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(folder / RESULT)


def _wait_for_exits(files: list[Path], poll: float = 2.0) -> None:
    """Wait until every file holds an exit status (written whole: a line ending in a newline);
    raise NotMade naming the first that is not 0."""
    for f in files:
        said = False
        while not (text := f.read_text() if f.is_file() else "").endswith("\n"):
            if not said:
                print(f"waiting for {f} (an exit status scripts/test's background step writes)",
                      flush=True)
                said = True
            time.sleep(poll)
        if text.strip() != "0":
            raise NotMade(f"not made: a step it needs failed (exit status {text.strip()!r} in "
                          f"{f}; scripts/test's log says which: the k8s tools' build or "
                          f"scripts/docker-engine)")


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
    if len(sys.argv) < 3 or sys.argv[1] != "prepare" or (
            len(sys.argv) > 3 and (sys.argv[3] != "--after" or len(sys.argv) == 4)):
        sys.exit("usage: python tests/e2e/kind_tier.py prepare DIR [--after EXIT_FILE...] | down")
    prepare(Path(sys.argv[2]), [Path(a) for a in sys.argv[4:]])
