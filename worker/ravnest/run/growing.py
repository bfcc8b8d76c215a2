"""Growing on `ravnest run` (issue 20, grow): `ravnest grow <job.yaml>` adds the providers that the
edited job file lists after those of the running job. The order is a file in the run folder's
`grow/`, which the runner reads while it supervises: it forms the new providers into clusters
(`growth.grow`: each takes the stages of a planned cluster, so nothing the running clusters hold
changes), writes their node metadata and starts their workers. Those join as a restarted cluster
rejoins (`train.rejoining`): they introduce themselves to the members of their rings, take the
latest state from them, and take part in the rounds from their join round on, while the others
train on. The join is acknowledged (`cluster_<c>.joined` in the drain folder) and shows in the
run's versioned membership.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from ravnest.errors import SpecError
from ravnest.plan import growth
from ravnest.plan.plans import Plan, ProviderInfo
from ravnest.run import elastic, metadata
from ravnest.spec import Job, parse_job

GROW_DIR = "grow"
"""The folder in a run folder that holds the grow orders."""


def added_providers(running: Job, edited: Job) -> list[int]:
    """The providers (indices, replicas expanded) that `edited` adds to the `running` job: its
    providers are the running ones with more after them, and nothing else changed. Raises
    SpecError, path-qualified, otherwise."""
    before = running.spec.expanded_providers()
    if _without_providers(running) != _without_providers(edited):
        raise SpecError(["spec: a running job grows by providers added to spec.providers; "
                         "everything else must stay as it runs"])
    added = elastic.added_providers(before, edited.spec.expanded_providers())
    if added is None:
        raise SpecError([f"spec.providers: a running job grows by providers listed after its "
                         f"{len(before)} (replicas expanded), the others unchanged and in order"])
    return added


def _without_providers(job: Job) -> dict[str, Any]:
    d = job.to_dict()
    d["spec"].pop("providers", None)
    return d


def order_growth(out: Path, edited: Job, running: bool) -> list[int]:
    """Order the run in `out` to add the providers that `edited` lists after its own; returns
    their indices. Raises RavnestError with no run going on, SpecError for an edit that is not
    such an addition (nothing is ordered)."""
    job = metadata.of_run(out, running, "grow adds providers to").job
    assert job is not None
    folder = out / GROW_DIR
    done = [json.loads(p.read_text()) for p in sorted(folder.glob("order-*.json"))]
    if done:  # (the job as the last order left it)
        job = parse_job(done[-1]["job"])
    added = added_providers(job, edited)
    folder.mkdir(exist_ok=True)
    tmp = folder / ".order.tmp"
    tmp.write_text(json.dumps({"job": edited.to_dict(), "providers": added,
                               "at": round(time.time(), 3)}))
    tmp.replace(folder / f"order-{len(done):04d}.json")
    return added


def orders(folder: Path, seen: int) -> list[dict[str, Any]]:
    """The grow orders in `folder` after the first `seen`, in order."""
    return [json.loads(p.read_text()) for p in sorted(folder.glob("order-*.json"))[seen:]]


def grown_plan(plan: Plan, order: dict[str, Any]) -> tuple[Job, Plan]:
    """The job and plan after a grow order. Raises PlanError when its providers cannot form new
    clusters of the running job."""
    job = parse_job(order["job"])
    pool = job.spec.expanded_providers()
    added = [(i, ProviderInfo(pool[i].ram, pool[i].bandwidth, pool[i].compute))
             for i in order["providers"]]
    return job, growth.grow(plan, added)


def joined_file(folder: Path, cluster: int) -> Path:
    """Where the root of a cluster added to the job says when it joined (in the drain folder)."""
    return folder / f"cluster_{cluster}.joined"


def joined(folder: Path, cluster: int) -> dict[str, Any] | None:
    """What the root of an added `cluster` said when it joined (round, updates, ...), or None."""
    try:
        return dict(json.loads(joined_file(folder, cluster).read_text()))
    except (OSError, ValueError):
        return None
