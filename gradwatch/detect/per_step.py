"""Judging every step as soon as its values reach the host: ``nonfinite`` and the model's ``exploding``.

The step's values come from a lagged read-back (``flush.readback``) that never waits for the
device between flushes; at a flush, the last steps of the window are read with the window.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from ..alerts import Alert
from ..failures import FailureLog
from ..flush.readback import StepReadback, forward_order, silent_layers, summarize
from .checks import HealthChecks
from .tracker import AlertTracker


class StepJudge:
    """The per-step checks of one monitor.

    Args:
        readback: the lagged copy of each step's row to the host.
        layout: the rank's buffer layout (what a row holds).
        checks: the health checks whose per-step rules judge each step.
        tracker: where findings become alerts (onsets only).
        failures: where a failure of these checks is reported (they never raise into training).
        scaler_enabled: whether a GradScaler is active now (a skipped step is its calibration).
    """

    def __init__(self, readback: StepReadback, layout: Any, checks: HealthChecks, tracker: AlertTracker,
                 failures: FailureLog, scaler_enabled: Callable[[], bool]) -> None:  # fmt: skip
        self._readback = readback
        self._layout = layout
        self._checks = checks
        self._tracker = tracker
        self._failures = failures
        self._scaler_enabled = scaler_enabled
        self._window_order: list[int] = []  # the window's latest forward order
        #: a layer that had a gradient fell silent at a judged step (all its units dead at once):
        #: the pipeline then records the rest of the window in full, on fresh dead-unit evidence
        self.fell_silent: np.ndarray | None = None
        self._silent: np.ndarray | None = None  # [L] layers silent at the last judged step (None: none)

    def judge(self, slot: int | None, steps: list[int], wait: bool = False) -> list[Alert]:
        """Judge the steps whose values are on the host (``slot``: the step just recorded, whose copy
        starts now; ``steps``: the window's step numbers by slot). Returns the new alerts."""
        try:
            if slot is not None:
                self._readback.capture(slot)
            findings = []
            scaler = self._scaler_enabled()
            for values in self._readback.ready(wait=wait):
                if values.order is not None:
                    self._window_order = forward_order(values.order)
                summary = summarize(values, self._layout)
                silent = None
                if summary.zero_grad and not values.failed:
                    silent = silent_layers(values, self._layout)
                    fell = silent if self._silent is None else silent & ~self._silent  # silent now, not before
                    fell = self._checks.dead.fell_silent(fell, self._layout.unit_count, self._checks.vanishing.rms_peak)
                    self.fell_silent = fell if self.fell_silent is None else self.fell_silent | fell
                self._silent = silent
                if values.failed or values.slot >= len(steps):
                    continue
                findings += self._checks.judge_step(steps[values.slot], summary, self._window_order, scaler)
            return self._tracker.raise_onsets(findings) if findings else []
        except Exception as exc:  # never break a run
            self._failures.failed("the per-step checks", exc)
            return []

    def judge_calm(self, slot: int, steps: list[int], total_sq: float) -> list[Alert]:
        """:meth:`judge` for an unsampled step whose parameter gradients the recorder already found all
        present, finite and not tiny on the host (``Recorder.calm_total``: their sum of squares,
        ``total_sq``). Then the step is what ``flush.readback.summarize`` calls calm when its
        forward sums are finite too (an unsampled step records no output-gradient statistics or
        non-finite counts): judged from ``total_sq`` and the forward row, without staging the row's
        values (each call right after backward costs microseconds). Otherwise, the full judgement."""
        try:
            forward = self._readback.host_forward
            if forward is None or not math.isfinite(total_sq + sum(forward[slot].tolist())):
                return self.judge(slot, steps)
            self._silent = None  # no gradient was zero: no layer silent at this step
            finding = self._checks.judge_model_step(steps[slot], math.sqrt(total_sq))
            return self._tracker.raise_onsets([finding]) if finding is not None else []
        except Exception as exc:  # never break a run
            self._failures.failed("the per-step checks", exc)
            return []

    def finish_window(self, steps: list[int]) -> list[Alert]:
        """At a flush: judge the window's last steps (the flush waits for the device anyway)."""
        try:
            return self.judge(None, steps, wait=True)
        finally:
            self._readback.clear()
