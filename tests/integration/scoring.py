"""Ground truth for trained digits models: a fused state_dict scored by plain PyTorch."""

from __future__ import annotations

from typing import Any

import torch

from ravnest.examples.digits import build_model, datasets


def digits_accuracy(state: dict[str, Any]) -> float:
    """Validation accuracy of the digits example's model holding `state`."""
    model = build_model()
    model.load_state_dict(state)
    model.eval()
    _, val = datasets()
    with torch.no_grad():
        return (model(val.tensors[0]).argmax(1) == val.tensors[1]).float().mean().item()
