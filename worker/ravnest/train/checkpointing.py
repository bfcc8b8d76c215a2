"""Checkpoints: atomic, checksummed, per node, grouped by step in a directory all nodes share.

Layout: ``<dir>/step-00000120/node_3.pt`` plus ``node_3.plan`` (the fingerprint of the plan that
wrote it) and ``node_3.sha256``. A file is written to a temporary name and renamed, and its checksum
is written last, so a checkpoint is *complete* for a node only when both exist and agree. A step is
resumable when it is complete for every node of the plan and every node's file of it loads; nodes
resume from the newest such step, so they always agree. A step whose files are all there but do not
match their checksums (truncated, corrupted) or do not load (garbage whose checksum was rewritten to
match) is logged and set aside as ``corrupt-step-…`` (kept for inspection, never deleted as good
data), and the one before is used. A folder holding checkpoints of another plan is refused
(`ForeignCheckpoint`), never loaded: its state would not fit this plan's stages, and starting over
in it would overwrite them. Old steps, and set-aside ones, are pruned only below the newest
resumable one.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from ravnest.errors import RavnestError

log = logging.getLogger(__name__)


class ForeignCheckpoint(RavnestError):
    """The checkpoint folder holds checkpoints another plan wrote."""


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save(root: str | Path, step: int, node: str, state: dict[str, Any], plan: str = "") -> Path:
    """Write one node's checkpoint for `step` atomically: the state, the fingerprint of the `plan`
    that wrote it (when given), its checksum last."""
    d = _step_dir(Path(root), step)
    d.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    path = d / f"{node}.pt"
    _atomic_write(path, data)
    if plan:
        _atomic_write(d / f"{node}.plan", plan.encode())
    _atomic_write(d / f"{node}.sha256", hashlib.sha256(data).hexdigest().encode())
    return path


def _problem(d: Path, node: str) -> str | None:
    """Why `node`'s checkpoint in `d` cannot be used, or None when it matches its checksum."""
    try:
        digest = (d / f"{node}.sha256").read_text().strip()
        data = (d / f"{node}.pt").read_bytes()
    except OSError as e:
        return f"cannot read {e.filename}: {e.strerror}"
    if hashlib.sha256(data).hexdigest() != digest:
        return f"{node}.pt ({len(data)} bytes) does not match {node}.sha256"
    try:  # mapped, not read: the structure is checked without holding every node's tensors
        torch.load(d / f"{node}.pt", map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # torch.load raises any kind of error on garbage
        return f"{node}.pt does not load: {type(e).__name__}: {str(e)[:200]}"
    return None


def _set_aside(d: Path) -> Path:
    """Rename a corrupt step out of the way (`corrupt-step-…`, `.1`, `.2` if taken)."""
    target, n = d.with_name(f"corrupt-{d.name}"), 0
    while target.exists():
        n += 1
        target = d.with_name(f"corrupt-{d.name}.{n}")
    try:
        d.rename(target)
    except FileNotFoundError:  # another node set it aside first
        pass
    return target


def complete_steps(root: str | Path, nodes: list[str]) -> list[int]:
    """Steps for which every node wrote its checkpoint and checksum (not verified here)."""
    r = Path(root)
    if not r.is_dir():
        return []
    steps = []
    for d in r.iterdir():
        if d.is_dir() and d.name.startswith("step-") and d.name[5:].isdigit():
            if all((d / f"{n}.sha256").exists() for n in nodes):
                steps.append(int(d.name[5:]))
    return sorted(steps)


def refuse_other_plans(root: str | Path, plan: str) -> None:
    """Raise `ForeignCheckpoint` when a step in `root` holds a node's checkpoint that a plan other
    than `plan` (a fingerprint) wrote. Checkpoints that record no plan are not judged."""
    r = Path(root)
    if not plan or not r.is_dir():
        return
    for d in sorted(r.glob("step-*")):
        for f in sorted(d.glob("*.plan")):
            try:
                theirs = f.read_text().strip()
            except OSError:  # pruned or set aside meanwhile
                continue
            if theirs and theirs != plan:
                raise ForeignCheckpoint(
                    f"checkpoint folder {r} holds checkpoints of another plan ({d.name}/"
                    f"{f.stem}.pt was written by plan {theirs}; this job's plan is {plan}): "
                    f"they are not loaded and not overwritten. Choose another checkpoint path "
                    f"(spec.checkpoint.path) for this plan, move that folder away, or run the "
                    f"job that wrote them to resume it")


def latest(root: str | Path, nodes: list[str], plan: str = "",
           set_aside: bool = True) -> int | None:
    """The newest step whose checkpoints are complete, intact and loadable for all nodes; newer
    complete steps that fail their checksums or do not load are logged and set aside (unless
    `set_aside` is False: then only read, as a supervisor that leaves the repair to its nodes).
    With a `plan` fingerprint, a folder holding another plan's checkpoints raises
    `ForeignCheckpoint`."""
    refuse_other_plans(root, plan)
    for step in reversed(complete_steps(root, nodes)):
        d = _step_dir(Path(root), step)
        problems = [p for n in nodes if (p := _problem(d, n)) is not None]
        if not problems:
            return step
        if not set_aside:
            continue
        log.warning("checkpoint %s is corrupt (%s); set aside as %s, trying an older one", d,
                    "; ".join(problems), _set_aside(d).name)
    return None


def load(root: str | Path, step: int, node: str) -> dict[str, Any]:
    path = _step_dir(Path(root), step) / f"{node}.pt"
    state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    return state


def prune(root: str | Path, nodes: list[str], keep: int) -> None:
    """Delete steps older than the `keep` newest resumable ones."""
    steps = complete_steps(root, nodes)
    if len(steps) <= keep:
        return
    newest_kept = steps[-keep:]
    for d in Path(root).iterdir():
        name = d.name.removeprefix("corrupt-").split(".")[0]
        if d.is_dir() and name.startswith("step-") and name[5:].isdigit():
            if int(name[5:]) < newest_kept[0]:
                shutil.rmtree(d, ignore_errors=True)
