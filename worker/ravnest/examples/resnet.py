"""ResNet-50 in plain torch.nn, with torchvision's architecture and parameter names.

torchvision is not a dependency, but ResNet-50 is the usual yardstick for planning a real vision
model (`bench/planner.py --resnet`, `tests/unit/test_profiling.py`): Bottleneck blocks [3, 4, 6,
3] with expansion 4, the stride on the 3x3 convolution ("ResNet v1.5"), BatchNorm, a
1000-class head, and the same names as `torchvision.models.resnet50()` (conv1, bn1,
layer1.0.conv1, ..., layer1.0.downsample.0, fc): 25,557,032 parameters, so a state_dict saved by
one loads into the other. Initialised as torchvision does (Kaiming normal, fan-out, for the
convolutions; BatchNorm weight 1, bias 0; the Linear layer's own default).

A job names it as ``ravnest.examples.resnet:build_model``.
"""

from __future__ import annotations

import torch
from torch import nn

RESNET50_PARAMETERS = 25_557_032
"""torchvision's resnet50() parameter count; `build_model()` asserts it."""


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride), 1x1 expand by 4, plus the (projected) input."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1,
                 downsample: nn.Module | None = None) -> None:
        super().__init__()
        width = planes
        self.conv1 = nn.Conv2d(inplanes, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)  # type: ignore[no-any-return]


class ResNet(nn.Module):
    """torchvision's ResNet with Bottleneck blocks: stem, four stages, average pool, classifier."""

    def __init__(self, layers: tuple[int, int, int, int] = (3, 4, 6, 3),
                 num_classes: int = 1000) -> None:
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, self.inplanes, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(self.inplanes)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(64, layers[0])
        self.layer2 = self._make_layer(128, layers[1], stride=2)
        self.layer3 = self._make_layer(256, layers[2], stride=2)
        self.layer4 = self._make_layer(512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * Bottleneck.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _make_layer(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        out = planes * Bottleneck.expansion
        if stride != 1 or self.inplanes != out:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, out, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out))
        layers = [Bottleneck(self.inplanes, planes, stride, downsample)]
        self.inplanes = out
        layers += [Bottleneck(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)  # type: ignore[no-any-return]


def build_model(num_classes: int = 1000) -> nn.Module:
    """ResNet-50 (torchvision's `resnet50(num_classes=...)`, untrained)."""
    model = ResNet((3, 4, 6, 3), num_classes=num_classes)
    if num_classes == 1000:
        count = sum(p.numel() for p in model.parameters())
        assert count == RESNET50_PARAMETERS, count
    return model
