"""Checkpoints: atomic, checksummed, per node, grouped by step in a directory all nodes share.

Layout: ``<dir>/step-00000120/node_3.pt`` plus ``node_3.sha256``. A file is written to a temporary
name and renamed, and its checksum is written last, so a checkpoint is *complete* for a node only
when both exist and agree. A step is resumable when it is complete for every node of the plan;
nodes resume from the newest such step, so they always agree. Old steps are pruned only below the
newest resumable one.
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

log = logging.getLogger(__name__)


def _step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save(root: str | Path, step: int, node: str, state: dict[str, Any]) -> Path:
    """Write one node's checkpoint for `step` atomically, checksum last."""
    d = _step_dir(Path(root), step)
    d.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    path = d / f"{node}.pt"
    _atomic_write(path, data)
    _atomic_write(d / f"{node}.sha256", hashlib.sha256(data).hexdigest().encode())
    return path


def _valid(d: Path, node: str) -> bool:
    try:
        digest = (d / f"{node}.sha256").read_text().strip()
        data = (d / f"{node}.pt").read_bytes()
    except OSError:
        return False
    return hashlib.sha256(data).hexdigest() == digest


def complete_steps(root: str | Path, nodes: list[str]) -> list[int]:
    """Steps for which every node's checkpoint exists and matches its checksum, ascending."""
    r = Path(root)
    if not r.is_dir():
        return []
    steps = []
    for d in r.iterdir():
        if d.is_dir() and d.name.startswith("step-") and d.name[5:].isdigit():
            if all((d / f"{n}.sha256").exists() for n in nodes):
                steps.append(int(d.name[5:]))
    return sorted(steps)


def latest(root: str | Path, nodes: list[str]) -> int | None:
    """The newest step whose checkpoints are complete and intact for all nodes."""
    for step in reversed(complete_steps(root, nodes)):
        d = _step_dir(Path(root), step)
        if all(_valid(d, n) for n in nodes):
            return step
        log.warning("checkpoint %s is corrupt or incomplete; trying an older one", d)
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
        if d.is_dir() and d.name.startswith("step-") and d.name[5:].isdigit():
            if int(d.name[5:]) < newest_kept[0]:
                shutil.rmtree(d, ignore_errors=True)
