"""The elastic-training job of tests/integration/test_elastic.py and bench/elastic.py (digits on 9
providers in 3 clusters: each has a root, the planner gives two of them a stem and all of them a
leaf), and its workers' step counters read from their metrics."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from ravnest.run.progress import scrape

ROOT = Path(__file__).resolve().parents[2]


def elastic_job(folder: Path, epochs: int, checkpoint: dict[str, Any],
                run_policy: dict[str, Any] | None = None, spares: int = 0) -> Path:
    """The job file, written in `folder`; with `spares`, that many more providers (1 GB each) and
    spec.plan.spares asking for that many hot spares (the planner picks which)."""
    doc = yaml.safe_load((ROOT / "examples" / "digits.yaml").read_text())
    spec = doc["spec"]
    spec["plan"]["clusters"] = 3
    spec["providers"] += [{"ram": 4, "bandwidth": 1000}, {"ram": 8, "bandwidth": 1000},
                          {"ram": 2, "bandwidth": 500}]
    spec["training"]["epochs"] = epochs
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
