"""A flushed window as scalars: (step, [(tag, value), ...]) for every step it describes.

The one place that decides which value is written where: each statistic at the steps
where it was recorded (grad_max and output-gradient statistics on sampled steps with
detail="standard"), window statistics at the window's last step, update ratios at the
optimizer steps they were measured.
"""

from __future__ import annotations

import numpy as np

from ..flush.window import Window
from ..registry.statistics import written

PREFIX = "gradwatch"
#: The dashboard's magnitude view: log10 of the gradient RMS (grad_norm / sqrt(#elements)).
LOG_RMS = "log10_grad_rms"
#: A zero gradient is drawn at this log10 value, a line far below every real one (a dead or
#: vanished layer stays on the chart instead of disappearing from it).
LOG_RMS_FLOOR = -30.0


def tag(stat: str, layer: str) -> str:
    """The tag of a statistic: gradwatch/<stat>/<layer> or gradwatch/global/<stat>."""
    return f"{PREFIX}/global/{stat}" if layer == "" else f"{PREFIX}/{stat}/{layer}"


def window_scalars(w: Window, total_alerts: int, dashboard: bool = False) -> list[tuple[int, list[tuple[str, float]]]]:
    """Every scalar of a window, grouped by the step it describes, in step order.

    ``dashboard``: also the log10 gradient-RMS series the TensorBoard layout charts (a
    vanishing layer sits decades below the others instead of flat on zero).
    """
    out: list[tuple[int, list[tuple[str, float]]]] = []
    per_step = {  # each statistic where it was recorded (registry/statistics.py)
        s.name: (table, s.recorded(table, w))
        for s in written("step") if (table := w.table(s.name)) is not None
    }
    if dashboard:
        with np.errstate(divide="ignore", invalid="ignore"):
            log_rms = np.log10(np.maximum(w.grad_rms, 10.0**LOG_RMS_FLOOR))  # NaN stays NaN: not written
        per_step[LOG_RMS] = (log_rms, w.has_grad & np.isfinite(log_rms))
    # Python lists made once per table: the loop below runs for every value of the window at
    # each flush, and indexing numpy arrays value by value cost the MLP's flush ~1.5 ms.
    tables = [([tag(stat, name) for name in w.layers], table.tolist(), np.asarray(mask, dtype=bool).tolist())
              for stat, (table, mask) in per_step.items()]  # fmt: skip
    has_grad = w.has_grad.any(axis=1).tolist()  # the global norm exists exactly then
    global_norm = w.global_grad_norm.tolist()
    counted = [True] * len(w.steps) if w.nonfinite_counted is None else np.asarray(w.nonfinite_counted).tolist()
    nonfinite = np.nansum(w.nonfinite, axis=1).tolist()
    last = len(w.steps) - 1
    for t, step in enumerate(w.steps):
        values: list[tuple[str, float]] = []
        for row_tags, rows, masks in tables:
            values += [(name, value) for name, value, kept in zip(row_tags, rows[t], masks[t]) if kept]
        if has_grad[t]:
            values.append((tag("grad_norm", ""), global_norm[t]))
            if counted[t]:
                values.append((tag("nonfinite", ""), nonfinite[t]))
        if t == last:
            for statistic in written("window"):
                table = w.table(statistic.name)
                values.extend((tag(statistic.name, w.layers[i]), float(table[i])) for i in np.flatnonzero(np.isfinite(table)))
            values.append((tag("alerts", ""), float(total_alerts)))
            if w.skipped is not None:
                values.append((tag("skipped_steps", ""), float(w.skipped.sum())))
        out.append((int(step), values))
    for statistic in written("update"):
        table = w.table(statistic.name)
        for t, step in enumerate(w.update_steps if table is not None else ()):
            row = table[t]
            values = [(tag(statistic.name, w.layers[i]), float(row[i])) for i in np.flatnonzero(np.isfinite(row))]
            if values:
                out.append((int(step), values))
    out.sort(key=lambda item: item[0])  # an update measured after the previous window's last step
    return out


def as_dicts(scalars: list[tuple[int, list[tuple[str, float]]]]) -> list[tuple[int, dict[str, float]]]:
    """The same, one dict per step (a step that appears twice is merged). Non-finite values stay:
    a NaN grad_norm is what a tracker should show at that step."""
    merged: dict[int, dict[str, float]] = {}
    for step, values in scalars:
        merged.setdefault(step, {}).update(values)
    return sorted(merged.items())
