"""Real model shapes gradwatch must never break; values checked against independent computations."""

from __future__ import annotations

import copy
from collections import namedtuple

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gradwatch import GradMonitor

from ..reference import RetainedOutputs, own_grad_norm

# Every test here runs on both parameter-statistics paths (see conftest.param_path).
pytestmark = pytest.mark.usefixtures("param_path")


def _window(monitor: GradMonitor):
    monitor.flush()
    return monitor.last_window


def _value(window, table: str, layer: str, t: int = 0) -> float:
    return float(getattr(window, table)[t, window.layers.index(layer)])


# ---------------------------------------------------------------- ResNet-style
class Block(nn.Module):
    def __init__(self, channels: int, inplace: bool) -> None:
        super().__init__()
        self.inplace = inplace
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=inplace)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.inplace:
            out += identity
        else:
            out = out + identity
        return self.relu(out)


def _resnet(inplace: bool) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=inplace),
        Block(8, inplace), Block(8, inplace), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    )  # fmt: skip


def test_resnet_with_inplace_relu_and_residual():
    torch.manual_seed(0)
    model = _resnet(inplace=True)
    twin = copy.deepcopy(model)
    for m in twin.modules():  # same weights, no in-place ops: the reference
        if isinstance(m, (nn.ReLU, Block)):
            m.inplace = False
    names = ["1", "3.bn1", "3.bn2", "4.conv2", "4.bn2"]
    reference = RetainedOutputs(twin, names)
    monitor = GradMonitor(model, flush_every=10)
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 4, (4,))
    nn.functional.cross_entropy(model(x), y).backward()
    nn.functional.cross_entropy(twin(x), y).backward()
    monitor.step()
    w = _window(monitor)
    for name in monitor.layers:
        assert _value(w, "grad_norm", name) == pytest.approx(own_grad_norm(model.get_submodule(name)), rel=1e-5)
    for name in names:
        assert _value(w, "out_grad_norm", name) == pytest.approx(reference.norm(name), rel=1e-5), name
    monitor.close()


# ------------------------------------------------------------------- GPT-2
def test_gpt2_decoder_with_tied_embeddings():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight
    monitor = GradMonitor(model, flush_every=5)
    assert "transformer.wte" in monitor.layers and "lm_head" not in monitor.layers
    ids = torch.randint(0, 64, (2, 12))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        monitor.step()
        expected = {n: own_grad_norm(model.get_submodule(n)) for n in monitor.layers}
        model.zero_grad()
    w = _window(monitor)
    for name, value in expected.items():
        assert _value(w, "grad_norm", name, t=1) == pytest.approx(value, rel=1e-5), name
    total = sum(v**2 for v in expected.values()) ** 0.5
    assert w.global_grad_norm[1] == pytest.approx(total, rel=1e-5)
    assert monitor.alerts == []
    monitor.close()


# ---------------------------------------------------- attention and recurrent
def test_transformer_encoder_multihead_attention_in_proj():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    monitor = GradMonitor(model, flush_every=5)
    assert "layers.0.self_attn" in monitor.layers  # owns in_proj_weight / in_proj_bias
    reference = RetainedOutputs(model, ["layers.0.linear1", "layers.1.norm2"])
    model(torch.randn(3, 5, 16)).square().mean().backward()
    monitor.step()
    w = _window(monitor)
    for name in monitor.layers:
        assert _value(w, "grad_norm", name) == pytest.approx(own_grad_norm(model.get_submodule(name)), rel=1e-5)
    for name in ("layers.0.linear1", "layers.1.norm2"):
        assert _value(w, "out_grad_norm", name) == pytest.approx(reference.norm(name), rel=1e-5)
    monitor.close()


def test_lstm_with_loss_on_h_n_only():
    torch.manual_seed(0)
    lstm = nn.LSTM(4, 8, num_layers=2, batch_first=True)
    model = nn.ModuleDict({"lstm": lstm})
    monitor = GradMonitor(model, flush_every=5)
    reference = RetainedOutputs(model, ["lstm"], pick=lambda out: out[1][0])  # h_n
    out, (h_n, c_n) = model["lstm"](torch.randn(3, 6, 4))
    h_n.square().sum().backward()
    monitor.step()
    w = _window(monitor)
    assert _value(w, "grad_norm", "lstm") == pytest.approx(own_grad_norm(lstm), rel=1e-5)
    assert _value(w, "out_grad_norm", "lstm") == pytest.approx(reference.norm("lstm"), rel=1e-5)
    monitor.close()


def test_gru_values():
    torch.manual_seed(0)
    model = nn.ModuleDict({"gru": nn.GRU(4, 8, batch_first=True), "head": nn.Linear(8, 1)})
    monitor = GradMonitor(model, flush_every=5)
    reference = RetainedOutputs(model, ["gru"])
    out, _ = model["gru"](torch.randn(3, 6, 4))
    model["head"](out[:, -1]).sum().backward()
    monitor.step()
    w = _window(monitor)
    for name in ("gru", "head"):
        assert _value(w, "grad_norm", name) == pytest.approx(own_grad_norm(model[name]), rel=1e-5)
    assert _value(w, "out_grad_norm", "gru") == pytest.approx(reference.norm("gru"), rel=1e-5)
    monitor.close()


# ------------------------------------------------------------ odd structures
Pair = namedtuple("Pair", ["main", "aux"])


class DictOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 6)

    def forward(self, x):
        return {"hidden": self.lin(x), "mask": x > 0}


class TupleOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        h = self.lin(x)
        return Pair(main=h, aux=h.detach().mean())


class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.d = DictOut()
        self.t = TupleOut()
        self.shared = nn.Linear(6, 6)
        self.head = nn.Linear(6, 1)

    def forward(self, x, *, scale: float = 1.0):
        h = self.d(x)["hidden"]
        h = self.t(h).main
        for _ in range(3):  # one module, three calls
            h = torch.tanh(self.shared(input=h))
        return self.head(h) * scale


def test_dict_namedtuple_outputs_kwargs_and_three_calls():
    torch.manual_seed(0)
    model = Odd()
    monitor = GradMonitor(model, flush_every=5)
    reference = RetainedOutputs(model, ["d.lin", "t.lin", "shared"])
    # the dict / namedtuple modules own nothing; their Linear children are the layers
    assert monitor.layers == ["d.lin", "t.lin", "shared", "head"]
    model(torch.randn(5, 4), scale=2.0).sum().backward()
    monitor.step()
    w = _window(monitor)
    assert len(reference.outputs["shared"]) == 3
    for name in ("d.lin", "t.lin", "shared"):
        assert _value(w, "out_grad_norm", name) == pytest.approx(reference.norm(name), rel=1e-5)
        assert _value(w, "grad_norm", name) == pytest.approx(own_grad_norm(model.get_submodule(name)), rel=1e-5)
    monitor.close()


def test_modules_returning_dicts_are_layers_too():
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 3))

        def forward(self, x):
            return {"logits": x @ self.weight, "aux": None}

    model = nn.Sequential(nn.Linear(2, 4), Head())
    monitor = GradMonitor(model, flush_every=5)
    reference = RetainedOutputs(model, ["1"], pick=lambda out: out["logits"])
    model(torch.randn(3, 2))["logits"].sum().backward()
    monitor.step()
    w = _window(monitor)
    assert _value(w, "out_grad_norm", "1") == pytest.approx(reference.norm("1"), rel=1e-5)
    monitor.close()


# ----------------------------------------------------------- checkpointing
@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_counts_every_statistic_once(reentrant):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    twin = copy.deepcopy(model)
    reference = RetainedOutputs(twin, ["0", "2", "4"])
    monitor = GradMonitor(model, flush_every=5)
    x = torch.randn(6, 4, requires_grad=True)
    mid = checkpoint(lambda t: model[2](model[1](model[0](t))), x, use_reentrant=reentrant)
    model[4](model[3](mid)).sum().backward()
    twin(x).sum().backward()
    monitor.step()
    w = _window(monitor)
    for name in ("0", "2", "4"):
        assert _value(w, "out_grad_norm", name) == pytest.approx(reference.norm(name), rel=1e-5), name
        assert _value(w, "grad_norm", name) == pytest.approx(own_grad_norm(model.get_submodule(name)), rel=1e-5)
        assert w.out_seen[0, w.layers.index(name)]
    monitor.close()


# ------------------------------------------------------- validation & copies
def test_validation_under_no_grad_interleaved_with_training():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    monitor = GradMonitor(model, flush_every=4, detail="full")
    reference = RetainedOutputs(model, ["0"])
    norms = []
    for _ in range(4):
        reference.clear()
        model(torch.randn(5, 4)).sum().backward()
        with torch.no_grad():
            model.eval()
            model(torch.randn(50, 4))  # validation: must not count
            model.train()
        norms.append(reference.norm("0"))
        monitor.step()
        model.zero_grad()
    w = monitor.last_window
    assert w.out_grad_norm[:, 0] == pytest.approx(norms, rel=1e-5)
    monitor.close()


def test_deepcopy_of_a_monitored_model_does_not_record_into_the_monitor():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    monitor = GradMonitor(model, flush_every=5)
    clone = copy.deepcopy(model)
    reference = RetainedOutputs(model, ["0"])
    model(torch.randn(5, 4)).sum().backward()
    clone(torch.randn(7, 4)).sum().backward()  # the copy trains too
    monitor.step()
    w = _window(monitor)
    assert _value(w, "out_grad_norm", "0") == pytest.approx(reference.norm("0"), rel=1e-5)
    assert _value(w, "grad_norm", "0") == pytest.approx(own_grad_norm(model[0]), rel=1e-5)
    monitor.close()


def test_unused_parameters_in_some_steps():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 3)
            self.b = nn.Linear(3, 3)

        def forward(self, x, use_b):
            return self.b(x) if use_b else self.a(x)

    model = Branchy()
    monitor = GradMonitor(model, flush_every=4)
    for step in range(4):
        model(torch.randn(2, 3), use_b=step % 2 == 1).sum().backward()
        monitor.step()
        model.zero_grad(set_to_none=True)
    w = monitor.last_window
    assert w.has_grad[:, 0].tolist() == [True, False, True, False]
    assert w.has_grad[:, 1].tolist() == [False, True, False, True]
    assert monitor.alerts == []
    monitor.close()


# ----------------------------------------------------------- attach / close
def test_hundred_attach_close_cycles_leave_nothing_behind():
    # Structural, not timed (speed is measured in benchmarks/): after 100 cycles no hook is
    # left anywhere, and a closed monitor's recorder receives nothing from later steps.
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    x = torch.randn(32, 64)
    recorders = []
    for _ in range(100):
        with GradMonitor(model, flush_every=2) as monitor:
            model(x).sum().backward()
            monitor.step()
            model.zero_grad()
        recorders.append(monitor._recorder)
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks and not m._backward_hooks
    for p in model.parameters():
        assert not p._backward_hooks
    out = model(x)
    assert out._backward_hooks is None  # no tensor hook registered on the output
    out.sum().backward()
    for recorder in (recorders[0], recorders[-1]):
        cells = recorder.cells.devices[0]
        assert not cells.sums.any() and not cells.first_calls.any() and not cells.backward.any() and not recorder.buffer["out_grad"].any()
