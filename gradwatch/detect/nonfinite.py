"""The nonfinite rule: the first NaN/Inf of a step, named at its origin (forward order, then backward)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..alerts import Finding
from ..flush.window import Window


class ScalerSkips:
    """Consecutive optimizer steps a GradScaler skipped (non-finite gradients): normal calibration
    while it recovers, a ``nonfinite`` alert once ``limit`` steps in a row were skipped (the scale
    fell by 2**limit and the gradients are still not finite: the NaN is real).

    Args:
        limit: ``HealthConfig.scaler_skips_max``.
        layers: the layer names.
    """

    def __init__(self, limit: int, layers: list[str]) -> None:
        self.limit, self.layers = limit, layers
        self.streak = 0
        self.first_origin: Finding | None = None  # the first skipped step of the streak, named at its origin

    def step(self, step: int, skipped: bool, grad_bad: np.ndarray, order: list[int], count: float) -> Finding | None:
        """One optimizer step; the finding when this step makes the streak reach the limit."""
        if not skipped:
            self.streak, self.first_origin = 0, None
            return None
        self.streak += 1
        if self.first_origin is None:
            self.first_origin = nonfinite_finding(self.layers, step, np.zeros_like(grad_bad), grad_bad, order, count)
        if self.streak != self.limit:
            return None
        origin = self.first_origin
        return Finding(
            "nonfinite", origin.layer, step, float(self.streak), float(self.limit),
            f"the GradScaler skipped {self.streak} optimizer steps in a row (its scale fell by 2^{self.streak} and "
            f"the gradients stayed non-finite: not a calibration); first at step {origin.step}, {origin.detail}",
        )  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        return {"scaler_skip_streak": self.streak}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.streak = int(state.get("scaler_skip_streak", 0))


def bad_gradients(w: Window) -> np.ndarray:
    """[step, layer] a parameter or output gradient was non-finite. A non-finite sum of squares is a
    non-finite gradient (finite ones are summed exactly, whatever their size), also on steps where
    the elements were not counted."""
    out_bad = w.out_seen & ~np.isfinite(w.out_grad_norm)
    return (w.nonfinite > 0) | out_bad | (w.has_grad & ~np.isfinite(w.grad_norm))


def judge_window(w: Window, skipped: np.ndarray, layers: list[str], result: Any) -> None:
    """The window's first step with a non-finite value (not a GradScaler skip), as one finding; else
    every layer is clear."""
    grad_bad = bad_gradients(w)
    fwd_bad = w.fwd_nonfinite
    for t in range(len(w.steps)):
        if not (fwd_bad[t].any() or grad_bad[t].any()):
            continue
        if skipped[t] and not fwd_bad[t].any():
            continue  # a GradScaler skip, reported as such
        fwd_order = w.step_orders[t][0] if t < len(w.step_orders) else []
        counted = w.nonfinite_counted is None or bool(w.nonfinite_counted[t])
        count = float(np.nansum(w.nonfinite[t])) if counted else 0.0
        result.findings.append(nonfinite_finding(w.layers, w.steps[t], fwd_bad[t], grad_bad[t], fwd_order, count))
        return
    result.clear.update(("nonfinite", name) for name in layers + [""])


def nonfinite_finding(layers: list[str], step: int, fwd_bad: np.ndarray, grad_bad: np.ndarray, fwd_order: list[int],
                       count: float) -> Finding:  # fmt: skip
    """The one nonfinite finding of a step: its origin is the first layer in forward order whose
    output was non-finite, else the first in backward order (the forward order reversed) whose
    gradient was. The value: non-finite gradient elements counted, else the layers affected."""
    if fwd_bad.any():
        origin = _first_in(fwd_order, fwd_bad)
        detail = f"origin: first non-finite forward output, in layer {layers[origin]}"
    else:
        origin = _first_in(list(reversed(fwd_order)), grad_bad, reverse_default=True)
        detail = f"origin: first non-finite gradient in backward order, in layer {layers[origin]}"
    if count == 0:
        count = float(np.sum(fwd_bad | grad_bad))
    return Finding("nonfinite", layers[origin], step, count, 0.0, detail)


def _first_in(order: list[int], mask: np.ndarray, reverse_default: bool = False) -> int:
    for i in order:
        if mask[i]:
            return int(i)
    hits = np.flatnonzero(mask)
    return int(hits[-1] if reverse_default else hits[0])
