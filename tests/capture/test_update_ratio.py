"""update_ratio: ||w_after - w_before|| / ||w_before|| per layer, against the test's own weight copies."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from gradwatch import GradMonitor, HealthConfig

from ..conftest import read_scalars

LAYERS = ("0", "2", "4")


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_every_written_update_ratio_equals_the_ratio_of_weight_copies(tmp_path, name):
    torch.manual_seed(0)
    model = _mlp()
    opt = _optimizer(name, model.parameters())
    monitor = GradMonitor(model, logdir=str(tmp_path), flush_every=4, optimizer=opt)
    expected: dict[int, dict[str, float]] = {}
    for step in range(12):
        x = torch.randn(8, 16)
        nn.functional.mse_loss(model(x), torch.tanh(x[:, :4])).backward()
        monitor.step()
        before = {n: [p.detach().clone() for p in model.get_submodule(n).parameters()] for n in LAYERS}
        opt.step()
        expected[step] = {}
        for n in LAYERS:
            after = [p.detach() for p in model.get_submodule(n).parameters()]
            change = math.sqrt(sum(float((a.double() - b.double()).square().sum()) for a, b in zip(after, before[n])))
            norm = math.sqrt(sum(float(b.double().square().sum()) for b in before[n]))
            expected[step][n] = change / norm
        opt.zero_grad()
        assert monitor._recorder.updates._before is None  # the copy lives only around one optimizer step
    monitor.close()
    scalars = read_scalars(str(tmp_path))
    for n in LAYERS:
        written = scalars[f"gradwatch/update_ratio/{n}"]
        assert written
        for step, value in written.items():
            assert value == pytest.approx(expected[step][n], rel=1e-3), (n, step)
        for window in range(3):  # every flush window has a value for every layer
            assert any(4 * window <= s < 4 * window + 4 for s in written), (n, window, sorted(written))


def test_without_an_optimizer_nothing_about_updates_is_written(tmp_path):
    model = _mlp()
    monitor = GradMonitor(model, logdir=str(tmp_path), flush_every=2)
    for _ in range(4):
        model(torch.randn(4, 16)).sum().backward()
        monitor.step()
        model.zero_grad()
    monitor.close()
    assert not [t for t in read_scalars(str(tmp_path)) if "update_ratio" in t]
    assert monitor.last_window.update_ratio is None


def _train(lr: float, steps: int, flush_every: int, make=_mlp, batch=lambda: torch.randn(32, 16)):
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    monitor = GradMonitor(model, flush_every=flush_every, optimizer=opt)
    teacher = torch.randn(16, 4) / 4
    for _ in range(steps):
        x = batch()
        nn.functional.mse_loss(model(x), torch.tanh(x @ teacher)).backward()
        monitor.step()
        opt.step()
        opt.zero_grad()
    monitor.close()
    return monitor


def test_adam_with_a_learning_rate_far_too_high_is_flagged_within_two_windows():
    monitor = _train(lr=0.5, steps=40, flush_every=20)
    flagged = [a for a in monitor.alerts if a.kind == "update_ratio"]
    assert {a.layer for a in flagged} == set(LAYERS)
    assert all(a.step < 40 and a.value > a.threshold == HealthConfig().update_ratio_max for a in flagged)
    assert "learning rate" in flagged[0].message


def test_adam_at_a_healthy_learning_rate_is_silent():
    monitor = _train(lr=1e-3, steps=200, flush_every=20)
    assert monitor.alerts == [], [a.message for a in monitor.alerts]
    ratios = monitor.last_window.update_ratio
    assert ratios is not None and ((ratios[~torch.isnan(torch.as_tensor(ratios)).numpy()] < 0.05).all())


def test_update_ratio_alert_recovers_and_is_logged_once(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="gradwatch"):
        _train(lr=0.5, steps=200, flush_every=20)  # the weights grow, the relative change falls
    onsets = [r.getMessage() for r in caplog.records if "update_ratio" in r.getMessage() and r.levelno == logging.WARNING]
    recoveries = [r.getMessage() for r in caplog.records if "update_ratio" in r.getMessage() and "recovered" in r.getMessage()]
    # one grouped line each, naming every layer
    assert len(onsets) == 1 and "in 3 layers: 0, 2, 4" in onsets[0], onsets
    assert len(recoveries) == 1 and all(f"layer {n}" in recoveries[0] for n in LAYERS), recoveries


def test_bad_optimizer_arguments_name_the_problem():
    model = _mlp()
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        GradMonitor(model, optimizer=object())
    other = torch.optim.SGD(_mlp().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="none of the monitored layers' parameters"):
        GradMonitor(model, optimizer=other)


def test_close_removes_the_optimizer_hooks():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = GradMonitor(model, optimizer=opt)
    assert opt._optimizer_step_pre_hooks and opt._optimizer_step_post_hooks
    monitor.close()
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks


def test_chunks_are_whole_layers_within_a_bound_and_fit_a_window():
    from gradwatch.capture.updates import _chunks

    params = [torch.zeros(1000, 1000), torch.zeros(1000), torch.zeros(3000, 1000), torch.zeros(10)]
    owner = torch.tensor([0, 0, 1, 2]).numpy()
    # 4 MB + 12 MB + 40 B with room for 5 chunks per window: one chunk under 64 MiB
    assert _chunks([0, 1, 2, 3], params, owner, flush_every=10) == [[0, 1, 2, 3]]
    import gradwatch.capture.updates as U

    old, U.CHUNK_BYTES = U.CHUNK_BYTES, 5_000_000
    try:
        assert _chunks([0, 1, 2, 3], params, owner, flush_every=10) == [[0, 1], [2], [3]]
        assert _chunks([0, 1, 2, 3], params, owner, flush_every=4) == [[0, 1], [2, 3]]  # 2 fit a window
    finally:
        U.CHUNK_BYTES = old


def test_a_measurement_after_a_windows_last_step_is_written_with_its_own_step(tmp_path):
    # flush_every=1: every step's update happens after its window was flushed; it joins the
    # next window, and close() writes the last one.
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = GradMonitor(model, logdir=str(tmp_path), flush_every=1, optimizer=opt)
    for _ in range(3):
        model(torch.randn(4, 16)).sum().backward()
        monitor.step()
        opt.step()
        opt.zero_grad()
    monitor.close()
    assert sorted(read_scalars(str(tmp_path))["gradwatch/update_ratio/0"]) == [0, 1, 2]


def test_a_measurement_that_fails_keeps_its_row_empty_so_rows_are_the_same_on_every_rank(monkeypatch, caplog):
    # The rows of a window are those the schedule names, on every rank: a rank whose chunk copy
    # failed keeps the row, empty, so a cross-process sum never mixes different steps' rows.
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    monitor = GradMonitor(model, flush_every=4, optimizer=opt)
    local, calls = monitor._recorder.updates._local, [0]

    def failing_once(columns):
        calls[0] += 1
        if calls[0] == 3:  # the chunk's copy before the second measured step (pre, post, pre)
            raise RuntimeError("forced copy failure")
        return local(columns)

    monkeypatch.setattr(monitor._recorder.updates, "_local", failing_once)
    for _ in range(4):
        x = torch.randn(8, 16)
        nn.functional.mse_loss(model(x), torch.tanh(x[:, :4])).backward()
        monitor.step()
        opt.step()
        opt.zero_grad()
    monitor.flush()
    w = monitor.last_window
    assert w.update_steps == [0, 1]  # both scheduled rows
    assert all(math.isfinite(v) for v in w.update_ratio[0]) and all(math.isnan(v) for v in w.update_ratio[1])
    monitor.close()


def test_a_learning_rate_jump_between_the_measured_steps_is_found_at_its_steps():
    # One chunk is measured exactly at window positions 0 and 1; a learning rate 500x too high
    # for 8 steps in the middle of a window falls between them. The per-step estimate (a fixed
    # sample of each weight matrix) sees it at its steps.
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = GradMonitor(model, flush_every=50, optimizer=opt)
    for step in range(100):
        for group in opt.param_groups:
            group["lr"] = 0.5 if 20 <= step < 28 else 1e-3
        x = torch.randn(8, 16)
        nn.functional.mse_loss(model(x), torch.tanh(x[:, :4])).backward()
        monitor.step()
        opt.step()
        opt.zero_grad()
    monitor.close()
    found = [a for a in monitor.alerts if a.kind == "update_ratio"]
    assert found and all(20 <= a.step <= 22 for a in found), [(a.layer, a.step) for a in found]
    assert "estimated from a sample" in found[0].message
    assert {a.layer for a in found} >= {"0", "2"}


def test_the_per_step_estimate_follows_the_exact_ratio():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    monitor = GradMonitor(model, flush_every=10, optimizer=opt)
    exact = {}
    for step in range(10):
        x = torch.randn(16, 64)
        nn.functional.mse_loss(model(x), torch.tanh(x[:, :4])).backward()
        monitor.step()
        before = model[0].weight.detach().clone()
        opt.step()
        exact[step] = float((model[0].weight.detach() - before).norm() / before.norm())
        opt.zero_grad()
    monitor.flush()
    estimated = monitor.last_window.estimated_update_ratio[:, 0]
    for step in range(9):  # the window's last step is flushed before its optimizer step
        assert estimated[step] == pytest.approx(exact[step], rel=0.15), step
    monitor.close()
