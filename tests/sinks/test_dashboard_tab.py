"""The gradwatch tab in TensorBoard (gradwatch/dashboard): its tables against TensorBoard's own reader
and ``gradwatch report``, its routes on a real TensorBoard server with default flags, and the page
in a real headless Chromium (skipped where none is installed)."""

from __future__ import annotations

import glob
import io
import math
import os
import urllib.error
import urllib.parse
import urllib.request

import pytest

from gradwatch.dashboard import data
from gradwatch.demo import run_demo
from gradwatch.report import read_runs

from ..browser import Browser, chromium_path
from ..conftest import read_scalars
from ..tensorboard_server import TensorBoardServer, get_json

STEPS = 60


def test_a_table_keeps_each_columns_largest_value_and_tells_missing_from_non_finite():
    series = {
        "a": [(s, float(s)) for s in range(10)],  # 0..9
        "b": [(s, 1.0) for s in range(10) if s != 4] + [(4, math.nan)],  # a NaN at step 4
        "c": [(8, 5.0)],  # one point
    }
    t = data.table(series, ["a", "b", "c", "d"], max_steps=4)
    assert t.stride == 3 and t.steps == [0, 3, 6, 9]  # ceil(10 / 4) steps per column
    # computed here by hand: column k covers steps 3k..3k+2
    assert t.values[0] == [2.0, 5.0, 8.0, 9.0]
    assert t.values[1] == [1.0, "NaN", 1.0, 1.0]
    assert t.values[2] == [None, None, 5.0, None]
    assert t.values[3] == [None, None, None, None]  # a layer without data: every cell missing
    assert data.decode(t.encoded()) == t.values  # what the route sends, read back
    whole = data.table(series, ["a"], max_steps=100, first=2, last=5)
    assert whole.stride == 1 and whole.steps == [2, 3, 4, 5] and whole.values[0] == [2.0, 3.0, 4.0, 5.0]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Three demos (dead units, a NaN: 4 layers; vanishing: 26) in one folder under a real TensorBoard
    server with default flags."""
    root = str(tmp_path_factory.mktemp("tab"))
    for fault in ("dead", "nan", "vanishing"):
        run_demo(logdir=os.path.join(root, fault), steps=STEPS, fault=fault, out=io.StringIO())
    server = TensorBoardServer(root)
    try:
        server.wait_for("scalars", "gradwatch/grad_norm/0")
        # run_demo writes a folder per run inside each: TensorBoard names runs by the path from root
        names = {fault: os.path.relpath(os.path.dirname(path), root)
                 for fault in ("dead", "nan", "vanishing")
                 for path in glob.glob(os.path.join(root, fault, "**", "events.out.tfevents.*"), recursive=True)}  # fmt: skip
        yield root, server, names
    finally:
        server.close()


def _runs(server: TensorBoardServer) -> dict:
    return {r["run"]: r for r in server.get("gradwatch/runs")}


def test_tensorboard_lists_the_tab_and_serves_the_page(served):
    _, server, _ = served
    listing = get_json(f"{server.url}/data/plugins_listing")["gradwatch"]
    assert listing["enabled"] and listing["tab_name"] == "gradwatch"
    assert listing["loading_mechanism"] == {"type": "IFRAME", "module_path": "/data/plugin/gradwatch/index.js"}
    with urllib.request.urlopen(f"{server.base}/gradwatch/index.js", timeout=10) as r:
        assert b"export async function render" in r.read()


def test_runs_and_tables_say_what_the_event_files_and_the_report_say(served):
    root, server, names = served
    reports = {r.run: r for r in read_runs(root)}
    runs = _runs(server)
    assert sorted(runs) == sorted(reports) == sorted(names.values())
    for run, report in reports.items():
        table = server.get(f"gradwatch/table?run={urllib.parse.quote(run)}&stat=grad_norm&max_steps=1000")
        # the same alerts as gradwatch report, each once, in step order
        assert [(a["kind"], a["layer"], a["step"]) for a in table["alerts"]] == sorted(
            (a["kind"], a["layer"], a["step"]) for a in report.alerts)  # fmt: skip
        assert runs[run]["alerts"] == len(report.alerts) and runs[run]["layers"] == len(report.layers)
        # layers in module order with their module types; every value as TensorBoard's reader has it
        assert table["layers"] == [s.layer for s in report.layers]
        assert set(table["types"]) == {"Linear"}
        scalars = read_scalars(os.path.join(root, run))
        assert table["stride"] == 1 and table["steps"] == list(range(STEPS))
        values = data.decode(table["values"])
        for i, layer in enumerate(table["layers"]):
            expected = scalars[f"gradwatch/grad_norm/{layer}"]
            got = {s: v for s, v in zip(table["steps"], values[i]) if v is not None}
            assert sorted(got) == sorted(expected)
            for step, value in got.items():
                if isinstance(value, str):
                    assert value in ("NaN", "Infinity") and not math.isfinite(expected[step])
                else:
                    assert value == pytest.approx(expected[step], rel=1e-6)


def test_a_downsampled_table_keeps_the_largest_value_of_each_column(served):
    root, server, names = served
    table = server.get(f"gradwatch/table?run={urllib.parse.quote(names['dead'])}&stat=log10_grad_rms&max_steps=7")
    scalars = read_scalars(os.path.join(root, "dead"))
    stride = math.ceil(STEPS / 7)
    assert table["stride"] == stride and table["steps"] == list(range(0, STEPS, stride))
    values = data.decode(table["values"])
    for i, layer in enumerate(table["layers"]):
        series = scalars[f"gradwatch/log10_grad_rms/{layer}"]
        for k, first in enumerate(table["steps"]):
            covered = [series[s] for s in range(first, first + stride) if s in series]
            assert values[i][k] == pytest.approx(max(covered), rel=1e-6)
    assert all(v == pytest.approx(-30.0) for v in values[0])  # the demo's dead layer: zero gradient


def test_bad_requests_get_a_clear_error(served):
    _, server, names = served
    dead = urllib.parse.quote(names["dead"])
    for query, status, says in (("run=nosuchrun&stat=grad_norm", 404, "no gradwatch data"),
                                (f"run={dead}&stat=grad_norm&max_steps=many", 400, "integers")):  # fmt: skip
        with pytest.raises(urllib.error.HTTPError) as caught:
            server.get(f"gradwatch/table?{query}")
        assert caught.value.code == status and says in caught.value.read().decode()


@pytest.mark.skipif(chromium_path() is None, reason="needs Chromium (Debian: apt-get install chromium)")
def test_the_tab_in_chromium_moves_to_a_clicked_alert_and_compares_runs(served, tmp_path):
    _, server, names = served
    browser = Browser(1280, 800)
    try:
        browser.open(f"{server.url}/data/plugin_entry.html?name=gradwatch")  # what TensorBoard's iframe loads
        browser.wait_for("document.querySelectorAll('canvas.heatmap').length === 1")
        assert browser.evaluate("document.getElementById('run-a').value") == names["dead"]
        alert = browser.evaluate("[...document.querySelectorAll('tr.alert')[0].cells].map(c => c.textContent)")
        kind, layer, step = alert[0], alert[1], int(alert[2])
        assert kind == "dead_units"
        browser.evaluate("document.querySelectorAll('tr.alert')[0].click()")
        label = browser.wait_for("document.getElementById('zoom-label').textContent")
        assert label == f"steps {max(0, step - 25)}-{step + 25}"
        # the heatmap's and the lines' tables were fetched again for those steps (entries appear
        # once a response has arrived)
        window = f"first={max(0, step - 25)}&last={step + 25}"
        browser.wait_for(f"(() => {{ const u = performance.getEntriesByType('resource').map(e => e.name);"
                         f" return ['log10_grad_rms', 'grad_norm'].every(s => u.some(x => x.includes('stat=' + s)"
                         f" && x.includes('{window}'))); }})()")  # fmt: skip
        chosen = browser.wait_for("[...document.querySelectorAll('.chip.focus')].map(c => c.textContent)")
        assert chosen == [f"{layer} (Linear)"]  # the alert's layer picked out in the legend
        # compare with the other run: two panels side by side, the same zoom in both
        browser.evaluate(f"(() => {{ const s = document.getElementById('run-b'); s.value = '{names['nan']}';"
                         " s.dispatchEvent(new Event('change')); })()")  # fmt: skip
        runs = browser.wait_for("(() => { const p = [...document.querySelectorAll('.panel')];"
                                " return p.length === 2 && p.map(x => x.dataset.run); })()")  # fmt: skip
        assert runs == [names["dead"], names["nan"]]
        # a layer filter (a regular expression on names and module types) keeps the matching rows
        browser.evaluate("(() => { const f = document.getElementById('layer-filter'); f.value = '^(2|4)$';"
                         " f.dispatchEvent(new Event('input')); })()")  # fmt: skip
        kept = browser.wait_for("(() => { const p = [...document.querySelectorAll('.panel')].map("
                                "x => [...x.querySelectorAll('.chip')].map(c => c.textContent));"
                                " return p.length === 2 && p.every(c => c.length === 2) && p; })()")  # fmt: skip
        assert kept == [["2 (Linear)", "4 (Linear)"]] * 2
        browser.screenshot(str(tmp_path / "tab.png"))
        assert os.path.getsize(tmp_path / "tab.png") > 10_000
    finally:
        browser.close()


def test_layer_names_that_are_indices_carry_their_module_type():
    from gradwatch.sinks.tensorboard import display_name, layers_markdown, parse_layer_types_markdown

    text = layers_markdown(["0", "encoder.attn"], types={"0": "Linear", "encoder.attn": "MultiheadAttention"})
    assert "`0 (Linear)`" in text and "`encoder.attn`" in text  # a named layer says what it is already
    assert parse_layer_types_markdown(text) == {"0": "Linear", "encoder.attn": "MultiheadAttention"}
    assert display_name("blocks.3", "Block") == "blocks.3 (Block)" and display_name("head", None) == "head"


def test_runs_of_different_depths_in_one_folder_share_one_custom_scalars_layout(served):
    # TensorBoard merges every run's layout: charts named after one run's layers used to multiply
    # ("layers 0..6" beside "layers 0..10") and stand empty for the other runs.
    import re

    _, server, _ = served
    layout = get_json(f"{server.base}/custom_scalars/layout")
    charts = [c for category in layout["category"] for c in category["chart"]]
    titles = [c["title"] for c in charts]
    assert len(titles) == len(set(titles)), titles
    for run, tags in get_json(f"{server.base}/scalars/tags").items():  # no chart stands empty for any run
        for chart in charts:
            assert any(re.match(p, tag) for p in chart["multiline"]["tag"] for tag in tags), (run, chart["title"])
