"""Alerts: the record, the error, and the onset/reminder/recovery bookkeeping."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

log = logging.getLogger("gradwatch")


@dataclass(frozen=True)
class Alert:
    """One detected gradient-health problem."""

    kind: str  # "vanishing" | "exploding" | "dead_units" | "nonfinite"
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


class AlertTracker:
    """Logs each condition at onset, reminds while it persists, and logs recovery."""

    def __init__(self, remind_every: int, log_alerts: bool = True) -> None:
        self.remind_every = remind_every
        # Distributed runs: every rank tracks the same (reduced) alerts, one rank logs them.
        self._level_offset = 0 if log_alerts else logging.CRITICAL
        self.alerts: list[Alert] = []
        # (kind, layer) -> flushes since the condition was last logged
        self.active: dict[tuple[str, str], int] = {}
        self.callbacks: list[Callable[[Alert], None]] = []

    def update(self, findings: list[Finding], step: int) -> list[Alert]:
        """Take one flush's findings; return the alerts that are new."""
        new: list[Alert] = []
        current: dict[tuple[str, str], Finding] = {}
        for f in findings:
            current.setdefault((f.kind, f.layer), f)
        for key, f in current.items():
            message = format_message(f)
            if key not in self.active:
                alert = Alert(f.kind, f.layer, int(f.step), float(f.value), float(f.threshold), message)
                self.alerts.append(alert)
                new.append(alert)
                self.active[key] = 0
                log.log(self._level(f.kind), message)
            else:
                self.active[key] += 1
                if self.remind_every and self.active[key] >= self.remind_every:
                    self.active[key] = 0
                    log.log(self._level(f.kind), "%s (still present)", message)
        for key in list(self.active):
            if key not in current:
                del self.active[key]
                kind, layer = key
                log.log(
                    self._level("recovery"),
                    "[gradwatch] %s in %s recovered by step %d",
                    kind,
                    f"layer {layer}" if layer else "the whole model",
                    step,
                )
        for alert in new:
            for callback in list(self.callbacks):
                try:
                    callback(alert)
                except Exception as exc:
                    log.warning("gradwatch: alert callback %r failed: %s", callback, exc)
        return new

    def _level(self, kind: str) -> int:
        """ERROR for non-finite values, INFO for recoveries, WARNING otherwise; DEBUG on non-writing ranks."""
        if self._level_offset:
            return logging.DEBUG
        return {"nonfinite": logging.ERROR, "recovery": logging.INFO}.get(kind, logging.WARNING)

    def state_dict(self) -> dict[str, Any]:
        return {
            "alerts": [a.to_dict() for a in self.alerts],
            "active": [[k, layer, n] for (k, layer), n in self.active.items()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.alerts = [Alert(**a) for a in state.get("alerts", [])]
        self.active = {(k, layer): int(n) for k, layer, n in state.get("active", [])}
