"""The gradient-flow heatmap: log10 gradient RMS, layers x steps of one window."""

from __future__ import annotations

import numpy as np

from ..window import Window


def gradient_flow_image(w: Window) -> np.ndarray | None:
    """An RGB image (H, W, 3, uint8) of log10 gradient RMS; raises ImportError without matplotlib."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure  # no pyplot: no global state, thread-safe

    if not w.steps or not w.layers:
        return None
    with np.errstate(divide="ignore", invalid="ignore"):
        rms = np.where(w.has_grad, w.grad_rms, np.nan)
        values = np.log10(np.where(rms > 0, rms, np.nan)).T  # [layers, steps]
    n_layers = len(w.layers)
    height = min(2.0 + 0.22 * n_layers, 14.0)
    fig = Figure(figsize=(8, height), dpi=80)
    canvas = FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#bbbbbb")  # none, zero or non-finite
    image = ax.imshow(np.ma.masked_invalid(values), aspect="auto", cmap=cmap, interpolation="nearest")
    ax.set_yticks(range(n_layers))
    ax.set_yticklabels(w.layers if n_layers <= 60 else [""] * n_layers, fontsize=7)
    ticks = np.linspace(0, len(w.steps) - 1, min(len(w.steps), 8)).round().astype(int)
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(w.steps[t]) for t in ticks], fontsize=7)
    ax.set_xlabel("step")
    ax.set_title("gradient flow: log10 gradient RMS per layer (grey: none, zero or non-finite)", fontsize=8)
    fig.colorbar(image, ax=ax, fraction=0.04)
    fig.tight_layout()
    canvas.draw()
    rgba = np.asarray(canvas.buffer_rgba())
    return np.ascontiguousarray(rgba[:, :, :3])
