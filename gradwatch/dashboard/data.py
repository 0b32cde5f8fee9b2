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

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..sinks.scalars import LOG_RMS, PREFIX
from ..sinks.tensorboard import (ALERTS_TAG, LAYERS_TAG, parse_alerts_markdown, parse_layer_types_markdown,
                                parse_layers_markdown)  # fmt: skip

#: The statistics the tab offers, in menu order, with how to draw them.
STATISTICS: dict[str, dict[str, Any]] = {
    LOG_RMS: {"label": "gradient RMS (log10)", "log": False, "heatmap": True},
    "grad_norm": {"label": "grad_norm", "log": True},
    "out_grad_norm": {"label": "out_grad_norm (output gradient)", "log": True},
    "grad_max": {"label": "grad_max (max |g|)", "log": True},
    "dead_fraction": {"label": "dead fraction", "log": False},
    "update_ratio": {"label": "update ratio", "log": True},
    "act_rms": {"label": "activation RMS", "log": True},
    "act_zero_fraction": {"label": "activation zero fraction", "log": False},
    "nonfinite": {"label": "non-finite elements", "log": False},
}
#: Steps a table is downsampled to by default: more columns than a 1280-px screen has pixels for.
DEFAULT_MAX_STEPS = 1000


@dataclass
class RunTable:
    """One statistic of one run: ``values[layer][column]`` (None: not recorded), at ``steps``."""

    layers: list[str]
    steps: list[int]
    values: list[list[float | str | None]]
    stride: int  # steps of the run per column (1: every recorded step)
    alerts: list[dict[str, Any]] = field(default_factory=list)


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
    from ``first`` to ``last`` (default: all), at most ``max_steps`` columns."""
    every = sorted({step for points in series.values() for step, _ in points
                    if (first is None or step >= first) and (last is None or step <= last)})  # fmt: skip
    stride = max(1, math.ceil(len(every) / max(1, max_steps)))
    columns = every[::stride]
    column_of = {step: k // stride for k, step in enumerate(every)}
    grid = np.full((len(layers), len(columns)), np.nan)
    seen = np.zeros(grid.shape, dtype=bool)
    for row, layer in enumerate(layers):
        for step, value in series.get(layer, ()):
            k = column_of.get(step)
            if k is None:
                continue
            if not seen[row, k] or _larger(value, grid[row, k]):
                grid[row, k] = value
            seen[row, k] = True
    values = [[_json_number(v) if s else None for v, s in zip(grid_row, seen_row)]
              for grid_row, seen_row in zip(grid, seen)]  # fmt: skip
    return RunTable(list(layers), [int(s) for s in columns], values, stride)


def _larger(value: float, kept: float) -> bool:
    """Whether ``value`` replaces ``kept`` in a column: a non-finite value always wins, then the
    larger (every statistic is a magnitude or its log10: the largest is the one that alarms)."""
    if not math.isfinite(value):
        return math.isfinite(kept) or math.isnan(value)
    return math.isfinite(kept) and value > kept


def _json_number(value: float) -> float | str:
    """JSON has no NaN or Inf: they travel as the strings "NaN", "Infinity", "-Infinity"."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return float(value)


def text_tags(tags: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The run's ``gradwatch/layers`` and ``gradwatch/alerts`` text tags (add_text appends "/text_summary")."""
    def of(base: str) -> list[str]:
        return [t for t in tags if t == base or t.startswith(base + "/")]

    return of(LAYERS_TAG), of(ALERTS_TAG)
