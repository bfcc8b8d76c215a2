"""Small models and datasets the tests train (importable by worker processes: tests/ is put on
PYTHONPATH by the fixtures)."""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.utils.data import TensorDataset


class SkipNet(nn.Module):
    """Skip connection across stages, BatchNorm and Dropout: everything a split can get wrong."""

    def __init__(self, dropout: float = 0.3) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.bn = nn.BatchNorm1d(32)
        self.fc2 = nn.Linear(32, 32)
        self.drop = nn.Dropout(dropout)
        self.fc3 = nn.Linear(32, 32)
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.fc1(x)))
        y = self.drop(torch.relu(self.fc2(h)))
        y = torch.tanh(self.fc3(y))
        return self.out(y + h)


class DeepMLP(nn.Module):
    """No BatchNorm or Dropout, so microbatched pipelines equal full-batch training exactly."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(64, width)
        self.h1 = nn.Linear(width, width)
        self.h2 = nn.Linear(width, width)
        self.h3 = nn.Linear(width, width)
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.flatten(1)
        a = torch.relu(self.inp(x))
        b = torch.relu(self.h1(a))
        c = torch.relu(self.h2(b)) + a
        d = torch.tanh(self.h3(c))
        return self.head(d)


def skipnet(dropout: float = 0.3) -> nn.Module:
    return SkipNet(dropout)


def deep_mlp(width: int = 32) -> nn.Module:
    return DeepMLP(width)


def blobs(n: int = 512, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=gen)
    y = (x[:, :4].argmax(1)).long()
    return TensorDataset(x[: n * 3 // 4], y[: n * 3 // 4]), TensorDataset(x[n * 3 // 4:],
                                                                           y[n * 3 // 4:])


def broken_data() -> tuple[TensorDataset, TensorDataset]:
    raise RuntimeError("dataset shard missing on this provider")


def data_missing_on_providers() -> tuple[TensorDataset, TensorDataset]:
    """The digits where the job is planned, nothing on the providers the local runner starts (a
    failure no check before the workers start can see)."""
    from ravnest.examples.digits import datasets
    from ravnest.run.metadata import RUNNER_PID_ENV

    if os.environ.get(RUNNER_PID_ENV):
        raise RuntimeError("dataset shard missing on this provider")
    return datasets()
