"""`model_fusion`: a cluster's trained stage files fused into one state_dict, as in Ravnest."""

from __future__ import annotations

from pathlib import Path

import torch

from ravnest.plan.building import set_seed
from ravnest.seed.arguments import Arguments
from ravnest.train.fusing import fuse_stage_files

__all__ = ["model_fusion", "set_seed"]


def model_fusion(cluster_id: int = 0,
                 trained_dir: str | Path = "trained") -> dict[str, torch.Tensor]:
    """Fuse the submodels a cluster's providers saved (``Trainer(save=True)``) into one
    state_dict with the original parameter names, save it as
    ``trained/trained_state_dict.pt`` and return it."""
    given = Arguments("model_fusion")
    given.whole("cluster_id", cluster_id, least=0)
    given.path("trained_dir", trained_dir)
    given.check()
    fused = fuse_stage_files(trained_dir, cluster_id)
    torch.save(fused, Path(trained_dir) / "trained_state_dict.pt")
    return fused
