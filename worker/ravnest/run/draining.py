"""Draining on `ravnest run` (issue 20, shrink): `ravnest drain <job> --provider P` removes
providers from a running local job. Their clusters (`elastic.drain_for`) get a drain order, a file
`cluster_<c>` in the run folder's `drain/`, which the cluster's root reads at its next round
boundary; the cluster then leaves the rings at a round the others agree on and stops
(`train.rejoining`), and its root leaves `cluster_<c>.done`. The runner counts the cluster as
drained, not failed: the job ends without it, and a whole-job restart leaves it out.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ravnest.run import elastic, jobstatus, locking, metadata

DRAIN_DIR = "drain"
"""The folder in a run folder that holds the drain orders and their acknowledgements."""


def order_file(folder: Path, cluster: int) -> Path:
    """The drain order of `cluster` in a drain folder (the run's `drain/`, which a worker gets as
    `run.metadata.DRAIN_DIR_ENV`): non-empty, the cluster drains."""
    return folder / f"cluster_{cluster}"


def done_file(folder: Path, cluster: int) -> Path:
    """Where the root of `cluster` acknowledges its drain (round, updates, samples)."""
    return folder / f"cluster_{cluster}.done"


def order_drain(out: Path, providers: Sequence[int], running: bool) -> list[int]:
    """Order the clusters of `providers` in the run in `out` to drain; returns them. `running`:
    whether a runner holds the folder (nothing is ordered when none does). Raises RavnestError
    for a provider that runs no stage, when no cluster would be left, or with no run."""
    plan = metadata.of_run(out, running, "drain removes providers from").plan
    folder = out / DRAIN_DIR
    with locking.orders_locked(out):  # (two drains at once: the second sees the first's order)
        runs_on = {n.name: n.provider for n in plan.nodes} | taken_over(_status(out))
        # (the orders stay for the whole run: a drained cluster's among them)
        clusters = elastic.drain_for(plan, providers, runs_on, ordered_clusters(folder))
        folder.mkdir(exist_ok=True)
        for c in sorted(clusters):
            order = {"providers": elastic.drained_by(plan, c, providers, runs_on),
                     "at": round(time.time(), 3)}
            locking.write_whole(order_file(folder, c), json.dumps(order))
    return sorted(clusters)


def taken_over(status: Mapping[str, Any]) -> dict[str, int]:
    """Node -> the spare provider that runs its stage now, from a run's status (`JobStatus`:
    status.takeovers; a list of takeovers in the status.json of older runs)."""
    taken = status.get("takeovers") or {}
    if isinstance(taken, list):
        taken = {t.get("node"): t.get("provider") for t in taken if isinstance(t, dict)}
    return {str(n): int(p) for n, p in taken.items() if isinstance(p, int)} \
        if isinstance(taken, dict) else {}


def _order_files(folder: Path) -> dict[int, Path]:
    return {int(p.name.split("_", 1)[1]): p for p in folder.glob("cluster_*")
            if p.name.split("_", 1)[1].isdigit()}


def ordered_clusters(folder: Path) -> set[int]:
    """The clusters a drain was ordered for in the drain folder `folder`."""
    return {c for c in _order_files(folder) if ordered(folder, c)}


def refused(folder: Path) -> dict[str, str]:
    """The files in the drain folder `folder` that are no drain order (`problem`): name -> why.
    Their clusters are not drained."""
    return {p.name: why for c, p in sorted(_order_files(folder).items())
            if (why := problem(folder, c)) is not None}


def ordered(folder: Path, cluster: int) -> bool:
    """Whether `cluster` was told to drain: its order is there and is one (`problem`)."""
    return order_file(folder, cluster).exists() and isinstance(_read(folder, cluster), dict)


def problem(folder: Path, cluster: int) -> str | None:
    """Why the drain order of `cluster` is none (it cannot be read, is no JSON object, or names
    no providers: not written by `ravnest drain`), or None."""
    said = _read(folder, cluster)
    return said if isinstance(said, str) else None


def order(folder: Path, cluster: int) -> dict[str, Any]:
    """The drain order of `cluster` as the job's status shows it (`jobstatus.Drain`: cluster,
    providers, orderedAt); an order that cannot be read gives the cluster only."""
    said = _read(folder, cluster)
    if not isinstance(said, dict):
        return {"cluster": cluster}
    at = said.get("at")
    return {"cluster": cluster, "providers": said["providers"],
            **({"orderedAt": jobstatus.timestamp(at)} if isinstance(at, int | float) else {})}


def _read(folder: Path, cluster: int) -> dict[str, Any] | str:
    """The drain order of `cluster` (a dict naming its providers), or why it is none."""
    try:
        said = json.loads(order_file(folder, cluster).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"[:300]
    providers = said.get("providers") if isinstance(said, dict) else None
    if not isinstance(providers, list) or not all(type(p) is int and p >= 0 for p in providers):
        return "not a drain order (no list of providers in it)"
    return dict(said)


def acknowledge(folder: Path, cluster: int, said: dict[str, Any]) -> None:
    """The root of `cluster` drained: leave what it says for the runner (`acknowledged`)."""
    done_file(folder, cluster).write_text(json.dumps({"cluster": cluster, **said}))


def acknowledged(folder: Path, cluster: int) -> dict[str, Any] | None:
    """What the root of `cluster` said once it drained (round, updates, samples), or None."""
    try:
        return dict(json.loads(done_file(folder, cluster).read_text()))
    except (OSError, ValueError):
        return None


def _status(out: Path) -> dict[str, Any]:
    try:
        return dict(json.loads((out / "status.json").read_text()))
    except (OSError, ValueError):
        return {}
