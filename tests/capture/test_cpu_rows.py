"""Exact sums of squares of float32 CPU tensors through float32 rows and a float64 redo
(``gradwatch/capture/cpu_rows.py``), each against the test's own float64 computation, at the
magnitudes where float32 squares underflow (~1e-25) or overflow (~1e22), in both layouts the
convolutions hand over."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from gradwatch import GradMonitor, registry
from gradwatch.capture import cpu_rows, host_branch
from gradwatch.capture.cells import add_recorded_output
from gradwatch.capture.grad_statistics import GradStatistics
from gradwatch.capture.recording_flags import RecordingFlags
from gradwatch.registry import outputs
from tests.test_core_hygiene import count_host_reads

_SHAPE = (16, 16, 32, 32)  # 262144 elements: cpu_rows.MIN_ELEMENTS, where the redo is worth it


def _extreme_rows() -> torch.Tensor:
    """(N, C, H, W) float32 whose (sample, channel) rows are normal, tiny (float32 squares vanish),
    huge (they overflow), zero, or hold a NaN or an inf."""
    torch.manual_seed(0)
    x = torch.randn(_SHAPE)
    x[0] *= 1e-25
    x[1, :4] *= 1e22
    x[2, 3] = 0.0
    x[3, 5, 7, 9] = float("nan")
    x[4, 6, 1, 2] = float("inf")
    x[5, 7] *= 1e-44  # float32 subnormals themselves
    return x


def _layouts(x: torch.Tensor) -> list[torch.Tensor]:
    return [x.contiguous(), x.contiguous(memory_format=torch.channels_last)]


def test_rows_of_any_magnitude_equal_the_float64_sums_in_both_layouts():
    x = _extreme_rows()
    want = x.double().square().sum(dim=(2, 3))
    assert cpu_rows.applies(x)
    for layout in _layouts(x):
        got = cpu_rows.channel_row_squares(layout, torch.float64)
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0, equal_nan=True)
        # the rows float32 could not hold are float64's own sums, not approximately
        torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=0)
        torch.testing.assert_close(got[1, :4], want[1, :4], rtol=1e-12, atol=0)
    # the test means something: float32 squares of those rows vanish or overflow
    plain = x.square().sum(dim=(2, 3))
    assert (plain[0] == 0).all() and torch.isinf(plain[1, :4]).all() and (want[0] > 0).all()


def test_a_whole_tensor_s_sum_equals_the_float64_sum_at_any_magnitude_and_layout():
    torch.manual_seed(1)
    for scale in (1.0, 1e-25, 1e22, 1e-44):
        x = torch.randn(_SHAPE) * scale
        want = x.double().square().sum()
        assert want > 0 and torch.isfinite(want)
        for layout in _layouts(x):
            got = cpu_rows.square_sum(layout, torch.float64)
            torch.testing.assert_close(got, want, rtol=1e-7, atol=0)
    # a slice with gaps, and a size that is no multiple of the rows: the float64 read, as exact
    x = torch.randn(16, 16, 32, 64)[..., ::2] * 1e-25
    odd = torch.randn(257, 1031) * 1e22
    for tensor in (x, odd):
        torch.testing.assert_close(cpu_rows.square_sum(tensor, torch.float64), tensor.double().square().sum(), rtol=1e-12, atol=0)
    nan = torch.randn(_SHAPE)
    nan[3, 2, 1, 0] = float("nan")
    assert torch.isnan(cpu_rows.square_sum(nan, torch.float64))


def test_the_rows_read_nothing_back_to_the_host(monkeypatch):
    # The redo is chosen by a selection on the values, not by a host read: no .item(), .tolist(),
    # .numpy() or scalar read, whether rows need it or not (they run between flushes).
    clean, extreme = torch.randn(_SHAPE), _extreme_rows()
    for x in (clean, extreme, extreme.contiguous(memory_format=torch.channels_last)):
        with count_host_reads(monkeypatch) as reads:
            cpu_rows.square_sum(x, torch.float64)
            cpu_rows.channel_row_squares(x, torch.float64)
        assert reads.count == 0, reads.ops


def test_only_float32_cpu_tensors_outside_compiled_code_take_the_rows():
    assert not cpu_rows.applies(torch.randn(_SHAPE, dtype=torch.float64))
    assert not cpu_rows.applies(torch.randn(64, 64))  # too small to be worth the redo
    with pytest.raises(ValueError, match="float32 CPU"):
        cpu_rows.square_sum(torch.randn(_SHAPE, dtype=torch.float64), torch.float64)
    with pytest.raises(ValueError, match=r"\(N, C, \*spatial\)"):
        cpu_rows.channel_row_squares(torch.randn(512, 1024), torch.float64)

    # Traced, the statistics keep their fused float64 reductions (a redo decides on values):
    # a 3-D convolution gradient's statistics compile under fullgraph and equal the eager ones.
    stats = GradStatistics(units=64, channel_first=True, weights=torch.ones(1 << 14), dtype=torch.float64)
    g = torch.randn(64, 64, 4096) * 1e-25

    def statistics(g: torch.Tensor):
        return stats.deltas(g, stats.weights), registry.accumulate_all(g, torch.float64)

    graphs = []

    def recording(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(str(gm.graph))
        return gm

    compiled = torch.compile(statistics, fullgraph=True, backend=recording)
    (sq, units), values = compiled(g)
    assert len(graphs) == 1 and "setitem" not in graphs[0]  # no selection of rows to redo
    (want_sq, want_units), want_values = statistics(g)
    torch.testing.assert_close(sq, want_sq, rtol=1e-9, atol=0)
    torch.testing.assert_close(units, want_units, rtol=1e-9, atol=0)
    torch.testing.assert_close(values, want_values, rtol=1e-9, atol=0)
    torch.testing.assert_close(sq[0], g.double().square().sum(), rtol=1e-9, atol=0)


def test_the_compiled_taps_ops_write_exact_statistics_of_tiny_channels_last_gradients_on_sampled_steps_only():
    # What compiled taps' sampled steps run (host_branch's kernels, eagerly at run time): a
    # gradient of ~1e-25 in inductor's channels-last layout, one channel dead, against float64,
    # recorded by the layer's tap, found by the zero-size key compiled code hands over, into its
    # backward row (the calls and samples on the host); the forward statistics a compiled step traced
    # whole writes into its cells (cells.add_recorded_output); the forward op, handed a key no tap
    # holds, records nothing; on an unsampled step they write nothing.
    if host_branch.add_output_grad is None:
        pytest.skip("the ops need torch.library.register_fake (torch >= 2.4)")
    torch.manual_seed(2)
    monitor = GradMonitor(nn.Conv2d(16, 16, 1), flush_every=50)  # its first step is sampled
    cells = monitor._stages.pipeline.recorder.cells
    tap, flags, host = cells.taps[0], cells.flags, cells.host
    assert flags.sampling
    g = (torch.randn(_SHAPE) * 1e-25).contiguous(memory_format=torch.channels_last)
    g[:, 3] = 0.0
    row = tap.grad_tap.grad_row  # the layer's backward cells (sum of squares, calls, samples), then its units
    units = row[3:]
    host_branch.add_output_grad(g, tap.grad_tap.row_key, flags.key)
    rows = g.double().square().sum(dim=(2, 3))
    torch.testing.assert_close(row[0:1], rows.sum().reshape(1), rtol=1e-12, atol=0)
    assert [host.values[1, 0], host.values[2, 0]] == [1.0, _SHAPE[0]]  # one call, its images as samples (host)
    assert units[3] == 0 and (units[torch.arange(16) != 3] > 0).all()
    forward = torch.zeros(2 + outputs.declared_accumulators(), dtype=torch.float64)
    clock = torch.full((1,), 7.0, dtype=torch.float64)
    host_branch.mark_output(g, tap.grad_tap.row_key.clone(), clock, flags.key)  # (no tap holds a copy)
    assert not forward.any() and clock.tolist() == [7.0] and host.values[3, 0] == 0  # no elements counted
    add_recorded_output(g, forward, clock, 2.0, True)
    assert forward[0] == 7.0 and clock.tolist() == [5.0]  # its first call's clock, then counted down
    assert forward[1] == g.numel()
    assert forward[2] == pytest.approx(float(rows.sum()), rel=1e-12)  # act_rms's sum of squares
    assert forward[3] == float(torch.count_nonzero(g))
    flags.sampling = False
    written = [t.clone() for t in (row, clock)] + [host.values.copy()]
    host_branch.add_output_grad(g, tap.grad_tap.row_key, flags.key)
    host_branch.mark_output(g, tap.grad_tap.row_key, clock, flags.key)
    assert torch.equal(written[0], row) and torch.equal(written[1], clock)  # unsampled: nothing computed,
    assert (written[2] == host.values).all()  # nothing written, nothing counted
    monitor.close()


def test_the_gate_compiled_code_reads_follows_each_monitor_s_sampling_and_outlives_none():
    # Inductor's wrapper calls the ops' kernels only where host_branch.GATE[key] is true
    # (_compat/inductor.py): it must follow each monitor's flag, say False once the monitor closed
    # (and for keys no monitor holds: a KeyError would stop compiled code), and a closed monitor's
    # flags must not write the gate of the monitor that took its key.
    first = RecordingFlags()
    assert host_branch.GATE[first.key] is True  # a monitor's first step is sampled
    first.sampling = False
    assert host_branch.GATE[first.key] is False
    first.sampling = True
    assert host_branch.GATE[first.key] is True
    key = first.key
    first.close()
    assert host_branch.GATE[key] is False
    second = RecordingFlags()
    assert second.key == key and host_branch.GATE[key] is True  # the smallest free key, its own value
    first.sampling = False  # the closed monitor's flags (a step after close) leave it alone
    assert host_branch.GATE[key] is True
    second.close()
    assert host_branch.GATE[10**6] is False
    third = RecordingFlags()  # collected without close(): its gate closes with it
    key = third.key
    assert host_branch.GATE[key] is True
    del third
    gc.collect()
    assert host_branch.GATE[key] is False


def test_the_tap_states_compiled_code_reads_are_each_monitor_s_own_and_leave_with_it():
    # Compiled taps read their device's shared state from cells.TAP_STATES by a key equal across the
    # layers (an attribute of every tap was a guard per layer). Each tap's key leads to its own
    # monitor's state; a closed monitor's entry is gone (its compiled code then fails its guards),
    # its key goes to the next monitor (the same constant for compiled code), and a monitor
    # collected without close() leaves nothing behind.
    from gradwatch.capture.cells import TAP_STATES

    def taps_of(monitor):
        return monitor._recorder.cells.taps

    before = dict(TAP_STATES)
    first = GradMonitor(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1)), flush_every=2)
    second = GradMonitor(nn.Linear(3, 2), flush_every=2)
    for monitor in (first, second):
        taps = taps_of(monitor)
        assert {tap.state_key for tap in taps} == {taps[0].state_key}  # one key for the device's layers
        assert TAP_STATES[taps[0].state_key] is taps[0].shared
    key = taps_of(first)[0].state_key
    assert key != taps_of(second)[0].state_key
    first.close()
    assert key not in TAP_STATES
    third = GradMonitor(nn.Linear(3, 2), flush_every=2)
    assert taps_of(third)[0].state_key == key and TAP_STATES[key] is taps_of(third)[0].shared
    first.close()  # closing again leaves the key's new owner alone
    assert TAP_STATES[key] is taps_of(third)[0].shared
    third.close()
    second_key = taps_of(second)[0].state_key
    del second, monitor, taps
    gc.collect()
    assert second_key not in TAP_STATES
    assert TAP_STATES == before


def test_a_large_tiny_layer_keeps_exact_statistics_in_eager_training():
    # act_rms's exact windows (every window of a layer at ~1e-25) and a channels-last convolution's
    # output gradients (never float32 rows: GradStatistics.float32_rows) take the rows on large tensors.
    torch.manual_seed(3)
    conv = nn.Conv2d(3, 16, 3, padding=1).to(memory_format=torch.channels_last)
    with torch.no_grad():
        conv.weight.mul_(1e-25)
        conv.bias.zero_()
    outputs, grads = [], []
    conv.register_forward_hook(lambda m, a, o: outputs.append(o.detach().double()))
    monitor = GradMonitor(conv, flush_every=3, detail="full")
    for _ in range(3):
        out = conv(torch.randn(16, 3, 32, 32).contiguous(memory_format=torch.channels_last))
        assert out.numel() >= cpu_rows.MIN_ELEMENTS and out.is_contiguous(memory_format=torch.channels_last)
        out.retain_grad()
        (out * torch.randn_like(out) * 1e-25).sum().backward()
        grads.append(out.grad.double())
        monitor.step()
    window = monitor.last_window
    monitor.close()
    want = [float(o.square().mean().sqrt()) for o in outputs]
    assert window.output_stats["act_rms"][:, 0].tolist() == [pytest.approx(w, rel=1e-9, abs=0) for w in want]
    want_norms = [float(g.norm()) for g in grads]
    assert window.out_grad_norm[:, 0].tolist() == [pytest.approx(w, rel=1e-6, abs=0) for w in want_norms]
    assert window.dead_fraction[0] == 0.0
    # the test means something: float32 squares of these outputs and gradients vanish
    assert want[0] < 1e-24 and float(torch.linalg.vector_norm(outputs[0].float())) == 0.0
    assert float(torch.linalg.vector_norm(grads[0].float())) == 0.0 < want_norms[0]
