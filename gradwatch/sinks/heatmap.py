"""The gradient-flow heatmap: log10 gradient RMS, layers x steps of one window.

Drawing a labelled matplotlib figure from scratch costs 150-350 ms of CPU
(text layout of every layer name, the colour bar, ``tight_layout``), too much
for every flush. ``GradientFlowHeatmap`` draws the whole figure once per
(layers, window length, colour range) and afterwards redraws only the image
pixels and the frame over a saved background (``copy_from_bbox`` /
``restore_region`` / ``Axes.draw_artist``), ~10-15 ms for 25 layers x 50 steps. The colour
range is fixed per figure, so colours mean the same in every image of a run;
a window outside it triggers one full redraw with a wider range.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..window import Window

_TITLE = "gradient flow: log10 gradient RMS per layer (grey: none, zero or non-finite)"


def log_rms(w: Window) -> np.ndarray:
    """log10 gradient RMS, [layers, steps]; NaN where there is no, a zero or a non-finite gradient."""
    with np.errstate(divide="ignore", invalid="ignore"):
        rms = np.where(w.has_grad, w.grad_rms, np.nan)
        return np.log10(np.where(rms > 0, rms, np.nan)).T


class GradientFlowHeatmap:
    """Renders windows to RGB images, reusing one matplotlib figure while it fits."""

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._range = (0.0, 0.0)
        self._figure: Any = None
        self._axes: Any = None
        self._image: Any = None
        self._background: Any = None
        self._animated: list[Any] = []
        self.full_draws = 0  # how many times the whole figure was laid out and drawn

    def render(self, w: Window) -> np.ndarray | None:
        """An RGB image (H, W, 3, uint8), or None for an empty window; ImportError without matplotlib."""
        import matplotlib  # noqa: F401  (fail early and cleanly without it)

        if not w.steps or not w.layers:
            return None
        values = log_rms(w)
        finite = values[np.isfinite(values)]
        low, high = (float(finite.min()), float(finite.max())) if finite.size else (-1.0, 0.0)
        key = (tuple(w.layers), len(w.steps))
        if key != self._key or low < self._range[0] or high > self._range[1]:
            # One decade of margin each side, so that a drifting run rarely needs a new
            # layout; a range only grows, so that a run moving back and forth settles.
            low, high = math.floor(low) - 1.0, math.ceil(high) + 1.0
            if self._key is not None:
                low, high = min(low, self._range[0]), max(high, self._range[1])
            self._range = (low, high)
            self._key = key
            self._draw_figure(w, values)
        else:
            self._image.set_data(np.ma.masked_invalid(values))
            self._draw_pixels()
        rgba = np.asarray(self._figure.canvas.buffer_rgba())
        return np.ascontiguousarray(rgba[:, :, :3])

    def _draw_figure(self, w: Window, values: np.ndarray) -> None:
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure  # no pyplot: no global state

        n_layers, n_steps = len(w.layers), len(w.steps)
        figure = Figure(figsize=(8, min(2.0 + 0.22 * n_layers, 14.0)), dpi=80)
        canvas = FigureCanvasAgg(figure)
        axes = figure.add_subplot(1, 1, 1)
        cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#bbbbbb")
        image = axes.imshow(
            np.ma.masked_invalid(values),
            aspect="auto",
            cmap=cmap,
            interpolation="nearest",
            vmin=self._range[0],
            vmax=self._range[1],
        )
        axes.set_yticks(range(n_layers))
        axes.set_yticklabels(w.layers if n_layers <= 60 else [""] * n_layers, fontsize=7)
        # Offsets, not absolute steps, so the labels stay right when only the pixels are
        # redrawn; the image's own TensorBoard step is the window's last step.
        ticks = np.linspace(0, n_steps - 1, min(n_steps, 8)).round().astype(int)
        axes.set_xticks(ticks)
        axes.set_xticklabels([f"+{t}" for t in ticks], fontsize=7)
        axes.set_xlabel(f"step in the window ({n_steps} steps; the image's step is the last one)", fontsize=8)
        axes.set_title(_TITLE, fontsize=8)
        figure.colorbar(image, ax=axes, fraction=0.04)
        figure.tight_layout()
        # Animated artists are left out of canvas.draw(): the background is everything
        # else, saved once; each image is then the background, the pixels and the frame
        # on top (the frame lies on the image's edge), in the order a full draw uses.
        self._animated = [image, *axes.spines.values()]
        for artist in self._animated:
            artist.set_animated(True)
        canvas.draw()
        self._background = canvas.copy_from_bbox(figure.bbox)
        self._figure, self._axes, self._image = figure, axes, image
        self._draw_pixels()
        self.full_draws += 1

    def _draw_pixels(self) -> None:
        self._figure.canvas.restore_region(self._background)
        for artist in self._animated:
            self._axes.draw_artist(artist)
