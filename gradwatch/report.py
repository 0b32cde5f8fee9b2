"""Reads gradwatch's TensorBoard event files back into a per-layer health summary."""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .config import HealthConfig
from .sinks.tensorboard import (
    ALERTS_TAG, LAYERS_TAG, PREFIX, is_text_tag, natural_order, parse_alerts_markdown, parse_layers_markdown,
    parse_thresholds_markdown,
)


class ReportError(Exception):
    """Bad input for a report: no such folder, or no gradwatch data in it."""


@dataclass
class LayerSummary:
    layer: str
    steps: int
    grad_norm_min: float
    grad_norm_median: float
    grad_norm_max: float
    dead_fraction: float | None
    alerts: int
    update_ratio_median: float | None = None  # with optimizer=: the median measured update ratio


@dataclass
class RunReport:
    run: str
    first_step: int
    last_step: int
    layers: list[LayerSummary] = field(default_factory=list)
    alerts: list[dict[str, Any]] = field(default_factory=list)
    #: why a value shown over a threshold raised no alert, one line per such value
    notes: list[str] = field(default_factory=list)


def read_runs(logdir: str) -> list[RunReport]:
    """One RunReport per folder under ``logdir`` holding gradwatch event files."""
    if not os.path.isdir(logdir):
        raise ReportError(f"no such folder: {logdir}")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    by_run: dict[str, list[str]] = {}
    for path in sorted(glob.glob(os.path.join(logdir, "**", "events.out.tfevents.*"), recursive=True)):
        by_run.setdefault(_run_name(os.path.dirname(path), logdir), []).append(path)
    reports = []
    for run, paths in sorted(by_run.items()):
        scalars: dict[str, dict[int, float]] = {}
        texts: list[str] = []
        layer_order: list[str] = []
        thresholds: dict[str, Any] | None = None
        for path in paths:
            acc = EventAccumulator(path, size_guidance={"scalars": 0, "tensors": 0})
            acc.Reload()
            tags = acc.Tags()
            for tag in tags.get("scalars", []):
                if tag.startswith(PREFIX + "/"):
                    scalars.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
            for tag in tags.get("tensors", []):
                if is_text_tag(tag, ALERTS_TAG):
                    for event in acc.Tensors(tag):
                        texts.extend(v.decode("utf-8", "replace") for v in event.tensor_proto.string_val)
                elif is_text_tag(tag, LAYERS_TAG) and not layer_order:
                    for event in acc.Tensors(tag)[:1]:
                        text = b"".join(event.tensor_proto.string_val).decode("utf-8", "replace")
                        layer_order = parse_layers_markdown(text)
                        thresholds = parse_thresholds_markdown(text)
        if scalars:
            report = _summarise(run, scalars, texts, layer_order)
            report.notes = _unalerted_values(report, thresholds)
            reports.append(report)
    if not reports:
        raise ReportError(f"no gradwatch data (TensorBoard scalars under '{PREFIX}/') in {logdir}")
    return reports


def _run_name(folder: str, logdir: str) -> str:
    """A run's name: its folder relative to LOGDIR (as TensorBoard names runs); the folder's own
    name for event files directly in LOGDIR (TensorBoard says ".")."""
    relative = os.path.relpath(folder, logdir)
    return os.path.basename(os.path.abspath(logdir)) if relative == "." else relative


def _summarise(
    run: str, scalars: dict[str, dict[int, float]], texts: list[str], layer_order: list[str]
) -> RunReport:
    # Structured alert records (JSON written beside the table), never the message wording.
    alerts = [a for text in texts for a in parse_alerts_markdown(text)]
    alerts.sort(key=lambda a: a["step"])
    norm_prefix = f"{PREFIX}/grad_norm/"
    dead_prefix = f"{PREFIX}/dead_fraction/"
    all_steps = sorted({s for series in scalars.values() for s in series})
    report = RunReport(run, all_steps[0], all_steps[-1], alerts=alerts)
    for tag, series in scalars.items():
        if not tag.startswith(norm_prefix):
            continue
        layer = tag[len(norm_prefix):]
        values = np.array(list(series.values()), dtype=float)
        finite = values[np.isfinite(values)]
        dead = scalars.get(dead_prefix + layer)
        updates = scalars.get(f"{PREFIX}/update_ratio/" + layer)
        update_values = np.array(list(updates.values()), dtype=float) if updates else np.array([])
        update_values = update_values[np.isfinite(update_values)]
        report.layers.append(
            LayerSummary(
                layer=layer,
                steps=len(values),
                grad_norm_min=float(finite.min()) if finite.size else float("nan"),
                grad_norm_median=float(np.median(finite)) if finite.size else float("nan"),
                grad_norm_max=float(finite.max()) if finite.size else float("nan"),
                dead_fraction=dead[max(dead)] if dead else None,
                alerts=sum(1 for a in alerts if a["layer"] == layer),
                update_ratio_median=float(np.median(update_values)) if update_values.size else None,
            )
        )
    order = {name: i for i, name in enumerate(layer_order or _layer_order(scalars))}
    report.layers.sort(key=lambda s: order.get(s.layer, len(order)))
    return report


def _unalerted_values(report: RunReport, thresholds: dict[str, Any] | None) -> list[str]:
    """Why a value the table shows over a threshold raised no alert (the rules judge more than the
    one figure a column shows). Logs written before the thresholds were: the defaults, said so."""
    known = thresholds is not None
    th = {**HealthConfig().report_thresholds(), **(thresholds or {})}
    source = "" if known else " (default thresholds: this log does not record its own)"
    alerted = {(a.get("kind"), a.get("layer")) for a in report.alerts}
    notes = []
    for s in report.layers:
        if s.dead_fraction is not None and s.dead_fraction >= th["dead_fraction"] and ("dead_units", s.layer) not in alerted:
            notes.append(
                f"{s.layer}: dead {s.dead_fraction:.0%} is the last window's own evidence, at or over dead_fraction "
                f"{th['dead_fraction']:.0%}{source}, but no dead_units alert: the rule raises one only once a window "
                f"that records every step confirms it, and none did (the run ended first, or the units fired on "
                f"steps the default detail does not sample), from at least {th['dead_min_samples']:g} samples and in layers of {th['dead_min_units']:g} "
                f"units or more"
            )
        ratio = s.update_ratio_median
        if ratio is not None and ratio > th["update_ratio_max"] and ("update_ratio", s.layer) not in alerted:
            notes.append(
                f"{s.layer}: update ratio {ratio:.2g} (median) is over update_ratio_max {th['update_ratio_max']:g}"
                f"{source}, but no update_ratio alert: the rule needs {th['update_ratio_steps']:g} consecutive "
                f"measured optimizer steps over it, and does not measure weights still near a zero initialisation"
            )
    return notes


def _layer_order(scalars: dict[str, dict[int, float]]) -> list[str]:
    # Logs without the gradwatch/layers text: fall back to a numeric-aware name order.
    names = [t[len(PREFIX) + len("/grad_norm/"):] for t in scalars if t.startswith(f"{PREFIX}/grad_norm/")]
    return sorted(names, key=natural_order)


def to_json(reports: list[RunReport]) -> str:
    return json.dumps(
        {
            "healthy": not any(r.alerts for r in reports),
            "runs": [
                {
                    "run": r.run,
                    "first_step": r.first_step,
                    "last_step": r.last_step,
                    "layers": [
                        {
                            "layer": s.layer,
                            "steps": s.steps,
                            "grad_norm": {"min": _num(s.grad_norm_min), "median": _num(s.grad_norm_median), "max": _num(s.grad_norm_max)},
                            "dead_fraction": s.dead_fraction,
                            "update_ratio_median": s.update_ratio_median,
                            "alerts": s.alerts,
                        }
                        for s in r.layers
                    ],
                    "alerts": r.alerts,
                    "notes": r.notes,
                }
                for r in reports
            ],
        },
        indent=2,
    )


def _num(x: float) -> float | None:
    return None if not np.isfinite(x) else x


def to_text(reports: list[RunReport]) -> str:
    lines = []
    for r in reports:
        lines.append(f"run {r.run!s}: steps {r.first_step}-{r.last_step}, {len(r.layers)} layers, {len(r.alerts)} alert(s)")
        with_updates = any(s.update_ratio_median is not None for s in r.layers)
        header = ["layer", "steps", "norm min", "norm median", "norm max", "dead"]
        header += ["update ratio"] if with_updates else []
        header += ["alerts"]
        rows = [
            [
                s.layer,
                str(s.steps),
                f"{s.grad_norm_min:.3g}",
                f"{s.grad_norm_median:.3g}",
                f"{s.grad_norm_max:.3g}",
                "-" if s.dead_fraction is None else f"{s.dead_fraction:.0%}",
            ]
            + ([("-" if s.update_ratio_median is None else f"{s.update_ratio_median:.2g}")] if with_updates else [])
            + [str(s.alerts) if s.alerts else ""]
            for s in r.layers
        ]
        widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
        fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
        lines.append(fmt.format(*header))
        lines.extend(fmt.format(*row) for row in rows)
        if r.notes:
            lines.append("over a threshold without an alert:")
            lines.extend(f"  {note}" for note in r.notes)
        if r.alerts:
            lines.append("alerts:")
            lines.extend(f"  {a['message']}" for a in r.alerts)
        else:
            lines.append("no alerts: healthy")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
