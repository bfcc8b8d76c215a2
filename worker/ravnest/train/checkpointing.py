"""Checkpoints: atomic, checksummed, per node, grouped by step in a folder all nodes share (a
path, a mounted claim, or an object store such as S3: see `ravnest.storing`).

Layout: ``<dir>/step-00000120/node_3.pt`` plus ``node_3.plan`` (the fingerprint of the plan that
wrote it) and ``node_3.sha256``. A file is written to a temporary name and renamed, and its checksum
is written last, so a checkpoint is *complete* for a node only when both exist and agree. A step is
resumable when it is complete for every node of the plan and every node's file of it loads; nodes
resume from the newest such step, so they always agree. A step whose files are all there but do not
match their checksums (truncated, corrupted) or do not load (garbage whose checksum was rewritten to
match) is logged and set aside as ``corrupt-step-…`` (kept for inspection, never deleted as good
data), and the one before is used. A step whose files vanish while they are checked (another node
pruned it, having written newer ones) is passed over, never set aside. A folder holding
checkpoints of another plan is refused (`ForeignCheckpoint`), never loaded: its state would not
fit this plan's stages, and starting over in it would overwrite them. Old steps, and set-aside
ones, are pruned only below the newest resumable one.
"""

from __future__ import annotations

import hashlib
import io
import logging
from pathlib import Path
from typing import Any

import torch

from ravnest.errors import RavnestError
from ravnest.storing import Location, open_location
from ravnest.train.devices import on_host

log = logging.getLogger(__name__)

Where = str | Path | Location
"""A checkpoint folder: a `Location`, or a path or URI `storing.open_location` opens."""


class ForeignCheckpoint(RavnestError):
    """The checkpoint folder holds checkpoints another plan wrote."""


def _step(step: int) -> str:
    return f"step-{step:08d}"


def _step_of(name: str) -> int | None:
    return int(name[5:]) if name.startswith("step-") and name[5:].isdigit() else None


def save(root: Where, step: int, node: str, state: dict[str, Any], plan: str = "") -> str:
    """Write one node's checkpoint for `step`, each file atomically: the state, the fingerprint
    of the `plan` that wrote it (when given), its checksum last. Returns where the state went."""
    d = open_location(root).child(_step(step))
    buf = io.BytesIO()
    torch.save(on_host(state), buf)  # (loads anywhere, a device's state too)
    data = buf.getvalue()
    d.write(f"{node}.pt", data)
    if plan:
        d.write(f"{node}.plan", plan.encode())
    d.write(f"{node}.sha256", hashlib.sha256(data).hexdigest().encode())
    return d.path(f"{node}.pt")


def _problem(d: Location, node: str) -> str | None:
    """Why `node`'s checkpoint in `d` cannot be used, or None when it matches its checksum.
    Raises FileNotFoundError when a file of it is gone: pruned or set aside by another node while
    this one looked, which says nothing about its data."""
    try:
        digest = d.read(f"{node}.sha256").decode(errors="replace").strip()
        data = d.read(f"{node}.pt")
    except FileNotFoundError:
        raise
    except OSError as e:
        return f"cannot read {node}'s checkpoint: {e}"
    if hashlib.sha256(data).hexdigest() != digest:
        return f"{node}.pt ({len(data)} bytes) does not match {node}.sha256"
    # Locally mapped, not read: the structure is checked without holding every node's tensors.
    source: Any = d.path(f"{node}.pt") if d.local else io.BytesIO(data)
    try:
        torch.load(source, map_location="cpu", weights_only=True, mmap=d.local)
    except FileNotFoundError:
        raise
    except Exception as e:  # torch.load raises any kind of error on garbage
        return f"{node}.pt does not load: {type(e).__name__}: {str(e)[:200]}"
    return None


def _set_aside(root: Location, name: str) -> str:
    """Move a corrupt step out of the way (`corrupt-step-…`, `.1`, `.2` if taken)."""
    taken = set(root.folders())
    target, n = f"corrupt-{name}", 0
    while target in taken:
        n += 1
        target = f"corrupt-{name}.{n}"
    try:
        root.rename(name, target)
    except FileNotFoundError:  # another node set it aside first
        pass
    return target


def complete_steps(root: Where, nodes: list[str]) -> list[int]:
    """Steps for which every node wrote its checkpoint and checksum (not verified here)."""
    r = open_location(root)
    steps = []
    for name in r.folders():
        step = _step_of(name)
        if step is not None:
            present = set(r.child(name).files())
            if all(f"{n}.sha256" in present for n in nodes):
                steps.append(step)
    return sorted(steps)


def refuse_other_plans(root: Where, plan: str) -> None:
    """Raise `ForeignCheckpoint` when a step in `root` holds a node's checkpoint that a plan other
    than `plan` (a fingerprint) wrote. Checkpoints that record no plan are not judged."""
    if not plan:
        return
    r = open_location(root)
    for name in sorted(n for n in r.folders() if _step_of(n) is not None):
        d = r.child(name)
        for f in sorted(f for f in d.files() if f.endswith(".plan")):
            try:
                theirs = d.read(f).decode(errors="replace").strip()
            except OSError:  # pruned or set aside meanwhile
                continue
            if theirs and theirs != plan:
                raise ForeignCheckpoint(
                    f"checkpoint folder {r} holds checkpoints of another plan ({name}/"
                    f"{f[:-5]}.pt was written by plan {theirs}; this job's plan is {plan}): "
                    f"they are not loaded and not overwritten. Choose another checkpoint path "
                    f"(spec.checkpoint.path) for this plan, move that folder away, or run the "
                    f"job that wrote them to resume it")


def latest(root: Where, nodes: list[str], plan: str = "",
           set_aside: bool = True) -> int | None:
    """The newest step whose checkpoints are complete, intact and loadable for all nodes; newer
    complete steps that fail their checksums or do not load are logged and set aside (unless
    `set_aside` is False: then only read, as a supervisor that leaves the repair to its nodes).
    With a `plan` fingerprint, a folder holding another plan's checkpoints raises
    `ForeignCheckpoint`."""
    r = open_location(root)
    refuse_other_plans(r, plan)
    for step in reversed(complete_steps(r, nodes)):
        d = r.child(_step(step))
        try:
            problems = [p for n in nodes if (p := _problem(d, n)) is not None]
        except FileNotFoundError as e:  # gone while checked (pruned by a node that moved on)
            log.debug("checkpoint %s went away while it was checked (%s)", d, e)
            continue
        if not problems:
            return step
        if not set_aside:
            continue
        log.warning("checkpoint %s is corrupt (%s); set aside as %s, trying an older one", d,
                    "; ".join(problems), _set_aside(r, _step(step)))
    return None


def load(root: Where, step: int, node: str) -> dict[str, Any]:
    d = open_location(root).child(_step(step))
    source: Any = d.path(f"{node}.pt") if d.local else io.BytesIO(d.read(f"{node}.pt"))
    state: dict[str, Any] = torch.load(source, map_location="cpu", weights_only=True)
    return state


def prune(root: Where, nodes: list[str], keep: int) -> None:
    """Delete steps older than the `keep` newest resumable ones."""
    r = open_location(root)
    steps = complete_steps(r, nodes)
    if len(steps) <= keep:
        return
    oldest_kept = steps[-keep]
    for name in r.folders():
        step = _step_of(name.removeprefix("corrupt-").split(".")[0])
        if step is not None and step < oldest_kept:
            r.remove(name)
