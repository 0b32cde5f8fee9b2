"""The nonfinite rule: the first NaN/Inf of a step, named at its origin (forward order, then backward)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..alerts import Finding
from ..flush.window import Window


def judge_window(w: Window, skipped: np.ndarray, layers: list[str], result: Any) -> None:
    """The window's first step with a non-finite value (not a GradScaler skip), as one finding; else
    every layer is clear."""
    out_bad = w.out_seen & ~np.isfinite(w.out_grad_norm)
    # A non-finite sum of squares is a non-finite gradient (finite ones are summed exactly,
    # whatever their size), also on steps where the elements were not counted.
    grad_bad = (w.nonfinite > 0) | out_bad | (w.has_grad & ~np.isfinite(w.grad_norm))
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
