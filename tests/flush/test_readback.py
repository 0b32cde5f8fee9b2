"""What one step's host values say (readback.summarize): its fast path for the finite case and
its exact path agree with a direct computation."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from gradwatch.flush.readback import StepValues, summarize

# Three layers; tensors 0-1 belong to layer 0, 2 to layer 1, 3-4 to layer 2.
_LAYOUT = SimpleNamespace(names=["a", "b", "c"], param_layer=np.array([0, 0, 1, 2, 2]))


def _values(sq, present, nonfinite=None, forward=None, out_sq=None) -> StepValues:
    sq = np.asarray(sq, dtype=np.float64)
    return StepValues(
        slot=0, sq=sq, nonfinite=np.zeros_like(sq) if nonfinite is None else np.asarray(nonfinite, dtype=np.float64),
        present=np.asarray(present, dtype=np.int64),
        forward=np.array([1.5, -2.0, 3.0]) if forward is None else np.asarray(forward, dtype=np.float64),
        out_sq=np.zeros(3) if out_sq is None else np.asarray(out_sq, dtype=np.float64), order=None, failed=False,
    )  # fmt: skip


def test_finite_step_gives_the_norm_over_present_tensors_and_no_flag():
    sq = [4.0, 9.0, 1e30, 0.25, 16.0]
    present = [1, 1, 0, 1, 2]  # tensor 2 had no gradient this step (its column is ignored); 2 ranks had tensor 4
    s = summarize(_values(sq, present), _LAYOUT)
    expected = math.sqrt(np.sum(np.array(sq)[np.array(present) > 0], dtype=np.float64))
    assert s.global_norm == pytest.approx(expected, rel=1e-15)
    assert s.has_grad and not s.any_bad and not s.fwd_bad.any() and not s.grad_bad.any() and s.count == 0.0


def test_no_gradient_at_all_gives_a_nan_norm():
    s = summarize(_values([0.0] * 5, [0] * 5), _LAYOUT)
    assert not s.has_grad and math.isnan(s.global_norm) and not s.any_bad


def test_a_nan_in_an_absent_column_is_ignored_by_the_exact_path():
    s = summarize(_values([1.0, 1.0, math.nan, 1.0, 1.0], [1, 1, 0, 1, 1]), _LAYOUT)
    assert s.global_norm == pytest.approx(2.0) and not s.any_bad


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_gradient_flags_its_layer(bad):
    s = summarize(_values([1.0, 1.0, 1.0, bad, 1.0], [1] * 5, nonfinite=[0, 0, 0, 7, 0]), _LAYOUT)
    assert s.any_bad and s.grad_bad.tolist() == [False, False, True] and not s.fwd_bad.any() and s.count == 7.0


def test_opposite_infinities_do_not_cancel_into_a_finite_step():
    # +inf and -inf running forward sums: their sum is NaN, not a finite number
    s = summarize(_values([1.0] * 5, [1] * 5, forward=[math.inf, -math.inf, 0.0]), _LAYOUT)
    assert s.any_bad and s.fwd_bad.tolist() == [True, True, False]


def test_each_step_is_judged_on_its_own_forward_sums():
    # the sums are the step's own: a layer non-finite at two steps in a row is flagged at both,
    # and one that recovered is clear again
    first = summarize(_values([1.0] * 5, [1] * 5, forward=[1.0, math.inf, math.nan]), _LAYOUT)
    second = summarize(_values([1.0] * 5, [1] * 5, forward=[1.0, math.inf, 2.0]), _LAYOUT)
    assert first.fwd_bad.tolist() == [False, True, True]
    assert second.fwd_bad.tolist() == [False, True, False]


def test_a_non_finite_output_gradient_flags_its_layer():
    s = summarize(_values([1.0] * 5, [1] * 5, out_sq=[0.0, math.inf, 0.0]), _LAYOUT)
    assert s.any_bad and s.grad_bad.tolist() == [False, True, False]


def test_finite_values_whose_sum_overflows_flag_nothing():
    # each square is finite; their total overflows: the exact path finds no bad layer
    s = summarize(_values([1e308, 1e308, 1.0, 1.0, 1.0], [1] * 5), _LAYOUT)
    assert not s.any_bad and math.isinf(s.global_norm)


# --- the staging ring of the device-agnostic path (accelerators; here on CPU tensors) ---------


def _staged_monitor(monkeypatch, ring: int, **kwargs):
    import torch
    from torch import nn

    import gradwatch.capture.param_stats as param_stats
    import gradwatch.flush.readback as readback
    from gradwatch import GradMonitor

    monkeypatch.setattr(param_stats, "CPU_FAST_PATH", False)  # the accelerators' path
    monkeypatch.setattr(readback, "_RING", ring)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    monitor = GradMonitor(model, **kwargs)
    assert not monitor._stages.detection.judge._readback.host_path and monitor._stages.detection.per_step
    return torch, model, monitor


def _record_judged(monitor):
    """Wrap the per-step checks to record (step, global norm) of every step they judge."""
    judged = []
    checks = monitor._stages.detection.judge._checks
    original = checks.judge_step

    def judge_step(step, summary, *args):
        judged.append((step, summary.global_norm))
        return original(step, summary, *args)

    checks.judge_step = judge_step
    return judged


def test_a_full_ring_grows_and_every_step_is_judged_in_order(monkeypatch):
    # A device running ahead of the host: the copies of steps 0-2 have not landed when their
    # step() looks (simulated: ready() finds nothing), so steps 1-3 find the one slot in flight.
    # Every step must still be judged per step, in order, with its own values.
    torch, model, monitor = _staged_monitor(monkeypatch, ring=1, flush_every=10)
    readback = monitor._stages.detection.judge._readback
    original_ready = readback.ready
    lagging = {"on": True}
    monkeypatch.setattr(readback, "ready", lambda wait=False: [] if lagging["on"] and not wait else original_ready(wait))
    judged = _record_judged(monitor)
    reference = []
    for step in range(4):
        lagging["on"] = step < 3
        model(torch.randn(5, 4)).pow(2).mean().backward()
        reference.append(math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters())))
        monitor.step()
        model.zero_grad()
        if step < 3:
            assert judged == []  # nothing landed yet
    assert readback.slots == 4  # grew by one per step in flight, no step dropped
    assert [s for s, _ in judged] == [0, 1, 2, 3]
    assert [n for _, n in judged] == pytest.approx(reference, rel=1e-6)
    monitor.close()


def test_with_no_free_slot_at_attach_a_nan_still_stops_at_its_own_step(monkeypatch):
    # The simulation (a ring of 0): before, no step found a slot, so the per-step checks
    # never ran and a NaN was seen only at the flush (step 9). Now it stops the run at step 3.
    from gradwatch import GradientHealthError, HealthConfig

    torch, model, monitor = _staged_monitor(monkeypatch, ring=0, flush_every=10,
                                            config=HealthConfig(stop_on={"nonfinite"}))  # fmt: skip
    stopped_at = None
    for step in range(10):
        loss = model(torch.randn(5, 4)).pow(2).mean()
        (loss * float("nan") if step == 3 else loss).backward()
        try:
            monitor.step()
        except GradientHealthError:
            stopped_at = step
            break
        model.zero_grad()
    assert stopped_at == 3
    monitor.close()


def test_a_layer_ran_by_the_decoders_rule_in_the_per_step_silence_check():
    # silent_layers (the per-step check that a layer fell silent) and the decoder's has_grad share
    # one rule (registry.statistics.layer_ran): a layer ran when its forward sum is not zero or, on a
    # sampled step, its first-call clock is set. Layer 0's output summed to exactly 0.0 and all its
    # parameter gradients are zero; layer 1 did not run; layer 2 is alive.
    from dataclasses import replace

    from gradwatch.flush.readback import silent_layers
    from gradwatch.registry.statistics import layer_ran

    values = _values([0.0, 0.0, 0.0, 1.0, 1.0], [1, 1, 1, 1, 1], forward=[0.0, 0.0, 2.0])
    assert silent_layers(values, _LAYOUT).tolist() == [False, False, False]  # unsampled: no call seen
    sampled = replace(values, order=np.array([3.0, 0.0, 1.0]))  # layers 0 and 2 ran (clock), 1 did not
    assert silent_layers(sampled, _LAYOUT).tolist() == [True, False, False]
    # the decoder's rule, on the same evidence as [step, layer] tables
    ran = layer_ran(np.array([[0.0, 0.0, 2.0]] * 2), np.array([[0.0, 0.0, 0.0], [3.0, 0.0, 1.0]]))
    assert ran.tolist() == [[False, False, True], [True, False, True]]
    assert layer_ran(np.array([np.nan]), 0.0).tolist() == [True]  # a non-finite output is a call


def test_per_step_rows_carry_each_step_s_own_sums_to_the_window_and_the_per_step_checks(monkeypatch):
    # The accelerators' path keeps each step's gradient norms and forward sums in one device row
    # (capture/per_step_rows.py): the norms left unsquared where every gradient is there, the
    # general path's sums of squares turned into norms where one is missing, the taps' sums copied
    # and zeroed for the next step; the window's rows go into the buffer at the flush, squared. A
    # layer skipped at some steps (no gradient: the general path, as at sampled steps), a NaN batch at a step where it ran and at one where it did not, over two
    # windows: the windows and the per-step checks must say what the test computes itself.
    import torch
    from torch import nn

    import gradwatch.capture.param_stats as param_stats
    from gradwatch import GradMonitor

    monkeypatch.setattr(param_stats, "CPU_FAST_PATH", False)  # the accelerators' path, on CPU tensors
    kept_norms = []
    record = param_stats.ParamStats.record
    monkeypatch.setattr(param_stats.ParamStats, "record",
                        lambda self, *args: kept_norms.append(record(self, *args)) or kept_norms[-1])

    class Skips(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.mid, self.head = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 1)
            self.skip = False

        def forward(self, x):
            h = torch.relu(self.body(x))
            return self.head(h if self.skip else torch.tanh(self.mid(h)))

    torch.manual_seed(0)
    model = Skips()
    monitor = GradMonitor(model, flush_every=6)
    assert monitor._recorder.per_step_rows is not None
    windows, snapshot = [], monitor._recorder.snapshot
    monitor._recorder.snapshot = lambda *a, **k: windows.append(snapshot(*a, **k)) or windows[-1]
    judged = _record_judged(monitor)
    skipped, nan_steps = {5, 8}, {4, 8}  # 5: skipped right after a NaN forward (its cell must not keep it)
    norms, outputs = [], []
    for step in range(12):
        model.skip = step in skipped
        x = torch.randn(5, 4)
        if step in nan_steps:
            x[0, 0] = float("nan")
        kept = {}
        hooks = [getattr(model, n).register_forward_hook(lambda m, a, o, n=n: kept.__setitem__(n, o.detach()))
                 for n in ("body", "mid", "head")]  # fmt: skip
        model(x).pow(2).mean().backward()
        for h in hooks:
            h.remove()
        norms.append({n: float(torch.linalg.vector_norm(torch.cat([p.grad.double().reshape(-1) for p in
                                                                   getattr(model, n).parameters()])))
                      for n in ("body", "mid", "head") if getattr(model, n).weight.grad is not None})  # fmt: skip
        outputs.append({n: bool(torch.isfinite(o).all()) for n, o in kept.items()})
        monitor.step()
        model.zero_grad(set_to_none=True)
    monitor.close()
    # sums of squares turned into norms where "mid" had no gradient (the general path); the norms
    # left as they are at every other step, the sampled ones included (max |g| in the same foreach pass)
    assert len(windows) == 2 and [s for s, n in enumerate(kept_norms) if not n] == [5, 8]
    for w in windows:
        for t, step in enumerate(w.steps):
            for i, name in enumerate(w.layers):
                ran = name in outputs[step]
                assert w.has_grad[t, i] == (name in norms[step]), (step, name)
                if name in norms[step]:
                    expected = norms[step][name]
                    got = w.grad_norm[t, i]
                    assert (math.isnan(got) and math.isnan(expected)) or got == pytest.approx(expected, rel=1e-6)
                assert w.fwd_nonfinite[t, i] == (ran and not outputs[step][name]), (step, name)
    assert [s for s, _ in judged] == list(range(12))  # every step judged, each on its own values
    for step, norm in judged:
        assert math.isnan(norm) == (step in nan_steps), step
