"""`gradwatch demo`, `gradwatch report`, and the dashboard served by a real TensorBoard server."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import urllib.request

import pytest

from gradwatch.cli import main
from gradwatch.demo import run_demo

from ..tensorboard_server import TensorBoardServer, get_json

DEMO_STEPS = 60


@pytest.fixture(scope="module")
def demo_runs(tmp_path_factory):
    """One demo log folder per fault, and the alerts each raised."""
    root = tmp_path_factory.mktemp("demo")
    runs = {}
    for fault in ("none", "exploding", "vanishing", "dead", "nan"):
        out = io.StringIO()
        alerts = run_demo(logdir=str(root / fault), steps=DEMO_STEPS, fault=fault, out=out)
        runs[fault] = (str(root / fault), alerts, out.getvalue())
    return runs


@pytest.mark.parametrize(
    "fault,kind", [("exploding", "exploding"), ("vanishing", "vanishing"), ("dead", "dead_units"), ("nan", "nonfinite")]
)
def test_demo_fault_raises_the_matching_alert(demo_runs, fault, kind):
    _, alerts, printed = demo_runs[fault]
    assert kind in {a.kind for a in alerts}
    assert "tensorboard --logdir" in printed and kind in printed


def test_demo_without_fault_raises_nothing(demo_runs):
    _, alerts, printed = demo_runs["none"]
    assert alerts == []
    assert "no alerts" in printed


@pytest.mark.slow
def test_demo_shows_progress_on_long_runs(tmp_path):
    out = io.StringIO()
    run_demo(logdir=str(tmp_path), steps=200, out=out)
    assert "step 20/200" in out.getvalue() and "step 200/200" in out.getvalue()


def test_report_exit_codes_and_json(demo_runs, tmp_path, capsys):
    assert main(["report", demo_runs["none"][0]]) == 0
    text = capsys.readouterr().out
    assert "no alerts" in text and "norm median" in text

    assert main(["report", demo_runs["dead"][0], "--format", "json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["healthy"] is False
    run = data["runs"][0]
    assert [layer["layer"] for layer in run["layers"]] == ["0", "2", "4", "6"]
    assert run["layers"][0]["dead_fraction"] == 1.0
    assert run["layers"][0]["grad_norm"]["max"] == 0.0
    assert any(a["kind"] == "dead_units" and a["layer"] == "0" for a in run["alerts"])
    assert run["last_step"] == DEMO_STEPS - 1

    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "no such folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2
    assert "no gradwatch data" in capsys.readouterr().err


def test_report_text_table_is_aligned(demo_runs, capsys):
    main(["report", demo_runs["nan"][0]])
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("layer"))
    table = lines[header : header + 5]
    assert len({len(line) for line in table}) == 1  # every row as wide as the header
    assert any("nonfinite" in line and "layer 2" in line for line in lines)


@pytest.mark.slow
def test_console_script_and_module_entry_point(tmp_path, capsys, demo_runs):
    # Each entry point is a fresh interpreter importing torch (seconds on the CI machine), so the
    # two run side by side: the module runs the demo, the console script the report of a demo run
    # made in-process; bad arguments are checked in-process.
    from gradwatch.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--steps", "0"])
    assert exit_info.value.code == 2 and ">= 1" in capsys.readouterr().err
    demo = subprocess.Popen([sys.executable, "-m", "gradwatch", "demo", "--steps", "5", "--logdir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    script = os.path.join(os.path.dirname(sys.executable), "gradwatch")
    report = subprocess.Popen([script, "report", demo_runs["dead"][0]], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) if os.path.exists(script) else None  # fmt: skip
    stdout, stderr = demo.communicate(timeout=120)
    assert demo.returncode == 0, stderr
    assert f"tensorboard --logdir {tmp_path}" in stdout
    if report is not None:  # the contract's exit status: 1 for a run that had alerts
        printed, errors = report.communicate(timeout=120)
        assert report.returncode == 1, errors
        assert "dead_units" in printed, printed


@pytest.fixture(scope="module")
def dead_demo_served(demo_runs):
    """The dead-units demo and, in a folder inside it, a three-branch model whose three dead layers
    alert at one flush, under one real TensorBoard server (starting one costs seconds)."""
    import torch
    from torch import nn

    from gradwatch import GradMonitor

    class ThreeBranches(nn.Module):  # a dead ReLU layer in each of three parallel branches
        def __init__(self):
            super().__init__()
            self.dead = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
            self.out = nn.ModuleList(nn.Linear(16, 2) for _ in range(3))
            with torch.no_grad():
                for layer in self.dead:
                    layer.bias.fill_(-100.0)

        def forward(self, x):
            return sum(out(torch.relu(dead(x))) for dead, out in zip(self.dead, self.out))

    logdir = demo_runs["dead"][0]
    model = ThreeBranches()
    with GradMonitor(model, logdir=os.path.join(logdir, "three_branches"), flush_every=5) as monitor:
        for _ in range(10):  # every unit dead on the sampled steps of 0-4: conclusive, all three at one flush
            model(torch.randn(32, 16)).sum().backward()
            monitor.step()
            model.zero_grad()
    server = TensorBoardServer(logdir)
    try:
        yield server, monitor.alerts
    finally:
        server.close()


def test_tensorboard_server_serves_scalars_layout_and_images(dead_demo_served):
    server, _ = dead_demo_served
    base = server.base
    scalar_tags = server.wait_for("scalars", "gradwatch/grad_norm/0")
    tags = set().union(*[set(t) for t in scalar_tags.values()]) if scalar_tags else set()
    for expected in ("gradwatch/grad_norm/0", "gradwatch/out_grad_norm/6", "gradwatch/dead_fraction/0",
                     "gradwatch/global/grad_norm", "gradwatch/global/alerts"):  # fmt: skip
        assert expected in tags
    run = next(r for r, t in scalar_tags.items() if "gradwatch/grad_norm/0" in t)
    series = get_json(f"{base}/scalars/scalars?run={urllib.request.quote(run)}&tag=gradwatch/grad_norm/0")
    assert [point[1] for point in series] == list(range(DEMO_STEPS))

    layout = get_json(f"{base}/custom_scalars/layout")
    charts = {c["title"]: c for cat in layout["category"] for c in cat["chart"]}
    assert "grad_norm" in charts and "dead_fraction" in charts and "alerts" in charts
    assert charts["grad_norm"]["multiline"]["tag"] == ["^gradwatch/grad_norm/.*"]

    images = get_json(f"{base}/images/tags")
    image_run = next(r for r, t in images.items() if "gradwatch/gradient_flow" in t)
    entries = get_json(f"{base}/images/images?run={urllib.request.quote(image_run)}&tag=gradwatch/gradient_flow")
    assert entries
    with urllib.request.urlopen(f"{base}/images/individualImage?{entries[-1]['query']}", timeout=10) as r:
        assert r.read(8) == b"\x89PNG\r\n\x1a\n"
    texts = get_json(f"{base}/text/tags")
    assert any(any(t.startswith("gradwatch/alerts") for t in tags) for tags in texts.values())
    assert "gradwatch/log10_grad_rms/0" in tags  # the log-scale magnitude series, the dead layer too
    floor = get_json(f"{base}/scalars/scalars?run={urllib.request.quote(run)}&tag=gradwatch/log10_grad_rms/0")
    assert {point[2] for point in floor} == {-30.0}  # a zero gradient drawn at the floor
    first = layout["category"][0]["chart"][0]
    assert "log10" in first["title"] and first["multiline"]["tag"] == ["^gradwatch/log10_grad_rms/.*"]


def test_every_alert_of_a_flush_is_visible_with_tensorboards_default_loader(dead_demo_served):
    """TensorBoard keeps one text per tag and step: all alerts of a flush must be in that one."""
    server, alerts = dead_demo_served
    dead_alerts = [a for a in alerts if a.kind == "dead_units"]
    assert sorted(a.layer for a in dead_alerts) == ["dead.0", "dead.1", "dead.2"] and {a.step for a in dead_alerts} == {4}
    texts = server.wait_for("text", "gradwatch/alerts/text_summary")
    run = next(r for r, tags in texts.items() if "three_branches" in r and "gradwatch/alerts/text_summary" in tags)
    shown = server.get(f"text/text?run={urllib.request.quote(run)}&tag=gradwatch/alerts/text_summary")
    html = " ".join(entry["text"] for entry in shown)
    for layer in ("dead.0", "dead.1", "dead.2"):
        assert f"<td>{layer}</td>" in html, html[:2000]
    assert "gradwatch-alerts-json" not in html  # the machine-readable copy is not shown


def test_the_window_of_an_alert_always_gets_its_heatmap(tmp_path):
    pytest.importorskip("matplotlib")
    import torch
    from tensorboard.backend.event_processing.event_accumulator import IMAGES, EventAccumulator
    from torch import nn

    from gradwatch import GradMonitor

    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    with GradMonitor(model, logdir=str(tmp_path), flush_every=5) as monitor:
        clock = _fake_heatmap_clock(monitor._stages.outputs.tensorboard)
        for step in range(60):  # 0.1 ms steps, 10 ms drawings: the budget leaves most windows undrawn
            clock.advance(1e-4)
            out = model(torch.randn(4, 4))
            if step == 37:
                out = out * float("nan")
            out.sum().backward()
            monitor.step()
            model.zero_grad()
    assert [(a.kind, a.step) for a in monitor.alerts] == [("nonfinite", 37)]
    events = EventAccumulator(str(tmp_path), size_guidance={IMAGES: 0})
    events.Reload()
    at_alerts = [image.step for image in events.Images("gradwatch/gradient_flow_at_alerts")]
    budgeted = [image.step for image in events.Images("gradwatch/gradient_flow")]
    assert at_alerts == [39]
    # budgeted: the first window, the second (the first drawing is not a measure of the cost), then
    # nothing until a drawing is within its budget of the time since the last one, and the last
    # window at close()
    assert budgeted == [4, 9, 59]


def test_two_demos_into_one_folder_are_two_runs(tmp_path, capsys):
    run_demo(logdir=str(tmp_path), steps=30, out=io.StringIO())
    run_demo(logdir=str(tmp_path), steps=30, fault="dead", out=io.StringIO())
    assert main(["report", str(tmp_path), "--format", "json"]) == 1
    runs = json.loads(capsys.readouterr().out)["runs"]
    names = sorted(r["run"] for r in runs)
    assert len(runs) == 2 and names[0].startswith("dead-") and names[1].startswith("none-")
    by_fault = {r["run"].split("-")[0]: r for r in runs}
    assert by_fault["none"]["alerts"] == [] and by_fault["dead"]["alerts"]


def test_heatmap_skipped_cleanly_without_matplotlib(tmp_path, monkeypatch, caplog):
    import logging

    import torch

    from gradwatch import GradMonitor

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    with caplog.at_level(logging.INFO, logger="gradwatch"):
        with GradMonitor(model, logdir=str(tmp_path), flush_every=2) as monitor:
            for _ in range(4):
                model(torch.randn(2, 3)).sum().backward()
                monitor.step()
                model.zero_grad()
    assert any("matplotlib" in r.getMessage() for r in caplog.records)
    from ..conftest import read_scalars

    assert sorted(read_scalars(str(tmp_path))["gradwatch/grad_norm/0"]) == [0, 1, 2, 3]


def test_report_lists_layers_in_module_order_not_alphabetically(tmp_path, capsys):
    import torch
    from torch import nn

    from gradwatch import GradMonitor

    model = nn.Sequential()
    model.add_module("zeta", nn.Linear(3, 4))
    model.add_module("alpha", nn.Linear(4, 1))
    with GradMonitor(model, logdir=str(tmp_path), flush_every=2) as monitor:
        for _ in range(3):
            model(torch.randn(2, 3)).sum().backward()
            monitor.step()
            model.zero_grad()
    assert main(["report", str(tmp_path), "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [layer["layer"] for layer in data["runs"][0]["layers"]] == ["zeta", "alpha"]


def test_optional_histograms_hold_the_gradients_of_the_flush_step(tmp_path):
    import glob

    import torch
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch import nn

    from gradwatch import GradMonitor

    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    with GradMonitor(model, logdir=str(tmp_path), flush_every=2, histograms=True) as monitor:
        for step in range(2):
            model(torch.randn(5, 3)).sum().backward()
            if step == 1:
                expected = torch.cat([p.grad.reshape(-1) for p in model[0].parameters()])
            monitor.step()
            model.zero_grad()
    acc = EventAccumulator(glob.glob(str(tmp_path / "events.out.tfevents.*"))[0], size_guidance={"histograms": 0})
    acc.Reload()
    assert {"gradwatch/hist/0", "gradwatch/hist/1"} <= set(acc.Tags()["histograms"])
    hist = acc.Histograms("gradwatch/hist/0")[0]
    assert hist.step == 1
    assert hist.histogram_value.num == expected.numel()
    assert hist.histogram_value.sum == pytest.approx(float(expected.sum()), rel=1e-5, abs=1e-6)
    assert hist.histogram_value.max == pytest.approx(float(expected.max()), rel=1e-6)


def test_no_histograms_by_default(demo_runs):
    import glob

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    path = glob.glob(os.path.join(demo_runs["none"][0], "**", "events.out.tfevents.*"), recursive=True)[0]
    acc = EventAccumulator(path, size_guidance={"histograms": 0})
    acc.Reload()
    assert acc.Tags()["histograms"] == []


def _window(layers, steps, seed):
    import numpy as np

    from gradwatch.flush.window import Window

    rng = np.random.default_rng(seed)
    shape = (steps, len(layers))
    zeros = np.zeros(shape)
    norms = 10.0 ** rng.uniform(-4, -2, shape)
    norms[0, 0] = 0.0  # a zero gradient: drawn grey
    return Window(
        list(range(steps)), list(layers), norms, zeros, zeros, zeros, zeros.astype(bool),
        np.ones(shape, bool), np.ones(shape, bool), np.ones(len(layers)), np.full(len(layers), 100.0),
        np.zeros(len(layers)), np.ones(steps),
    )  # fmt: skip


def test_heatmap_redraws_only_pixels_and_matches_a_full_draw():
    pytest.importorskip("matplotlib")
    import numpy as np

    from gradwatch.sinks.heatmap import GradientFlowHeatmap, log_rms

    layers = ["embed", "block.0", "block.1", "head"]
    first, second = _window(layers, 12, 0), _window(layers, 12, 1)
    reused = GradientFlowHeatmap()
    image_first = reused.render(first)
    image_second = reused.render(second)  # same layers, length and colour range: pixels only
    assert reused.full_draws == 1
    assert image_first.shape == image_second.shape and image_first.dtype == np.uint8
    assert not np.array_equal(image_first, image_second)

    reference = GradientFlowHeatmap()
    reference.render(first)  # the same colour range as `reused`
    reference._layout(second)  # a whole new figure for the second window, then its drawing
    reference._image.set_data(np.ma.masked_invalid(log_rms(second)))
    reference._draw_changing_parts(second, [])
    full = np.asarray(reference._figure.canvas.buffer_rgba())[:, :, :3]
    assert np.array_equal(image_second, full)

    louder = _window(layers, 12, 2)
    louder.grad_norm[3, 2] = 1e6  # far outside the colour range: a new layout
    reused.render(louder)
    assert reused.full_draws == 2
    reused.render(_window(layers[:3], 12, 3))  # other layers: a new layout
    assert reused.full_draws == 3


def _with_output_stats(w, seed, rms_decades=(-1.0, 1.0)):
    import numpy as np

    rng = np.random.default_rng(seed)
    shape = (len(w.steps), len(w.layers))
    rms = 10.0 ** rng.uniform(*rms_decades, shape)
    rms[::2, 1] = np.nan  # a layer sampled at half the steps only
    zeros = rng.uniform(0.0, 1.0, shape)
    rms[:, 2] = zeros[:, 2] = np.nan  # a layer without a value this window: no bar
    w.extra_stats = {"act_rms": rms, "act_zero_fraction": zeros}
    return w


def test_layer_outputs_chart_redraws_only_bars_and_matches_a_full_draw():
    # #30: laid out from scratch the companion image cost 90-190 ms at every heatmap; it is now
    # laid out once per (layers, statistics, log range) and redrawn over a saved background.
    pytest.importorskip("matplotlib")
    import numpy as np

    from gradwatch.sinks.activations import LayerOutputsChart, window_means

    layers = ["embed", "block.0", "block.1", "head"]
    first = _with_output_stats(_window(layers, 12, 0), 0)
    second = _with_output_stats(_window(layers, 12, 1), 1)
    reused = LayerOutputsChart()
    image_first, image_second = reused.render(first), reused.render(second)
    assert reused.full_draws == 1
    assert image_first.shape == image_second.shape and image_first.dtype == np.uint8
    assert image_first.shape[1] == 360 and not np.array_equal(image_first, image_second)
    # Each bar is the layer's mean over the steps that have a value (computed here with numpy),
    # none for the layer without one.
    for name, _, bars in reused._panels:
        expected = np.nanmean(second.extra_stats[name][:, [0, 1, 3]], axis=0)
        widths = np.array([bar.get_width() for bar in bars])
        np.testing.assert_allclose(widths[[0, 1, 3]], expected, rtol=1e-12)
        assert widths[2] == 0.0

    reference = LayerOutputsChart()
    reference.render(first)  # the same log range as `reused`
    reference._layout(second, ["act_rms", "act_zero_fraction"])  # a whole new figure, then its drawing
    reference._draw_changing_parts(second, window_means(second))
    full = np.asarray(reference._figure.canvas.buffer_rgba())[:, :, :3]
    assert np.array_equal(image_second, full)

    reused.render(_with_output_stats(_window(layers, 12, 2), 2, rms_decades=(-1.0, 4.0)))  # beyond the range
    assert reused.full_draws == 2
    reused.render(_with_output_stats(_window(layers, 12, 3), 3))  # back inside: the range only grows
    assert reused.full_draws == 2
    reused.render(_with_output_stats(_window(layers + ["out"], 12, 4), 4))  # other layers: a new layout
    assert reused.full_draws == 3


class _FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def _fake_heatmap_clock(sink, drawing_seconds: float = 1e-2) -> _FakeClock:
    """Give the sink a clock the test moves: each step advances it, each drawing takes ``drawing_seconds``."""
    clock = _FakeClock()
    sink.use_clock(clock)
    draw = sink._add_heatmap

    def timed_draw(*args, **kwargs):
        clock.advance(drawing_seconds)
        return draw(*args, **kwargs)

    sink._add_heatmap = timed_draw
    return clock


def _heatmap_steps(tmp_path, budget, steps=7, step_seconds=1e-4):
    import torch
    from tensorboard.backend.event_processing.event_accumulator import IMAGES, EventAccumulator

    from gradwatch import GradMonitor

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    with GradMonitor(model, logdir=str(tmp_path), flush_every=2) as monitor:
        if budget is not None:
            monitor._stages.outputs.tensorboard.heatmap_budget = budget
        clock = _fake_heatmap_clock(monitor._stages.outputs.tensorboard)
        for _ in range(steps):  # full windows of 2 steps, the last one partial, flushed by close()
            clock.advance(step_seconds)  # a drawing takes 10 ms on this clock
            model(torch.randn(2, 3)).sum().backward()
            monitor.step()
            model.zero_grad()
    events = EventAccumulator(str(tmp_path), size_guidance={IMAGES: 0})
    events.Reload()
    images = events.Images("gradwatch/gradient_flow")
    assert all(image.encoded_image_string.startswith(b"\x89PNG") for image in images)
    return [image.step for image in images]


def test_heatmap_written_at_every_flush_within_its_budget(tmp_path):
    pytest.importorskip("matplotlib")
    assert _heatmap_steps(tmp_path, budget=float("inf")) == [1, 3, 5, 6]


def test_heatmap_of_tiny_steps_is_spaced_out_by_its_cost_but_first_and_last_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    # Steps of 0.1 ms: a 10 ms drawing at every flush would dwarf training. Of 21 windows: the
    # first, the second (the first drawing is not a measure of the cost) and the last.
    assert _heatmap_steps(tmp_path, budget=None, steps=41) == [1, 3, 40]


def test_heatmap_budget_draws_again_once_a_drawing_is_a_quarter_percent_of_the_time():
    pytest.importorskip("matplotlib")
    import tempfile

    from gradwatch.sinks.tensorboard import TensorBoardSink

    assert TensorBoardSink.heatmap_budget == 0.0025
    # 11 ms steps, 10 ms drawings, windows of 2 steps: a drawing is due when 4 s have passed since
    # the last one ended. The second drawing (step 3) ends at 64 ms on the test's clock (4 steps,
    # 2 drawings); the flush of step s comes at (s + 1) x 11 ms + 20 ms: s = 367 is the first at
    # least 4 s later. That drawing ends at 4078 ms, and the first flush 4 s after it (one more
    # drawing's 10 ms on the clock) is step 731; the last window is drawn at close().
    with tempfile.TemporaryDirectory() as tmp:
        steps = _heatmap_steps(tmp, budget=None, steps=900, step_seconds=11e-3)
    assert steps == [1, 3, 367, 731, 899]


def test_the_heatmaps_companion_image_shows_each_layers_output_statistics(tmp_path):
    # Drawn with the heatmap, under gradwatch/layer_outputs: one bar per layer and statistic, the
    # window's mean over its sampled steps (a layer with half its outputs exactly zero shows 0.5).
    import glob

    import torch
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch import nn

    from gradwatch import GradMonitor
    from gradwatch.sinks.activations import window_means

    pytest.importorskip("matplotlib")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))
    with torch.no_grad():
        model[2].weight[:8].zero_()
        model[2].bias[:8].zero_()
    outputs = []
    model[2].register_forward_hook(lambda m, a, o: outputs.append(o.detach()))
    monitor = GradMonitor(model, flush_every=5, detail="full", logdir=str(tmp_path))
    for _ in range(5):
        model(torch.randn(4, 8)).sum().backward()
        monitor.step()
        model.zero_grad()
    monitor.close()
    means = window_means(monitor.last_window)
    expected = float(torch.stack([(o == 0).double().mean() for o in outputs]).mean())
    assert means["act_zero_fraction"][1] == pytest.approx(expected) == pytest.approx(0.5)
    files = glob.glob(str(tmp_path / "events.out.tfevents.*"))
    acc = EventAccumulator(files[0], size_guidance={"images": 0})
    acc.Reload()
    assert "gradwatch/layer_outputs" in acc.Tags()["images"]
    image = acc.Images("gradwatch/layer_outputs")[-1]
    assert image.step == 4 and image.width == 360 and image.height > 100


def test_report_explains_a_value_over_a_threshold_without_an_alert(tmp_path, capsys):
    # One 25-step window of units that fire on ~1% of rows, 8 rows a step: on the default's two
    # sampled steps (16 rows, too few to judge) most of them look silent, which the table shows as
    # "dead", over dead_fraction, with no alert (the rule needs 32 rows, then every step).
    # The report says why, with the run's own thresholds (dead_fraction=0.4 here, not the default).
    import torch

    from gradwatch import GradMonitor, HealthConfig

    from ..detect.test_detection_rules import _rarely_active_layer

    gate, model = _rarely_active_layer()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = GradMonitor(model, flush_every=25, optimizer=opt, logdir=str(tmp_path / "run"),
                          config=HealthConfig(dead_fraction=0.4))  # fmt: skip
    for _ in range(25):
        model(torch.randn(8, 16)).sum().backward()
        monitor.step()
        opt.step()
        opt.zero_grad()
    monitor.close()
    assert not monitor.alerts
    assert main(["report", str(tmp_path), "--format", "json"]) == 0
    run = json.loads(capsys.readouterr().out)["runs"][0]
    dead = {layer["layer"]: layer["dead_fraction"] for layer in run["layers"]}
    assert dead["0"] >= 0.4 and dead["2"] < 0.4
    assert len(run["notes"]) == 1 and run["notes"][0].startswith("0: dead")
    assert "dead_fraction 40%" in run["notes"][0] and "no dead_units alert" in run["notes"][0]
    main(["report", str(tmp_path)])
    assert "over a threshold without an alert:" in capsys.readouterr().out
