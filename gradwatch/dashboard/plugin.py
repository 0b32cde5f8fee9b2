"""The gradwatch tab in TensorBoard: a dynamic plugin (entry point ``tensorboard_plugins``), so
``tensorboard --logdir DIR`` with its default flags shows it once gradwatch is installed.

Routes, under ``/data/plugin/gradwatch/``:

- ``index.js``: the tab (an ES module TensorBoard loads into an iframe; ``static/index.js``).
- ``runs``: ``[{run, layers, stats, alerts, first_step, last_step}]`` for each run with gradwatch data.
- ``table?run=R&stat=S[&max_steps=N][&first=A&last=B]``: one statistic of one run, layers x steps
  (``data.table``; the values as base64 float32 with a recorded mask, ``RunTable.encoded``), with
  the layers' module types and the run's alerts.

Everything is read through TensorBoard's data provider (what its own tabs read, with its default
sampling of 1000 points per scalar tag); downsampling to the screen happens here, not in the page.
"""

from __future__ import annotations

import json
import os
from typing import Any

from werkzeug import wrappers

from tensorboard import plugin_util
from tensorboard.data import provider
from tensorboard.plugins import base_plugin

from ..sinks.tensorboard import natural_order
from . import data

_STATIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
#: A run's scalars are read in one call; a 500-layer run has ~5000 gradwatch tags.
_SCALAR_PLUGIN = "scalars"
_TEXT_PLUGIN = "text"


class GradWatchPlugin(base_plugin.TBPlugin):
    """The gradwatch tab (``help(GradWatchPlugin)``; TensorBoard creates it, users never do).

    Args:
        context: TensorBoard's ``TBContext`` (its data provider is all the plugin uses).
    """

    plugin_name = "gradwatch"

    def __init__(self, context: base_plugin.TBContext) -> None:
        self._provider = context.data_provider

    def get_plugin_apps(self) -> dict[str, Any]:
        return {"/index.js": self._serve_js, "/runs": self._serve_runs, "/table": self._serve_table}

    def is_active(self) -> bool:
        return False  # activity comes from data_plugin_names: the tab shows where gradwatch wrote scalars

    def data_plugin_names(self) -> tuple[str, ...]:
        return (_SCALAR_PLUGIN,)

    def frontend_metadata(self) -> base_plugin.FrontendMetadata:
        return base_plugin.FrontendMetadata(es_module_path="/index.js", tab_name="gradwatch")

    # ------------------------------------------------------------------ routes
    @wrappers.Request.application
    def _serve_js(self, request: wrappers.Request) -> wrappers.Response:
        with open(os.path.join(_STATIC, "index.js"), encoding="utf-8") as f:
            return wrappers.Response(f.read(), content_type="text/javascript")

    @wrappers.Request.application
    def _serve_runs(self, request: wrappers.Request) -> wrappers.Response:
        ctx, experiment = plugin_util.context(request.environ), plugin_util.experiment_id(request.environ)
        scalars = self._provider.list_scalars(ctx, experiment_id=experiment, plugin_name=_SCALAR_PLUGIN)
        runs = []
        for run, tags in sorted(scalars.items()):
            index = data.run_index(tags)
            if not index["stats"]:
                continue
            steps = [t.max_step for tag, t in tags.items() if data.stat_and_layer(tag)]
            layer_tags, alert_tags = self._text_tags(ctx, experiment, run)
            layers, _ = self._layers(ctx, experiment, run, index, layer_tags)
            runs.append({"run": run, "layers": len(layers), "stats": index["stats"],
                         "alerts": len(self._alerts(ctx, experiment, run, alert_tags)),
                         "last_step": max(steps) if steps else None})  # fmt: skip
        return _json(runs)

    @wrappers.Request.application
    def _serve_table(self, request: wrappers.Request) -> wrappers.Response:
        ctx, experiment = plugin_util.context(request.environ), plugin_util.experiment_id(request.environ)
        run, stat = request.args.get("run"), request.args.get("stat", next(iter(data.STATISTICS)))
        try:
            max_steps = int(request.args.get("max_steps", data.DEFAULT_MAX_STEPS))
            first = _optional_int(request.args.get("first"))
            last = _optional_int(request.args.get("last"))
        except ValueError as exc:
            return _json({"error": f"max_steps, first and last are integers: {exc}"}, status=400)
        scalars = self._provider.list_scalars(ctx, experiment_id=experiment, plugin_name=_SCALAR_PLUGIN,
                                              run_tag_filter=provider.RunTagFilter(runs=[run]))  # fmt: skip
        tags = scalars.get(run)
        if not tags:
            return _json({"error": f"no gradwatch data in run {run!r}"}, status=404)
        index = data.run_index(tags)
        layer_tags, alert_tags = self._text_tags(ctx, experiment, run)
        layers, types = self._layers(ctx, experiment, run, index, layer_tags)
        wanted = [f"{data.PREFIX}/{stat}/{layer}" for layer in index["layers"].get(stat, [])]
        read = self._provider.read_scalars(
            ctx, experiment_id=experiment, plugin_name=_SCALAR_PLUGIN,
            run_tag_filter=provider.RunTagFilter(runs=[run], tags=wanted), downsample=data.DEFAULT_MAX_STEPS * 100,
        ).get(run, {})  # fmt: skip
        series = {data.stat_and_layer(tag)[1]: [(p.step, p.value) for p in points] for tag, points in read.items()}
        result = data.table(series, layers, max_steps, first, last)
        return _json({"run": run, "stat": stat, "meta": data.STATISTICS.get(stat, {"label": stat, "log": False}),
                      "layers": result.layers, "types": [types.get(name, "") for name in result.layers],
                      "steps": result.steps, "stride": result.stride, "values": result.encoded(),
                      "alerts": self._alerts(ctx, experiment, run, alert_tags), "stats": index["stats"]})  # fmt: skip

    # ---------------------------------------------------------------- reading
    def _texts(self, ctx: Any, experiment: str, run: str, tags: list[str]) -> list[str]:
        if not tags:
            return []
        read = self._provider.read_tensors(
            ctx, experiment_id=experiment, plugin_name=_TEXT_PLUGIN,
            run_tag_filter=provider.RunTagFilter(runs=[run], tags=tags), downsample=10_000,
        ).get(run, {})  # fmt: skip
        texts = []
        for tag in tags:
            for datum in read.get(tag, []):
                texts.extend(_strings(datum.numpy))
        return texts

    def _text_tags(self, ctx: Any, experiment: str, run: str) -> tuple[list[str], list[str]]:
        listed = self._provider.list_tensors(ctx, experiment_id=experiment, plugin_name=_TEXT_PLUGIN,
                                             run_tag_filter=provider.RunTagFilter(runs=[run]))  # fmt: skip
        return data.text_tags(listed.get(run, {}))

    def _layers(self, ctx: Any, experiment: str, run: str, index: dict[str, Any],
                layer_tags: list[str]) -> tuple[list[str], dict[str, str]]:  # fmt: skip
        """The run's layers in module order (the layer list gradwatch wrote, then any other layer
        with data) and their module types."""
        texts = self._texts(ctx, experiment, run, layer_tags[:1])
        order, types = data.layer_info(texts[0]) if texts else ([], {})
        known = set(order)
        extra = sorted({layer for layers in index["layers"].values() for layer in layers} - known, key=natural_order)
        return order + extra, types

    def _alerts(self, ctx: Any, experiment: str, run: str, alert_tags: list[str]) -> list[dict[str, Any]]:
        return data.alerts_of(self._texts(ctx, experiment, run, alert_tags))


def _strings(array: Any) -> list[str]:
    values = array.reshape(-1).tolist() if hasattr(array, "reshape") else [array]
    return [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in values]


def _optional_int(value: str | None) -> int | None:
    return None if value in (None, "") else int(value)


def _json(value: Any, status: int = 200) -> wrappers.Response:
    return wrappers.Response(json.dumps(value, allow_nan=False), status=status, content_type="application/json")
