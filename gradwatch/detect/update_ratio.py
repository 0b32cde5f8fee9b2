"""The update-ratio rule: weights that change by more than ``update_ratio_max`` of their norm at
``update_ratio_steps`` consecutive optimizer steps (streaks carry across windows)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..alerts import Finding
from ..config import HealthConfig
from ..flush.window import Window

CLEAR = 0.5  # clearly healthy: the ratio at most half its limit


class UpdateRatioRule:
    """Measured exactly at each layer's two measured steps per window, and estimated at every step
    from a fixed sample of each matrix, so that a learning rate far too high for a few steps is
    seen wherever those steps fall in the window.

    Args:
        config: the thresholds (``update_ratio_max``, ``update_ratio_steps``, ``update_ratio_min_weight_rms``).
        layers: the layer names.
    """

    def __init__(self, config: HealthConfig, layers: list[str]) -> None:
        self.config, self.layers = config, layers
        # consecutive measured steps above the limit, exact and estimated
        self.streaks = {"update_streak": np.zeros(len(layers), dtype=np.int64),
                        "estimate_streak": np.zeros(len(layers), dtype=np.int64)}  # fmt: skip

    def judge(self, w: Window, findings: list[Finding], clear: set[tuple[str, str]]) -> None:
        """Append the window's findings; ``clear`` gets the clearly healthy layers."""
        calm = np.ones(len(self.layers), dtype=bool)
        measured_any = np.zeros(len(self.layers), dtype=bool)
        flagged = np.zeros(len(self.layers), dtype=bool)
        sources = []
        if w.judged_update_ratio is not None:
            sources.append(("update_streak", w.update_steps, w.judged_update_ratio, w.judged_weight_rms,
                            "measured steps"))  # fmt: skip
        if w.estimated_update_ratio is not None:
            sources.append(("estimate_streak", w.steps, w.estimated_update_ratio, w.estimated_weight_rms,
                            "steps in a row (estimated from a sample of each matrix)"))  # fmt: skip
        for key, steps, ratio, rms, what in sources:
            ratio, rms = np.asarray(ratio, dtype=np.float64)[: len(steps)], np.asarray(rms)[: len(steps)]
            if not len(ratio):
                continue
            streaks, measured, step_calm = self._streaks(self.streaks[key], ratio, rms)
            calm &= step_calm.all(axis=0)
            measured_any |= measured.any(axis=0)
            reached = streaks >= self.config.update_ratio_steps
            # Each layer's first step at the limit that measured it. A streak carried over from the last
            # window is not reported at a step that did not measure the layer (its ratio there is NaN);
            # a window that never measures it reports nothing, and the tracker keeps the condition
            # (neither present nor clear) until a measured step ends it or finds it again.
            seen = reached & measured
            onset = np.where(seen.any(axis=0) & ~flagged, seen.argmax(axis=0), -1)
            for t, i in sorted((int(t), int(i)) for i, t in enumerate(onset) if t >= 0):
                findings.append(self._finding(i, int(steps[t]), float(ratio[t, i]), int(streaks[t, i]), what))
            flagged |= onset >= 0
            self.streaks[key] = streaks[-1]
        clear.update(("update_ratio", self.layers[i]) for i in np.flatnonzero(calm & measured_any))

    def _streaks(self, start: np.ndarray, ratio: np.ndarray, rms: np.ndarray) -> tuple[np.ndarray, ...]:
        """Measured steps [steps, layers], all at once: each layer's streak after each step (a step
        above the limit adds one, a measured step below it ends the streak, an unmeasured one keeps
        it; ``start``: the streaks before), which steps were measured, and which were clearly calm."""
        cfg = self.config
        with np.errstate(invalid="ignore"):
            measured = np.isfinite(ratio) & (rms >= cfg.update_ratio_min_weight_rms)
            above = measured & (ratio > cfg.update_ratio_max)
            calm = ~measured | (ratio <= CLEAR * cfg.update_ratio_max)
        counted = np.cumsum(above, axis=0)  # steps above the limit so far
        rows = np.arange(len(ratio))[:, None]
        # each step's latest measured step below the limit (-1: none in this window), which ended the streak
        last_end = np.maximum.accumulate(np.where(measured & ~above, rows, -1), axis=0)
        at_end = np.take_along_axis(counted, np.maximum(last_end, 0), axis=0)
        streaks = np.where(last_end >= 0, counted - at_end, start[None, :] + counted)
        return streaks, measured, calm

    def _finding(self, i: int, step: int, ratio: float, streak: int, what: str) -> Finding:
        limit = self.config.update_ratio_max
        return Finding(
            "update_ratio", self.layers[i], step, ratio, limit,
            f"its weights changed by {ratio:.3g} of their norm in one optimizer step, above {limit:g} at "
            f"{streak} {what}: the learning rate is far too high for this layer",
        )  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        return {key: dict(zip(self.layers, (int(s) for s in streak))) for key, streak in self.streaks.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in self.streaks:
            saved = state.get(key, {})
            self.streaks[key] = np.array([int(saved.get(n, 0)) for n in self.layers], dtype=np.int64)
