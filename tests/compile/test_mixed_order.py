"""The forward order where eager and compiled layers alternate (a regionally compiled model whose
embedding, head and some blocks stay eager): eager taps order themselves on the host between the
compiled calls, which count the device clock down (capture/host_cells.py). The order is what names
the first layer of a NaN, so it must be the order the layers ran in, whichever way each was run.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradwatch import GradMonitor, HealthConfig
from gradwatch.capture import buffer as buffer_module
from gradwatch.capture import cells as cells_module

from .test_compile import Block

pytestmark = pytest.mark.compile


class Mixed(nn.Module):
    """Modules declared in one order and called in another: eager, compiled, two eager, compiled,
    eager, and an eager layer called twice (its first call is its place)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.head = nn.Linear(width, 3)
        self.late = Block(width)  # compiled, runs second to last
        self.shared = nn.Linear(width, width)  # eager, called twice
        self.early = Block(width)  # compiled, runs second
        self.inp = nn.Linear(4, width)
        self.mid = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = self.early(h)
        h = self.shared(torch.relu(self.mid(h)))
        h = self.late(h)
        return self.head(self.shared(h))


CALL_ORDER = ["inp", "early.fc", "early.norm", "mid", "shared", "late.fc", "late.norm", "head"]


def _orders(model: nn.Module, steps: int, detail: str) -> list[list[str]]:
    monitor = GradMonitor(model, flush_every=steps, detail=detail, config=HealthConfig(stop_on=frozenset()))
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        model(torch.randn(5, 4, generator=g)).square().mean().backward()
        monitor.step()
        model.zero_grad()
    w = monitor.last_window
    monitor.close()
    return [[w.layers[i] for i in w.step_orders[t][0]] for t in range(steps) if w.sampled[t]]


@pytest.mark.parametrize("ops", [True, False], ids=["ops", "masked"])
def test_the_forward_order_runs_through_eager_and_compiled_layers(ops, monkeypatch):
    # The default detail (compiled taps count the clock down where the device's flag says the step
    # is sampled); detail="full" with eager layers before and after compiled blocks is in test_compile.
    # "ops": the opaque op that marks a compiled call tells the host, so eager taps before any
    # compiled call of the step need no device mark (the clock is at its start), those after one
    # take it; "masked" (a torch where the ops are not in use): compiled calls cannot tell the
    # host, so every eager tap marks the device.
    from gradwatch.capture import host_branch

    monkeypatch.setattr(host_branch, "IN_USE", ops)
    torch.manual_seed(0)
    model = Mixed()
    for block in (model.early, model.late):
        block.compile(backend="aot_eager", fullgraph=True)
    orders = _orders(model, steps=4, detail="standard")
    assert len(orders) >= 2  # the default samples slots 0 and 1
    for order in orders:
        assert order == CALL_ORDER


def test_float32_cells_keep_the_exact_order_eager(monkeypatch):
    # Cells in float32 (Apple MPS has no float64) cannot hold the host's place between two clock
    # values: there eager taps count the clock down themselves. Here on the CPU, by making the
    # statistics dtype float32 as it is on MPS.
    monkeypatch.setattr(buffer_module, "stat_dtype", lambda device: torch.float32)
    monkeypatch.setattr(cells_module, "stat_dtype", lambda device: torch.float32)
    torch.manual_seed(0)
    model = Mixed()
    monitor_dtype_check = GradMonitor(model, flush_every=2)
    assert monitor_dtype_check._recorder.buffer.dtype == torch.float32
    assert not monitor_dtype_check._recorder.cells.taps[0].shared.host_order
    monitor_dtype_check.close()
    for order in _orders(model, steps=2, detail="standard"):
        assert order == CALL_ORDER


def test_eager_and_compiled_layers_counts_add_up_at_the_default_detail():
    # Eager layers count calls, samples and elements on the host, compiled ones in device cells;
    # both reach the step's row. out_grad_norm (which needs the calls), act_rms (the elements) and
    # the dead-unit rows (the samples) against an unmonitored eager twin's retained outputs, on
    # the sampled steps of the second window (slots 0 and 1), "shared" called twice a step.
    import copy
    import math

    from ..reference import RetainedOutputs

    torch.manual_seed(0)
    model = Mixed()
    twin = copy.deepcopy(model)
    for block in (model.early, model.late):
        block.compile(backend="aot_eager", fullgraph=True)
    monitor = GradMonitor(model, flush_every=4, config=HealthConfig(stop_on=frozenset()))
    retained = RetainedOutputs(twin, CALL_ORDER)
    g = torch.Generator().manual_seed(0)
    expected = []
    for _ in range(6):
        x = torch.randn(5, 4, generator=g)
        retained.clear()
        for net in (model, twin):
            net(x).square().mean().backward()
        expected.append({name: (retained.norm(name), math.sqrt(
            sum(float(t.detach().double().square().sum()) for t in retained.outputs[name])
            / sum(t.numel() for t in retained.outputs[name]))) for name in CALL_ORDER})  # fmt: skip
        monitor.step()
        model.zero_grad()
        twin.zero_grad()
    monitor.close()  # flushes steps 4 and 5
    w = monitor.last_window
    assert w.steps == [4, 5] and w.sampled.all()
    for t in range(2):
        for name in CALL_ORDER:
            i = w.layers.index(name)
            out_norm, rms = expected[4 + t][name]
            assert w.out_grad_norm[t, i] == pytest.approx(out_norm, rel=1e-5), (t, name)
            assert w.output_stats["act_rms"][t, i] == pytest.approx(rms, rel=1e-5), (t, name)
    assert w.rows_seen[w.layers.index("shared")] == 2 * 2 * 5  # two calls a step, two steps, 5 rows
    assert w.rows_seen[w.layers.index("early.fc")] == 2 * 5
