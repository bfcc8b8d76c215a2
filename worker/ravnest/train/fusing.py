"""Fuse the stages of one cluster back into one state_dict with the original parameter names."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from ravnest.errors import RavnestError
from ravnest.storing import Location, open_location


def fuse_stage_files(stages_dir: str | Path | Location, cluster: int = 0,
                     which: str = "state") -> dict[str, torch.Tensor]:
    """Merge the `which` ("state" or "best") dicts of every stage file of `cluster`, in order."""
    return fuse_stages(load_stages(stages_dir, cluster), which)


def load_stages(stages_dir: str | Path | Location, cluster: int = 0) -> list[dict[str, Any]]:
    """The stage files of `cluster` (``node_*.pt``), loaded once, in stage order."""
    where = open_location(stages_dir)
    parts: list[dict[str, Any]] = []
    for name in sorted(f for f in where.files() if f.startswith("node_") and f.endswith(".pt")):
        blob = torch.load(io.BytesIO(where.read(name)), map_location="cpu", weights_only=True)
        if blob["cluster"] == cluster:
            parts.append(blob)
    if not parts:
        raise RavnestError(f"no stage files of cluster {cluster} in {where}")
    return sorted(parts, key=lambda blob: blob["stage"])


def fuse_stages(stages: list[dict[str, Any]], which: str = "state") -> dict[str, torch.Tensor]:
    """Merge the `which` ("state" or "best") dicts of one cluster's loaded stages, in order."""
    fused: dict[str, torch.Tensor] = {}
    for blob in stages:
        cluster, state = blob["cluster"], blob[which]
        if state is None:
            raise RavnestError(f"cluster {cluster} stage {blob['stage']} has no {which!r} weights"
                               " (no validation ran?)")
        overlap = fused.keys() & state.keys()
        if overlap:
            raise RavnestError(f"stages of cluster {cluster} overlap on {sorted(overlap)[:3]}")
        fused.update(state)
    return fused


def ordered_like(fused: dict[str, torch.Tensor], reference: dict[str, Any]) -> dict[str, Any]:
    """Order `fused` like the model's own state_dict and check no key is missing or extra."""
    missing = [k for k in reference if k not in fused]
    extra = [k for k in fused if k not in reference]
    if missing or extra:
        raise RavnestError(f"fused weights do not match the model: missing {missing[:3]}, "
                           f"unexpected {extra[:3]}")
    return {k: fused[k] for k in reference}
