"""``gradwatch.lightning.GradWatch``: the Lightning callback under the import path LightningCLI
configurations name (implemented in :mod:`gradwatch.integrations.lightning`)."""

from .integrations.lightning import GradWatch, default_logdir

__all__ = ["GradWatch", "default_logdir"]
