"""LightningCLI entry point for the CLI test: python -m tests.lightning_app.cli fit ..."""

try:
    from lightning.pytorch.cli import LightningCLI
except ImportError:  # pragma: no cover
    from pytorch_lightning.cli import LightningCLI  # type: ignore[no-redef]

from tests.lightning_app.model import Regressor

if __name__ == "__main__":
    LightningCLI(Regressor)
