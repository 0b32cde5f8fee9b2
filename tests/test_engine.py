"""The engine's guarantees: declared layout, exact values at any magnitude, no references kept,
failures that never reach the training loop, and per-folder dashboard metadata."""

from __future__ import annotations

import gc
import logging
import weakref

import numpy as np
import pytest
import torch
from torch import nn

from gradwatch import GradMonitor, HealthConfig
from gradwatch.capture.reductions import CpuBlasStats, ForeachStats, StepRows, _CpuSlots

from .conftest import read_scalars
from .reference import own_grad_norm

# Every test here runs on both parameter-statistics paths (see conftest.param_path).
pytestmark = pytest.mark.usefixtures("param_path")


# ------------------------------------------------------------- declared layout
def test_layout_is_declared_at_attach_from_module_metadata():
    model = nn.Sequential(
        nn.Conv2d(3, 5, 3), nn.BatchNorm2d(5), nn.Flatten(), nn.Linear(20, 7), nn.LayerNorm(7),
        nn.Embedding(10, 6), nn.LSTM(6, 4, bidirectional=True),
    )  # fmt: skip
    monitor = GradMonitor(model, flush_every=4)
    units = dict(zip(monitor.layers, monitor._recorder.layout.unit_count.tolist()))
    assert units == {"0": 5, "1": 5, "3": 7, "4": 7, "5": 6, "6": 8}
    before = monitor._recorder.buffer.layout()
    nbytes = monitor.buffer_bytes
    x = torch.randn(2, 3, 4, 4)
    model[4](model[3](model[2](model[1](model[0](x))))).sum().backward()  # the others never run
    monitor.step()
    assert monitor._recorder.buffer.layout() == before and monitor.buffer_bytes == nbytes
    monitor.close()


# ------------------------------------------------------------- huge gradients
@pytest.mark.parametrize("width", [8, 256], ids=["foreach-path", "cpu-blas-path"])
def test_finite_gradient_beyond_float32_squares_has_exact_norm_and_explodes(width):
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 4))
    monitor = GradMonitor(model, flush_every=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    expected = None
    for step in range(10):
        model(torch.randn(16, width)).square().sum().backward()
        if step == 6:  # as a diverging SGD run reaches in two steps: squares overflow float32
            with torch.no_grad():
                model[0].weight.grad.mul_(1e20)
            grads = torch.cat([p.grad.reshape(-1).double() for p in model[0].parameters()])
            expected = float(torch.linalg.vector_norm(grads))
            assert torch.isinf(model[0].weight.grad.square().sum())  # float32 cannot hold it
        monitor.step()
        opt.step()
        opt.zero_grad()
    w = monitor.last_window
    assert w.grad_norm[6, 0] == pytest.approx(expected, rel=1e-3)
    assert w.nonfinite[6, 0] == 0 and np.isfinite(w.global_grad_norm[6])
    exploding = [a for a in monitor.alerts if a.kind == "exploding" and a.layer == "0"]
    assert [a.step for a in exploding] == [6]
    assert not [a for a in monitor.alerts if a.kind == "nonfinite"]
    monitor.close()


def test_output_gradient_beyond_float32_squares_has_exact_norm():
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 1))
    monitor = GradMonitor(model, flush_every=1, config=HealthConfig(exploding_abs_norm=1e300))
    out = model[0](torch.randn(3, 4))
    out.retain_grad()
    (model[1](out).sum() * 1e25).backward()
    expected = float(torch.linalg.vector_norm(out.grad.double()))
    monitor.step()
    assert monitor.last_window.out_grad_norm[0, 0] == pytest.approx(expected, rel=1e-6)
    monitor.close()


# ------------------------------------------------------------- GradScaler and dead_eps
@pytest.mark.parametrize("use_scaler", [False, True], ids=["fp32", "gradscaler"])
def test_dead_eps_is_compared_with_unscaled_gradients(use_scaler):
    lin = nn.Linear(4, 4)
    mask = torch.tensor([1.0, 1.0, 1e-7, 0.0])  # unit 2: |g| ~ 1e-7 (dead at eps 1e-3), unit 3: zero
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16) if use_scaler else None
    monitor = GradMonitor(lin, flush_every=3, config=HealthConfig(dead_eps=1e-3), scaler=scaler)
    for _ in range(3):
        loss = (lin(torch.randn(8, 4)) * mask).sum()
        (scaler.scale(loss) if scaler else loss).backward()
        monitor.step()
        lin.zero_grad()
    assert monitor.last_window.dead_fraction[0] == pytest.approx(0.5)
    monitor.close()


# ------------------------------------------------------------- no references after close
class _RootParam(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(6))  # the root owns a parameter: it is a layer
        self.body = nn.Linear(6, 6)

    def forward(self, x):
        return self.body(x) * self.scale


def test_closed_monitor_that_lives_on_keeps_no_reference_to_the_model():
    model = _RootParam()
    monitor = GradMonitor(model, flush_every=2)
    assert monitor.layers == ["<root>", "body"]
    for _ in range(3):
        model(torch.randn(4, 6)).sum().backward()
        monitor.step()
        model.zero_grad()
    monitor.close()
    model_ref, param_ref = weakref.ref(model), weakref.ref(model.body.weight)
    del model
    gc.collect()
    assert model_ref() is None and param_ref() is None
    # the monitor stays readable
    assert monitor.layers == ["<root>", "body"] and monitor.last_window is not None
    assert monitor.alerts == []


# ------------------------------------------------------------- failures stay inside
@pytest.mark.parametrize("full_from", ["the-start", "after-opening"])
def test_a_disk_that_fails_every_write_costs_a_few_warnings_not_the_run(tmp_path, monkeypatch, caplog, full_from):
    from tensorboard.summary.writer import event_file_writer

    def no_space(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    first = nn.Linear(16, 32)
    with torch.no_grad():
        first.bias.fill_(-100.0)  # a dead layer: an alert to return
    model = nn.Sequential(first, nn.ReLU(), nn.Linear(32, 4))
    if full_from == "the-start":
        monkeypatch.setattr(event_file_writer.EventFileWriter, "add_event", no_space)
    returned = []
    # the monitor is built inside the block: opening the writer is where "the-start" first fails
    with caplog.at_level(logging.WARNING, logger="gradwatch"):
        monitor = GradMonitor(model, logdir=str(tmp_path), flush_every=5)
        if full_from == "after-opening":
            assert monitor._stages.outputs.tensorboard is not None
            monkeypatch.setattr(event_file_writer.EventFileWriter, "add_event", no_space)
            monkeypatch.setattr(event_file_writer.EventFileWriter, "flush", no_space)
            monkeypatch.setattr(event_file_writer.EventFileWriter, "close", no_space)
        for _ in range(40):
            model(torch.randn(8, 16)).sum().backward()
            returned += monitor.step()
            model.zero_grad()
        monitor.close()
    assert any(a.kind == "dead_units" for a in returned)
    writing = [r for r in caplog.records if "No space left" in r.getMessage()]
    assert 1 <= len(writing) <= 3, [r.getMessage() for r in writing]


def test_an_exception_inside_the_checks_is_one_warning(monkeypatch, caplog):
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    monitor = GradMonitor(model, flush_every=2)

    def broken(window):
        raise ZeroDivisionError("forced failure in the checks")

    monkeypatch.setattr(monitor._stages.detection.checks, "check", broken)
    with caplog.at_level(logging.WARNING, logger="gradwatch"):
        for _ in range(8):
            model(torch.randn(2, 3)).sum().backward()
            assert monitor.step() == []
            model.zero_grad()
        monitor.close()
    failures = [r for r in caplog.records if "forced failure in the checks" in r.getMessage()]
    assert len(failures) == 1
    assert monitor.last_window is not None and len(monitor.last_window.steps) == 2


def test_an_exception_inside_step_keeps_the_window_aligned(monkeypatch, caplog):
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    monitor = GradMonitor(model, flush_every=3)
    record, calls = monitor._recorder.param_stats.record, [0]

    def sometimes(rows, present, *riders):
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("forced failure in step")
        return record(rows, present, *riders)

    monkeypatch.setattr(monitor._recorder.param_stats, "record", sometimes)
    with caplog.at_level(logging.WARNING, logger="gradwatch"):
        for _ in range(3):
            model(torch.randn(2, 3)).sum().backward()
            monitor.step()
            model.zero_grad()
    w = monitor.last_window
    assert w.steps == [0, 1, 2]  # the third step() flushed, as without the failure
    assert w.has_grad[:, 0].tolist() == [True, False, True]  # the failed step is left out
    assert sum("forced failure in step" in r.getMessage() for r in caplog.records) == 1
    monitor.close()


# ------------------------------------------------------------- layout per folder
def test_resuming_into_a_new_folder_writes_layout_and_layer_list_there(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))

    def run(folder, state=None):
        monitor = GradMonitor(model, logdir=str(tmp_path / folder), flush_every=2)
        if state is not None:
            monitor.load_state_dict(state)
        for _ in range(2):
            model(torch.randn(2, 4)).sum().backward()
            monitor.step()
            model.zero_grad()
        state = monitor.state_dict()
        monitor.close()
        events = EventAccumulator(str(tmp_path / folder))
        events.Reload()
        return state, events

    state, v0 = run("v0")
    _, v1 = run("v1", state)
    _, v0_again = run("v0", state)  # resumed into the same folder: not written a second time
    for events in (v0, v1):
        assert any(t.startswith("gradwatch/layers") for t in events.Tags()["tensors"])
        assert events.summary_metadata  # the custom-scalars layout is a tensor with its plugin
    layer_texts = [t for t in v0_again.Tags()["tensors"] if t.startswith("gradwatch/layers")]
    assert len(v0_again.Tensors(layer_texts[0])) == 1


def test_report_reads_structured_alerts_not_message_wording(tmp_path, monkeypatch, capsys):
    import gradwatch.detect.tracker as alerts_module
    from gradwatch.cli import main
    from gradwatch.demo import run_demo

    run_demo(logdir=str(tmp_path / "plain"), steps=30, fault="dead", out=open("/dev/null", "w"))
    monkeypatch.setattr(alerts_module, "format_message", lambda f: f"Heads up! Something odd near {f.layer!r}.")
    run_demo(logdir=str(tmp_path / "reworded"), steps=30, fault="dead", out=open("/dev/null", "w"))
    import json

    kinds = {}
    for folder in ("plain", "reworded"):
        assert main(["report", str(tmp_path / folder), "--format", "json"]) == 1
        data = json.loads(capsys.readouterr().out)
        kinds[folder] = sorted((a["kind"], a["layer"], a["step"]) for a in data["runs"][0]["alerts"])
    assert kinds["plain"] == kinds["reworded"] and kinds["plain"]
    alert = next(a for a in data["runs"][0]["alerts"] if a["kind"] == "dead_units")
    assert alert["layer"] == "0" and alert["message"].startswith("Heads up!")


# ------------------------------------------------------------- the two parameter strategies
def _reference(grads):
    flat = [g.reshape(-1).double() for g in grads]
    finite = [f[torch.isfinite(f)] for f in flat]
    return (
        [float(torch.linalg.vector_norm(f)) ** 2 for f in flat],
        [float(g.abs().max()) for g in grads],
        [float((~torch.isfinite(f)).sum()) for f, fin in zip(flat, finite)],
    )


@pytest.mark.parametrize("strategy", ["foreach", "foreach-cpu-slots", "foreach-cpu-slots-and-dots", "cpu-blas"])
def test_each_parameter_strategy_fills_every_statistic_of_its_tensors(strategy):
    torch.manual_seed(0)
    # (the last one transposed: not contiguous, as a channels-last or tied-transposed gradient)
    grads = [torch.randn(300, 200), torch.randn(256, 130), torch.randn(40000), torch.randn(190, 180).t()]
    grads[1][3, 4] = float("nan")
    grads[1][5, 6] = float("inf")
    grads[2].mul_(1e21)  # finite, but its squares overflow float32
    k = len(grads)
    rows = StepRows(torch.full((k,), -1.0, dtype=torch.float64), torch.full((k,), -1.0, dtype=torch.float64),
                    torch.zeros(k, dtype=torch.float64))  # fmt: skip
    if strategy == "foreach":
        ForeachStats(torch.float64).reduce(grads, rows, None)  # the accelerator path, run on the CPU
    elif strategy == "foreach-cpu-slots":
        ForeachStats(torch.float64).reduce(grads, rows, _CpuSlots(k))
    elif strategy == "foreach-cpu-slots-and-dots":  # the first by the foreach norm, the rest by dots
        ForeachStats(torch.float64).reduce(grads, rows, _CpuSlots(k), dots_from=1)
    else:
        CpuBlasStats().reduce(grads, rows, _CpuSlots(k))
    sq, mx, nonfinite = _reference(grads)
    for i in range(k):
        assert rows.nonfinite[i].item() == nonfinite[i], i
        if nonfinite[i]:
            assert not np.isfinite(rows.sq[i].item())
            continue
        assert rows.sq[i].item() == pytest.approx(sq[i], rel=1e-5), i
        assert rows.max[i].item() == pytest.approx(mx[i], rel=1e-6), i


def test_strategies_are_named_per_tensor(param_path):
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 2))
    stats = GradMonitor(model)._recorder.param_stats
    kinds = {stats.params[j].shape: stats.strategy_of(j) for j in range(stats.n_params)}
    # the device-agnostic path reduces every tensor with foreach kernels, as on an accelerator
    assert kinds[torch.Size([256, 256])] == ("cpu-blas" if param_path == "cpu-path" else "foreach")
    assert kinds[torch.Size([2, 256])] == kinds[torch.Size([256])] == "foreach"
    assert stats.counts_every_step == (param_path == "cpu-path")


def test_a_flush_that_fails_while_prepared_drops_its_whole_window(monkeypatch, caplog):
    # A NaN in the forward pass at step 1, in a window whose flush fails while it is prepared:
    # the per-step check reports it at its step; the window is dropped whole, and nothing of it
    # (the NaN) shows up in the next window.
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    monitor = GradMonitor(model, flush_every=3)
    recorder = monitor._recorder
    prepare = recorder.prepare_flush
    calls = [0]

    def failing_once():
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("forced failure while preparing the flush")
        prepare()

    monkeypatch.setattr(recorder, "prepare_flush", failing_once)
    with caplog.at_level(logging.WARNING, logger="gradwatch"):
        for step in range(6):
            x = torch.randn(5, 4)
            if step == 1:
                x[0, 0] = float("nan")
            model(x).sum().backward()
            monitor.step()
            model.zero_grad(set_to_none=True)
    assert any("preparing a flush" in r.getMessage() for r in caplog.records)
    assert monitor.last_window.steps == [3, 4, 5]
    assert not monitor.last_window.fwd_nonfinite.any() and not monitor.last_window.nonfinite.any()
    assert [(a.kind, a.step, a.layer) for a in monitor.alerts] == [("nonfinite", 1, "0")]
    monitor.close()


# ------------------------------------------------------------- moved or cast after attaching
@pytest.mark.parametrize("cast", ["double", "bfloat16"])
def test_statistics_follow_a_cast_after_attaching(cast):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(300, 200), nn.ReLU(), nn.Linear(200, 3))  # a large tensor too
    monitor = GradMonitor(model, flush_every=3, detail="full")
    getattr(model, cast)()
    dtype = next(model.parameters()).dtype
    expected = []
    for _ in range(3):
        model(torch.randn(8, 300, dtype=dtype)).float().square().sum().backward()
        expected.append([own_grad_norm(model[i]) for i in (0, 2)])
        monitor.step()
        model.zero_grad()
    w = monitor.last_window
    assert np.isfinite(w.grad_norm).all() and np.isfinite(w.out_grad_norm).all()
    assert w.grad_norm == pytest.approx(np.array(expected), rel=1e-3)
    monitor.close()


def test_parameters_replaced_after_attaching_are_one_clear_error_not_nan(caplog, tmp_path):
    # Loading a checkpoint with assign=True replaces the parameters: gradwatch would read stale
    # ones. One ERROR says what to do, and nothing (no NaN) is written from then on. (A move that
    # keeps the parameters, model.to("cuda"), raises ModelMoved: tests/test_gpu.py.)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    monitor = GradMonitor(model, flush_every=2, logdir=str(tmp_path))
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        monitor.step()
        model.zero_grad()
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    with caplog.at_level(logging.WARNING, logger="gradwatch"):
        for _ in range(4):
            model(torch.randn(3, 4)).sum().backward()
            monitor.step()
            model.zero_grad()
        monitor.close()
    errors = [r for r in caplog.records if "were replaced after gradwatch attached" in r.getMessage()]
    assert len(errors) == 1 and errors[0].levelno == logging.ERROR
    assert "create the monitor after the model is materialised" in errors[0].getMessage()
    written = read_scalars(str(tmp_path))["gradwatch/grad_norm/0"]
    assert sorted(written) == [0, 1] and all(np.isfinite(v) for v in written.values())


def test_a_model_on_the_meta_device_is_refused_with_the_remedy():
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="meta device.*after materialising"):
        GradMonitor(model)



def test_the_torch_2_3_fallback_of_foreach_norm_gives_the_same_values():
    # torch 2.3 has no dtype argument on _foreach_norm: the per-tensor fallback must agree.
    import gradwatch.capture.devices as devices

    tensors = [torch.randn(300, 200), torch.randn(7) * 1e20, torch.randn(0)]
    fast = [float(t) for t in devices.foreach_norm(tensors, 2, torch.float64)]
    slow = [float(t) for t in devices._norms_one_by_one(tensors, 2, torch.float64)]
    expected = [float(torch.linalg.vector_norm(t.double())) for t in tensors]
    assert fast == pytest.approx(expected, rel=1e-12) and slow == pytest.approx(expected, rel=1e-12)
