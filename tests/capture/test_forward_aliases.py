"""A MultiheadAttention's out_proj outputs the very tensor its attention does (torch applies it
functionally): the attention's tap takes one forward check for both, and every reader of a step's
forward sums (the per-step checks, the window) sees out_proj's as the attention's
(capture/layers.py, ForwardAliases)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import gradwatch.capture.param_stats as param_stats
from gradwatch import GradMonitor
from gradwatch.registry.states import FWD_SUM


class _Attends(nn.Module):
    """A projection, an attention that ``skip`` leaves out of the forward, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(4, 8), nn.Linear(8, 1)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.skip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        if not self.skip:
            h = h + self.attn(h, h, h, need_weights=False)[0]
        return self.head(h).mean(dim=1)


def _attention_sum(twin: _Attends, x: torch.Tensor) -> float:
    """The attention's output summed in float64 by an unmonitored twin (0.0 where it did not run)."""
    sums = [0.0]
    hook = twin.attn.register_forward_hook(lambda m, a, o: sums.__setitem__(0, float(o[0].double().sum())))
    with torch.no_grad():
        twin(x)
    hook.remove()
    return sums[0]


@pytest.mark.parametrize("path", ["cpu-path", "accelerators"])
def test_out_proj_reads_its_attentions_forward_check_at_every_step_and_in_the_window(path, monkeypatch):
    monkeypatch.setattr(param_stats, "CPU_FAST_PATH", path == "cpu-path")
    torch.manual_seed(0)
    model = _Attends()
    twin = copy.deepcopy(model)
    monitor = GradMonitor(model, flush_every=6)
    names = list(monitor.layers)
    attn, out_proj = names.index("attn"), names.index("attn.out_proj")
    recorder = monitor._recorder
    flushed = []
    prepare = recorder.prepare_flush
    recorder.prepare_flush = lambda: (prepare(), flushed.append(recorder.buffer[FWD_SUM].clone()))[0]
    per_step, calm = [], []  # (window, slot) judged from staged values / entering the calm case
    judge = monitor._stages.detection.judge
    readback = judge._readback
    ready, judge_calm = readback.ready, judge.judge_calm
    readback.ready = lambda wait=False: [per_step.append((len(flushed), v.slot, v.forward.copy())) or v
                                         for v in ready(wait)]  # fmt: skip
    judge.judge_calm = lambda slot, steps, total: calm.append((len(flushed), slot)) or judge_calm(slot, steps, total)
    compiled = torch.compile(model, backend="aot_eager")

    skipped, nan_steps, compiled_steps = {2, 7}, {4, 9}, {8, 9}
    expected = []
    for step in range(12):
        model.skip = twin.skip = step in skipped
        x = torch.randn(3, 5, 4)
        if step in nan_steps:
            x[0, 0, 0] = float("nan")
        expected.append(_attention_sum(twin, x))
        (compiled if step in compiled_steps else model)(x).pow(2).mean().backward()
        monitor.step()
        model.zero_grad(set_to_none=True)
    monitor.close()

    # Every step is judged once: from its staged values, or (the CPU path's unsampled steps whose
    # gradients its host check found calm) in the calm case, which stages them only where a forward
    # sum is not finite. Those judged from staged values read the attention's check for out_proj.
    staged = {(window, slot): forward for window, slot, forward in per_step}
    assert len(flushed) == 2 and len(staged) == len(per_step)
    assert set(staged) | set(calm) == {(window, slot) for window in range(2) for slot in range(6)}
    assert (len(calm) > 0) == (path == "cpu-path")
    assert {(step // 6, step % 6) for step in nan_steps} <= set(staged)  # a NaN is never judged calm
    for step, want in enumerate(expected):
        window = flushed[step // 6].numpy()[step % 6]
        judged = staged.get((step // 6, step % 6))
        reads = (window[attn], window[out_proj]) + (() if judged is None else (judged[attn], judged[out_proj]))
        for got in reads:
            if math.isnan(want):
                assert math.isnan(got), (step, got)
            elif want == 0.0:
                assert got == 0.0, (step, got)  # not run: no call, as the decoder reads it
            else:
                assert got == pytest.approx(want, rel=1e-4, abs=1e-5), (step, got, want)


def test_a_nan_from_attention_is_named_at_the_attention_with_its_out_proj_beside_it():
    # The origin is the first layer in forward order whose output is not finite: the attention
    # (out_proj, the same tensor, is reported non-finite at that step too, as before).
    torch.manual_seed(0)
    model = _Attends()
    monitor = GradMonitor(model, flush_every=4)
    for step in range(4):
        x = torch.randn(3, 5, 4)
        with torch.no_grad():  # a NaN value bias at step 1 only: the attention's output is NaN there
            model.attn.in_proj_bias[16] = float("nan") if step == 1 else 0.0
        model(x).pow(2).mean().backward()
        monitor.step()
        model.zero_grad(set_to_none=True)
    window = monitor._stages.pipeline.last_window
    monitor.close()
    nonfinite = window.fwd_nonfinite
    names = window.layers
    assert nonfinite[1, names.index("attn")] and nonfinite[1, names.index("attn.out_proj")]
    assert not nonfinite[1, names.index("body")]
    assert not nonfinite[[0, 2, 3]].any()
