"""Statistic values against an independent computation, read back from the event files."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from gradwatch import GradMonitor, registry

from ..conftest import TwoBranch, read_scalars
from ..reference import RetainedOutputs

# Every test here runs on both parameter-statistics paths (see conftest.param_path).
pytestmark = pytest.mark.usefixtures("param_path")


def _expected_param_stats(model: nn.Module, layers: dict[str, nn.Module]) -> dict[str, dict[str, float]]:
    out = {}
    total = 0.0
    for name, module in layers.items():
        grads = [p.grad for p in module.parameters(recurse=False) if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        norm = float(torch.linalg.vector_norm(flat.double()))
        total += norm**2
        out[name] = {
            "grad_norm": norm,
            "grad_max": float(flat.abs().max()),
            "nonfinite": float((~torch.isfinite(flat)).sum()),
        }
    out[""] = {"grad_norm": math.sqrt(total)}
    return out


def _check(scalars, tag, step, expected, rel=2e-5):
    assert tag in scalars, f"missing tag {tag}; have {sorted(scalars)[:10]}..."
    assert step in scalars[tag], f"{tag} has no value at step {step}"
    assert scalars[tag][step] == pytest.approx(expected, rel=rel, abs=1e-12), (tag, step)


@pytest.mark.parametrize("use_scaler", [False, True], ids=["fp32", "gradscaler"])
def test_every_statistic_at_every_step_matches_independent_computation(tmp_path, use_scaler):
    model = TwoBranch()
    layers = {"inp": model.inp, "shared": model.shared, "head": model.head}
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2) if use_scaler else None
    monitor = GradMonitor(model, logdir=str(tmp_path), flush_every=4, scaler=scaler, detail="full")
    assert monitor.layers == ["inp", "shared", "head"]
    capture = RetainedOutputs(model, list(layers))
    expected: dict[int, dict] = {}
    steps = 10  # 2 full windows and a partial one flushed by close()
    for step in range(steps):
        for _ in range(3):  # three micro-batches per optimizer step
            x, y = torch.randn(5, 6), torch.randn(5, 3)
            loss = nn.functional.mse_loss(model(x), y) / 3
            (scaler.scale(loss) if scaler else loss).backward()
        scale = 1.0
        if scaler:
            scale = float(scaler.get_scale())
            scaler.unscale_(opt)
        exp = _expected_param_stats(model, layers)
        for name in layers:
            exp[name]["out_grad_norm"] = capture.norm(name) / scale
        expected[step] = exp
        capture.clear()
        monitor.step()
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
    monitor.close()
    capture.remove()

    if scaler:  # the scale really changed during the run, so unscaling was exercised
        assert len({round(v["inp"]["out_grad_norm"], 9) for v in expected.values()}) == steps

    scalars = read_scalars(str(tmp_path))
    for step, exp in expected.items():
        for name in layers:
            for stat in ("grad_norm", "grad_max", "nonfinite", "out_grad_norm"):
                _check(scalars, f"gradwatch/{stat}/{name}", step, exp[name][stat])
        _check(scalars, "gradwatch/global/grad_norm", step, exp[""]["grad_norm"])
    assert len(scalars["gradwatch/grad_norm/inp"]) == steps


def test_nonfinite_counts_match(tmp_path):
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    monitor = GradMonitor(model, logdir=str(tmp_path), flush_every=2)
    model(torch.randn(3, 4)).sum().backward()
    with torch.no_grad():
        model[2].weight.grad[0, :3] = float("nan")
        model[2].weight.grad[1, 0] = float("inf")
    expected = int((~torch.isfinite(model[2].weight.grad)).sum())
    monitor.step()
    model.zero_grad()
    model(torch.randn(3, 4)).sum().backward()
    monitor.step()
    monitor.close()
    scalars = read_scalars(str(tmp_path))
    assert expected == 4
    assert scalars["gradwatch/nonfinite/2"][0] == expected
    assert scalars["gradwatch/nonfinite/0"][0] == 0
    assert scalars["gradwatch/nonfinite/2"][1] == 0


class _LargeAndSparse(nn.Module):
    """Parameters on every reduction path: large float32 (one op each on the CPU),
    small (foreach), a sparse gradient and a parameter that gets a gradient only
    on some steps (both leave the planned grouping)."""

    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 600, sparse=sparse)  # 38400 elements: large
        self.big = nn.Linear(600, 256)  # 153600 + 256 elements
        self.head = nn.Linear(256, 4)
        self.extra = nn.Linear(256, 4)
        self.use_extra = False

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.big(self.embed(idx)))
        out = self.head(h)
        return out + self.extra(h) if self.use_extra else out


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_large_sparse_and_intermittent_gradients_match_independent_computation(tmp_path, sparse):
    # dense: steps 1 and 4 have every gradient (the planned grouping), the others not
    model = _LargeAndSparse(sparse)
    layers = {"embed": model.embed, "big": model.big, "head": model.head, "extra": model.extra}
    monitor = GradMonitor(model, logdir=str(tmp_path), flush_every=3, detail="full")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    expected: dict[int, dict] = {}
    for step in range(7):
        model.use_extra = step % 3 == 1
        model(torch.randint(0, 64, (16,))).pow(2).mean().backward()
        if step == 4:  # non-finite values in a large gradient
            with torch.no_grad():
                model.big.weight.grad[3, :5] = float("nan")
                model.big.weight.grad[7, 1] = float("-inf")
        expected[step] = {}
        for name, module in layers.items():
            grads = [p.grad for p in module.parameters(recurse=False) if p.grad is not None]
            if grads:
                flat = torch.cat([(g.to_dense() if g.is_sparse else g).reshape(-1) for g in grads])
                finite = flat[torch.isfinite(flat)]
                expected[step][name] = {
                    "grad_norm": float(torch.linalg.vector_norm(flat.double())),
                    "grad_max": float(flat.abs().max()),
                    "nonfinite": float((~torch.isfinite(flat)).sum()),
                    "finite_norm": float(torch.linalg.vector_norm(finite.double())),
                }
        monitor.step()
        opt.step()
        opt.zero_grad()
    monitor.close()
    scalars = read_scalars(str(tmp_path))
    for step, exp in expected.items():
        for name, stats in exp.items():
            if stats["nonfinite"]:
                assert math.isnan(scalars[f"gradwatch/grad_norm/{name}"][step])
                _check(scalars, f"gradwatch/nonfinite/{name}", step, stats["nonfinite"])
                continue
            for stat in ("grad_norm", "grad_max", "nonfinite"):
                _check(scalars, f"gradwatch/{stat}/{name}", step, stats[stat])
    assert expected[4]["big"]["nonfinite"] == 6
    # "extra" had a gradient on steps 1 and 4 only (zero_grad sets it back to None)
    assert sorted(scalars["gradwatch/grad_norm/extra"]) == [1, 4]


def test_dead_fraction_written_once_per_window(tmp_path):
    lin = nn.Linear(8, 10)
    with torch.no_grad():
        lin.bias[:4] = -100.0  # 4 of 10 units never activate: 40% dead
    model = nn.Sequential(lin, nn.ReLU(), nn.Linear(10, 1))
    monitor = GradMonitor(model, logdir=str(tmp_path), flush_every=5, detail="full")
    for _ in range(10):
        model(torch.randn(16, 8).abs()).sum().backward()
        monitor.step()
        model.zero_grad()
    monitor.close()
    dead = read_scalars(str(tmp_path))["gradwatch/dead_fraction/0"]
    assert dead == {4: pytest.approx(0.4), 9: pytest.approx(0.4)}


def test_module_called_several_times_contributes_every_call(tmp_path):
    model = TwoBranch()
    capture = RetainedOutputs(model, ["shared"])
    monitor = GradMonitor(model, logdir=str(tmp_path), flush_every=1)
    model(torch.randn(4, 6)).sum().backward()
    assert len(capture.outputs["shared"]) == 2
    expected = capture.norm("shared")
    monitor.step()
    monitor.close()
    assert read_scalars(str(tmp_path))["gradwatch/out_grad_norm/shared"][0] == pytest.approx(expected, rel=1e-5)


def test_tied_parameters_count_once():
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = nn.Sequential(emb, head)
    monitor = GradMonitor(model)
    assert monitor.layers == ["0"]  # the head owns nothing of its own
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    monitor.step()
    monitor.flush()
    w = monitor.last_window
    assert w.grad_norm[0, 0] == pytest.approx(float(torch.linalg.vector_norm(emb.weight.grad)), rel=1e-5)
    monitor.close()


def test_nothing_recorded_under_no_grad_or_inference():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    monitor = GradMonitor(model, flush_every=10)
    with torch.no_grad():
        out = model(torch.randn(2, 4))
    with torch.inference_mode():
        model(torch.randn(2, 4))
    assert not out.requires_grad
    cells = monitor._recorder.cells.devices[0]
    assert not cells.sums.any() and not cells.first_calls.any() and not cells.backward.any()  # the taps wrote nothing
    monitor.close()


def test_frozen_and_unused_layers_report_no_gradient(tmp_path):
    class Partly(nn.Module):
        def __init__(self):
            super().__init__()
            self.used = nn.Linear(3, 3)
            self.unused = nn.Linear(3, 3)
            self.frozen = nn.Linear(3, 3)
            self.frozen.requires_grad_(False)

        def forward(self, x):
            return self.frozen(self.used(x))

    model = Partly()
    monitor = GradMonitor(model, logdir=str(tmp_path), flush_every=2)
    assert monitor.layers == ["used", "unused"]
    for _ in range(2):
        model(torch.randn(2, 3)).sum().backward()
        monitor.step()
        model.zero_grad()
    monitor.close()
    scalars = read_scalars(str(tmp_path))
    assert set(scalars["gradwatch/grad_norm/used"]) == {0, 1}
    assert "gradwatch/grad_norm/unused" not in scalars
    assert monitor.alerts == []


def test_include_exclude_select_layers():
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    assert GradMonitor(model, include="1.*").layers == ["1.0", "1.1"]
    assert GradMonitor(model, exclude=["1.1"]).layers == ["0", "1.0"]


def test_buffer_memory_does_not_grow(param_path):
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    monitor = GradMonitor(model, flush_every=3)
    sizes = []
    for _ in range(12):
        model(torch.randn(2, 4)).sum().backward()
        monitor.step()
        model.zero_grad()
        sizes.append(monitor.buffer_bytes)
    assert len(set(sizes)) == 1
    # float64, declared at attach: per step 4 values per parameter tensor (4 tensors), 5 per layer
    # (2 layers), a failure mark, an unsampled mark and the activation statistics' 3 accumulators
    # per layer (elements, sum of squares, zeros), over 3 steps; per window 9 units and a dead-unit
    # request mark per layer. The step's cells: the first-call clock and 3 backward values per
    # layer, the units, the clock, 3 accumulators per layer, the sampled-step flag as a number; in
    # float32 the forward check's sum per layer and the projection weights (16384); the
    # sampled-step flag as a bool (1 byte); in int64 where the backward values (3 per layer) and
    # the units (9) are in the layers' backward rows. The accelerators' path stages each step's
    # gradient norms (float64, 4 tensors) beside the forward sums, which are the cells' (its host
    # table of the window is host memory; capture/per_step_rows.py).
    per_step_rows = 8 * 4 if param_path == "device-agnostic" else 0
    assert sizes[0] == (8 * (3 * (4 * 4 + 5 * 2 + 2 + 3 * 2) + 9 + 2) + 8 * (4 * 2 + 9 + 1 + 3 * 2 + 1)
                        + 4 * (2 + 16384) + 1 + 8 * (3 * 2 + 9) + per_step_rows)  # fmt: skip
    monitor.close()


def test_step_numbers_and_state_dict_round_trip(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    monitor = GradMonitor(model, logdir=str(tmp_path / "a"), flush_every=2)
    for step in range(100, 104):
        model(torch.randn(2, 4)).sum().backward()
        monitor.step(step)
        model.zero_grad()
    state = monitor.state_dict()
    monitor.close()
    assert state["next_step"] == 104
    resumed = GradMonitor(model, logdir=str(tmp_path / "b"), flush_every=2)
    resumed.load_state_dict(state)
    model(torch.randn(2, 4)).sum().backward()
    resumed.step()
    resumed.close()
    assert list(read_scalars(str(tmp_path / "b"))["gradwatch/grad_norm/0"]) == [104]
    # 4 steps of history came back with the state, plus the one recorded after resuming.
    assert resumed._stages.detection.checks.steps_seen == 5


@pytest.mark.parametrize("dead_eps,expected", [(0.0, 0.25), (1e-3, 0.5)])
def test_dead_units_exact_zero_and_with_dead_eps(dead_eps, expected):
    from gradwatch import HealthConfig

    lin = nn.Linear(4, 4)
    mask = torch.tensor([1.0, 1.0, 1e-7, 0.0])  # unit 2: tiny gradient, unit 3: none at all
    monitor = GradMonitor(lin, flush_every=3, config=HealthConfig(dead_eps=dead_eps))
    for _ in range(3):
        (lin(torch.randn(8, 4)) * mask).sum().backward()
        monitor.step()
        lin.zero_grad()
    assert monitor.last_window.dead_fraction[0] == pytest.approx(expected)
    monitor.close()


@pytest.mark.parametrize("dead_eps", [0.0, 1e-40], ids=["projection", "unit-sums"])
def test_tiny_output_gradients_are_alive_and_have_their_norm(dead_eps):
    # Output gradients of ~1e-25 (a layer deep in a vanishing network): float32 squares of them
    # vanish, so the dead-unit evidence must be squared in float64, or every unit would read dead;
    # and out_grad_norm must be their float64 norm, not 0. Unit 3 gets no gradient at all: dead.
    from gradwatch import HealthConfig

    torch.manual_seed(0)
    lin, conv = nn.Linear(4, 4), nn.Conv2d(2, 3, 3, padding=1)
    model = nn.ModuleDict({"lin": lin, "conv": conv})
    scale = torch.tensor([1e-25, 3e-25, 2e-25, 0.0])
    monitor = GradMonitor(model, flush_every=3, config=HealthConfig(dead_eps=dead_eps), detail="full")
    expected = []
    for _ in range(3):
        out, image = lin(torch.randn(8, 4)), conv(torch.randn(2, 2, 5, 5))
        out.retain_grad(), image.retain_grad()
        ((out * scale).sum() + image.sum() * 1e-26).backward()
        expected.append([float(out.grad.double().norm()), float(image.grad.double().norm())])
        monitor.step()
        model.zero_grad()
    w = monitor.last_window
    monitor.close()
    assert expected[0][0] > 0 and float(torch.linalg.vector_norm(torch.full((8,), 1e-25))) == 0.0  # it means something
    assert w.out_grad_norm.tolist() == [pytest.approx(e, rel=1e-6, abs=0) for e in expected]
    assert w.dead_fraction.tolist() == [pytest.approx(0.25), 0.0]  # lin: only unit 3; conv: none


def test_a_step_whose_cells_were_zeroed_mid_step_is_recorded_from_the_calls_after():
    # A flush between a forward and the step() that claims it zeroes the cells (that forward is
    # lost, as documented); the calls after it are the step's first again: each layer writes its
    # sums, statistics and order afresh instead of adding to what it believes it wrote.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    monitor = GradMonitor(model, flush_every=5, detail="full")
    x = torch.randn(3, 4)
    model(x).sum().backward()
    monitor.step()
    model.zero_grad()
    model(x * 1000.0)  # never claimed: the flush closes the window and zeroes the cells
    monitor.flush()
    out = model(x)
    hidden = model[0](x)
    out.sum().backward()
    monitor.step()
    monitor.flush()
    w = monitor.last_window
    monitor.close()
    assert [w.layers[i] for i in w.step_orders[0][0]] == ["0", "2"]
    expected = [float(t.detach().double().square().mean().sqrt()) for t in (hidden, out)]
    assert w.output_stats["act_rms"][0].tolist() == [pytest.approx(e, rel=1e-6) for e in expected]


def test_chunked_nonfinite_count_matches_isfinite():
    """The accelerator path counts in bounded chunks; checked here on CPU tensors."""
    from gradwatch.capture.reductions import nonfinite_counts as _nonfinite_counts

    grads = [torch.randn(1000), torch.randn(37, 11), torch.randn(5), torch.randn(3000)]
    grads[0][[3, 999]] = float("nan")
    grads[1][4, 7] = float("inf")
    grads[3][::500] = -float("inf")
    expected = [float((~torch.isfinite(g)).sum()) for g in grads]
    for chunk in (64, 1000, 10**6):
        assert _nonfinite_counts(grads, chunk=chunk).tolist() == expected


def test_layer_first_used_mid_window_keeps_other_layers_unit_counters():
    """Growing the per-unit buffer for a late layer must not forget earlier steps of the window."""

    class Late(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 4)
            self.b = nn.Linear(3, 4)

        def forward(self, x, step):
            out = self.a(x) * (1.0 if step == 0 else 0.0)  # a: a gradient only at step 0
            return out + self.b(x) if step >= 1 else out  # b: runs from step 1 on

    model = Late()
    monitor = GradMonitor(model, flush_every=3, detail="full")
    for step in range(3):
        model(torch.randn(5, 3), step).sum().backward()
        monitor.step()
        model.zero_grad()
    # a's units got a gradient at step 0, so none is dead over the window
    assert monitor.last_window.dead_fraction.tolist() == [0.0, 0.0]
    monitor.close()


def test_metrics_callback_receives_every_flushed_step_in_order():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    received: list[tuple[int, dict]] = []
    monitor = GradMonitor(model, flush_every=3, metrics_callback=lambda m, s: received.append((s, dict(m))))
    expected = {}
    for step in range(7):
        model(torch.randn(5, 4)).square().sum().backward()
        expected[step] = float(torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1).double() for p in model[0].parameters()])))
        monitor.step()
        if step == 1:
            assert received == []  # nothing before the first flush
        model.zero_grad()
    monitor.close()
    assert [s for s, _ in received] == list(range(7))
    for step, metrics in received:
        assert metrics["gradwatch/grad_norm/0"] == pytest.approx(expected[step], rel=1e-6)
        assert "gradwatch/global/grad_norm" in metrics
    assert "gradwatch/dead_fraction/0" in received[2][1]  # the window's last step carries it
    with pytest.raises(TypeError, match="callable"):
        monitor.add_metrics_callback("wandb")  # type: ignore[arg-type]


def test_a_failing_metrics_callback_is_one_warning(caplog):
    import logging

    model = nn.Linear(3, 1)

    def broken(metrics, step):
        raise ConnectionError("tracker unreachable")

    monitor = GradMonitor(model, flush_every=1, metrics_callback=broken)
    with caplog.at_level(logging.WARNING, logger="gradwatch"):
        for _ in range(5):
            model(torch.randn(2, 3)).sum().backward()
            monitor.step()
            model.zero_grad()
        monitor.close()
    assert sum("tracker unreachable" in r.getMessage() for r in caplog.records) == 1


def test_wandb_example_runs_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    import runpy
    import sys

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setattr(sys, "argv", ["plain_loop_wandb.py", "--dir", str(tmp_path), "--steps", "60"])
    runpy.run_path(str(__import__("pathlib").Path(__file__).parents[2] / "examples" / "plain_loop_wandb.py"),
                   run_name="__main__")  # fmt: skip
    import wandb

    from ..integrations.test_lightning_loggers import _wandb_history

    wandb.teardown()  # waits for W&B's core process to finish writing the run's file
    rows = _wandb_history(str(tmp_path / "wandb"))
    steps = sorted(row["train/step"] for row in rows if "gradwatch/grad_norm/0" in row)
    assert steps == list(range(60))  # every step kept, although they arrived after the fact


# ----------------------------------------------------- judged at every step (lagged read-back)
class _Poisonable(nn.Linear):
    """A Linear whose own output gets ``poison`` added (NaN at the step the test chooses)."""

    poison = 0.0

    def forward(self, x):
        return super().forward(x) + self.poison


class _NaNAt(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 16)
        self.middle = _Poisonable(16, 16)
        self.last = nn.Linear(16, 2)

    def forward(self, x):
        return self.last(torch.relu(self.middle(torch.relu(self.first(x)))))


def test_a_nan_is_returned_by_the_next_step_at_the_latest_with_its_origin(param_path):
    torch.manual_seed(0)
    model = _NaNAt()
    monitor = GradMonitor(model, flush_every=50)
    returned = {}
    for step in range(12):
        model.middle.poison = float("nan") if step == 7 else 0.0
        model(torch.randn(4, 6)).sum().backward()
        for alert in monitor.step():
            returned.setdefault(alert.kind, (step, alert))
        model.zero_grad()
    at, alert = returned["nonfinite"]
    assert alert.step == 7 and at <= 8  # the step() of step 7 (CPU path) or of step 8, not the flush at 49
    assert alert.layer == "middle" and "first non-finite forward output, in layer middle" in alert.message
    assert len([a for a in monitor.alerts if a.kind == "nonfinite"]) == 1
    monitor.close()


def test_a_model_level_explosion_is_returned_at_its_step_and_stop_on_stops_before_the_update(param_path):
    from gradwatch import GradientHealthError, HealthConfig

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))
    monitor = GradMonitor(model, flush_every=50, config=HealthConfig(stop_on=frozenset({"exploding"})))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    stopped_at = None
    for step in range(40):
        loss = model(torch.randn(8, 6)).square().mean()
        (loss * (1e6 if step == 30 else 1.0)).backward()
        try:
            monitor.step()
        except GradientHealthError as exc:
            stopped_at = step
            assert [(a.kind, a.layer, a.step) for a in exc.alerts] == [("exploding", "", 30)]
            break
        opt.step()
        opt.zero_grad()
    assert stopped_at in (30, 31)  # judged at its own step() on the CPU path, at the next one at the latest
    monitor.close()


@pytest.mark.parametrize("outputs_path", ["cpu-rows", "written"])
def test_activation_statistics_equal_a_direct_computation_over_every_call_of_the_step(tmp_path, outputs_path,
                                                                                      monkeypatch):  # fmt: skip
    # act_rms and act_zero_fraction of each layer's output (registry/outputs.py), against the outputs this
    # test keeps itself: a layer called twice per step (its calls pooled), a layer with units that
    # are exactly zero (weights and bias zeroed), two micro-batches per step; written to TensorBoard
    # under gradwatch/act_rms/<layer> and gradwatch/act_zero_fraction/<layer> at the sampled steps.
    # Both ways an eager first call takes: the CPU's own reductions stacked into the cells, and each
    # statistic written into its cells (the accelerators' path, ``registry.outputs.write_all``).
    from ..conftest import read_scalars

    monkeypatch.setattr(registry.outputs, "CPU_ROWS", outputs_path == "cpu-rows")
    written = []
    write_all = registry.outputs.write_all
    monkeypatch.setattr(registry.outputs, "write_all", lambda *a: (written.append(1), write_all(*a))[1])

    torch.manual_seed(0)
    shared = nn.Linear(6, 6)
    head = nn.Linear(6, 4)
    with torch.no_grad():
        head.weight[:3].zero_()
        head.bias[:3].zero_()  # 3 of 4 output units exactly zero

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.shared, self.head = shared, head

        def forward(self, x):
            return self.head(torch.tanh(self.shared(torch.tanh(self.shared(x)))))

    model = Twice()
    outputs = {"shared": [], "head": []}
    for name in outputs:
        model.get_submodule(name).register_forward_hook(lambda m, a, o, name=name: outputs[name].append(o.detach().clone()))
    monitor = GradMonitor(model, flush_every=30, logdir=str(tmp_path))  # default detail: sampled steps 0 and 25
    expected = []
    for step in range(27):
        for _ in range(2):
            model(torch.randn(3, 6)).square().sum().backward()
        pooled = {name: torch.cat([o.reshape(-1).double() for o in outs]) for name, outs in outputs.items()}
        expected.append({name: (float(v.square().mean().sqrt()), float((v == 0).double().mean())) for name, v in pooled.items()})
        for outs in outputs.values():
            outs.clear()
        monitor.step()
        model.zero_grad()
    monitor.close()
    w = monitor.last_window
    scalars = read_scalars(str(tmp_path))
    for t in range(27):
        for i, name in enumerate(w.layers):
            rms, zeros = expected[t][name]
            if w.sampled[t]:
                assert w.output_stats["act_rms"][t, i] == pytest.approx(rms, rel=1e-6)
                assert w.output_stats["act_zero_fraction"][t, i] == pytest.approx(zeros, abs=1e-12)
                assert scalars[f"gradwatch/act_rms/{name}"][t] == pytest.approx(rms, rel=1e-5)
                assert scalars[f"gradwatch/act_zero_fraction/{name}"][t] == pytest.approx(zeros, abs=1e-7)
            else:
                assert math.isnan(w.output_stats["act_rms"][t, i])
                assert t not in scalars[f"gradwatch/act_rms/{name}"]
    assert expected[0]["head"][1] == pytest.approx(0.75)  # the test means something: 3 of 4 units zero
    assert [t for t in range(27) if w.sampled[t]] == [0, 25]
    assert bool(written) == (outputs_path == "written")  # the way asked for is the way taken


def test_activation_rms_is_reduced_in_float32_only_where_the_last_window_shows_it_exact():
    # act_rms's sum of squares costs several times more in float64 (the reduction copies the
    # output); a layer whose act_rms stayed within 1e-12..1e12 in a window gets float32 sums in
    # the next (registry/outputs.py). Layer "tiny" works at 1e-25, where float32 squares vanish:
    # it keeps float64 throughout; "normal" switches to float32 after the first window and back to
    # float64 after a window where it collapsed. Every value against the test's own float64 computation.
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("normal", nn.Linear(8, 8))
    model.add_module("tiny", nn.Linear(8, 8))
    with torch.no_grad():
        model.tiny.weight.mul_(1e-25)
        model.tiny.bias.zero_()
        model.normal.bias.zero_()  # its outputs scale with its inputs
    outputs = {"normal": [], "tiny": []}
    for name in outputs:
        model.get_submodule(name).register_forward_hook(lambda m, a, o, name=name: outputs[name].append(o.detach().double()))
    monitor = GradMonitor(model, flush_every=4, detail="full")
    taps = {tap.name: tap for tap in monitor._recorder.cells.taps}
    exact, expected = [], []
    for step in range(12):
        scale = 1e-26 if 4 <= step < 8 else 1.0  # window 2: "normal"'s outputs collapse to ~1e-26
        exact.append({name: tap.exact_outputs for name, tap in taps.items()})
        model(torch.randn(16, 8) * scale).square().sum().backward()
        expected.append({name: float(outs[0].square().mean().sqrt()) for name, outs in outputs.items()})
        for outs in outputs.values():
            outs.clear()
        monitor.step()
        model.zero_grad()
        if step in (3, 7, 11):
            window = monitor.last_window
            for t in range(4):
                for i, name in enumerate(window.layers):
                    got, want = window.output_stats["act_rms"][t, i], expected[step - 3 + t][name]
                    if exact[step - 3 + t][name]:  # float64: exact at any magnitude
                        assert got == pytest.approx(want, rel=1e-9), (step, t, name)
                    elif want > 1e-12:
                        assert got == pytest.approx(want, rel=1e-6), (step, t, name)
    monitor.close()
    assert [e["tiny"] for e in exact] == [True] * 12  # its outputs are ~1e-25: never float32
    assert [e["normal"] for e in exact] == [True] * 4 + [False] * 4 + [True] * 4
    assert expected[0]["tiny"] < 1e-23  # the test means something: float32 squares of it vanish
    assert float(torch.linalg.vector_norm(torch.full((8,), 1e-25))) == 0.0


@pytest.mark.parametrize("detail", ["full", "standard"])
@pytest.mark.parametrize("magnitude", [1e-12, 1e-21, 1e-26, 1e-40])
def test_tiny_gradients_get_their_exact_norm_not_zero(param_path, magnitude, detail):
    # A vanishing layer's gradient of 1e-25 has float32 squares that underflow (subnormal below
    # |g| ~ 1e-19, zero below ~2.6e-23): its norm must still be 1e-25-ish, not "zero". Small
    # tensors (foreach) and one large enough for the CPU's BLAS path; 1e-40 is itself subnormal.
    # Steps 0-2 tiny (the CPU path moves such tensors to float64 norms after the first), steps 3-4
    # of a normal size again (back to float32 after 3), each against the test's own float64 norms.
    # "standard": steps 2-4 are not sampled, and the CPU path reads the 64K weights by a dot there.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4096))  # 64K weights: the BLAS strategy on CPU
    monitor = GradMonitor(model, flush_every=5, detail=detail)
    stats = monitor._recorder.param_stats
    reference, strategies = [], []
    for step in range(5):
        model(torch.randn(3, 8)).square().mean().backward()
        for p in model.parameters():
            p.grad = torch.randn_like(p) * (magnitude if step < 3 else 1.0)  # float32: 1e-40 is stored subnormal
        reference.append([torch.cat([p.grad.double().flatten() for p in m.parameters()]).norm().item() for m in model])
        monitor.step()
        strategies.append({stats.strategy_of(c) for c in range(stats.n_params)})
    monitor.flush()
    assert min(min(r) for r in reference) > 0
    assert monitor.last_window.grad_norm.tolist() == [pytest.approx(r, rel=1e-6, abs=0) for r in reference]
    if param_path == "cpu-path" and magnitude < 1e-15 and detail == "full":
        assert strategies[1] == {"tiny"} and "tiny" not in strategies[4]  # float64 from step 1, float32 again at 4
    monitor.close()


def test_tiny_gradients_beside_float64_and_complex_parameters_keep_every_value(param_path, caplog):
    # Only the float32 groups the CPU slots check move to the tiny strategy: a float64 layer and a
    # complex parameter beside a tiny float32 layer keep their own strategies and exact values.
    torch.manual_seed(0)

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.tiny = nn.Linear(4, 4)
            self.wide = nn.Linear(4, 4).double()
            self.rot = nn.Linear(4, 4, bias=False)
            self.rot.phase = nn.Parameter(torch.randn(4, dtype=torch.complex64))

    model = Mixed()
    monitor = GradMonitor(model, flush_every=3)
    for _ in range(3):
        for p in model.parameters():
            p.grad = torch.randn_like(p) * (1e-25 if p.dtype == torch.float32 else 1.0)
        reference = [math.sqrt(sum(float(p.grad.abs().double().square().sum()) for p in m.parameters(recurse=False)))
                     for m in (model.tiny, model.wide, model.rot)]  # fmt: skip
        with caplog.at_level("WARNING", logger="gradwatch"):
            monitor.step()
    monitor.flush()
    assert monitor.last_window.grad_norm[-1].tolist() == pytest.approx(reference, rel=1e-5, abs=0)
    assert not [r for r in caplog.records if "failed" in r.getMessage()]
    monitor.close()


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=["nchw", "channels-last"])
def test_output_gradients_are_reduced_in_float32_on_the_cpu_only_where_the_last_window_shows_it_exact(memory_format):
    # #30: on the CPU a float64 reduction of a float32 output gradient costs 3-80x a float32 one; a
    # layer whose out_grad_norm stayed within 1e-11..1e12 in a window has its next window's rows
    # normed in float32 (capture/grad_statistics.py). Windows: 1 float64 (nothing known yet), 2 float32,
    # 3 float32 while the gradients collapse by 1e-20 (the price: its norms are not exact), 4 float64
    # again. The dead-unit zero test stays exact in every window: unit/channel 0 gets no gradient
    # (dead), unit/channel 1 a gradient of ~1e-30 (alive), whose float32 squares vanish, so a
    # convolution's evidence is a projection in float32 windows, not the norms of its rows.
    # Everything against the test's own float64 computation on the retained gradients. A
    # channels-last convolution keeps the float64 path (its projection would copy the gradient).
    torch.manual_seed(0)
    lin, conv = nn.Linear(8, 6), nn.Conv2d(3, 4, 3, padding=1).to(memory_format=memory_format)
    model = nn.ModuleDict({"lin": lin, "conv": conv})
    unit_scale = torch.tensor([0.0, 1e-30, 1.0, 1.0, 1.0, 1.0])
    channel_scale = torch.tensor([0.0, 1e-30, 1.0, 1.0]).view(1, 4, 1, 1)
    monitor = GradMonitor(model, flush_every=4, detail="full")
    taps = {tap.name: tap for tap in monitor._recorder.cells.taps}
    float32, expected, grads = [], [], {"lin": [], "conv": []}
    for step in range(16):
        collapse = 1e-20 if 8 <= step < 12 else 1.0
        float32.append({name: tap.grad_stats.float32 for name, tap in taps.items()})
        out, image = lin(torch.randn(5, 8)), conv(torch.randn(4, 3, 6, 6).to(memory_format=memory_format))
        out.retain_grad(), image.retain_grad()
        assert image.is_contiguous(memory_format=memory_format)
        loss = (out * unit_scale * torch.randn_like(out)).sum() + (image * channel_scale * torch.randn_like(image)).sum()
        (loss * collapse).backward()
        expected.append({"lin": float(out.grad.double().norm()), "conv": float(image.grad.double().norm())})
        grads["lin"].append(out.grad.clone())
        grads["conv"].append(image.grad.transpose(0, 1).reshape(4, -1).t().clone())  # (samples x positions, channel)
        monitor.step()
        model.zero_grad()
        if step % 4 == 3:
            w = monitor.last_window
            for t in range(4):
                for i, name in enumerate(w.layers):
                    got, want = w.out_grad_norm[t, i], expected[step - 3 + t][name]
                    if not float32[step - 3 + t][name]:  # float64: exact at any magnitude
                        assert got == pytest.approx(want, rel=1e-9), (step, t, name)
                    elif want > 1e-11:
                        assert got == pytest.approx(want, rel=1e-6), (step, t, name)
            for i, name in enumerate(w.layers):
                alive = (torch.cat(grads[name]) != 0).any(dim=0)
                assert w.dead_fraction[i] == pytest.approx(1.0 - float(alive.double().mean())), (step, name)
                if step < 8:  # the test means something: one dead unit, the tiny one alive
                    assert alive.tolist()[:3] == [False, True, True]
                grads[name].clear()
    monitor.close()
    assert [f["lin"] for f in float32] == [False] * 4 + [True] * 8 + [False] * 4
    assert [f["conv"] for f in float32] == [False] * 4 + [True] * 8 + [False] * 4
    assert float(torch.linalg.vector_norm(torch.full((8,), 1e-30))) == 0.0  # float32 rows of it read zero


@pytest.mark.parametrize("layout", ["linear", "conv-channels-last"])
def test_activation_rms_of_a_large_output_in_a_float32_window_is_accurate_on_the_cpu(layout):
    # #30: one float32 norm of a million-element CPU tensor accumulates sequentially per vector lane
    # and is off by ~1e-5 relative; act_rms's float32 windows norm 1024-element rows (in memory
    # order: a channels-last output too) and combine them in float64 (registry/outputs.py): within
    # 1e-7 of the test's own float64 computation.
    torch.manual_seed(0)
    if layout == "linear":
        model, batch = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU()), (1024, 1024)
    else:
        model, batch = nn.Sequential(nn.Conv2d(16, 64, 3, padding=1), nn.ReLU()), (16, 16, 32, 32)
        model = model.to(memory_format=torch.channels_last)
    outputs = []
    model[0].register_forward_hook(lambda m, a, o: outputs.append(o.detach()))
    monitor = GradMonitor(model, flush_every=2, detail="full")
    tap = monitor._recorder.cells.taps[0]
    for _ in range(4):
        x = torch.randn(batch)
        model(x if x.ndim == 2 else x.contiguous(memory_format=torch.channels_last)).sum().backward()
        monitor.step()
        model.zero_grad()
    assert not tap.exact_outputs  # window 2 took the float32 path
    assert outputs[2].numel() == 1 << 20 and outputs[2].is_contiguous() == (layout == "linear")
    expected = [float(o.double().square().mean().sqrt()) for o in outputs[2:]]
    got = monitor.last_window.output_stats["act_rms"][:, 0].tolist()
    monitor.close()
    assert got == [pytest.approx(e, rel=1e-7, abs=0) for e in expected]
    # the test means something: one float32 norm of the same output is further off
    plain = float(torch.linalg.vector_norm(outputs[2])) / 1024.0
    assert abs(plain - expected[0]) / expected[0] > 1e-7


@pytest.mark.parametrize("units", [512, 2048])
def test_float32_windows_sum_an_output_of_up_to_2_18_elements_by_one_dot_within_1e_6(units):
    # #30: in a float32 window an output (and its gradient) of at most cpu_rows.DOT_MAX elements is
    # summed by one BLAS dot of its flat view (half the time of float32 rows combined in float64),
    # larger ones keep the rows. act_rms and out_grad_norm of window 2 against the test's own
    # float64 computation: within 1e-6 either way (the dot measured ~4e-7 at 2**18).
    from benchmarks.harness import OpCounter
    from gradwatch.capture import cpu_rows

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, units), nn.ReLU())
    outputs = RetainedOutputs(model, ["0"])
    monitor = GradMonitor(model, flush_every=2, detail="full")
    tap = monitor._recorder.cells.taps[0]
    norms = []
    for step in range(4):
        outputs.clear()
        with OpCounter() as calls:
            model(torch.randn(256, 512)).square().mean().backward()
        norms.append(calls.ops[torch.ops.aten.linalg_vector_norm.default])  # the float32 rows' reduction
        monitor.step()
        model.zero_grad()
    assert not tap.exact_outputs and tap.grad_stats.float32  # window 2 took the float32 path
    window = monitor.last_window
    monitor.close()
    out = outputs.outputs["0"][-1]  # step 3's, the window's last
    grad = out.grad
    outputs.remove()
    assert (out.numel() <= cpu_rows.DOT_MAX) == (units == 512)
    assert window.output_stats["act_rms"][1, 0] == pytest.approx(float(out.double().square().mean().sqrt()), rel=1e-6, abs=0)
    assert window.out_grad_norm[1, 0] == pytest.approx(float(grad.double().norm()), rel=1e-6, abs=0)
    # the dot took no rows' norm of the output or its gradient; the larger output took both
    assert norms[3] == (0 if units == 512 else 2), norms


class _SometimesExtra(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head, self.extra = nn.Linear(32, 4), nn.Linear(32, 4)
        self.use_extra = False

    def forward(self, x):
        h = self.body(x)
        return self.head(h) + (self.extra(h) if self.use_extra else 0.0)


def test_unsampled_steps_take_the_direct_reduction_and_fall_back_exactly(tmp_path, monkeypatch, param_path):
    # #30: on an unsampled step an unsharded model of one dtype is reduced without the general
    # loop (ParamStats._record_whole); a gradient missing, a NaN, a cast after attaching must still
    # give every step's grad_norm as an independent float64 computation does.
    from gradwatch.capture.param_stats import ParamStats

    taken: dict[int, bool] = {}
    direct = ParamStats._record_whole
    current = [0]

    def spy(self, *args):
        rode = direct(self, *args)  # None: declined (else whether the forward sums rode along)
        taken[current[0]] = rode is not None
        return rode

    monkeypatch.setattr(ParamStats, "_record_whole", spy)
    torch.manual_seed(0)
    model = _SometimesExtra()
    monitor = GradMonitor(model, logdir=str(tmp_path), flush_every=8)  # steps 0, 1, 8, 9 sampled
    layers = {"body.0": model.body[0], "body.2": model.body[2], "head": model.head, "extra": model.extra}
    expected: dict[int, dict[str, float]] = {}
    with_extra = (5, 6, 9, 13)
    for step in range(16):
        current[0] = step
        model.use_extra = step in with_extra  # "extra" has a gradient at these steps only
        if step == 11:
            model.double()  # a cast after attaching: regrouped
        x = torch.randn(16, 8, dtype=next(model.parameters()).dtype)
        model(x).pow(2).mean().backward()
        if step in (6, 9):
            with torch.no_grad():
                model.body[2].weight.grad[0, 0] = float("nan")
        expected[step] = {
            name: float(torch.linalg.vector_norm(torch.cat([p.grad.double().reshape(-1) for p in m.parameters()])))
            for name, m in layers.items() if m.weight.grad is not None
        }  # fmt: skip
        monitor.step()
        model.zero_grad(set_to_none=True)
    monitor.close()
    scalars = read_scalars(str(tmp_path))
    for step, norms in expected.items():
        for name, norm in norms.items():
            if math.isnan(norm):
                assert math.isnan(scalars[f"gradwatch/grad_norm/{name}"][step]), (name, step)
            else:
                _check(scalars, f"gradwatch/grad_norm/{name}", step, norm)
    assert sorted(scalars["gradwatch/grad_norm/extra"]) == list(with_extra)
    if param_path == "cpu-path":  # counted at unsampled steps too (accelerators: on sampled steps)
        _check(scalars, "gradwatch/nonfinite/body.2", 6, 1.0)
    _check(scalars, "gradwatch/nonfinite/body.2", 9, 1.0)
    # taken at the unsampled steps with every gradient, declined at those without one; after the
    # cast the float64 group is the CPU path's counted one, reduced by the general loop there
    assert taken[5] and taken[6]
    assert not any(taken.get(step, False) for step in range(16) if step not in with_extra)
    assert taken.get(13, False) == (param_path != "cpu-path")


def test_gradients_still_scaled_at_step_are_recorded_unscaled(tmp_path, param_path):
    # step() before scaler.unscale_(optimizer): the gradients carry the loss scale (2**12 here, then
    # halved by a skipped step's update) and gradwatch divides by it without a sync; the accelerators'
    # path does so on the gradient norms of its per-step rows (capture/per_step_rows.py), the CPU's
    # on sums of squares. Against the norms of the unscaled gradients the test takes itself.
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=1000)
    monitor = GradMonitor(model, logdir=str(tmp_path), flush_every=6, scaler=scaler)
    expected = {}
    for step in range(6):
        loss = model(torch.randn(8, 6)).pow(2).mean()
        if step == 3:
            loss = loss * float("inf")  # a skipped step: the scale is halved after it
        scaler.scale(loss).backward()
        scale = float(scaler.get_scale())
        expected[step] = {name: float(torch.linalg.vector_norm(torch.cat([p.grad.double().reshape(-1) / scale
                                                                          for p in m.parameters()])))
                          for name, m in (("0", model[0]), ("2", model[2]))}  # fmt: skip
        monitor.step()  # before unscale_: still scaled
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    monitor.close()
    assert float(scaler.get_scale()) == 2.0**11  # the test means something: the scale changed
    scalars = read_scalars(str(tmp_path))
    for step, norms in expected.items():
        if step == 3:
            continue  # skipped by the scaler: reported as such, not as a statistic of the model
        for name, norm in norms.items():
            _check(scalars, f"gradwatch/grad_norm/{name}", step, norm, rel=1e-6)
    if param_path == "device-agnostic":
        assert monitor._recorder.per_step_rows is not None  # norms divided on the device's row
