"""The detect stage of one monitor, assembled at attach: the rules, the alert tracker, the per-step judge."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import HealthConfig
from ..failures import FailureLog
from ..flush.readback import StepReadback
from ..flush.unit_probe import UnitProbe
from .checks import HealthChecks, normalises_step
from .per_step import StepJudge
from .tracker import AlertTracker


@dataclass
class Detection:
    """The rules (``checks``), where their findings become alerts (``tracker``), and the per-step
    judge (``judge``; ``per_step`` False: every kind is judged at the flush)."""

    checks: HealthChecks
    tracker: AlertTracker
    judge: StepJudge
    per_step: bool
    units_probe: UnitProbe  # the dead-unit evidence of a window's first sampled steps, read mid-window


def assemble(config: HealthConfig, names: list[str], optimizer: Any, recorder: Any, union: bool,
             failures: FailureLog, scaler: Any, is_writer: bool) -> Detection:  # fmt: skip
    """The detect stage for ``names`` (every rank's layers when ``union``).

    nonfinite and the model's exploding are judged at every step, from a read-back that never
    waits for the device; not for sharded parameters (each rank's values are partial until the
    flush's reduction, and a ``stop_on`` decision must be the same on every rank), nor when ranks
    hold different layers (``union``). Dead units are confirmed inside their own window where
    every rank holds the same layers (``flush/unit_probe.py``), in the next one otherwise.
    """
    normalised = config.normalised_optimizer
    if normalised is None:
        normalised = optimizer is not None and normalises_step(optimizer)
    checks = HealthChecks(config, names, normalised_steps=normalised)
    tracker = AlertTracker(config.remind_every, log_alerts=is_writer, recovery_flushes=config.recovery_flushes,
                           layers=names)  # fmt: skip
    readback = StepReadback(recorder.layout, per_step_rows=recorder.per_step_rows)
    per_step = readback.available and not recorder.param_stats.sharded and not union
    checks.model_per_step = per_step
    # the scaler, not the monitor: nothing the hooks reach may keep the monitor alive
    judge = StepJudge(readback, recorder.layout, checks, tracker, failures,
                      lambda: scaler is not None and scaler.is_enabled())  # fmt: skip
    probe = UnitProbe(recorder.layout, config.dead_eps, enabled=not union)
    return Detection(checks, tracker, judge, per_step, probe)
