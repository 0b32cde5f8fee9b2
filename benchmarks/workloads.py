"""The benchmark workloads: synthetic data, a model, a loss, and an optimizer factory."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn


@dataclass
class Workload:
    name: str
    make_model: Callable[[], nn.Module]
    make_batch: Callable[[torch.device], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def mlp(depth: int = 8, width: int = 512, batch: int = 256) -> Workload:
    def make_model() -> nn.Module:
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(width, 10))

    def make_batch(device: torch.device):
        return torch.randn(batch, width, device=device), torch.randint(0, 10, (batch,), device=device)

    return Workload(f"mlp{depth}x{width}", make_model, make_batch, nn.functional.cross_entropy)


class _Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity  # the in-place residual that breaks full backward hooks
        return self.relu(out)


def resnet(batch: int = 32) -> Workload:
    def make_model() -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(inplace=True),
            _Block(32), _Block(32),
            nn.Conv2d(32, 64, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
            _Block(64), _Block(64),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10),
        )  # fmt: skip

    def make_batch(device: torch.device):
        return torch.randn(batch, 3, 32, 32, device=device), torch.randint(0, 10, (batch,), device=device)

    return Workload("resnet-cnn", make_model, make_batch, nn.functional.cross_entropy)


class _Encoder(nn.Module):
    def __init__(self, d_model: int, layers: int) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model, 4, 4 * d_model, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).mean(1))


def transformer(d_model: int = 256, seq: int = 64, batch: int = 16, layers: int = 4) -> Workload:
    def make_batch(device: torch.device):
        return torch.randn(batch, seq, d_model, device=device), torch.randint(0, 10, (batch,), device=device)

    return Workload("transformer", lambda: _Encoder(d_model, layers), make_batch, nn.functional.cross_entropy)


def standard() -> list[Workload]:
    return [mlp(), resnet(), transformer()]
