"""A small CNN on scikit-learn's 8x8 handwritten digits (1,797 images shipped with scikit-learn).

It has BatchNorm, Dropout and a skip connection, so it exercises everything the pipeline must get
right while training to >95% validation accuracy in seconds on a CPU.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset


class DigitsCNN(nn.Module):
    def __init__(self, width: int = 16, dropout: float = 0.1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(width)
        self.pool = nn.MaxPool2d(2)
        self.conv3 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.bn3 = nn.BatchNorm2d(2 * width)
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(2 * width * 16, 64)
        self.dropout = nn.Dropout(dropout)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        h = h + torch.relu(self.bn2(self.conv2(h)))
        h = self.pool(h)
        h = torch.relu(self.bn3(self.conv3(h)))
        h = self.dropout(torch.relu(self.fc1(self.flatten(h))))
        return self.fc2(h)


def build_model(width: int = 16, dropout: float = 0.1) -> nn.Module:
    return DigitsCNN(width=width, dropout=dropout)


def datasets(validation_fraction: float = 0.2,
             seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """Train/validation split of the digits, scaled to [0, 1], shaped (N, 1, 8, 8)."""
    images, targets = digits()
    x = torch.tensor(images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(targets, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_val = int(len(y) * validation_fraction)
    val, train = order[:n_val], order[n_val:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[val], y[val])


def digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits: images (1797, 8, 8) and targets, as `load_digits` gives them. Read
    from the file scikit-learn ships them in, as `load_digits` reads it, without importing
    scikit-learn: that import costs 1.5 CPU-seconds in every process that loads the data (each
    worker), more than such a worker spends training. `load_digits` itself where that file is
    not found."""
    spec = importlib.util.find_spec("sklearn")  # (finds the package, runs none of it)
    if spec is not None and spec.origin is not None:
        path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            data = np.loadtxt(path, delimiter=",")
            return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)
    from sklearn.datasets import load_digits

    loaded = load_digits()
    return loaded.images, loaded.target
