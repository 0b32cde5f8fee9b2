"""Writes flushed windows to TensorBoard through a SummaryWriter.

All scalars of one step go into a single ``Summary`` proto (one event per
step instead of one ``add_scalar`` call per value), which keeps a flush of
50 steps x 100 layers x 5 statistics in the tens of milliseconds.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from typing import Any, Callable

import numpy as np

from ..alerts import Alert
from ..flush.window import Window
from .activations import LayerOutputsChart
from .heatmap import GradientFlowHeatmap
from ..registry.statistics import all_statistics
from .scalars import LOG_RMS, PREFIX, window_scalars

log = logging.getLogger("gradwatch")

ALERTS_TAG = f"{PREFIX}/alerts"
LAYERS_TAG = f"{PREFIX}/layers"  # the monitored layers in module order (layers_markdown)
HEATMAP_TAG = f"{PREFIX}/gradient_flow"  # the heatmap of windows within the drawing budget
HEATMAP_ALERTS_TAG = f"{PREFIX}/gradient_flow_at_alerts"  # the heatmap of every window that raised an alert
ACTIVATIONS_TAG = f"{PREFIX}/layer_outputs"  # the heatmap's companion: each layer's output statistics


def _json_comment(label: str, data: Any) -> str:
    """``data`` as JSON inside an HTML comment of a text: TensorBoard's sanitiser drops comments
    from what it shows, `gradwatch report` reads them back (:func:`_json_comments`)."""
    # Inside the comment nothing may read "--" ("-->" would close it); in JSON only strings can hold it.
    text = json.dumps(data).replace("--", "-\\u002d")
    return f"<!-- gradwatch-{label}-json: {text} -->"


def _json_comments(label: str, text: str) -> list[Any]:
    """Every value :func:`_json_comment` wrote under ``label`` into ``text``, in order."""
    pattern = rf"<!-- gradwatch-{re.escape(label)}-json: (.*?) -->"
    return [json.loads(match.group(1)) for match in re.finditer(pattern, text, re.S)]


def alerts_markdown(alerts: list[Alert], steps: tuple[int, int]) -> str:
    """One text for all alerts of a flush: a table to read, the same alerts as JSON to parse."""
    lines = [
        f"**{len(alerts)} new alert{'s' if len(alerts) != 1 else ''}** in steps {steps[0]}-{steps[1]}",
        "",
        "| kind | layer | step | value | threshold |",
        "|---|---|---|---|---|",
    ]
    for a in alerts:
        cells = [a.kind, a.layer or "(whole model)", str(a.step), f"{a.value:.4g}", f"{a.threshold:.4g}"]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    lines += ["", "What each says:", ""]
    lines += [f"- {a.message}" for a in alerts]
    lines += ["", _json_comment("alerts", [a.to_dict() for a in alerts])]
    return "\n".join(lines)


def layers_markdown(layers: list[str], thresholds: dict[str, Any] | None = None,
                    types: dict[str, str] | None = None) -> str:  # fmt: skip
    """The monitored layers on one line to read, and as JSON (in a comment) to parse; with the
    health checks' thresholds (``gradwatch report`` explains values over them without an alert)
    and the layers' module types (``types``: name -> class name; shown where a name is an index)."""
    types = types or {}
    shown = ", ".join(f"`{display_name(name, types.get(name))}`" for name in layers)
    text = f"**{len(layers)} monitored layers**, in module order: {shown}\n\n{_json_comment('layers', layers)}"
    if types:
        text += f"\n\n{_json_comment('layer-types', {name: types[name] for name in layers if name in types})}"
    return text if thresholds is None else f"{text}\n\n{_json_comment('thresholds', thresholds)}"


def display_name(name: str, module_type: str | None) -> str:
    """A layer's name as shown: with its module type where the name ends in an index (``2 (Linear)``,
    ``blocks.0.1 (LayerNorm)``), where the name alone does not say what the layer is."""
    last = name.rsplit(".", 1)[-1]
    return f"{name} ({module_type})" if module_type and last.isdigit() else name


def parse_layer_types_markdown(text: str) -> dict[str, str]:
    """The module types :func:`layers_markdown` wrote ({} for logs written before they were)."""
    found = _json_comments("layer-types", text)
    return dict(found[0]) if found else {}


def parse_thresholds_markdown(text: str) -> dict[str, Any] | None:
    """The thresholds :func:`layers_markdown` wrote (None: logs written before they were)."""
    found = _json_comments("thresholds", text)
    return dict(found[0]) if found else None


def parse_layers_markdown(text: str) -> list[str]:
    """The layers written by :func:`layers_markdown` (or, for older logs, one per paragraph)."""
    found = _json_comments("layers", text)
    if found:
        return list(found[0])
    return [name for name in text.split("\n\n") if name]


def is_text_tag(tag: str, base: str) -> bool:
    """Whether ``tag`` is the text written under ``base`` (``SummaryWriter.add_text`` stores
    ``<base>/text_summary``)."""
    return tag == base or tag.startswith(base + "/")


def natural_order(name: str) -> list[Any]:
    """A sort key that orders layer names as people number them (``2`` before ``10``)."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def parse_alerts_markdown(text: str) -> list[dict[str, Any]]:
    """The alerts written by :func:`alerts_markdown` (none for any other text)."""
    return [alert for alerts in _json_comments("alerts", text) for alert in alerts]


#: The first chart: gradient magnitude on a log scale, where a vanishing layer stands out
#: (decades below the others) instead of lying flat on zero beside them.
LOG_RMS_CHART = "gradient RMS per layer, log10 (a vanishing layer sits decades below; zero at -30)"


def custom_scalars_layout(layers: list[str] | None = None) -> dict[str, Any]:
    """The magnitude chart first, then one chart per statistic with every layer in it, then the
    global norm and the alert count. The same charts for every run whatever its depth (TensorBoard
    merges the layouts of the runs in one folder: charts named after a run's layers would multiply
    and stand empty for the others); telling layers apart is the gradwatch tab's job. ``layers`` is
    accepted for callers that pass it."""
    charts = {LOG_RMS_CHART: ["Multiline", [rf"^{PREFIX}/{LOG_RMS}/.*"]]}
    charts.update({stat: ["Multiline", [rf"^{PREFIX}/{stat}/.*"]] for stat in _written_statistics()})
    charts["global grad_norm"] = ["Multiline", [rf"^{PREFIX}/global/grad_norm$"]]
    charts["alerts"] = ["Multiline", [rf"^{PREFIX}/global/alerts$"]]
    return {"gradwatch": charts}


def _written_statistics() -> list[str]:
    """Every statistic written under a tag, in the registry's order (registry/statistics.py)."""
    return [s.name for s in all_statistics() if s.written]


class TensorBoardSink:
    """Writes windows, alerts and the dashboard layout to a ``SummaryWriter``."""

    #: The heatmap (and its companion) is drawn at a flush when its last drawing took at most
    #: this fraction of the wall time since the previous image: a redraw of both is ~15-40 ms,
    #: so at flush_every=50 every flush once a step takes ~0.3 s, every few flushes below. The
    #: images are snapshots (the gradwatch tab draws its heatmap from the scalars of every step,
    #: and TensorBoard shows 10 images per tag), so they get a quarter of a percent of the run:
    #: at 1% they were a third of the default's whole 3% budget (#30). The first window, the
    #: last one (at close()) and every window that raised an alert are always drawn.
    heatmap_budget: float = 0.0025

    def __init__(self, writer: Any, owns_writer: bool, heatmap: bool = True) -> None:
        self.writer = writer
        self.owns_writer = owns_writer
        log_dir = getattr(writer, "log_dir", None) or getattr(writer, "logdir", None)
        self.log_dir = os.path.abspath(str(log_dir)) if log_dir else None
        self.layout_dir: str | None = None  # the folder the layout and layer list were written to
        self.heatmap = heatmap
        #: The layers the dashboard layout and layer list name (None: the window's own). Several
        #: monitors sharing one writer (one per optimizer) share one layout: the first names every
        #: layer, the others write none (``share_layout``).
        self.layout_layers: list[str] | None = None
        self.clock = time.monotonic  # the heatmap budget's clock (tests give it a known one)
        self._last_heatmap = self.clock()
        self._heatmap_cost: float | None = None  # seconds the last drawing took; None: draw now
        self._undrawn: Window | None = None  # the newest window not drawn yet
        self._heatmap: GradientFlowHeatmap | None = None
        self._outputs_chart = LayerOutputsChart()  # the heatmap's companion (lays itself out when first drawn)
        #: the health checks' thresholds, written with the layer list (None: not written)
        self.thresholds: dict[str, Any] | None = None
        #: the layers' module types (name -> class name), written with the layer list
        self.layer_types: dict[str, str] = {}

    def write(self, w: Window, alerts: list[Alert], total_alerts: int, final: bool = False) -> None:
        """Write one window's scalars at the steps they describe, then its alerts."""
        described = w.steps + w.update_steps
        first, last = min(described), max(described)
        if not self.layout_written:
            layers = self.layout_layers or w.layers
            self.writer.add_custom_scalars(custom_scalars_layout(layers))
            self.writer.add_text(LAYERS_TAG, layers_markdown(layers, self.thresholds, self.layer_types), first)
            self.layout_dir = self.log_dir or ""
        for step, values in window_scalars(w, total_alerts, dashboard=True):
            self._add_scalars(values, step)
        if alerts:  # one text per flush: TensorBoard keeps one text per tag and step
            self.writer.add_text(ALERTS_TAG, alerts_markdown(alerts, (first, last)), last)
        if not w.steps:
            return
        now = self.clock()
        cost = self._heatmap_cost
        due = cost is None or cost <= self.heatmap_budget * (now - self._last_heatmap)
        # A window that raised an alert is always drawn, whatever the budget: it is the one that matters.
        if self.heatmap and (final or alerts or due):
            first = self._heatmap is None
            self._add_heatmap(w, [a.step for a in alerts])
            self._last_heatmap = self.clock()
            # The first drawing also imports matplotlib and lays the figure out: not a
            # measure of what the next one costs.
            self._heatmap_cost = None if first else self._last_heatmap - now
            self._undrawn = None
        else:
            self._undrawn = w
        # No writer.flush() here: it would wait for the writer thread to put every event on
        # disk. Events reach disk at the writer's own pace (flush_secs) and at close().

    def use_clock(self, clock: Callable[[], float]) -> None:
        """Measure the heatmap budget on ``clock`` (seconds, monotonic) from now on, e.g. one that
        counts only this run's own steps when it shares the process with others; the budget's
        period restarts now.

        Args:
            clock: returns the current time in seconds.
        """
        self.clock = clock
        self._last_heatmap = clock()

    def share_layout(self, layers: list[str], writes_it: bool) -> None:
        """This sink is one of several on the same writer: the layout names ``layers`` (all of
        theirs), written by one sink only."""
        self.layout_layers = list(layers)
        if not writes_it:
            self.layout_dir = self.log_dir or ""

    @property
    def layout_written(self) -> bool:
        """Whether this writer's folder has the layout and the layer list."""
        return self.layout_dir is not None

    def restore_layout_dir(self, layout_dir: str | None) -> None:
        """A resumed run: the layout is already there only if it was written to this same folder."""
        if layout_dir is not None and self.log_dir is not None and layout_dir == self.log_dir:
            self.layout_dir = layout_dir

    def write_histograms(self, named_grads: list[tuple[str, Any]], step: int) -> None:
        """Per-layer gradient histograms (host copy of every gradient: costly, off by default)."""
        for name, grads in named_grads:
            flat = np.concatenate([g.detach().float().reshape(-1).cpu().numpy() for g in grads])
            flat = flat[np.isfinite(flat)]
            if flat.size:
                self.writer.add_histogram(f"{PREFIX}/hist/{name}", flat, step)

    def _add_scalars(self, values: list[tuple[str, float]], step: int) -> None:
        get_file_writer = getattr(self.writer, "_get_file_writer", None)
        if get_file_writer is None:  # another writer implementation: the public API
            for name, value in values:
                self.writer.add_scalar(name, value, step)
            return
        from tensorboard.compat.proto.event_pb2 import Event

        # Filled in place: a Summary.Value per scalar handed to Summary(), and that Summary to
        # Event() (what add_summary does), copies each message again (2-3x the time at every flush).
        event = Event()
        add = event.summary.value.add
        for name, value in values:
            add(tag=name, simple_value=value)
        get_file_writer().add_event(event, step)

    def _add_heatmap(self, w: Window, alert_steps: list[int] | None = None) -> None:
        if self._heatmap is None:
            self._heatmap = GradientFlowHeatmap()
        try:
            image = self._heatmap.render(w, alert_steps)
        except ImportError:
            log.info("gradwatch: install matplotlib (pip install gradwatch[plot]) for the gradient-flow heatmap")
            self.heatmap = False
            return
        if image is not None:
            # TensorBoard shows a sample of 10 images per tag: windows with alerts get a tag of
            # their own, so that each of them stays on the dashboard of a long run.
            name = HEATMAP_ALERTS_TAG if alert_steps else HEATMAP_TAG
            self.writer.add_image(name, image, w.steps[-1], dataformats="HWC")
            companion = self._outputs_chart.render(w)  # the layers' output statistics, beside it
            if companion is not None:
                self.writer.add_image(ACTIVATIONS_TAG, companion, w.steps[-1], dataformats="HWC")

    def close(self) -> None:
        """Draw the last window's heatmap if it was not; flush; close the writer only if gradwatch created it."""
        if self.heatmap and self._undrawn is not None:
            self._add_heatmap(self._undrawn)
            self._undrawn = None
        if self.owns_writer:
            self.writer.close()
        else:
            self.writer.flush()
