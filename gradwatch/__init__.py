"""gradwatch: a gradient-health monitor for PyTorch training loops."""

from .alerts import Alert, GradientHealthError
from .config import HealthConfig
from .monitor import GradMonitor

__all__ = ["GradMonitor", "GradWatch", "HealthConfig", "Alert", "GradientHealthError"]
__version__ = "0.1.0"


def __getattr__(name: str):  # the Lightning adapter imports Lightning only when asked for
    if name == "GradWatch":
        from .integrations.lightning import GradWatch

        return GradWatch
    raise AttributeError(f"module 'gradwatch' has no attribute {name!r}")
