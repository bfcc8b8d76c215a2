"""`model_fusion`: a cluster's trained stage files fused into one state_dict, as in Ravnest."""

from __future__ import annotations

from pathlib import Path

import torch

from ravnest.plan.building import set_seed
from ravnest.train.fusing import fuse_stage_files

__all__ = ["model_fusion", "set_seed"]


def model_fusion(cluster_id: int = 0,
                 trained_dir: str | Path = "trained") -> dict[str, torch.Tensor]:
    """Fuse the submodels a cluster's providers saved (``Trainer(save=True)``) into one
    state_dict with the original parameter names, save it as
    ``trained/trained_state_dict.pt`` and return it."""
    fused = fuse_stage_files(trained_dir, cluster_id)
    torch.save(fused, Path(trained_dir) / "trained_state_dict.pt")
    return fused
