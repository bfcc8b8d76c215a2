"""An MLP over 2-D points: 3 classes, one per spiral arm."""

from __future__ import annotations

from torch import nn


def build(hidden: int = 64, depth: int = 4, classes: int = 3) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(2, hidden), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(hidden, hidden), nn.ReLU()]
    layers.append(nn.Linear(hidden, classes))
    return nn.Sequential(*layers)
