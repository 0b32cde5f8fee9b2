"""No host sync between flushes, clean removal, clear errors on bad input."""

from __future__ import annotations

import gc
import logging
import weakref
from contextlib import contextmanager

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from gradwatch import GradMonitor, HealthConfig


class SyncCounter(TorchDispatchMode):
    """Counts ops that read a device value back to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        is_d2h = func is torch.ops.aten._to_copy.default and kwargs.get("device") is not None and (
            torch.device(kwargs["device"]).type == "cpu" and args[0].device.type != "cpu"
        )
        if func is torch.ops.aten._local_scalar_dense.default or is_d2h:
            self.count += 1
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


@contextmanager
def count_host_reads(monkeypatch):
    """Dispatch-level sync counter plus counting wrappers on the Python-level escapes (patched
    for the block only: other patches of the test stay)."""
    counter = SyncCounter()
    with pytest.MonkeyPatch.context() as patch:
        for method in ("item", "tolist", "numpy", "cpu"):
            original = getattr(torch.Tensor, method)

            def wrapper(self, *a, _orig=original, _name=method, **k):
                counter.count += 1
                counter.ops.append(f"Tensor.{_name}")
                return _orig(self, *a, **k)

            patch.setattr(torch.Tensor, method, wrapper)
        with counter:
            yield counter


def _train(model, opt, monitor, steps, monkeypatch, micro_batches=2):
    counts = []
    for _ in range(steps):
        with count_host_reads(monkeypatch) as c:
            for _ in range(micro_batches):
                out = model(torch.randn(8, 3, 8, 8))
                out.square().mean().backward()
            if monitor is not None:
                monitor.step()
            opt.step()
            opt.zero_grad()
        counts.append((c.count, list(c.ops)))
    return counts


def _cnn():
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(inplace=True),
        nn.Flatten(),
        nn.Linear(4 * 64, 5),
    )


def test_counter_detects_a_sync(monkeypatch):
    with count_host_reads(monkeypatch) as c:
        torch.ones(2).sum().item()
    assert c.count >= 1  # the probe is not vacuous


def test_no_host_sync_between_flushes(monkeypatch, param_path):
    # Both parameter paths, and with them both read-backs of the per-step checks (host views of
    # the CPU buffer; non-blocking copies into a staging ring, the accelerators' path).
    torch.manual_seed(0)
    model = _cnn()
    opt = torch.optim.Adam(model.parameters())
    baseline = _train(model, opt, None, 3, monkeypatch)
    monitor = GradMonitor(model, flush_every=5)
    _train(model, opt, monitor, 5, monkeypatch)  # warm up: first window, caches built, one flush
    monitored = _train(model, opt, monitor, 4, monkeypatch)  # steps 5..8: none of them flushes
    assert monitor._stages.detection.judge._readback.host_path == (param_path == "cpu-path") and monitor._stages.detection.per_step
    base_count = max(c for c, _ in baseline)
    for count, ops in monitored:
        assert count <= base_count, f"gradwatch read the device back between flushes: {ops}"
    monitor.close()


def test_close_removes_every_hook_and_releases_model():
    model = _cnn()
    before = {
        n: (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
        for n, m in model.named_modules()
    }
    monitor = GradMonitor(model, flush_every=2)
    assert any(len(m._forward_hooks) for m in model.modules())
    for _ in range(3):
        model(torch.randn(2, 3, 8, 8)).sum().backward()
        monitor.step()
        model.zero_grad()
    monitor.close()
    monitor.close()  # idempotent
    after = {
        n: (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
        for n, m in model.named_modules()
    }
    assert after == before
    for p in model.parameters():
        assert not p._backward_hooks
        assert not getattr(p, "_post_accumulate_grad_hooks", None)
    ref = weakref.ref(model)
    del model, p
    gc.collect()
    assert ref() is None
    assert monitor.layers  # the monitor itself stays usable for reading


def test_context_manager_closes():
    model = nn.Linear(3, 1)
    with GradMonitor(model) as monitor:
        model(torch.randn(2, 3)).sum().backward()
        monitor.step()
    assert not model._forward_hooks
    with pytest.raises(RuntimeError, match="closed"):
        monitor.step()


def test_bad_input_errors_name_the_problem():
    with pytest.raises(TypeError, match="nn.Module"):
        GradMonitor(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="flush_every"):
        GradMonitor(nn.Linear(2, 2), flush_every=0)
    with pytest.raises(ValueError, match="flush_every"):
        GradMonitor(nn.Linear(2, 2), flush_every=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="flush_every=1000000000 with 1 monitored layers .* smaller flush_every"):
        GradMonitor(nn.Linear(2, 2), flush_every=10**9)  # would be 36 GB of buffer, not an allocator error
    with pytest.raises(ValueError, match=r"nope\*"):
        GradMonitor(nn.Sequential(nn.Linear(2, 2)), include=["0", "nope*"])
    with pytest.raises(ValueError, match="gone"):
        GradMonitor(nn.Sequential(nn.Linear(2, 2)), exclude="gone")
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no parameters that require grad"):
        GradMonitor(frozen)
    with pytest.raises(ValueError, match="no parameters that require grad"):
        GradMonitor(nn.ReLU())
    with pytest.raises(TypeError, match="HealthConfig"):
        GradMonitor(nn.Linear(2, 2), config={"dead_fraction": 0.5})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="logdir.*writer|writer.*logdir"):
        GradMonitor(nn.Linear(2, 2), logdir="x", writer=object())
    with pytest.raises(TypeError, match="GradScaler"):
        GradMonitor(nn.Linear(2, 2), scaler=object())


def test_failing_hook_warns_once_and_training_goes_on(caplog, monkeypatch):
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    monitor = GradMonitor(model, flush_every=2)

    def broken(*args, **kwargs):
        raise RuntimeError("forced failure")

    # what runs inside the forward hook of each layer (the taps call it through their class:
    # capture/taps.py, OutputTap._record_outputs)
    monkeypatch.setattr(type(monitor._recorder.cells.taps[0]), "record_output", broken)
    with caplog.at_level(logging.WARNING, logger="gradwatch"):
        for _ in range(4):
            model(torch.randn(2, 3)).sum().backward()
            monitor.step()
            model.zero_grad()
    failures = [r for r in caplog.records if "forced failure" in r.getMessage()]
    assert len(failures) == 2  # once per layer, not once per call
    assert model[0].weight.grad is None  # training loop ran to the end (zero_grad set None)
    monitor.close()


def test_dropping_an_unclosed_monitor_removes_its_hooks():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    monitor = GradMonitor(model, flush_every=5)
    model(torch.randn(2, 3)).sum().backward()
    monitor.step()
    ref = weakref.ref(monitor)
    del monitor
    gc.collect()
    assert ref() is None  # the hooks on the model do not keep the monitor alive
    assert all(not m._forward_hooks for m in model.modules())


def test_data_parallel_is_one_warning_that_says_what_is_not_recorded(caplog):
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    with caplog.at_level(logging.WARNING, logger="gradwatch"):
        monitor = GradMonitor(nn.DataParallel(model), flush_every=2)  # no GPU: runs the module itself
        for _ in range(2):
            model(torch.randn(3, 4)).sum().backward()
            monitor.step()
    said = [r.getMessage() for r in caplog.records if "DataParallel" in r.getMessage()]
    assert len(said) == 1 and "first GPU only" in said[0] and "DistributedDataParallel" in said[0]
    assert monitor.layers == ["module.0", "module.2"]
    monitor.close()


@pytest.mark.parametrize("failure", ["bad metrics callback", "hooks fail to register"])
def test_construction_that_fails_part_way_leaves_no_hook_and_no_thread(tmp_path, monkeypatch, failure):
    # A bad callback is refused before anything is built; a failure while the hooks go on (the
    # last stage: the writer thread is open and the optimizer hooks are registered by then) takes
    # down everything built so far before the error propagates.
    import threading

    from gradwatch import stages

    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = set(threading.enumerate())
    if failure == "bad metrics callback":
        with pytest.raises(TypeError, match="callback must be callable"):
            GradMonitor(model, logdir=str(tmp_path), optimizer=opt, metrics_callback=42)
    else:
        def refuse(*args, **kwargs):
            raise RuntimeError("no hooks today")

        monkeypatch.setattr(stages, "HookSet", refuse)
        with pytest.raises(RuntimeError, match="no hooks today"):
            GradMonitor(model, logdir=str(tmp_path), optimizer=opt)
    assert all(not m._forward_hooks for m in model.modules())
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    left = [t for t in set(threading.enumerate()) - before if t.is_alive()]
    assert left == [], left


def test_alerts_are_a_bounded_ring_and_checkpoints_stay_the_same_size():
    # A new condition at every step (a new layer each time): far more than KEEP_ALERTS onsets.
    from gradwatch.alerts import Finding
    from gradwatch.detect.tracker import KEEP_ALERTS, AlertTracker

    tracker = AlertTracker(remind_every=10, log_alerts=False, recovery_flushes=1, layers=["a"])
    sizes = []
    for k in range(3 * KEEP_ALERTS):
        tracker.raise_onsets([Finding("exploding", f"layer{k}", k, 1.0, 0.5, "")])
        if k % KEEP_ALERTS == KEEP_ALERTS - 1:
            sizes.append(len(tracker.state_dict()["alerts"]))
    assert len(tracker.alerts) == KEEP_ALERTS and tracker.raised == 3 * KEEP_ALERTS
    assert [a.layer for a in tracker.alerts][-1] == f"layer{3 * KEEP_ALERTS - 1}"  # the most recent kept
    assert sizes == [KEEP_ALERTS] * 3


def test_help_of_the_public_classes_lists_every_argument():
    import inspect

    from gradwatch import GradWatch
    from gradwatch.hf import GradWatchCallback

    for cls in (GradMonitor, GradWatch, GradWatchCallback):
        doc = inspect.getdoc(cls)
        for name in inspect.signature(cls.__init__).parameters:
            if name != "self":
                assert f"{name}:" in doc or f"{name} " in doc or f"/ {name}" in doc, (cls.__name__, name)
    assert "Args:" in inspect.getdoc(GradMonitor) and "Raises:" in inspect.getdoc(GradMonitor)
    assert inspect.getdoc(HealthConfig).count("\n") > 10  # every threshold documented


def test_step_numbers_that_do_not_grow_warn_once_and_bad_types_are_a_type_error(caplog):
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    monitor = GradMonitor(model, flush_every=10)
    with caplog.at_level(logging.WARNING, logger="gradwatch"):
        for step in (5, 6, 6, 3, 7):
            model(torch.randn(2, 3)).sum().backward()
            monitor.step(step)
            model.zero_grad()
    assert sum("step numbers must grow" in r.getMessage() for r in caplog.records) == 1
    for bad in ("abc", 2.5, True):
        with pytest.raises(TypeError, match="step\\(global_step\\) takes an int"):
            monitor.step(bad)
    monitor.step(torch.tensor(8))  # an integer tensor is its value
    monitor.close()


# ------------------------------------------------------------ strict mode: a bug is not a logged warning
def _probe_with_a_bug(monitor):
    def broken(slot):
        raise AttributeError("a bug inside gradwatch")

    monitor._stages.pipeline.units_probe.after_step = broken


def _train_two_steps(monitor, model):
    for _ in range(2):
        model(torch.randn(8, 4)).sum().backward()
        monitor.step()
        model.zero_grad()


def test_strict_mode_raises_a_programming_error_the_guards_would_log():
    assert __import__("os").environ["GRADWATCH_STRICT"] == "1"  # the suite runs strict (conftest.py)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    monitor = GradMonitor(model, flush_every=10)
    _probe_with_a_bug(monitor)
    with pytest.raises(AttributeError, match="a bug inside gradwatch"):
        _train_two_steps(monitor, model)
    monitor.close()


def test_without_strict_mode_the_same_error_is_one_warning_and_training_goes_on(lenient, caplog):
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    monitor = GradMonitor(model, flush_every=10)
    _probe_with_a_bug(monitor)
    with caplog.at_level(logging.WARNING, logger="gradwatch"):
        _train_two_steps(monitor, model)
    monitor.close()
    failed = [r.getMessage() for r in caplog.records if "the dead-unit check failed" in r.getMessage()]
    assert len(failed) == 1 and "AttributeError: a bug inside gradwatch" in failed[0]


# ------------------------------------------------------------ gradients taken before step(): said, not silent
def _train_with_gradients_cleared_in_backward(clear: bool, caplog) -> GradMonitor:
    """An optimizer stepped inside backward that clears each p.grad as it arrives (as DeepSpeed ZeRO
    and optimizer-in-backward do): at step() no parameter holds a gradient."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    if clear:
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    monitor = GradMonitor(model, flush_every=5)
    with caplog.at_level(logging.WARNING, logger="gradwatch"):
        for _ in range(10):
            model(torch.randn(8, 4)).sum().backward()
            monitor.step()
            model.zero_grad()
        monitor.close()
    return monitor


def test_gradients_taken_before_step_are_said_once_not_silently_missing(caplog):
    _train_with_gradients_cleared_in_backward(True, caplog)
    said = [r.getMessage() for r in caplog.records if "no parameter had a .grad at step()" in r.getMessage()]
    assert len(said) == 1 and "DeepSpeed ZeRO" in said[0]
    caplog.clear()
    _train_with_gradients_cleared_in_backward(False, caplog)  # gradients in p.grad: nothing to say
    assert not [r for r in caplog.records if "no parameter had a .grad" in r.getMessage()]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled-kv-cache"])
def test_hands_off_weights_gradients_and_optimizer_state_equal_an_unmonitored_twin(compiled):
    # gradwatch observes: after training with it, every weight and optimizer state is bit-equal to
    # an unmonitored twin's; p.grad is the very tensor backward made; compiled with a KV-cache
    # switch on (where a layer's output is handed on as a copy: capture/grad_passthrough.py) too;
    # and the one dynamo setting gradwatch changes while attached is the user's again after close().
    import copy

    import torch._dynamo

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = type("Config", (), {"use_cache": True})()
            self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Linear(16, 16), nn.LayerNorm(16))
            self.head = nn.Linear(16, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.body(x)
            h += x.repeat(1, 2)
            return self.head(h)

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Net()
    twin = copy.deepcopy(model)
    setting = torch._dynamo.config.skip_nnmodule_hook_guards
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, twin)]
    monitor = GradMonitor(model, flush_every=5, optimizer=opts[0])
    runs = [torch.compile(m, backend="aot_eager") if compiled else m for m in (model, twin)]
    batches = torch.Generator().manual_seed(1)
    for _ in range(12):
        x, y = torch.randn(4, 8, generator=batches), torch.randint(0, 3, (4,), generator=batches)
        for run, opt in zip(runs, opts):
            nn.functional.cross_entropy(run(x), y).backward()
        grads = [p.grad for p in model.parameters()]
        monitor.step()
        assert all(p.grad is g for p, g in zip(model.parameters(), grads))
        for opt in opts:
            opt.step()
            opt.zero_grad()
    monitor.close()
    assert torch._dynamo.config.skip_nnmodule_hook_guards == setting
    for mine, theirs in zip(model.parameters(), twin.parameters()):
        assert torch.equal(mine, theirs)
    for mine, theirs in zip(opts[0].state.values(), opts[1].state.values()):
        assert all(torch.equal(mine[k], theirs[k]) for k in ("exp_avg", "exp_avg_sq"))
    assert monitor.last_window is not None and (monitor.last_window.out_grad_norm > 0).any()
    torch._dynamo.reset()
