"""Health checks on pathologies made on purpose, and on healthy runs that must raise nothing."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from gradwatch import Alert, GradientHealthError, GradMonitor, HealthConfig

from ..conftest import regression_batches as _regression_batch
from ..conftest import sigmoid_stack


def _train(model, monitor, steps, make_batch, loss_fn, lr=1e-3, opt=None, before_step=None, poison=None):
    opt = opt or torch.optim.Adam(model.parameters(), lr=lr)
    for step in range(steps):
        x, y = make_batch()
        loss = loss_fn(model(x), y)
        if poison is not None:
            loss = poison(step, loss)
        loss.backward()
        if before_step is not None:
            before_step(step)
        monitor.step()
        opt.step()
        opt.zero_grad()
    monitor.close()
    return monitor.alerts


def _kinds(alerts: list[Alert], kind: str) -> list[Alert]:
    return [a for a in alerts if a.kind == kind]


# ----------------------------------------------------------------- dead units
def test_fully_dead_relu_layer_is_reported():
    first = nn.Linear(16, 32)
    with torch.no_grad():
        first.bias.fill_(-100.0)
    model = nn.Sequential(first, nn.ReLU(), nn.Linear(32, 4))
    monitor = GradMonitor(model, flush_every=10)
    alerts = _train(model, monitor, 20, _regression_batch(), nn.functional.mse_loss)
    dead = _kinds(alerts, "dead_units")
    # every unit silent on every sampled row of the first window: conclusive, reported at its flush
    # (a layer dead on some units only is confirmed on every step of the next window, below)
    assert [(a.layer, a.step, a.value) for a in dead] == [("0", 9, 1.0)]
    assert dead[0].threshold == HealthConfig().dead_fraction
    assert "0" in dead[0].message and "dead_units" in dead[0].message


def test_half_dead_layer_has_half_dead_fraction():
    first = nn.Linear(16, 32)
    with torch.no_grad():
        first.bias[:16] = -100.0
    model = nn.Sequential(first, nn.ReLU(), nn.Linear(32, 4))
    monitor = GradMonitor(model, flush_every=10)
    _train(model, monitor, 10, _regression_batch(), nn.functional.mse_loss)
    assert monitor.last_window.dead_fraction[0] == pytest.approx(0.5)
    assert monitor.last_window.dead_fraction[1] == 0.0


def test_persistent_dead_layer_logged_once_then_recovery_at_info(caplog):
    first = nn.Linear(16, 32)
    with torch.no_grad():
        first.bias.fill_(-100.0)
    model = nn.Sequential(first, nn.ReLU(), nn.Linear(32, 4))
    monitor = GradMonitor(model, flush_every=5, config=HealthConfig(vanishing_abs_rms=0, vanishing_rel_rms=0))
    make = _regression_batch()
    with caplog.at_level(logging.INFO, logger="gradwatch"):
        _train_no_close(model, monitor, 25, make)  # 5 windows, dead throughout
        with torch.no_grad():
            first.bias.fill_(0.5)  # revive it: recovered after recovery_flushes clear windows
        _train_no_close(model, monitor, 5 * HealthConfig().recovery_flushes, make)
        monitor.close()
    dead_logs = [r for r in caplog.records if "dead_units" in r.getMessage() and r.levelno == logging.WARNING]
    assert len(dead_logs) == 1
    recovered = [r for r in caplog.records if "recovered" in r.getMessage()]
    assert len(recovered) == 1 and recovered[0].levelno == logging.INFO
    assert len(_kinds(monitor.alerts, "dead_units")) == 1


def _train_no_close(model, monitor, steps, make):
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for _ in range(steps):
        x, y = make()
        nn.functional.mse_loss(model(x.abs()), y).backward()
        monitor.step()
        opt.zero_grad()


# ------------------------------------------------------------------ vanishing
def test_deep_sigmoid_stack_vanishes_in_first_layers_not_last():
    model = sigmoid_stack()
    monitor = GradMonitor(model, flush_every=10)
    alerts = _train(model, monitor, 10, _regression_batch(n_in=32), nn.functional.mse_loss, lr=1e-4)
    vanishing = {a.layer for a in _kinds(alerts, "vanishing")}
    assert "0" in vanishing and "2" in vanishing  # first layers
    assert "60" not in vanishing and "58" not in vanishing  # head and last hidden layer
    first = next(a for a in alerts if a.layer == "0")
    assert first.value < first.threshold


# ------------------------------------------------------------------ exploding
def test_sudden_loss_spike_is_exploding_and_nothing_before():
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    monitor = GradMonitor(model, flush_every=10)
    spike_at = 45
    alerts = _train(
        model,
        monitor,
        60,
        _regression_batch(),
        nn.functional.mse_loss,
        poison=lambda step, loss: loss * 1e6 if step == spike_at else loss,
    )
    assert alerts, "the spike was not detected"
    assert all(a.step >= spike_at for a in alerts)
    exploding = _kinds(alerts, "exploding")
    assert exploding and exploding[0].step == spike_at
    assert exploding[0].value > exploding[0].threshold


# ------------------------------------------------------------------ non-finite
class Poisonable(nn.Linear):
    """Its output holds ``value`` (NaN unless set) at one position at its ``poison_at``-th call."""

    poison_at: int | None = None
    value = float("nan")
    calls = 0

    def forward(self, x):
        out = super().forward(x)
        if self.calls == self.poison_at:
            out = out.clone()
            out[0, 0] = self.value
        self.calls += 1
        return out


def test_nan_in_one_forward_output_names_that_layer_and_step():
    mid = Poisonable(32, 32)
    mid.poison_at = 13
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), mid, nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 4))
    monitor = GradMonitor(model, flush_every=5)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    make = _regression_batch()
    for step in range(20):
        x, y = make()
        nn.functional.mse_loss(model(x), y).backward()
        monitor.step()
        if step != 13:  # keep the weights finite so only that step is affected
            opt.step()
        opt.zero_grad()
    monitor.close()
    nonfinite = _kinds(monitor.alerts, "nonfinite")
    assert [(a.layer, a.step) for a in nonfinite] == [("2", 13)]
    assert "forward" in nonfinite[0].message


def test_inf_gradient_in_one_weight_names_that_layer_and_step(caplog):
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    monitor = GradMonitor(model, flush_every=5)

    def inject(step):
        if step == 7:
            with torch.no_grad():
                model[2].weight.grad[3, 4] = float("inf")

    with caplog.at_level(logging.ERROR, logger="gradwatch"):
        alerts = _train(
            model, monitor, 10, _regression_batch(), nn.functional.mse_loss, opt=torch.optim.SGD(model.parameters(), lr=0.0), before_step=inject
        )
    nonfinite = _kinds(alerts, "nonfinite")
    assert [(a.layer, a.step, a.value) for a in nonfinite] == [("2", 7, 1.0)]
    assert any(r.levelno == logging.ERROR and "nonfinite" in r.getMessage() for r in caplog.records)


def test_gradscaler_skipped_steps_are_not_alerts(caplog):
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    monitor = GradMonitor(model, flush_every=5, scaler=scaler)
    make = _regression_batch()
    with caplog.at_level(logging.INFO, logger="gradwatch"):
        for step in range(10):
            x, y = make()
            loss = nn.functional.mse_loss(model(x), y)
            if step in (2, 6):  # an overflow in the loss, as fp16 training meets it
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            monitor.step()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        monitor.close()
    assert monitor.alerts == []
    assert monitor._stages.detection.checks.skipped_steps == 2
    assert float(scaler.get_scale()) == 2.0**14  # the scaler did skip (and back off) twice
    assert any("skipped" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------- healthy runs
def _healthy_mlp():
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    return model, _regression_batch(), nn.functional.mse_loss


def _healthy_cnn():
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3),
    )  # fmt: skip
    protos = torch.randn(3, 3, 8, 8)

    def make():
        y = torch.randint(0, 3, (16,))
        return protos[y] + 0.5 * torch.randn(16, 3, 8, 8), y

    return model, make, nn.functional.cross_entropy


class _Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x))).squeeze(-1)


def _healthy_transformer():
    def make():
        x = torch.randn(8, 12, 8)
        return x, x.sum(-1).cumsum(1) / 10

    return _Transformer(), make, nn.functional.mse_loss


class _LSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(4, 32, batch_first=True)
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.head(out[:, -1]).squeeze(-1)


def _healthy_lstm():
    def make():
        x = torch.randn(16, 10, 4)
        return x, x[:, :, 0].sum(1) / 3

    return _LSTM(), make, nn.functional.mse_loss


@pytest.mark.parametrize("factory", [_healthy_mlp, _healthy_cnn, _healthy_transformer, _healthy_lstm],
                         ids=["mlp-adam", "cnn-batchnorm", "transformer", "lstm"])
def test_healthy_training_raises_nothing(factory):
    model, make, loss_fn = factory()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    monitor = GradMonitor(model, flush_every=25, optimizer=opt)  # update_ratio judged too
    alerts = _train(model, monitor, 200, make, loss_fn, opt=opt)
    assert alerts == [], [a.message for a in alerts]
    # the run really trained and really was monitored
    assert monitor._stages.detection.checks.steps_seen == 200


# ------------------------------------------------------------ config & stop
@pytest.mark.parametrize(
    "field,value",
    [("vanishing_abs_rms", -1.0), ("vanishing_rel_rms", 2.0), ("exploding_abs_norm", 0.0),
     ("exploding_factor", 0.5), ("dead_fraction", 1.5), ("dead_eps", float("nan")),
     ("remind_every", -1), ("exploding_warmup_steps", 1.5), ("stop_on", {"exploded"}),
     ("update_ratio_max", 0.0), ("update_ratio_steps", 0), ("update_ratio_min_weight_rms", -1.0)],
)  # fmt: skip
def test_health_config_rejects_nonsense_naming_the_field(field, value):
    with pytest.raises((ValueError, TypeError), match=field):
        HealthConfig(**{field: value})


def test_stop_on_raises_gradient_health_error_and_callbacks_get_alerts():
    first = nn.Linear(16, 32)
    with torch.no_grad():
        first.bias.fill_(-100.0)
    model = nn.Sequential(first, nn.ReLU(), nn.Linear(32, 4))
    monitor = GradMonitor(model, flush_every=5, config=HealthConfig(stop_on=frozenset({"dead_units"})))
    received: list[Alert] = []
    monitor.add_alert_callback(received.append)
    make = _regression_batch()
    with pytest.raises(GradientHealthError) as info:
        for _ in range(10):  # found on the first window's sampled steps, confirmed on the second
            x, y = make()
            nn.functional.mse_loss(model(x), y).backward()
            monitor.step()
            model.zero_grad()
    assert [a.kind for a in info.value.alerts] == ["dead_units"]
    assert "dead_units" in {a.kind for a in received}
    monitor.close()


def test_smooth_growth_early_in_training_is_not_exploding():
    # Adam on one fixed batch: every layer's gradient norm grows ~1.2x per step for
    # ~40 steps (100x in all) while the loss falls; healthy, not an explosion.
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(256, 256), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(256, 10))
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    norms = []
    monitor = GradMonitor(model, flush_every=50)
    alerts = _train(
        model,
        monitor,
        150,
        lambda: (x, y),
        nn.functional.cross_entropy,
        lr=1e-4,
        before_step=lambda step: norms.append(model[0].weight.grad.norm().item()),
    )
    assert max(norms[20:60]) > 10 * min(norms[:20]), "the run did not show the growth this test is about"
    assert _kinds(alerts, "exploding") == [], [a.message for a in alerts]


def test_the_exploding_rule_flags_the_pathologies_alike_step_by_step_and_over_a_window():
    # One implementation (detect/exploding.py) serves the per-step model check and the flush's
    # window judgement: fed the same series one step at a time, or as one window, it flags the
    # same steps with the same thresholds and reasons: a high start that settles with a jump in its
    # warm-up, noise, a 20x spike, a dip and a rise back (the settled median's call), smooth 1.15x
    # growth, NaN steps, a 28x step after the growth, a value above the absolute ceiling.
    import numpy as np

    from gradwatch.detect.checks import HealthChecks
    from gradwatch.flush.readback import StepSummary

    rng = np.random.default_rng(3)
    series = list(50.0 * np.exp(-np.arange(30) / 5.0) + 1.0)  # high start, settling at ~1
    series[15] = 2e4 * series[14]  # a jump inside the warm-up (below the absolute ceiling)
    series += list(1.0 + 0.1 * rng.random(40))  # noise
    series += [20.0] + list(1.0 + 0.1 * rng.random(10))  # a spike, then calm again
    series += [0.2] * 10 + [3.0]  # a dip, then 15x the dip but 3x the settled level: the median's call
    series += list(1.15 ** np.arange(20))  # smooth growth: raises its own bar
    series += [float("nan"), 2.0, 400.0, 2.0, float("nan"), 2e6, 2.0]  # non-finite, 28x the level, the ceiling
    layers = ["a", "b"]
    none = np.zeros(len(layers), dtype=bool)
    per_step = HealthChecks(HealthConfig(), layers)
    per_step.model_per_step = True
    window_rule = HealthChecks(HealthConfig(), layers)
    scalar_findings, array_findings = [], []
    for step, value in enumerate(series):
        scalar_findings += per_step.judge_step(step, StepSummary(True, value, none, none, 0.0), [], False)
    table = np.full((len(series), len(layers) + 1), np.nan)
    table[:, -1] = series
    array_findings, _ = window_rule.exploding.judge_window(table, list(range(len(series))), [len(layers)], layers + [""])
    # the window judgement reports a column's first exploded step: compare it with the per-step onsets
    assert [f.step for f in scalar_findings] == [15, 70, 114, 117], [(f.step, f.detail) for f in scalar_findings]

    def described(findings):
        return [(f.kind, f.step, f.layer, f.value, f.detail) for f in findings]

    assert described(array_findings) == described(scalar_findings[:1])
    assert array_findings[0].threshold == scalar_findings[0].threshold
    # the rings after the window equal those after the steps: the same state, whichever path judged
    for name in ("level", "recent", "last_calm"):
        np.testing.assert_array_equal(getattr(per_step.exploding, name)[..., -1], getattr(window_rule.exploding, name)[..., -1])


# ------------------------------------------------------------ the exploding ceiling widened by a column's own noise
def _judge_series(series, config) -> list[int]:
    from gradwatch.detect.exploding import ExplodingRule

    rule = ExplodingRule(config, 1)
    return [t for t, value in enumerate(series) if rule.judge_step(t, float(value), 0, "")[0] is not None]


def test_a_column_whose_steps_vary_widely_is_judged_against_its_own_spread():
    import numpy as np

    rng = np.random.default_rng(0)
    # A rare class: one step in five holds a rare sample whose gradient is ~300x the common steps'.
    rare = rng.random(300) < 0.2
    noisy = np.where(rare, 0.3, 1e-3) * np.exp(rng.normal(0.0, 0.3, 300))
    ratios = [noisy[t] / np.median(noisy[t - 50 : t]) for t in range(50, 300)]
    assert max(ratios) > 100  # its own spikes, far above a fixed 10x of its level
    assert len(_judge_series(noisy, HealthConfig(exploding_spread_z=0))) > 5  # the fixed ratio's false alarms
    assert _judge_series(noisy, HealthConfig()) == []
    spiked = noisy.copy()
    spiked[200] = 20.0 * noisy[150:200].max()  # 20x the largest of its last 50 steps: still exploding
    assert _judge_series(spiked, HealthConfig()) == [200]


def test_a_quiet_column_keeps_the_fixed_ratio_and_a_trend_is_not_spread():
    import numpy as np

    rng = np.random.default_rng(1)
    quiet = 1.0 + 0.05 * rng.random(120)
    quiet[100] = 12.0  # 12x a column that moves 5%
    assert _judge_series(quiet, HealthConfig()) == [100]
    growing = list(1.03 ** np.arange(100))  # smooth growth: a trend, not step-to-step noise
    growing[80] = 15.0 * growing[79]
    assert _judge_series(growing, HealthConfig()) == [80]


def test_the_spread_never_widens_the_ceiling_beyond_the_jump():
    import numpy as np

    rng = np.random.default_rng(2)
    wild = np.exp(rng.normal(0.0, 3.0, 200))  # so noisy that z x spread is far beyond 1e4
    wild[150] = 2e4 * np.median(wild[100:150])
    assert 150 in _judge_series(wild, HealthConfig(exploding_abs_norm=1e30))


def test_a_return_to_where_a_column_has_been_is_not_exploding():
    import numpy as np

    # The common steps' gradient collapses four decades in 25 steps (the majority class learned);
    # a rare-class batch then lifts it back under its starting level for one step: 18,000x its
    # previous step, yet a return to where it has been, not an explosion.
    collapse = list(np.exp(-0.4 * np.arange(25)))
    calm_after = [float(np.exp(-10.0))] * 10
    assert 0.8 / collapse[-1] > 1e4
    assert _judge_series(collapse + [0.8] + calm_after, HealthConfig()) == []
    # Above the largest of its last 50 calm steps, the same jump is exploding.
    assert _judge_series(collapse + [1.5] + calm_after, HealthConfig()) == [25]


def test_the_per_step_shortcut_of_the_exploding_rule_decides_as_the_full_judgement():
    # ExplodingRule.judge_step decides the common calm case on Python floats (it runs at every
    # step); on random series with spikes, level shifts, zeros and scales from 1e-8 to 1e2 it must
    # flag the same steps, give the same jumps and leave the same rings as judge_row alone.
    import numpy as np

    from gradwatch.detect.exploding import ExplodingRule

    config, rng = HealthConfig(), np.random.default_rng(0)
    flagged = 0
    for _ in range(30):
        values = np.exp(rng.normal(0, rng.uniform(0.05, 1.5), 300)) * 10 ** rng.uniform(-8, 2)
        for _ in range(rng.integers(0, 4)):
            k = rng.integers(0, 300)
            values[k : k + rng.integers(1, 80)] *= 10 ** rng.uniform(0.5, 4)
        values[rng.integers(0, 300)] = 0.0
        shortcut, full = ExplodingRule(config, 2), ExplodingRule(config, 2)
        for step, value in enumerate(values.tolist()):
            finding, jump = shortcut.judge_step(step, value, 1, "")
            verdict = full.judge_row(np.array([value]), np.array([1]))
            assert (finding is not None) == bool(verdict.over[0]), (step, value)
            np.testing.assert_equal(jump, verdict.jumps[0])
            flagged += finding is not None
        for ring in ("level", "recent", "last_calm", "judged", "exploded_streak", "level_slot", "recent_slot"):
            np.testing.assert_array_equal(getattr(shortcut, ring), getattr(full, ring))
    assert flagged > 10  # the series do explode: both paths were exercised


class _Finite(nn.Module):
    """Zeroes what is not finite (a masked score's -inf): the gradients behind it stay finite."""

    def forward(self, x):
        return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def _judged_step_by_step(calm_case: bool, steps: int = 70) -> tuple[list[list[tuple]], list[int], dict[int, float]]:
    """Train a twin of one model through a loss spike (step 23), NaN gradients (step 35), a vanishing
    stretch (steps 44-47: every gradient below float32's squares) and a forward output of -inf that
    the model masks (step 67, once the NaN's alert has recovered: its gradients are finite), with or
    without the per-step judgement's calm case. Each is on a step the default does not sample.
    Returns each step()'s alerts, the steps judged in the calm case, and the global gradient norm
    at each step, read from ``p.grad`` in float64."""
    torch.manual_seed(0)
    masked = Poisonable(32, 32)
    masked.poison_at, masked.value = 67, -float("inf")
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), masked, _Finite(), nn.ReLU(), nn.Linear(32, 4))
    monitor = GradMonitor(model, flush_every=10)
    judge, calm = monitor._stages.pipeline.judge, []
    full, judge_calm = judge.judge, judge.judge_calm

    def judged(slot, steps, total):  # the steps offered to the calm case: judged there, or in full
        if not calm_case:
            return full(slot, steps)
        calm.append(steps[slot])
        return judge_calm(slot, steps, total)

    judge.judge_calm = judged
    opt, make, returned, norms = torch.optim.SGD(model.parameters(), lr=1e-3), _regression_batch(), [], {}
    for step in range(steps):
        x, y = make()
        loss = nn.functional.mse_loss(model(x), y) * (1e6 if step == 23 else 1e-30 if 44 <= step < 48 else 1.0)
        (loss * float("nan") if step == 35 else loss).backward()
        norms[step] = float(sum(p.grad.double().square().sum() for p in model.parameters()) ** 0.5)
        returned.append([(a.kind, a.layer, a.step, a.value, a.threshold, a.message) for a in monitor.step()])
        if step not in (23, 35):  # keep the weights finite and near where they were
            opt.step()
        opt.zero_grad()
    monitor.close()
    return returned, calm, norms


def test_the_calm_case_of_the_per_step_judgement_decides_as_the_full_judgement():
    # On the CPU's own path the recorder checks every gradient on the host anyway; an unsampled step
    # whose gradients that check found finite and not tiny is judged from its total, without staging
    # the row's values (StepJudge.judge_calm), unless its forward sums are not finite. Made
    # pathologies must give the same alerts, returned by the same step() calls, as the full
    # judgement of every step.
    with_calm, calm, norms = _judged_step_by_step(calm_case=True)
    without, none, _ = _judged_step_by_step(calm_case=False)
    assert none == [] and with_calm == without
    raised = {(kind, layer, step) for alerts in with_calm for kind, layer, step, *_ in alerts}
    assert {("exploding", "", 23), ("nonfinite", "5", 35), ("nonfinite", "2", 67)} <= raised, raised
    spike = next(alert for alert in with_calm[23] if alert[0] == "exploding" and alert[1] == "")
    assert spike[3] == pytest.approx(norms[23], rel=1e-6)  # the global norm, as p.grad gives it
    # the spike and the masked -inf entered the calm case (the first is judged there, the second
    # sent on to the full judgement by its forward sums); the NaN and tiny gradients never did
    assert {23, 67} <= set(calm) and not {35, 44, 45, 46, 47} & set(calm)
    assert len(calm) > 40


def _windows_row_by_row(rule, table, steps, cols, names, stands=None):
    """The window judgement as ``judge_row`` alone gives it: the reference for its calm stretches."""
    import functools

    import numpy as np

    index = np.asarray(cols, dtype=np.int64)
    first, exploded = {}, np.zeros(len(cols), dtype=bool)
    for t in range(table.shape[0]):
        verdict = rule.judge_row(table[t, index], index, None if stands is None else functools.partial(stands, t))
        for k, why in zip(np.flatnonzero(verdict.over), verdict.why):
            exploded[k] = True
            first.setdefault(k, (steps[t], names[cols[k]], float(table[t, index][k]), float(verdict.threshold[k]), why))
    return [first[k] for k in sorted(first)], ~exploded & np.isfinite(table[:, index]).any(axis=0)


def test_the_window_judgement_of_calm_stretches_at_once_decides_as_judge_row_step_by_step():
    # ExplodingRule.judge_window judges the rows that are calm for sure all at once (the flush's
    # usual case) and only the others with judge_row. On windows of random walks with spikes, level
    # shifts, persistent explosions (the relearning), zeros, missing values (a whole column or a
    # stretch of one), Inf, a veto (stands) and the warm-up, both must give the same findings and
    # calm columns and leave the same rings, window after window.
    import numpy as np

    from gradwatch.detect.exploding import ExplodingRule

    rng = np.random.default_rng(1)
    stretches = flagged = 0
    for trial in range(40):
        config = HealthConfig(exploding_warmup_steps=int(rng.choice([0, 5, 20, 80])))
        layers = int(rng.integers(1, 7))
        fast, slow = ExplodingRule(config, layers + 1), ExplodingRule(config, layers + 1)
        cols = list(range(layers + 1)) if trial % 2 else list(range(layers))
        names = [f"l{k}" for k in range(layers)] + [""]
        scale = 10 ** rng.uniform(-6, 2, layers + 1)
        for window in range(int(rng.integers(2, 7))):
            steps = list(range(window * 50, window * 50 + 50))
            table = scale * np.exp(np.cumsum(rng.normal(0, rng.uniform(0.01, 0.8), (50, layers + 1)), axis=0))
            for _ in range(int(rng.integers(0, 4))):  # spikes and level shifts, some lasting past a window
                t, k = int(rng.integers(0, 50)), int(rng.integers(0, layers + 1))
                table[t : t + int(rng.integers(1, 70)), k] *= 10 ** rng.uniform(0.5, 6)
            if rng.random() < 0.3:
                table[:, int(rng.integers(0, layers + 1))] = np.nan  # a quiet layer
            if rng.random() < 0.3:
                t = int(rng.integers(0, 50))
                table[t : t + int(rng.integers(1, 20)), int(rng.integers(0, layers + 1))] = np.nan
            if rng.random() < 0.15:
                table[int(rng.integers(0, 50)), int(rng.integers(0, layers + 1))] = rng.choice([np.inf, 0.0, 1e6])
            scale = table[-1].copy()
            scale[~np.isfinite(scale)] = 1.0

            def stands(t, over, jumps):  # a veto that depends on the row, as checks.py's does
                return (jumps >= 30) | ~np.isfinite(jumps) | (t % 7 == 0)

            veto = stands if rng.random() < 0.5 else None
            calls = []
            original = fast._remember_calm_rows
            fast._remember_calm_rows = lambda *a: calls.append(original(*a) - a[2]) or a[2] + calls[-1]
            got, got_calm = fast.judge_window(table, steps, cols, names, veto)
            del fast._remember_calm_rows
            stretches += sum(n > 1 for n in calls)
            expected, expected_calm = _windows_row_by_row(slow, table, steps, cols, names, veto)
            assert [(f.step, f.layer, f.value, f.threshold, f.detail) for f in got] == expected, (trial, window)
            np.testing.assert_array_equal(got_calm, expected_calm)
            flagged += len(got)
            for ring in ("level", "recent", "last_calm", "judged", "exploded_streak", "exploded_recent",
                         "level_slot", "recent_slot"):  # fmt: skip
                np.testing.assert_array_equal(getattr(fast, ring), getattr(slow, ring), err_msg=ring)
    assert stretches > 100 and flagged > 20  # both the stretches and judge_row were exercised


def test_the_rules_column_median_is_numpys_nanmedian():
    # detect/columns.nan_median_columns replaces np.nanmedian(values, axis=0) in the rules (its
    # masked-array path cost every flush ~0.3 ms a call): the same values, NaN where a column has none.
    import warnings

    import numpy as np

    from gradwatch.detect.columns import nan_median_columns

    rng = np.random.default_rng(2)
    for rows in (0, 1, 2, 7, 50):
        values = np.exp(rng.normal(0, 3, (rows, 9)))
        values[rng.random((rows, 9)) < 0.3] = np.nan
        if rows:
            values[:, 0] = np.nan  # a column with no value
            values[0, 1] = np.inf
            values[:, 2] = values[0, 2]  # ties
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns
            expected = np.nanmedian(values, axis=0) if rows else np.full(9, np.nan)
        np.testing.assert_array_equal(nan_median_columns(values), expected)


def test_the_update_ratio_streaks_of_a_window_at_once_are_those_of_its_steps_one_by_one():
    # UpdateRatioRule.judge counts each layer's streak over a window's measured steps with array
    # operations (the flush's cost). Reference: the rule's definition, step by step (a step above the
    # limit adds one, a measured step below it ends the streak, an unmeasured one keeps it; the
    # first measured step at which a layer's streak stands at update_ratio_steps is its finding,
    # once per window).
    import numpy as np

    from gradwatch.detect.update_ratio import UpdateRatioRule
    from gradwatch.flush.window import Window

    rng = np.random.default_rng(3)
    onsets = 0
    for trial in range(200):
        layers, config = int(rng.integers(1, 6)), HealthConfig(update_ratio_steps=int(rng.integers(1, 6)))
        rule = UpdateRatioRule(config, [f"l{i}" for i in range(layers)])
        streaks = {"update_streak": np.zeros(layers, int), "estimate_streak": np.zeros(layers, int)}
        for window in range(4):
            steps, updates = list(range(20 * window, 20 * window + int(rng.integers(0, 12)))), []
            updates = sorted(rng.choice(100, int(rng.integers(0, 4)), replace=False).tolist())

            def ratios(n):
                r = 10 ** rng.uniform(-3, 0, (n, layers)) * (rng.random((n, layers)) < 0.9)
                r[rng.random((n, layers)) < 0.2] = np.nan
                return r

            w = Window.__new__(Window)  # only what the rule reads
            w.steps, w.update_steps = steps, updates
            w.judged_update_ratio = ratios(len(updates)) if rng.random() < 0.8 else None
            w.judged_weight_rms = 10 ** rng.uniform(-9, 0, (len(updates), layers))
            w.estimated_update_ratio = ratios(len(steps)) if rng.random() < 0.8 else None
            w.estimated_weight_rms = 10 ** rng.uniform(-9, 0, (len(steps), layers))
            findings, clear = [], set()
            rule.judge(w, findings, clear)
            expected, flagged = [], set()
            for key, at, ratio, rms in (("update_streak", updates, w.judged_update_ratio, w.judged_weight_rms),
                                        ("estimate_streak", steps, w.estimated_update_ratio, w.estimated_weight_rms)):
                if ratio is None:
                    continue
                for t, step in enumerate(at):
                    for i in range(layers):
                        measured = np.isfinite(ratio[t, i]) and rms[t, i] >= config.update_ratio_min_weight_rms
                        if measured:
                            streaks[key][i] = streaks[key][i] + 1 if ratio[t, i] > config.update_ratio_max else 0
                        if measured and streaks[key][i] >= config.update_ratio_steps and i not in flagged:
                            flagged.add(i)
                            expected.append((f"l{i}", step, repr(float(ratio[t, i])), int(streaks[key][i])))
                np.testing.assert_array_equal(rule.streaks[key], streaks[key])
            assert [(f.layer, f.step, repr(f.value), int(f.detail.split(" at ")[1].split()[0])) for f in findings] \
                == expected, (trial, window)  # fmt: skip
            onsets += len(expected)
    assert onsets > 50


def test_an_update_ratio_streak_carried_into_a_window_is_reported_where_it_is_measured():
    # A streak at the limit carries across windows; the next window's first exact row may not
    # measure the layer (NaN there). The finding is the first step that measured it, with its own
    # ratio (it used to be that first row, value NaN, "changed by nan of their norm"); a window that
    # never measures it reports nothing and the condition stays active (neither present nor clear).
    import numpy as np

    from gradwatch.detect.tracker import AlertTracker
    from gradwatch.detect.update_ratio import UpdateRatioRule
    from gradwatch.flush.window import Window

    config = HealthConfig(update_ratio_steps=2)
    rule, tracker = UpdateRatioRule(config, ["a", "b"]), AlertTracker(remind_every=10, log_alerts=False)

    def window(update_steps, ratios):
        w = Window.__new__(Window)
        w.steps, w.update_steps = [], update_steps
        w.judged_update_ratio = np.array(ratios, dtype=float)
        w.judged_weight_rms = np.ones_like(w.judged_update_ratio)
        w.estimated_update_ratio = None
        return w

    def judge(w):
        findings, clear = [], set()
        rule.judge(w, findings, clear)
        tracker.update(type("A", (), {"findings": findings, "clear": clear})(), w.update_steps[-1])
        return findings

    first = judge(window([10, 20], [[0.9, 0.01], [0.8, 0.01]]))
    assert [(f.layer, f.step, f.value) for f in first] == [("a", 20, 0.8)]
    carried = judge(window([60, 70], [[np.nan, 0.01], [0.7, 0.01]]))
    assert [(f.layer, f.step, f.value) for f in carried] == [("a", 70, 0.7)]
    assert judge(window([110, 120], [[np.nan, 0.01], [np.nan, 0.01]])) == []
    assert ("update_ratio", "a") in tracker.active  # not recovered: no step said anything
    assert [a.value for a in tracker.alerts] == [0.8]  # one onset, with a real ratio
