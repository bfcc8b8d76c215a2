"""The elastic-training job of tests/integration/test_elastic.py and bench/elastic.py (digits on 9
providers in 3 clusters: each has a root, the planner gives two of them a stem and all of them a
leaf), and its workers' step counters read from their metrics."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from ravnest.run.progress import scrape

ROOT = Path(__file__).resolve().parents[2]


def elastic_job(folder: Path, epochs: int, checkpoint: dict[str, Any],
                run_policy: dict[str, Any] | None = None, spares: int = 0,
                criterion: dict[str, Any] | None = None) -> Path:
    """The job file, written in `folder`; with `spares`, that many more providers (1 GB each) and
    spec.plan.spares asking for that many hot spares (the planner picks which); `criterion`:
    spec.training.criterion (e.g. gated_loss's)."""
    doc = yaml.safe_load((ROOT / "examples" / "digits.yaml").read_text())
    spec = doc["spec"]
    spec["plan"]["clusters"] = 3
    spec["providers"] += [{"ram": 4, "bandwidth": 1000}, {"ram": 8, "bandwidth": 1000},
                          {"ram": 2, "bandwidth": 500}]
    spec["training"]["epochs"] = epochs
    if criterion is not None:
        spec["training"]["criterion"] = criterion
    spec["checkpoint"] = checkpoint
    if run_policy is not None:
        spec["runPolicy"] = run_policy
    if spares:
        spec["providers"] += [{"ram": 1, "bandwidth": 1000}] * spares
        spec["plan"]["spares"] = spares
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def steps(ports: dict[str, int]) -> dict[str, int]:
    """Each worker's ravnest_step by name (metrics port), leaving out those that do not answer."""
    out = {}
    for name, port in ports.items():
        try:
            out[name] = int(scrape(port, timeout=0.5).get("ravnest_step", -1))
        except OSError:
            continue
    return out


@contextmanager
def local_run(job: Path, out: Path) -> Iterator[subprocess.Popen[str]]:
    """`ravnest run job -o out` in the background (its output piped), killed if it is still
    there when the block ends."""
    run = subprocess.Popen([sys.executable, "-m", "ravnest", "run", str(job), "-o", str(out),
                            "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    try:
        yield run
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()


def wait(what: str, ready: Callable[[], Any], run: subprocess.Popen[str],
         seconds: float = 300) -> None:
    """Wait until `ready()`, failing if the run ends first or after `seconds`."""
    deadline = time.monotonic() + seconds
    while not ready():
        assert run.poll() is None, f"the run ended before {what}: {run.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"not {what} within {seconds} s"
        time.sleep(0.1)


def planned(run: subprocess.Popen[str], out: Path) -> tuple[dict[str, Any], dict[str, int]]:
    """The run's plan, once written, and each node's metrics port."""
    wait("a plan", lambda: (out / "plan.txt").exists(), run, 120)
    plan = json.loads((out / "nodes" / "node_0.json").read_text())["plan"]
    ports = {n["name"]: json.loads((out / "nodes" / f"{n['name']}.json").read_text())[
        "metricsPort"] for n in plan["nodes"]}
    return plan, ports
