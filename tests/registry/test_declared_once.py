"""A statistic is declared once (gradwatch/registry/): one table entry reaches the buffer, the
decoder, the scalars and the tags, with nothing else changed. Each test adds a statistic by
patching one table only, runs a real model, and checks the written values against its own
computation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from gradwatch import GradMonitor
from gradwatch.registry import outputs, statistics
from gradwatch.registry.outputs import OutputStatistic
from gradwatch.registry.statistics import Statistic
from gradwatch.sinks.tensorboard import custom_scalars_layout

from ..conftest import read_scalars


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))


def test_a_gradient_statistic_added_as_one_entry_is_decoded_tagged_and_written(tmp_path, monkeypatch):
    # grad_rms per layer (the root-mean-square of its parameter gradients), decoded from states
    # that exist: one entry in registry/statistics.py.
    def grad_rms(d):
        return np.where(d.has_grad, np.sqrt(d.layer_sumsq / np.maximum(d.layout.param_numel, 1)), np.nan)

    entry = Statistic("grad_rms_added", grad_rms, "step", lambda table, w: w.has_grad, "gradient RMS", True)
    monkeypatch.setattr(statistics, "STATISTICS", statistics.STATISTICS + (entry,))
    model = _mlp()
    monitor = GradMonitor(model, flush_every=4, logdir=str(tmp_path))
    expected = []
    for _ in range(6):
        model(torch.randn(8, 5)).square().mean().backward()
        expected.append({name: float(torch.cat([p.grad.reshape(-1) for p in model.get_submodule(name).parameters()])
                                     .double().square().mean().sqrt()) for name in ("0", "2")})  # fmt: skip
        monitor.step()
        model.zero_grad()
    monitor.close()
    scalars = read_scalars(str(tmp_path))
    for step in range(6):
        for name in ("0", "2"):
            assert scalars[f"gradwatch/grad_rms_added/{name}"][step] == pytest.approx(expected[step][name], rel=1e-6)
    assert monitor.last_window.table("grad_rms_added").shape == (2, 2)
    assert "grad_rms_added" in custom_scalars_layout()["gradwatch"]  # its chart, too


def test_an_output_statistic_added_as_one_entry_is_accumulated_decoded_and_written(tmp_path, monkeypatch):
    # The mean of each layer's output over the step's calls: one entry in registry/outputs.py gives
    # the taps' accumulator (a cell in the buffer), its decoding and its tag.
    def accumulate(out, dtype, exact):  # exact: a sum reduced in dtype either way
        return [out.sum(dtype=dtype)]

    def decode(accumulators, elements):
        return np.where(elements > 0, accumulators[..., 0] / np.where(elements > 0, elements, 1.0), np.nan)

    entry = OutputStatistic("act_mean_added", ("sum of elements",), accumulate, decode, label="activation mean")
    monkeypatch.setattr(outputs, "OUTPUT_STATISTICS", outputs.OUTPUT_STATISTICS + (entry,))
    model = _mlp()
    seen: dict[str, list[torch.Tensor]] = {"0": [], "2": []}
    for name in seen:
        model.get_submodule(name).register_forward_hook(lambda m, a, o, name=name: seen[name].append(o.detach().double()))
    monitor = GradMonitor(model, flush_every=5, logdir=str(tmp_path), detail="full")
    expected = []
    for _ in range(5):
        for _ in range(2):  # two calls per step, pooled
            model(torch.randn(4, 5)).square().mean().backward()
        expected.append({name: float(torch.cat([o.reshape(-1) for o in outs]).mean()) for name, outs in seen.items()})
        for outs in seen.values():
            outs.clear()
        monitor.step()
        model.zero_grad()
    monitor.close()
    scalars = read_scalars(str(tmp_path))
    w = monitor.last_window
    for step in range(5):
        for i, name in enumerate(("0", "2")):
            assert scalars[f"gradwatch/act_mean_added/{name}"][step] == pytest.approx(expected[step][name], rel=1e-5)
            assert w.output_stats["act_mean_added"][step, i] == pytest.approx(expected[step][name], rel=1e-9)
    # the statistics already declared are unchanged beside it
    rms = w.output_stats["act_rms"]
    assert np.isfinite(rms).all() and not math.isclose(rms[0, 0], w.output_stats["act_mean_added"][0, 0])


def test_each_output_statistic_written_into_its_cells_equals_its_stacked_accumulators():
    # The accelerators' path writes an eager first call's output statistics straight into their cells
    # (``registry.outputs.write_all``: no stack); the same values as the stacked accumulators, exactly
    # for the counts: -0.0 is a zero, NaN and Inf are not; float32 windows (exact=False) too.
    values = torch.randn(4, 33, dtype=torch.float64).float()
    values[0, :5] = 0.0
    values[1, :3] = -0.0
    values[2, 0], values[2, 1], values[3, 0] = float("nan"), float("inf"), -float("inf")
    finite = values[:2]
    for out in (values, finite, finite.to(torch.bfloat16)):
        for exact in (True, False):
            cells = torch.zeros(outputs.declared_accumulators(), dtype=torch.float64)
            outputs.write_all(out, exact, outputs.written_cells(cells))
            stacked = outputs.accumulate_all(out, torch.float64, exact)
            assert cells[1].item() == stacked[1].item() == float((out != 0).sum())  # non-zero elements
            expected = float(out.double().square().sum())
            want = expected if not np.isfinite(expected) else pytest.approx(expected, rel=1e-6)
            for got in (cells[0].item(), stacked[0].item()):
                assert (np.isnan(got) and np.isnan(expected)) or got == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_cpu_zero_count_is_exact_at_any_share_of_zeros_layout_and_size(dtype, monkeypatch):
    # The CPU counts a large output's non-zero elements on the bits of its magnitude (the float count
    # branches per element: ~7x slower on a ReLU's output): -0.0 is a zero, NaN, Inf and subnormals are
    # not, whatever the layout; pieces of a huge output add up. Against a float64 comparison.
    torch.manual_seed(0)
    values = torch.randn(8, 16, 32, 32, dtype=torch.float64)  # 131072 elements: past the threshold
    values = torch.where(values < 0, torch.zeros(()), values)  # a ReLU's: half zero
    flat = values.view(-1)
    flat[:100] = -0.0
    flat[100], flat[101], flat[102] = float("nan"), float("inf"), -float("inf")
    flat[103] = torch.finfo(dtype).smallest_normal / 4 if dtype != torch.bfloat16 else 1e-40  # subnormal
    out = values.to(dtype)
    assert out.numel() >= outputs._NONZERO_MIN
    laid_out = (out, out.to(memory_format=torch.channels_last), out.transpose(1, 3))
    for chunk in (outputs._NONZERO_CHUNK, 10_000):  # whole, then in pieces (non-contiguous: the float count)
        monkeypatch.setattr(outputs, "_NONZERO_CHUNK", chunk)
        for x in laid_out:
            (count,) = outputs._nonzeros(x, torch.float64, True)
            assert count.item() == int((x.double() != 0).sum()) == int((values.to(dtype).double() != 0).sum())
            assert outputs.accumulate_all(x, torch.float64)[1].item() == count.item()
