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
from collections.abc import Collection
from pathlib import Path
from typing import Any

from ravnest.errors import SpecError
from ravnest.plan import growth
from ravnest.plan.plans import Plan, ProviderInfo
from ravnest.run import elastic, locking, metadata
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
    such an addition (nothing is ordered). Orders given at once take turns (the run folder's
    order lock): each is checked against the job as every order before it left it."""
    job = metadata.of_run(out, running, "grow adds providers to").job
    assert job is not None
    folder = out / GROW_DIR
    with locking.orders_locked(out):
        given = [order for _, order in orders(folder, set()) if isinstance(order, dict)]
        if given:  # (the job as the last order left it)
            job = parse_job(given[-1]["job"], template_allow=None)  # (checked when ordered)
        added = added_providers(job, edited)
        folder.mkdir(exist_ok=True)
        number = 1 + max((int(p.name[6:-5]) for p in folder.glob(ORDER_GLOB)
                          if p.name[6:-5].isdigit()), default=-1)
        locking.write_whole(folder / f"order-{number:04d}.json", json.dumps(
            {"job": edited.to_dict(), "providers": added, "at": round(time.time(), 3)}))
    return added


ORDER_GLOB = "order-*.json"
"""The grow orders in the grow folder: order-0000.json, order-0001.json, ..."""


def orders(folder: Path, seen: Collection[str]) -> list[tuple[str, dict[str, Any] | SpecError]]:
    """The grow orders in `folder` not among `seen` (file names), in order: each file's name and
    its order, or the SpecError saying why it is no order (it cannot be read, is no JSON, or
    lacks the job and the providers it adds)."""
    got: list[tuple[str, dict[str, Any] | SpecError]] = []
    for path in sorted(folder.glob(ORDER_GLOB)):
        if path.name not in seen:
            got.append((path.name, _read_order(path)))
    return got


def _read_order(path: Path) -> dict[str, Any] | SpecError:
    try:
        order = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return SpecError([f"{path.name}: not a grow order ({type(e).__name__}: {e})"])
    if not isinstance(order, dict) or not isinstance(order.get("job"), dict):
        return SpecError([f"{path.name}: not a grow order (no job in it)"])
    providers = order.get("providers")
    if not isinstance(providers, list) or not providers or not all(
            type(p) is int and p >= 0 for p in providers):
        return SpecError([f"{path.name}.providers: a list of provider indices, got "
                          f"{providers!r}"[:300]])
    return order


def grown_plan(running: Job, plan: Plan, order: dict[str, Any]) -> tuple[Job, Plan]:
    """The job and plan after a grow order to the `running` job. Raises SpecError when the
    order's job is not the running one with the order's providers added after its own,
    PlanError when those cannot form new clusters of the running job."""
    job = parse_job(order["job"])
    adds = added_providers(running, job)
    if adds != order["providers"]:
        raise SpecError([f"providers: the order adds provider(s) {order['providers']}, its job "
                         f"adds {adds}"])
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
