"""Small LightningModules for the callback tests and the LightningCLI test (synthetic data only)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

try:
    import lightning.pytorch as L
except ImportError:  # pragma: no cover - the tests install lightning
    import pytorch_lightning as L  # type: ignore[no-redef]


class Indices(Dataset):
    def __init__(self, n: int = 4096) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class Regressor(L.LightningModule):
    """Linear -> ReLU -> Linear -> ReLU -> Linear on a synthetic teacher task."""

    def __init__(self, width: int = 32, lr: float = 1e-3, dead_first_layer: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1))
        if dead_first_layer:
            with torch.no_grad():
                self.net[0].bias.fill_(-100.0)
        g = torch.Generator().manual_seed(1)
        self.register_buffer("teacher", torch.randn(8, 1, generator=g))

    def batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(int(idx[0]))
        x = torch.randn(len(idx), 8, generator=g).to(self.device)
        return x, torch.tanh(x @ self.teacher)

    def training_step(self, idx: torch.Tensor, batch_idx: int) -> torch.Tensor:
        x, y = self.batch(idx)
        return nn.functional.mse_loss(self.net(x).float(), y)

    def validation_step(self, idx: torch.Tensor, batch_idx: int) -> None:
        x, y = self.batch(idx)
        self.log("val_loss", nn.functional.mse_loss(self.net(x).float(), y))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self):
        return DataLoader(Indices(), batch_size=16)

    def val_dataloader(self):
        return DataLoader(Indices(64), batch_size=16)


class RankSplitModel(L.LightningModule):
    """A fixed identity layer before a ReLU; each rank feeds it inputs that kill different units.

    On rank 0 units 0-7 get only negative inputs, on rank 1 units 0-3: only
    units 0-3 are dead on both ranks, so the reduced dead fraction is 4/16 while
    rank 0 alone would report 8/16.
    """

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)
        with torch.no_grad():
            self.gate.weight.copy_(torch.eye(16))
            self.gate.bias.zero_()

    def training_step(self, idx: torch.Tensor, batch_idx: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(int(idx[0]) + 1000 * self.global_rank)
        x = torch.rand(len(idx), 16, generator=g) + 0.1
        negative = 8 if self.global_rank == 0 else 4
        x[:, :negative] *= -1
        return self.head(torch.relu(self.gate(x))).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self):
        return DataLoader(Indices(256), batch_size=8)


class TinyGAN(L.LightningModule):
    """A generator and a discriminator, each with its own optimizer (manual optimisation, as
    Lightning's GAN example): two optimizer steps per batch, the generator's first."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        self.discriminator = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))

    def training_step(self, idx: torch.Tensor, batch_idx: int) -> None:
        opt_g, opt_d = self.optimizers()
        g = torch.Generator().manual_seed(int(idx[0]))
        real = torch.randn(len(idx), 8, generator=g) * 0.5 + 1.0
        z = torch.randn(len(idx), 4, generator=g)
        ones, zeros = torch.ones(len(idx), 1), torch.zeros(len(idx), 1)
        bce = nn.functional.binary_cross_entropy_with_logits
        fake = self.generator(z)
        opt_g.zero_grad()
        self.manual_backward(bce(self.discriminator(fake), ones))
        opt_g.step()
        opt_d.zero_grad()
        self.manual_backward(bce(self.discriminator(real), ones) + bce(self.discriminator(fake.detach()), zeros))
        opt_d.step()

    def configure_optimizers(self):
        return [torch.optim.Adam(self.generator.parameters(), lr=1e-3),
                torch.optim.Adam(self.discriminator.parameters(), lr=1e-3)]  # fmt: skip

    def train_dataloader(self):
        return DataLoader(Indices(256), batch_size=8)
