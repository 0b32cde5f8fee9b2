"""The heatmap's companion image: each layer's declared output statistics over a window.

One panel per statistic of ``registry.OUTPUT_STATISTICS`` (act_rms on a log scale, the zero
fraction on [0, 1]): a horizontal bar per layer, the window's mean over its sampled steps,
layers in the heatmap's order (module order, top to bottom). Drawn when the heatmap is, at the
same size; a layer without a value that window has no bar.

Laid out from scratch, the figure costs 90-190 ms (``tight_layout`` and the text of every layer
name and tick), ten times the heatmap's redraw, and it was drawn at every heatmap: most of a
flush's cost. ``LayerOutputsChart`` lays it out once per (layers, statistics, log-axis range),
like ``heatmap.GradientFlowHeatmap``, and afterwards redraws only the bars and the title over a
saved background. The log axis's range is fixed per layout (the whole decades the values span,
only ever growing), so a bar's length means the same in every image of a run.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..flush.window import Window
from ..registry.outputs import OUTPUT_STATISTICS
from .heatmap import _DPI, _WIDTH_PX, _short, figure_rgb

_LOG_SCALE = {s.name for s in OUTPUT_STATISTICS if s.log_scale}  # drawn on a log axis (magnitudes over decades)
_BAR_COLOUR = "#1f77b4"
# The title is laid out with the widest step numbers a run is likely to reach; drawn per window.
_TITLE = "layer outputs, steps {}-{} (mean of sampled steps)"


def window_means(w: Window) -> dict[str, np.ndarray]:
    """Per declared output statistic, each layer's mean over the window's recorded steps (NaN: none)."""
    means = {}
    for name, table in w.output_stats.items():
        finite = np.isfinite(table)
        counts = finite.sum(axis=0)
        totals = np.where(finite, table, 0.0).sum(axis=0)
        means[name] = np.where(counts > 0, totals / np.maximum(counts, 1), np.nan)
    return means


def bar_lengths(name: str, values: np.ndarray) -> np.ndarray:
    """The drawn length of each layer's bar: 0 (no bar) where there is no value, or none a log axis can show."""
    shown = np.isfinite(values) & ((values > 0) | (name not in _LOG_SCALE))
    return np.where(shown, values, 0.0)


def _decades(means: dict[str, np.ndarray]) -> dict[str, tuple[float, float]]:
    """Per log-scale statistic, the whole decades its positive values span, with at least 0.3 of a
    decade below the smallest (so that its bar is seen: bars start at the axis's left end)."""
    spans = {}
    for name, values in means.items():
        if name not in _LOG_SCALE:
            continue
        positive = values[np.isfinite(values) & (values > 0)]
        if positive.size:
            logs = np.log10(positive)
            spans[name] = (float(math.floor(logs.min() - 0.3)), float(math.ceil(logs.max())))
    return spans


class LayerOutputsChart:
    """Renders windows' output statistics to RGB images, reusing one matplotlib figure while it fits."""

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._ranges: dict[str, tuple[float, float]] = {}  # log10 x-limits of each log-scale panel
        self._figure: Any = None
        self._panels: list[tuple[str, Any, list[Any]]] = []  # (statistic, axes, its bars)
        self._title: Any = None
        self._background: Any = None
        self.full_draws = 0  # how many times the whole figure was laid out and drawn

    def render(self, w: Window) -> np.ndarray | None:
        """An RGB image (H, W, 3, uint8), or None when the window has no output statistics;
        ImportError without matplotlib."""
        import matplotlib  # noqa: F401  (fail early and cleanly without it)

        means = window_means(w)
        if not means or not w.layers or not any(np.isfinite(v).any() for v in means.values()):
            return None
        if self._needs_layout(w, means):
            self._layout(w, list(means))
        self._draw_changing_parts(w, means)
        return figure_rgb(self._figure)

    def _needs_layout(self, w: Window, means: dict[str, np.ndarray]) -> bool:
        """Whether the figure must be laid out anew (other layers or statistics, or a log value
        outside its panel's range); updates the ranges when it must (whole decades around the
        values, so that bars of one decade differ visibly; a range only grows, so that a run moving
        back and forth settles)."""
        key = (tuple(w.layers), tuple(means))
        spans = _decades(means)
        inside = all(
            name in self._ranges and self._ranges[name][0] <= low and high <= self._ranges[name][1]
            for name, (low, high) in spans.items()
        )  # fmt: skip
        if key == self._key and inside:
            return False
        ranges = {} if key != self._key else self._ranges
        for name in means:
            if name not in _LOG_SCALE:
                continue
            low, high = spans.get(name, (-1.0, 0.0))
            if name in ranges:
                low, high = min(low, ranges[name][0]), max(high, ranges[name][1])
            ranges[name] = (low, high)
        self._key, self._ranges = key, ranges
        return True

    def _layout(self, w: Window, names: list[str]) -> None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure  # no pyplot: no global state

        n_layers = len(w.layers)
        label_every = max(1, math.ceil(n_layers / 40))
        height = 1.6 + 0.15 * min(n_layers, 40)
        figure = Figure(figsize=(_WIDTH_PX / _DPI, height), dpi=_DPI)
        canvas = FigureCanvasAgg(figure)
        axes_list = figure.subplots(1, len(names), sharey=True, squeeze=False)[0]
        rows = np.arange(n_layers)
        self._panels = []
        for axes, name in zip(axes_list, names):
            bars = axes.barh(rows, np.ones(n_layers), color=_BAR_COLOUR, height=0.8)  # widths set per window
            if name in _LOG_SCALE:
                from matplotlib.ticker import LogLocator, NullFormatter

                axes.set_xscale("log")
                axes.xaxis.set_major_locator(LogLocator(numticks=4))
                axes.xaxis.set_minor_formatter(NullFormatter())
                low, high = self._ranges[name]
                axes.set_xlim(10.0**low, 10.0**high)
            else:
                axes.set_xlim(0.0, 1.0)
            axes.set_title(name, fontsize=8)
            axes.tick_params(which="both", labelsize=6)
            self._panels.append((name, axes, list(bars)))
        first = axes_list[0]
        first.set_yticks(rows[::label_every])
        first.set_yticklabels([_short(n) for n in w.layers[::label_every]], fontsize=7)
        first.set_ylim(n_layers - 0.5, -0.5)  # module order from the top, as in the heatmap
        self._title = figure.suptitle(_TITLE.format(9999999, 9999999), fontsize=8)
        figure.tight_layout()
        # Animated artists are left out of canvas.draw(): the background is everything else,
        # saved once; each image is the background with the bars, the frames and the title on top.
        for artist in self._animated():
            artist.set_animated(True)
        canvas.draw()
        self._background = canvas.copy_from_bbox(figure.bbox)
        self._figure = figure
        self.full_draws += 1

    def _animated(self) -> list[Any]:
        artists = [self._title]
        for _, axes, bars in self._panels:
            artists += [*bars, *axes.spines.values()]
        return artists

    def _draw_changing_parts(self, w: Window, means: dict[str, np.ndarray]) -> None:
        figure = self._figure
        figure.canvas.restore_region(self._background)
        for name, axes, bars in self._panels:
            for bar, length in zip(bars, bar_lengths(name, means[name]).tolist()):
                bar.set_width(length)
                axes.draw_artist(bar)
            for spine in axes.spines.values():  # over the bars' ends, as in a full draw
                axes.draw_artist(spine)
        self._title.set_text(_TITLE.format(w.steps[0], w.steps[-1]))
        figure.draw_artist(self._title)
