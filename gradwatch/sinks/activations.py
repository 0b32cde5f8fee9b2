"""The heatmap's companion image: each layer's declared output statistics over a window.

One panel per statistic of ``registry.OUTPUT_STATISTICS`` (act_rms on a log scale, the zero
fraction on [0, 1]): a horizontal bar per layer, the window's mean over its sampled steps,
layers in the heatmap's order (module order, top to bottom). Drawn when the heatmap is, at the
same size; a layer without a value that window has no bar.
"""

from __future__ import annotations

import math

import numpy as np

from ..flush.window import Window
from ..registry.outputs import OUTPUT_STATISTICS
from .heatmap import _DPI, _WIDTH_PX, _short

_LOG_SCALE = {s.name for s in OUTPUT_STATISTICS if s.log_scale}  # drawn on a log axis (magnitudes over decades)


def window_means(w: Window) -> dict[str, np.ndarray]:
    """Per declared output statistic, each layer's mean over the window's recorded steps (NaN: none)."""
    means = {}
    for name, table in w.output_stats.items():
        finite = np.isfinite(table)
        counts = finite.sum(axis=0)
        totals = np.where(finite, table, 0.0).sum(axis=0)
        means[name] = np.where(counts > 0, totals / np.maximum(counts, 1), np.nan)
    return means


def render_activations(w: Window) -> np.ndarray | None:
    """An RGB image (H, W, 3, uint8) of the window's output statistics per layer, or None when the
    window has none; ImportError without matplotlib."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure  # no pyplot: no global state

    means = window_means(w)
    if not means or not w.layers or not any(np.isfinite(v).any() for v in means.values()):
        return None
    n_layers = len(w.layers)
    label_every = max(1, math.ceil(n_layers / 40))
    height = 1.6 + 0.15 * min(n_layers, 40)
    figure = Figure(figsize=(_WIDTH_PX / _DPI, height), dpi=_DPI)
    FigureCanvasAgg(figure)
    axes_list = figure.subplots(1, len(means), sharey=True, squeeze=False)[0]
    rows = np.arange(n_layers)
    for axes, (name, values) in zip(axes_list, means.items()):
        shown = np.where(np.isfinite(values) & ((values > 0) | (name not in _LOG_SCALE)), values, np.nan)
        axes.barh(rows, np.nan_to_num(shown, nan=0.0), color="#1f77b4", height=0.8)
        if name in _LOG_SCALE and np.isfinite(shown).any():
            from matplotlib.ticker import LogLocator, NullFormatter

            axes.set_xscale("log")
            axes.xaxis.set_major_locator(LogLocator(numticks=4))
            axes.xaxis.set_minor_formatter(NullFormatter())
        elif name not in _LOG_SCALE:
            axes.set_xlim(0.0, 1.0)
        axes.set_title(name, fontsize=8)
        axes.tick_params(which="both", labelsize=6)
    first = axes_list[0]
    first.set_yticks(rows[::label_every])
    first.set_yticklabels([_short(n) for n in w.layers[::label_every]], fontsize=7)
    first.set_ylim(n_layers - 0.5, -0.5)  # module order from the top, as in the heatmap
    figure.suptitle(f"layer outputs, steps {w.steps[0]}-{w.steps[-1]} (mean of sampled steps)", fontsize=8)
    figure.tight_layout()
    figure.canvas.draw()
    rgba = np.asarray(figure.canvas.buffer_rgba())
    return np.ascontiguousarray(rgba[:, :, :3])
