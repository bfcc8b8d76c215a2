"""Three interleaved spiral arms of noisy 2-D points, drawn from a fixed seed."""

from __future__ import annotations

import math

import torch
from torch.utils.data import TensorDataset


def _points(n: int, arms: int, noise: float, gen: torch.Generator) -> TensorDataset:
    label = torch.randint(arms, (n,), generator=gen)
    radius = torch.rand(n, generator=gen)
    angle = radius * 2 * math.pi + label * (2 * math.pi / arms)
    angle = angle + noise * torch.randn(n, generator=gen)
    x = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=1)
    return TensorDataset(x, label)


def datasets(n_train: int = 6000, n_val: int = 1500, arms: int = 3, noise: float = 0.1,
             seed: int = 7) -> tuple[TensorDataset, TensorDataset]:
    gen = torch.Generator().manual_seed(seed)
    return _points(n_train, arms, noise, gen), _points(n_val, arms, noise, gen)
