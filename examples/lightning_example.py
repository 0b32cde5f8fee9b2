"""A LightningModule trained with GradWatch and a TensorBoardLogger.

    python examples/lightning_example.py [--logdir runs] [--steps 300]
"""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

try:
    import lightning.pytorch as L
    from lightning.pytorch.loggers import TensorBoardLogger
except ImportError:  # only pytorch_lightning installed
    import pytorch_lightning as L
    from pytorch_lightning.loggers import TensorBoardLogger

from gradwatch import GradWatch


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
            nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4),
        )  # fmt: skip

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def synthetic(n: int) -> TensorDataset:
    """Four noisy prototype images, one per class (no downloads)."""
    g = torch.Generator().manual_seed(0)
    protos = torch.randn(4, 1, 12, 12, generator=g)
    y = torch.randint(0, 4, (n,), generator=g)
    return TensorDataset(protos[y] + 0.5 * torch.randn(n, 1, 12, 12, generator=g), y)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--logdir", default="runs")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    watch = GradWatch(flush_every=25)
    trainer = L.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        callbacks=[watch],
        logger=TensorBoardLogger(args.logdir, name="lightning-example"),
        val_check_interval=100,
        enable_progress_bar=False,
    )
    trainer.fit(Classifier(), DataLoader(synthetic(4096), batch_size=32), DataLoader(synthetic(256), batch_size=64))
    print(f"{len(watch.alerts)} alert(s); tensorboard --logdir {args.logdir}")


if __name__ == "__main__":
    main()
