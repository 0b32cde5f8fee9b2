"""What the gradwatch tab shows, read from the event files gradwatch writes (through TensorBoard's
data provider, so the tab sees exactly what the Scalars and Text tabs see).

Every per-layer statistic is a scalar tag ``gradwatch/<stat>/<layer>``; the layers (in module order,
with their module types) and the alerts are JSON inside the ``gradwatch/layers`` and
``gradwatch/alerts`` texts (``sinks/tensorboard.py``). A run's table for one statistic is
layers x steps, downsampled on the server to at most ``max_steps`` columns: each column keeps the
largest value among the steps it covers (an explosion or a NaN is never averaged away; a zero
gradient shows only where every step of the column had one), and NaN/Inf stay visible as such.
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..registry.statistics import all_statistics as _declared
from ..sinks.scalars import LOG_RMS, PREFIX
from ..sinks.tensorboard import (ALERTS_TAG, LAYERS_TAG, is_text_tag, parse_alerts_markdown,
                                parse_layer_types_markdown, parse_layers_markdown)  # fmt: skip

# The tab's menu: the gradient's magnitudes first, the counts last.
_MENU_ORDER = sorted((s for s in _declared() if s.written), key=lambda s: s.name == "nonfinite")

#: The statistics the tab offers, in menu order, with how to draw them (registry/statistics.py).
STATISTICS: dict[str, dict[str, Any]] = {
    LOG_RMS: {"label": "gradient RMS (log10)", "log": False, "heatmap": True},
    **{s.name: {"label": s.label or s.name, "log": s.log_scale} for s in _MENU_ORDER},
}
#: Steps a table is downsampled to by default: more columns than a 1280-px screen has pixels for.
DEFAULT_MAX_STEPS = 1000


@dataclass
class RunTable:
    """One statistic of one run: ``grid[layer, column]`` (float64; NaN/Inf as recorded) where
    ``recorded``, at ``steps``; ``values`` is the same as lists (None: not recorded)."""

    layers: list[str]
    steps: list[int]
    grid: np.ndarray
    recorded: np.ndarray  # bool, the grid's shape
    stride: int  # steps of the run per column (1: every recorded step)

    @property
    def values(self) -> list[list[float | str | None]]:
        return [[_json_number(v) if r else None for v, r in zip(row, seen)]
                for row, seen in zip(self.grid.tolist(), self.recorded.tolist())]  # fmt: skip

    def encoded(self) -> dict[str, Any]:
        """The grid for the page: little-endian float32 (what TensorBoard stores) and a byte per
        cell, 1 where recorded, both base64: a 500 x 1280 table is 3.4 MB, not 10 MB of JSON."""
        return {"shape": list(self.grid.shape),
                "float32": base64.b64encode(self.grid.astype("<f4").tobytes()).decode(),
                "recorded": base64.b64encode(self.recorded.astype(np.uint8).tobytes()).decode()}  # fmt: skip


def decode(encoded: dict[str, Any]) -> list[list[float | str | None]]:
    """:meth:`RunTable.encoded` back into lists (what the page decodes; for tests and scripts)."""
    shape = tuple(encoded["shape"])
    grid = np.frombuffer(base64.b64decode(encoded["float32"]), dtype="<f4").astype(np.float64).reshape(shape)
    recorded = np.frombuffer(base64.b64decode(encoded["recorded"]), dtype=np.uint8).reshape(shape) > 0
    return RunTable([], [], grid, recorded, 1).values


def stat_and_layer(tag: str) -> tuple[str, str] | None:
    """``gradwatch/<stat>/<layer>`` -> (stat, layer); None for global tags and anything else."""
    if not tag.startswith(PREFIX + "/"):
        return None
    stat, _, layer = tag[len(PREFIX) + 1 :].partition("/")
    if not layer or stat == "global":
        return None
    return stat, layer


def run_index(scalar_tags: dict[str, Any]) -> dict[str, Any]:
    """What a run holds: its layers per statistic, the statistics present (in menu order)."""
    per_stat: dict[str, list[str]] = {}
    for tag in scalar_tags:
        parsed = stat_and_layer(tag)
        if parsed is not None:
            per_stat.setdefault(parsed[0], []).append(parsed[1])
    return {"stats": [s for s in STATISTICS if s in per_stat] + sorted(s for s in per_stat if s not in STATISTICS),
            "layers": per_stat}  # fmt: skip


def layer_info(text: str) -> tuple[list[str], dict[str, str]]:
    """The layers in module order and their module types, from the ``gradwatch/layers`` text."""
    return parse_layers_markdown(text), parse_layer_types_markdown(text)


def alerts_of(texts: list[str]) -> list[dict[str, Any]]:
    """Every alert in the ``gradwatch/alerts`` texts, in step order, each once."""
    seen, alerts = set(), []
    for text in texts:
        for alert in parse_alerts_markdown(text):
            key = (alert.get("kind"), alert.get("layer"), alert.get("step"))
            if key not in seen:
                seen.add(key)
                alerts.append(alert)
    alerts.sort(key=lambda a: (a.get("step", 0), a.get("kind", ""), a.get("layer", "")))
    return alerts


def table(series: dict[str, list[tuple[int, float]]], layers: list[str], max_steps: int,
          first: int | None = None, last: int | None = None) -> RunTable:  # fmt: skip
    """Layers x steps for one statistic from each layer's ``(step, value)`` points, over the steps
    from ``first`` to ``last`` (default: all), at most ``max_steps`` columns, each the largest value
    of the steps it covers (NaN wins over any number, +Inf over any finite one)."""
    rows, steps, values = [], [], []
    for row, layer in enumerate(layers):
        points = series.get(layer, ())
        rows.extend([row] * len(points))
        steps.extend(step for step, _ in points)
        values.extend(value for _, value in points)
    at_row = np.array(rows, dtype=np.int64)
    at_step = np.array(steps, dtype=np.int64)
    value = np.array(values, dtype=np.float64)
    keep = np.ones(len(at_step), dtype=bool)
    if first is not None:
        keep &= at_step >= first
    if last is not None:
        keep &= at_step <= last
    at_row, at_step, value = at_row[keep], at_step[keep], value[keep]
    every = np.unique(at_step)
    stride = max(1, math.ceil(len(every) / max(1, max_steps)))
    column = np.searchsorted(every, at_step) // stride
    shape = (len(layers), len(every[::stride]))
    grid = np.full(shape, -np.inf)
    np.maximum.at(grid, (at_row, column), np.where(np.isnan(value), -np.inf, value))
    nan = np.zeros(shape, dtype=bool)
    np.logical_or.at(nan, (at_row, column), np.isnan(value))
    recorded = np.zeros(shape, dtype=bool)
    recorded[at_row, column] = True
    grid[nan | ~recorded] = np.nan
    return RunTable(list(layers), [int(s) for s in every[::stride]], grid, recorded, stride)


def _json_number(value: float) -> float | str:
    """JSON has no NaN or Inf: they travel as the strings "NaN", "Infinity", "-Infinity"."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return float(value)


def text_tags(tags: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The run's ``gradwatch/layers`` and ``gradwatch/alerts`` text tags (add_text appends "/text_summary")."""
    return [t for t in tags if is_text_tag(t, LAYERS_TAG)], [t for t in tags if is_text_tag(t, ALERTS_TAG)]
