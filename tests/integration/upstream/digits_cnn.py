"""The model of the digits example, as a Ravnest user writes it: a small CNN, without dropout so
that a single-process run can reproduce the pipeline's training exactly."""

import torch
from torch import nn


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1, bias=False)  # BatchNorm follows
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.flatten = nn.Flatten()
        self.dense1 = nn.Linear(32 * 16, 64)
        self.dense2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        x = torch.relu(self.dense1(self.flatten(x)))
        return torch.softmax(self.dense2(x), dim=1)
