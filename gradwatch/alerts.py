"""The alert records users see: ``Alert``, ``GradientHealthError``, and a detector's ``Finding``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Alert:
    """One detected gradient-health problem."""

    kind: str  # "vanishing" | "exploding" | "dead_units" | "nonfinite" | "update_ratio"
    layer: str  # "" for the whole model
    step: int
    value: float
    threshold: float
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "layer": self.layer,
            "step": self.step,
            "value": self.value,
            "threshold": self.threshold,
            "message": self.message,
        }


class GradientHealthError(RuntimeError):
    """Raised by GradMonitor when an alert of a kind in ``HealthConfig.stop_on`` fires."""

    def __init__(self, alerts: list[Alert]) -> None:
        self.alerts = alerts
        super().__init__("; ".join(a.message for a in alerts))


@dataclass
class Finding:
    """A condition a detector found in one window (before de-duplication)."""

    kind: str
    layer: str
    step: int
    value: float
    threshold: float
    detail: str = ""


def format_message(f: Finding) -> str:
    where = f"layer {f.layer}" if f.layer else "the whole model"
    text = (
        f"[gradwatch] {f.kind} at step {f.step} in {where}: "
        f"value {f.value:.4g}, threshold {f.threshold:.4g}"
    )
    return f"{text} ({f.detail})" if f.detail else text
