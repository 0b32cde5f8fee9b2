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


def deep_mlp(depth: int, width: int = 256, batch: int = 256) -> Workload:
    """``depth`` blocks of Linear + LayerNorm + ReLU (2 monitored layers each), then a head: the
    shape where a monitor's fixed cost per layer shows."""

    def make_model() -> nn.Module:
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(width, 10))

    def make_batch(device: torch.device):
        return torch.randn(batch, width, device=device), torch.randint(0, 10, (batch,), device=device)

    return Workload(f"deep-mlp{depth}x{width}-b{batch}", make_model, make_batch, nn.functional.cross_entropy)


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


#: the standard workloads' makers by the name the benchmark scripts' ``--workload`` takes
BY_NAME = {"mlp": mlp, "cnn": resnet, "transformer": transformer}


# ---------------------------------------------------------------- real architectures
# Built from configs (random weights, no downloads) at batch sizes people train them with.


class _BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock (torchvision itself cannot load beside this torch build)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


def resnet18_model(classes: int = 200) -> nn.Module:
    """ResNet-18 as torchvision builds it (11.3M parameters with a 200-class head)."""
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                               nn.MaxPool2d(3, 2, 1)]  # fmt: skip
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [_BasicBlock(cin, cout, stride), _BasicBlock(cout, cout, 1)]
        cin = cout
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes))


def resnet18(batch: int = 32, size: int = 64) -> Workload:
    """ResNet-18 on 64x64 images (Tiny-ImageNet-sized), batch 32."""

    def make_batch(device: torch.device):
        return torch.randn(batch, 3, size, size, device=device), torch.randint(0, 200, (batch,), device=device)

    return Workload(f"resnet18-{size}px-b{batch}", resnet18_model, make_batch, nn.functional.cross_entropy)


def _gpt2(name: str, layers: int, width: int, heads: int, vocab: int, batch: int, seq: int, **config) -> Workload:
    """A GPT-2 built from transformers' config (random weights, tied embeddings), next-token loss."""

    def make_model() -> nn.Module:
        import transformers

        gpt2 = transformers.GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=width, n_layer=layers, n_head=heads,
                                       bos_token_id=0, eos_token_id=0, **config)  # fmt: skip
        return _LogitsOnly(transformers.GPT2LMHeadModel(gpt2))

    def make_batch(device: torch.device):
        ids = torch.randint(0, vocab, (batch, seq), device=device)
        return ids, ids

    def loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    return Workload(name, make_model, make_batch, loss)


def gpt2_small(batch: int = 4, seq: int = 128) -> Workload:
    """A small GPT-2 (6 layers, d_model 384, 6 heads)."""
    return _gpt2(f"gpt2-6x384-b{batch}x{seq}", 6, 384, 6, 8192, batch, seq)


def gpt2_tiny(batch: int = 8, seq: int = 128, use_cache: bool = False) -> Workload:
    """A tiny GPT-2 (2 layers, d_model 128, 4 heads), for compiled runs: ``use_cache=False`` as the
    Hugging Face Trainer sets it for training; ``use_cache=True`` as a model from ``from_pretrained``
    trains in a plain loop (compiled taps then take output gradients through an autograd function:
    docs/reference.md, "Compiled models")."""
    name = f"gpt2-2x128-b{batch}x{seq}" + ("-kv-cache-on" if use_cache else "")
    return _gpt2(name, 2, 128, 4, 2048, batch, seq, use_cache=use_cache)


def vit_tiny(batch: int = 8, size: int = 224) -> Workload:
    """ViT-Ti/16 from transformers' config (12 layers, hidden 192, 3 heads), 224x224 images."""

    def make_model() -> nn.Module:
        import transformers

        config = transformers.ViTConfig(image_size=size, patch_size=16, hidden_size=192, num_hidden_layers=12,
                                        num_attention_heads=3, intermediate_size=768, num_labels=100)  # fmt: skip
        return _LogitsOnly(transformers.ViTForImageClassification(config))

    def make_batch(device: torch.device):
        return torch.randn(batch, 3, size, size, device=device), torch.randint(0, 100, (batch,), device=device)

    return Workload(f"vit-ti16-{size}px-b{batch}", make_model, make_batch, nn.functional.cross_entropy)


class _LogitsOnly(nn.Module):
    """A Hugging Face model whose forward returns the logits tensor."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x).logits


def real_models() -> list[Workload]:
    return [resnet18(), gpt2_small(), vit_tiny()]
