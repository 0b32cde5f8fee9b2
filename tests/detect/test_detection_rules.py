"""Detection on real architectures: silent on healthy recipes, root causes first, few grouped lines,
one condition per crossing. Pathologies are made on purpose; healthy runs must raise nothing."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from gradwatch import GradMonitor, HealthConfig

from ..conftest import regression_batches as _regression
from ..conftest import sigmoid_stack


def _run(model, steps, flush_every=10, opt=None, lr=1e-3, make=None, loss_hook=None, config=None, **kwargs):
    make = make or _regression()
    opt = opt or torch.optim.AdamW(model.parameters(), lr=lr)
    monitor = GradMonitor(model, flush_every=flush_every, optimizer=opt, config=config, **kwargs)
    for step in range(steps):
        x, y = make()
        loss = nn.functional.mse_loss(model(x), y)
        if loss_hook is not None:
            loss = loss_hook(step, loss)
        loss.backward()
        monitor.step()
        opt.step()
        opt.zero_grad()
    monitor.close()
    return monitor


# ------------------------------------------------------------ healthy recipes
class _LayerScaleBlock(nn.Module):
    """x + gamma * MLP(LN(x)), gamma initialised at 1e-6 (ConvNeXt / CaiT layer scale)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.gamma = nn.Parameter(torch.full((d,), 1e-6))

    def forward(self, x):
        return x + self.gamma * self.fc2(torch.relu(self.fc1(self.norm(x))))


class _ReZeroBlock(nn.Module):
    """x + alpha * F(x), alpha initialised at 0 (ReZero)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)
        self.alpha = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return x + self.alpha * self.fc2(torch.relu(self.fc1(x)))


class _GatedBlock(nn.Module):
    """x + tanh(gate) * F(x), a zero-initialised gate (Flamingo-style gated cross layers)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.gate = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        return x + torch.tanh(self.gate) * torch.tanh(self.fc(x))


def _residual(block, depth=4, d=32):
    return nn.Sequential(nn.Linear(16, d), *[block(d) for _ in range(depth)], nn.LayerNorm(d), nn.Linear(d, 4))


@pytest.mark.parametrize("block", [_LayerScaleBlock, _ReZeroBlock, _GatedBlock], ids=["layer-scale-1e-6", "rezero", "zero-gate"])
@pytest.mark.parametrize("flush_every", [1, 10])
def test_residual_branches_scaled_by_a_tiny_or_zero_factor_trained_with_adamw_raise_nothing(block, flush_every):
    torch.manual_seed(0)
    monitor = _run(_residual(block), steps=80, flush_every=flush_every)
    assert monitor.alerts == [], [a.message for a in monitor.alerts]


def test_the_same_branch_scale_with_sgd_is_judged_by_the_relative_rule():
    # SGD's step is the gradient itself: a branch 1e-6 below the rest hardly moves, and that is reported
    torch.manual_seed(0)
    model = _residual(_LayerScaleBlock)
    monitor = _run(model, steps=30, opt=torch.optim.SGD(model.parameters(), lr=0.0))
    assert {a.kind for a in monitor.alerts} == {"vanishing"}
    assert "1.fc1" in {a.layer for a in monitor.alerts}


# ------------------------------------------------------------ dead units need evidence
class _Routed(nn.Module):
    """A router that sends one token per step to an expert (a ReLU MLP), the rest elsewhere."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(16, 16)
        self.expert = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.shared(x))
        routed = self.expert(h[:1])  # one token
        return self.head(torch.cat([h[:1] + routed, h[1:]]))


def test_an_expert_seeing_one_token_per_window_is_not_called_dead():
    torch.manual_seed(0)
    monitor = _run(_Routed(), steps=60, flush_every=1)
    assert not [a for a in monitor.alerts if a.kind == "dead_units"], [a.message for a in monitor.alerts]
    w = monitor.last_window  # each window alone is far too little evidence: a single token
    assert w.rows_seen[w.layers.index("expert.0")] == 1 and w.dead_fraction[w.layers.index("expert.0")] > 0.2


def test_a_dead_layer_is_still_found_when_its_evidence_spans_windows():
    torch.manual_seed(0)
    model = _Routed()
    with torch.no_grad():
        model.expert[0].bias.fill_(-100.0)
    monitor = _run(model, steps=60, flush_every=1)
    dead = [a for a in monitor.alerts if a.kind == "dead_units"]
    assert [(a.layer, a.value) for a in dead] == [("expert.0", 1.0)]
    assert dead[0].step == HealthConfig().dead_min_samples - 1  # after 32 one-token windows


# ------------------------------------------------------------ exploding jumps at any step
def test_a_ten_thousand_fold_jump_is_exploding_even_during_warm_up():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    monitor = _run(model, steps=10, loss_hook=lambda step, loss: loss * 1e4 if step == 4 else loss)
    exploding = [a for a in monitor.alerts if a.kind == "exploding"]
    assert exploding and {a.step for a in exploding} == {4}
    assert all(a.step >= 4 for a in monitor.alerts)


def test_sgd_with_a_learning_rate_1000x_too_high_explodes_before_it_turns_nonfinite():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    monitor = _run(model, steps=40, opt=torch.optim.SGD(model.parameters(), lr=50.0), flush_every=10)  # 0.05 is fine
    first_nonfinite = min(a.step for a in monitor.alerts if a.kind == "nonfinite")
    exploding = [a for a in monitor.alerts if a.kind == "exploding"]
    assert exploding and min(a.step for a in exploding) <= first_nonfinite


def _high_start(spike_at=None):
    """Gradients 100x their settled level for the first 50 steps (a loss scaled by 100, as with a
    large initial loss), then settled; optionally one 50x spike (a bad batch)."""

    def hook(step, loss):
        if step < 50:
            return loss * 100.0
        if step == spike_at:
            return loss * 50.0
        return loss

    return hook


def test_a_high_start_that_settles_raises_nothing():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    monitor = _run(model, steps=300, lr=1e-4, loss_hook=_high_start())
    assert monitor.alerts == [], [a.message for a in monitor.alerts]


def test_a_spike_after_a_high_start_is_judged_against_the_recent_level():
    # The all-time peak (100x, the first window) must not hide a later 50x spike.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    monitor = _run(model, steps=300, lr=1e-4, loss_hook=_high_start(spike_at=280))
    exploding = [a for a in monitor.alerts if a.kind == "exploding"]
    assert exploding and {a.step for a in exploding} == {280}, [a.message for a in monitor.alerts]
    assert all(a.step >= 280 for a in monitor.alerts)
    assert any("recent level" in a.message for a in exploding)


def test_smooth_growth_stays_silent():  # learning-rate warm-up: norms rise ~1.2x per step, never a jump
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    monitor = _run(model, steps=60, loss_hook=lambda step, loss: loss * 1.2 ** min(step, 40))
    assert monitor.alerts == [], [a.message for a in monitor.alerts]


# ------------------------------------------------------------ root cause first, grouped lines
def test_a_dead_first_layer_is_dead_units_not_vanishing():
    torch.manual_seed(0)
    first = nn.Linear(16, 32)
    with torch.no_grad():
        first.bias.fill_(-100.0)
    model = nn.Sequential(first, nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    monitor = _run(model, steps=20)
    assert [(a.kind, a.layer) for a in monitor.alerts] == [("dead_units", "0")]


def test_layers_before_a_dead_layer_are_explained_by_it():
    torch.manual_seed(0)
    middle = nn.Linear(32, 32)
    with torch.no_grad():
        middle.bias.fill_(-100.0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), middle, nn.ReLU(), nn.Linear(32, 4))
    monitor = _run(model, steps=20)
    assert [(a.kind, a.layer) for a in monitor.alerts] == [("dead_units", "2")]
    assert "layer 0" in monitor.alerts[0].message


def test_a_deep_sigmoid_stack_is_a_few_warning_lines_naming_the_first_layer_first(caplog):
    torch.manual_seed(0)
    model = sigmoid_stack()
    with caplog.at_level(logging.WARNING, logger="gradwatch"):
        monitor = _run(model, steps=10, opt=torch.optim.SGD(model.parameters(), lr=1e-4), make=_regression(n_in=32))
    vanishing = [a for a in monitor.alerts if a.kind == "vanishing"]
    assert len(vanishing) > 3 and vanishing[0].layer == "0"  # one Alert per layer is kept
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert 1 <= len(lines) <= 3, lines
    assert "layer 0" in lines[0] or "layers: 0," in lines[0]


# ------------------------------------------------------------ no flapping
def test_a_dead_fraction_hovering_around_the_threshold_is_one_condition():
    gate = nn.Linear(100, 100)
    with torch.no_grad():
        gate.weight.copy_(torch.eye(100))
    model = nn.Sequential(gate, nn.ReLU(), nn.Linear(100, 1))
    monitor = GradMonitor(model, flush_every=5, detail="full")
    for window in range(20):
        dead = 47 if window % 2 else 53  # 0.47 / 0.53 around the 0.5 threshold
        with torch.no_grad():
            gate.bias.zero_()
            gate.bias[:dead] = -100.0
        for _ in range(5):
            model(torch.rand(16, 100)).sum().backward()
            monitor.step()
            model.zero_grad()
    monitor.close()
    assert [w for w in monitor.alerts if w.kind == "dead_units"][0].value == pytest.approx(0.53)
    assert len(monitor.alerts) <= 2, [a.message for a in monitor.alerts]


def test_a_long_collapsing_run_has_at_most_two_onsets_per_layer_and_kind():
    # a narrow ReLU MLP regressed towards zero under strong weight decay: gradients shrink over
    # decades and units die slowly (real: detail="full" finds the same conditions). Without the
    # weight decay the units do not die, and the dead_units alert the default once raised on this
    # run came from two sampled steps only.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 6), nn.ReLU(),
                          nn.Linear(6, 1))  # fmt: skip
    x = torch.randn(256, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, weight_decay=0.05)
    monitor = GradMonitor(model, flush_every=50, optimizer=opt)
    for _ in range(4000):  # every onset of the 6000-step run is in its first 3150 steps (measured)
        idx = torch.randint(0, 256, (16,))
        model(x[idx]).square().mean().backward()
        monitor.step()
        opt.step()
        opt.zero_grad()
    monitor.close()
    onsets: dict[tuple[str, str], int] = {}
    for a in monitor.alerts:
        onsets[(a.kind, a.layer)] = onsets.get((a.kind, a.layer), 0) + 1
    assert monitor.alerts, "the run should collapse"
    assert max(onsets.values()) <= 2, onsets


# ------------------------------------------------------------ attention
def test_multihead_attention_out_proj_gets_output_gradient_statistics():
    from ..reference import RetainedOutputs

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
    monitor = GradMonitor(model, flush_every=5, detail="full")
    assert "layers.0.self_attn.out_proj" in monitor.layers
    reference = RetainedOutputs(model, ["layers.0.self_attn"])  # the attention's output = out_proj's
    model(torch.randn(3, 5, 16)).square().mean().backward()
    monitor.step()
    monitor.flush()
    w = monitor.last_window
    expected = reference.norm("layers.0.self_attn")
    for name in ("layers.0.self_attn", "layers.0.self_attn.out_proj"):
        assert w.out_grad_norm[0, w.layers.index(name)] == pytest.approx(expected, rel=1e-5)
    assert w.dead_fraction[w.layers.index("layers.0.self_attn.out_proj")] == 0.0
    monitor.close()


# ------------------------------------------------------------ root causes across a dead layer
class _DeadBatchNormBlock(nn.Module):
    """A residual block, conv -> BatchNorm (dead: gamma 0, beta -1, so the ReLU zeroes it) -> ReLU
    -> conv without bias -> BatchNorm, plus the identity (ResNet's BasicBlock)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)
        with torch.no_grad():
            self.bn1.weight.zero_()
            self.bn1.bias.fill_(-1.0)

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv1(x)))
        h = torch.relu(x + self.bn2(self.conv2(h)))
        return self.head(h.mean((2, 3)))


def test_a_bias_free_conv_after_a_dead_batchnorm_is_not_vanishing_the_dead_layer_is_named():
    torch.manual_seed(0)
    model = _DeadBatchNormBlock()

    def make():
        x = torch.randn(16, 8, 8, 8)
        return x, torch.randn(16, 4)

    monitor = _run(model, steps=40, make=make, opt=torch.optim.SGD(model.parameters(), lr=0.01))
    kinds = [(a.kind, a.layer) for a in monitor.alerts]
    assert kinds[0] == ("dead_units", "bn1"), kinds
    assert not [k for k in kinds if k[0] == "vanishing"], kinds  # conv2 (zero input) and conv1 (behind it)
    dead = next(a for a in monitor.alerts if a.kind == "dead_units")
    # reported at the first flush (every unit dead on every sampled row is conclusive), where it
    # already explains conv1; conv2's zero gradient comes after it and is never a separate alert
    assert dead.step == 9 and "vanishing gradient of layer conv1" in dead.message


class _NormBeforeDeadLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.dead = nn.Linear(32, 32)
        self.out = nn.Linear(32, 4)
        with torch.no_grad():
            self.dead.bias.fill_(-100.0)

    def forward(self, x):
        return self.out(torch.relu(self.dead(self.norm(self.inp(x)))))


def test_a_norm_feeding_a_dead_linear_is_not_named_before_the_dead_layer():
    # batch 8: the dead layer's first window has 16 samples (too few to judge); the norm before
    # it has had a zero gradient since step 0 and waits for that judgement instead of going first.
    torch.manual_seed(0)
    model = _NormBeforeDeadLinear()
    monitor = _run(model, steps=40, make=_regression(batch=8), opt=torch.optim.SGD(model.parameters(), lr=0.01))
    kinds = [(a.kind, a.layer) for a in monitor.alerts]
    assert kinds and kinds[0] == ("dead_units", "dead"), kinds
    assert ("vanishing", "norm") not in kinds and ("vanishing", "inp") not in kinds


def test_dead_channels_are_judged_on_images_not_on_positions():
    # Batch 4, 8x8 positions: 4 images a step, not 256 "samples". dead_min_samples=32 images need
    # 8 recorded steps (flush_every=2, both steps of a window sampled), so the dead convolution is
    # judged at step 7, not at the first flush from "256 samples" that were 4 images.
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 8, 3, padding=1)
    with torch.no_grad():
        conv.bias.fill_(-100.0)
    model = nn.Sequential(conv, nn.ReLU(), nn.Flatten(), nn.Linear(8 * 64, 4))

    def make():
        return torch.randn(4, 3, 8, 8), torch.randn(4, 4)

    monitor = _run(model, steps=12, flush_every=2, make=make, opt=torch.optim.SGD(model.parameters(), lr=0.0))
    dead = [a for a in monitor.alerts if a.kind == "dead_units"]
    assert [(a.layer, a.step) for a in dead] == [("0", 7)]
    assert "32 samples of 8 steps" in dead[0].message


# ------------------------------------------------------------ dead units judged on evidence that represents the window
def _rarely_active_layer():
    """64 ReLU units, each active on about 1% of rows (pre-activation ~ N(0, 1) - 2.33)."""
    torch.manual_seed(0)
    gate = nn.Linear(16, 64)
    with torch.no_grad():
        gate.weight.normal_(0, 0.25)  # unit variance for x ~ N(0, I_16)
        gate.bias.fill_(-2.33)
    return gate, nn.Sequential(gate, nn.ReLU(), nn.Linear(64, 1))


def test_units_firing_on_few_rows_are_not_called_dead_from_the_sampled_steps():
    # The default records dead-unit evidence on 2 steps of each 25-step window: 64 rows, on which
    # about half of these units never fire. Over every step of a window (800 rows) 10-20% are silent.
    gate, model = _rarely_active_layer()
    monitor, _, silent = _train_gated(model, gate, steps=100)
    monitor.close()
    assert max(silent) < 0.3, silent  # the layer is not dead over any window
    assert [a for a in monitor.alerts if a.kind == "dead_units"] == []


def test_a_layer_suspected_while_the_model_backs_off_is_not_called_dead_from_its_sampled_steps():
    # Two rarely active layers in parallel branches. a's confirmations (whole windows recorded at
    # every step) find it alive, so the model backs off (DeadUnitsRule.quiet_for: no borderline
    # layer is confirmed for 1, 2, ... windows). b fires on most rows until step 75, then on few:
    # its sampled steps (64 rows) read it ~60% dead while, by the test's own count over every row
    # of each window, at most 16% of its units are silent. Suspected while the model backs off, its
    # next window is not recorded in full, and its sampled rows alone must not raise the alert
    # (they did: "59% ... of the 64 samples of 2 steps"); it waits for a window in full instead.
    class TwoBranches(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            (self.gate_a, self.a), (self.gate_b, self.b) = _rarely_active_layer(), _rarely_active_layer()

        def forward(self, x):
            return self.a(x) + self.b(x)

    def sparse_from_step_75(step: int) -> None:
        model.gate_b.bias.fill_(1.0 if step < 75 else -2.33)

    torch.manual_seed(0)
    model = TwoBranches()
    monitor, _, silent = _train_gated(model, model.gate_b, steps=200, before_step=sparse_from_step_75)
    rule = monitor._stages.pipeline.checks.dead
    monitor.close()
    assert max(silent) < 0.3, silent  # b is not dead over any window
    assert [a.message for a in monitor.alerts if a.kind == "dead_units"] == []
    assert rule.confirming[rule.layers.index("gate_b")]  # its confirmation waits for a window in full


def _dead_gate_run(steps: int, batch: int, flush_every: int = 25, dead_from=lambda step: 48, alive_bias: float = -2.33):
    """The rarely active layer with ``dead_from(step)`` of its 64 units dead (bias -100), the others
    at ``alive_bias`` (1.0: active on most rows); returns (monitor, each flush's sampled slots, the
    test's own dead fraction per window)."""
    gate, model = _rarely_active_layer()

    def set_biases(step: int) -> None:
        dead = dead_from(step)
        gate.bias[:dead] = -100.0
        gate.bias[dead:] = alive_bias

    monitor, sampled, own = _train_gated(model, gate, steps, batch, flush_every, set_biases)
    monitor.close()
    return monitor, sampled, own


def _train_gated(model: nn.Module, gate: nn.Linear, steps: int, batch: int = 32, flush_every: int = 25,
                 before_step=lambda step: None):  # fmt: skip
    """Train ``model`` (learning rate 0: its layers stay as they are) under a monitor for ``steps``
    steps of random batches, ``before_step(step)`` (under no_grad) first at each; returns (the
    monitor, still open; each flush's sampled slots; the test's own fraction of ``gate``'s units
    that fired on no row of each window)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = GradMonitor(model, flush_every=flush_every, optimizer=opt)
    sampled, silent, alive = [], [], torch.zeros(gate.out_features, dtype=torch.bool)
    for step in range(steps):
        with torch.no_grad():
            before_step(step)
        x = torch.randn(batch, 16)
        alive |= (gate(x) > 0).any(0)  # the test's own count: a ReLU unit passes gradient where it fires
        model(x).sum().backward()
        monitor.step()
        opt.step()
        opt.zero_grad()
        if step % flush_every == flush_every - 1:
            sampled.append(monitor.last_window.sampled.copy())
            silent.append(1 - alive.double().mean().item())
            alive[:] = False
    return monitor, sampled, silent


def test_a_layer_dead_on_the_sampled_steps_is_confirmed_on_every_remaining_step_of_the_same_window():
    # The sampled steps (slots 0 and 1) find 75% dead: the rest of that window records every
    # statistic, and its own flush confirms it (not one window later).
    monitor, sampled, own = _dead_gate_run(50, batch=32)
    assert sampled[0].all() and own[0] >= 48 / 64
    dead = [a for a in monitor.alerts if a.kind == "dead_units"]
    assert [(a.layer, a.step) for a in dead] == [("0", 24)]
    assert abs(dead[0].value - own[0]) < 0.03  # over every row of the window, as the test counts


def test_a_layer_seen_on_too_few_rows_mid_window_is_confirmed_in_the_next_window():
    # 8 rows a step: the first window's two sampled steps (16 rows) are too few to judge; the
    # second window's sampled steps complete the evidence at its flush, and the third window
    # records every step to confirm it.
    monitor, sampled, own = _dead_gate_run(75, batch=8, alive_bias=1.0)  # the live units fire: never a zero gradient
    assert sampled[0].sum() == 2 and sampled[1].sum() == 2 and sampled[2].all()
    dead = [a for a in monitor.alerts if a.kind == "dead_units"]
    assert [(a.layer, a.step) for a in dead] == [("0", 74)] and dead[0].value >= 48 / 64


def test_a_layer_at_its_threshold_in_alternate_windows_is_reported_once():
    # 34 of 64 units (53%) dead in even windows, 30 (47%) in odd ones: one condition, reported once,
    # neither never (each 53% window confirmed by a 47% one) nor at every crossing.
    monitor, sampled, own = _dead_gate_run(200, batch=32, flush_every=10, alive_bias=1.0,
                                           dead_from=lambda step: 34 if (step // 10) % 2 == 0 else 30)  # fmt: skip
    assert min(own[0::2]) >= 0.5 > max(own[1::2])  # the test's own count: above, then below, the threshold
    dead = [a for a in monitor.alerts if a.kind == "dead_units"]
    assert [(a.layer, a.step) for a in dead] == [("0", 9)]


def test_dead_units_in_the_last_window_of_a_run_are_reported_by_close():
    # 48 of the layer's 64 units die at step 20 of a 40-step run (windows of 25): the window that
    # sees them on its sampled steps is cut short by close(), whose flush confirms and reports it.
    monitor, sampled, own = _dead_gate_run(40, batch=32, alive_bias=1.0, dead_from=lambda step: 48 if step >= 20 else 0)
    dead = [a for a in monitor.alerts if a.kind == "dead_units"]
    assert [(a.layer, a.step) for a in dead] == [("0", 39)] and dead[0].value == 48 / 64


def test_a_layer_whose_every_unit_dies_mid_window_is_reported_at_that_window_s_flush():
    # Every unit of the layer dies at step 33 (windows of 25): its gradient is exactly zero from
    # then on, which the per-step read-back sees; the rest of the window (34-49) is recorded in
    # full on fresh evidence, and the flush at 49 reports it (not the next window's, at 74).
    monitor, sampled, own = _dead_gate_run(75, batch=32, alive_bias=1.0, dead_from=lambda step: 64 if step >= 33 else 0)
    assert sampled[1][9:].all() and not sampled[1][2:9].any()  # slots 0-1 planned; 9 (step 34) on: in full
    dead = [a for a in monitor.alerts if a.kind == "dead_units"]
    assert [(a.layer, a.step, a.value) for a in dead] == [("0", 49, 1.0)]


def test_a_confirmation_that_finds_no_evidence_ends_within_two_windows():
    # The layer looks dead on the first window's sampled steps, then never runs again (its branch
    # switched off): the confirmation (every statistic at every step) ends, not on for good. 8 rows
    # a step: the evidence is complete at the second window's flush, too late to confirm inside it.
    gate, model = _rarely_active_layer()
    with torch.no_grad():
        gate.bias[:48] = -100.0
        gate.bias[48:] = 1.0  # the live units fire on most rows: the gradient is never exactly zero
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = GradMonitor(model, flush_every=25, optimizer=opt)
    full = []
    for step in range(175):
        if step < 50:
            model(torch.randn(8, 16)).sum().backward()
        else:  # the gate's branch no longer runs: only the head learns
            model[-1](torch.randn(32, model[-1].in_features)).sum().backward()
        monitor.step()
        opt.step()
        opt.zero_grad()
        if (step + 1) % 25 == 0:
            full.append(monitor.last_window.sampled.all())
    monitor.close()
    assert not full[1] and full[2] and not full[-1] and not full[-2], full  # confirmed once, then off again

# ------------------------------------------------------------ vanishing under a normalising optimizer
def test_a_gradient_collapsing_five_decades_is_vanishing_under_adam_too():
    # A saturated gate from step 30 on: the gradient reaching layer 0's output x 1e-7. Adam's
    # step normalises the gradient away until it falls under its eps, so no comparison with the
    # other layers can tell; the collapse against the layer's own level does.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    scale = [1.0]

    def gate(module, args, out):
        out.register_hook(lambda g: g * scale[0])

    model[0].register_forward_hook(gate)

    def hook(step, loss):
        if step == 30:
            scale[0] = 1e-7
        return loss

    monitor = _run(model, steps=80, lr=1e-3, loss_hook=hook)
    vanishing = [a for a in monitor.alerts if a.kind == "vanishing"]
    assert [a.layer for a in vanishing] == ["0"], [a.message for a in monitor.alerts]
    assert vanishing[0].step >= 30 and "own earlier level" in vanishing[0].message


def test_a_confirmation_carried_in_a_checkpoint_records_the_resumed_window_in_full():
    gate, model = _rarely_active_layer()
    with torch.no_grad():
        gate.bias[:48] = -100.0
        gate.bias[48:] = 1.0  # never an exactly zero gradient: confirmed by the next window
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def train(monitor, steps):
        for _ in range(steps):
            model(torch.randn(8, 16)).sum().backward()  # 8 rows: evidence complete at the second flush
            monitor.step()
            opt.step()
            opt.zero_grad()

    first = GradMonitor(model, flush_every=25, optimizer=opt)
    train(first, 50)  # dead on the sampled steps: to be confirmed
    state = first.state_dict()
    first.close()
    resumed = GradMonitor(model, flush_every=25, optimizer=opt)
    resumed.load_state_dict(state)
    train(resumed, 25)
    assert resumed.last_window.sampled.all()  # the confirmation window, recorded in full
    assert [(a.kind, a.layer, a.step) for a in resumed.alerts] == [("dead_units", "0", 74)]
    resumed.close()


def test_the_dead_unit_back_off_survives_a_checkpoint_matched_by_layer_name():
    # A layer that confirmations found alive waits before it is confirmed again, and the model backs
    # off after confirming windows that found nothing (dead_units.backoff); a resumed run keeps both
    # (was: a resumed run asked for a full window again at once).
    import json

    import numpy as np

    from gradwatch.detect.dead_units import DeadUnitsRule

    config = HealthConfig()
    rule = DeadUnitsRule(config, ["a", "b", "c"])
    rule.cooldown[1], rule.found_alive[1] = 4, 2
    rule.confirming[2], rule.confirm_windows[2] = True, 1
    rule.quiet_for, rule.quiet_confirmations = 3, 2
    state = json.loads(json.dumps(rule.state_dict()))  # plain JSON, as checkpoints hold it
    resumed = DeadUnitsRule(config, ["c", "b", "a", "new"])  # another order, and a layer added since
    resumed.load_state_dict(state)
    assert resumed.cooldown.tolist() == [0, 4, 0, 0] and resumed.found_alive.tolist() == [0, 2, 0, 0]
    assert resumed.confirming.tolist() == [True, False, False, False] and resumed.confirm_windows.tolist() == [1, 0, 0, 0]
    assert (resumed.quiet_for, resumed.quiet_confirmations) == (3, 2)
    # what it changes: layer b just past the threshold on enough samples asks for a confirmation
    # in a fresh rule, not in the resumed one (cooling down)
    fractions = np.array([0.0, config.dead_fraction + 0.01, 0.0, 0.0])
    rows, units = np.full(4, config.dead_min_samples), np.full(4, max(config.dead_min_units, 16))
    assert DeadUnitsRule(config, ["c", "b", "a", "new"]).worth_confirming(fractions, rows, units).tolist() == [
        False, True, False, False]
    assert not resumed.worth_confirming(fractions, rows, units).any()
    old = DeadUnitsRule(config, ["a"])
    old.load_state_dict({"confirming": ["a"]})  # a checkpoint of an earlier version: nothing backing off
    assert old.confirming.tolist() == [True] and old.cooldown.tolist() == [0] and old.quiet_for == 0
