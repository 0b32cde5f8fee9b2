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
        flagged: set[int] = set()
        sources = []
        if w.judged_update_ratio is not None:
            exact = list(zip(w.update_steps, w.judged_update_ratio, w.judged_weight_rms))  # type: ignore[arg-type]
            sources.append(("update_streak", exact, "measured steps"))
        if w.estimated_update_ratio is not None:
            estimated = list(zip(w.steps, w.estimated_update_ratio, w.estimated_weight_rms))  # type: ignore[arg-type]
            sources.append(("estimate_streak", estimated, "steps in a row (estimated from a sample of each matrix)"))
        for key, rows, what in sources:
            streak = self.streaks[key]
            for step, ratio, rms in rows:
                streak, measured, step_calm = self._advance(streak, ratio, rms)
                calm &= step_calm
                measured_any |= measured
                for i in np.flatnonzero(streak >= self.config.update_ratio_steps):
                    if int(i) not in flagged:
                        flagged.add(int(i))
                        findings.append(self._finding(int(i), int(step), float(ratio[i]), int(streak[i]), what))
            self.streaks[key] = streak
        clear.update(("update_ratio", self.layers[i]) for i in np.flatnonzero(calm & measured_any))

    def _advance(self, streak: np.ndarray, ratio: np.ndarray, rms: np.ndarray) -> tuple[np.ndarray, ...]:
        """One measured step: a step below the limit ends a streak; unmeasured layers keep theirs."""
        cfg = self.config
        with np.errstate(invalid="ignore"):
            measured = np.isfinite(ratio) & (rms >= cfg.update_ratio_min_weight_rms)
            above = measured & (ratio > cfg.update_ratio_max)
            calm = ~measured | (ratio <= CLEAR * cfg.update_ratio_max)
        return np.where(above, streak + 1, np.where(measured, 0, streak)), measured, calm

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
