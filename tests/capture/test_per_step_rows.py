"""The accelerators' per-step stage (capture/per_step_rows.py): the taps' forward sums are zeroed only
where a layer may not write its own at the next step, and a row that carried the last step's sums
still says each step's own."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import gradwatch.capture.param_stats as param_stats
from gradwatch import GradMonitor
from gradwatch.registry.states import FWD_SUM


class _Skips(nn.Module):
    """Three layers; ``mid`` is left out of the forward where ``skip`` (an idle expert, a branch)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.mid, self.head = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 1)
        self.skip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.body(x))
        return self.head(h if self.skip else torch.tanh(self.mid(h)))


_NAMES = ("body", "mid", "head")


def _output_sums(twin: _Skips, x: torch.Tensor) -> dict[str, float]:
    """Each layer's output summed in float64 by an unmonitored twin (the layers that ran)."""
    sums: dict[str, float] = {}
    hooks = [getattr(twin, n).register_forward_hook(lambda m, a, o, n=n: sums.__setitem__(n, float(o.double().sum())))
             for n in _NAMES]  # fmt: skip
    with torch.no_grad():
        twin(x)
    for h in hooks:
        h.remove()
    return sums


@pytest.mark.parametrize("landing", ["prompt", "lagging"])
def test_sums_kept_after_a_step_where_every_layer_wrote_are_taken_out_where_a_layer_did_not(landing, monkeypatch):
    # Where every layer's eager check wrote its cell at a step, the stage skips zeroing the cells (one
    # op a step): a layer that writes at the next step overwrites its own. One that does not (not
    # called; or called by compiled code, which adds) carried the last step's sum in its cell, and
    # the host takes it out of its row. Two windows of 8: steps 2, 8 and 13 leave "mid" out right
    # after steps where every layer wrote (8: the next window's first step, after the flush, which
    # does not reset the cells again; 13: after a NaN batch, whose carried sums are not finite);
    # 4-5 run the model compiled, 4 right after an eager step, 5 with a NaN batch. The windows'
    # forward sums and the per-step checks' must be each step's own, as an unmonitored twin computes them.
    # "lagging": a device whose copies land only at the flush (the per-step checks read every row
    # there), so the second window's first row is settled after the table's last row was rewritten.
    monkeypatch.setattr(param_stats, "CPU_FAST_PATH", False)  # the accelerators' path, on CPU tensors
    torch.manual_seed(0)
    model = _Skips()
    twin = copy.deepcopy(model)
    monitor = GradMonitor(model, flush_every=8)
    recorder = monitor._recorder
    stage = recorder.per_step_rows
    assert stage is not None
    compiled = torch.compile(model, backend="aot_eager")
    flushed = []
    prepare = recorder.prepare_flush
    recorder.prepare_flush = lambda: (prepare(), flushed.append(recorder.buffer[FWD_SUM].clone()))[0]
    zeroings = []  # the steps after which the stage zeroed the forward sums
    finish = stage.finish
    stage.finish = lambda slot, wrote, missing: (finish(slot, wrote, missing),
                                                 wrote or zeroings.append(8 * len(flushed) + slot))[0]
    per_step = []
    readback = monitor._stages.detection.judge._readback
    ready = readback.ready
    # (lagging: nothing has landed before the flush, which waits for every copy)
    readback.ready = lambda wait=False: [per_step.append((v.slot, v.forward.copy())) or v for v in ready(wait)] \
        if wait or landing == "prompt" else []

    skipped, nan_steps, compiled_steps = {2, 8, 13}, {5, 6, 12}, {4, 5}
    expected = []
    for step in range(16):
        model.skip = twin.skip = step in skipped
        x = torch.randn(5, 4)
        if step in nan_steps:
            x[0, 0] = float("nan")
        expected.append(_output_sums(twin, x))
        (compiled if step in compiled_steps else model)(x).pow(2).mean().backward()
        monitor.step()
        model.zero_grad(set_to_none=True)
    monitor.close()

    # zeroed after the steps where some layer did not write: 2 (mid), 4 and 5 (compiled), 8 and 13 (mid)
    assert zeroings == [2, 4, 5, 8, 13], zeroings
    assert len(flushed) == 2 and [slot for slot, _ in per_step] == list(range(8)) * 2
    for step in range(16):
        window, judged = flushed[step // 8].numpy(), per_step[step][1]
        for i, name in enumerate(_NAMES):
            want = expected[step].get(name, 0.0)  # a layer that did not run sums to 0: no call
            for got in (window[step % 8, i], judged[i]):
                if math.isnan(want):
                    assert math.isnan(got), (step, name, got)
                elif want == 0.0:
                    assert got == 0.0, (step, name, got)
                else:
                    assert got == pytest.approx(want, rel=1e-4, abs=1e-5), (step, name, got, want)

