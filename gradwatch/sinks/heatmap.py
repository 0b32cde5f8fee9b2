"""The gradient-flow heatmap: log10 gradient RMS, layers x steps of one window.

Drawing a labelled matplotlib figure from scratch costs 150-350 ms of CPU (text
layout of every layer name, the colour bar, ``tight_layout``), too much for every
flush. ``GradientFlowHeatmap`` lays the figure out once per (layers, window
length, colour range) and afterwards redraws only what changes: the image pixels,
the frame, the step numbers under the ticks and the markers of alert steps, over a
saved background (``copy_from_bbox`` / ``restore_region`` / ``Axes.draw_artist``),
~10-15 ms for 25 layers x 50 steps. The colour range is fixed per figure, so colours
mean the same in every image of a run; a window outside it gets a new layout.

Sized for TensorBoard's image card: 360 px wide (drawn at the card's size, not scaled
down into it), 7-8 pt text, labelled axes and colour bar, x ticks at regular offsets
labelled with the training steps, long layer names shortened from the left.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..flush.window import Window

_TITLE = "gradient flow (grey: no or zero gradient)"
_WIDTH_PX = 360  # TensorBoard's image card: drawn at its size, not scaled down into it
_DPI = 80
_LABEL_CHARS = 22  # longer layer names keep their end (the part that tells layers apart)
_ALERT_COLOUR = "#d62728"
_NICE_STEPS = (1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000)


def log_rms(w: Window) -> np.ndarray:
    """log10 gradient RMS, [layers, steps]; NaN where there is no, a zero or a non-finite gradient."""
    with np.errstate(divide="ignore", invalid="ignore"):
        rms = np.where(w.has_grad, w.grad_rms, np.nan)
        return np.log10(np.where(rms > 0, rms, np.nan)).T


def _short(name: str) -> str:
    """A layer name that fits the card: its end, where nested names differ."""
    return name if len(name) <= _LABEL_CHARS else "..." + name[-(_LABEL_CHARS - 3) :]


def figure_rgb(figure: Any) -> np.ndarray:
    """What a drawn figure's Agg canvas holds, as a contiguous RGB image (H, W, 3, uint8)."""
    rgba = np.asarray(figure.canvas.buffer_rgba())
    return np.ascontiguousarray(rgba[:, :, :3])


def tick_offsets(n_steps: int, most: int = 8) -> list[int]:
    """Regular tick positions 0, k, 2k, ... in a window of ``n_steps`` (k a round number)."""
    every = next((k for k in _NICE_STEPS if math.ceil(n_steps / k) <= most), n_steps)
    return list(range(0, n_steps, every))


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
        self._tick_labels: list[Any] = []
        self._offsets: list[int] = []
        self.full_draws = 0  # how many times the whole figure was laid out and drawn

    def render(self, w: Window, alert_steps: list[int] | None = None) -> np.ndarray | None:
        """An RGB image (H, W, 3, uint8), or None for an empty window; ImportError without matplotlib.

        ``alert_steps``: steps of the window to mark (the steps of this flush's alerts).
        """
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
            self._layout(w)
        self._image.set_data(np.ma.masked_invalid(values))
        self._draw_changing_parts(w, alert_steps or [])
        return figure_rgb(self._figure)

    def _layout(self, w: Window) -> None:
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure  # no pyplot: no global state

        n_layers, n_steps = len(w.layers), len(w.steps)
        label_every = max(1, math.ceil(n_layers / 40))  # at most ~40 readable layer names
        rows = min(n_layers, 40)
        height = 1.5 + 0.15 * rows  # ~12 px per labelled row at 80 dpi
        figure = Figure(figsize=(_WIDTH_PX / _DPI, height), dpi=_DPI)
        canvas = FigureCanvasAgg(figure)
        axes = figure.add_subplot(1, 1, 1)
        cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#bbbbbb")
        image = axes.imshow(
            np.full((n_layers, n_steps), np.nan), aspect="auto", cmap=cmap, interpolation="nearest",
            vmin=self._range[0], vmax=self._range[1],
        )  # fmt: skip
        axes.set_yticks(range(0, n_layers, label_every))
        axes.set_yticklabels([_short(name) for name in w.layers[::label_every]], fontsize=7)
        self._offsets = tick_offsets(n_steps, most=5)
        axes.set_xticks(self._offsets)
        axes.set_xticklabels([""] * len(self._offsets))  # the step numbers are drawn per window
        axes.set_xlabel("training step", fontsize=8, labelpad=10)
        axes.set_ylabel("layer", fontsize=8)
        axes.set_title(_TITLE, fontsize=8)
        colorbar = figure.colorbar(image, ax=axes, fraction=0.06, pad=0.03)
        colorbar.set_label("log10 gradient RMS", fontsize=8)
        colorbar.ax.tick_params(labelsize=7)
        figure.tight_layout()
        # Text for the step numbers under the ticks, positioned once, animated: redrawn per window.
        transform = axes.get_xaxis_transform()
        self._tick_labels = [
            axes.text(x, -0.01, "", transform=transform, ha="center", va="top", fontsize=7, animated=True)
            for x in self._offsets
        ]
        # Animated artists are left out of canvas.draw(): the background is everything
        # else, saved once; each image is then the background with the pixels, the frame,
        # the step numbers and the alert markers on top, in the order a full draw uses.
        self._animated = [image, *axes.spines.values()]
        for artist in self._animated:
            artist.set_animated(True)
        canvas.draw()
        self._background = canvas.copy_from_bbox(figure.bbox)
        self._figure, self._axes, self._image = figure, axes, image
        self.full_draws += 1

    def _draw_changing_parts(self, w: Window, alert_steps: list[int]) -> None:
        self._figure.canvas.restore_region(self._background)
        axes = self._axes
        axes.draw_artist(self._image)
        markers = []
        for step in sorted(set(alert_steps)):
            if step in w.steps:  # a red line at the step of an alert, across every layer
                t = w.steps.index(step)
                markers.append(axes.axvline(t, color=_ALERT_COLOUR, linewidth=1.5, alpha=0.9, animated=True))
        for marker in markers:
            axes.draw_artist(marker)
        for spine in axes.spines.values():
            axes.draw_artist(spine)
        for label, offset in zip(self._tick_labels, self._offsets):
            step = w.steps[offset]
            label.set_text(str(step))
            label.set_color(_ALERT_COLOUR if step in alert_steps else "black")
            axes.draw_artist(label)
        for marker in markers:
            marker.remove()
