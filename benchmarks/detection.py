"""Detection benchmark: pathologies made on purpose and healthy recipes, with the default settings.

    python benchmarks/detection.py            # every scenario (a minute or two on 2 CPU cores)
    python benchmarks/detection.py --json out.json

For each pathology: whether the expected alert kind was raised (recall), whether it
named the expected layer, and the latency in steps from the fault to the flush that
returned the alert. For each healthy recipe: the number of alerts (false alarms).
Every run uses GradMonitor's defaults (detail="standard", HealthConfig()) with the
optimizer passed (optimizer=), flush_every=25, synthetic data, no downloads.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness import gradwatch_logger_at  # noqa: E402
from gradwatch import GradMonitor  # noqa: E402
from gradwatch.demo import build_model  # noqa: E402

FLUSH_EVERY = 25


@dataclass
class Scenario:
    name: str
    build: Callable[[], tuple[nn.Module, torch.optim.Optimizer, Callable[[int], torch.Tensor]]]
    steps: int = 150
    expected: str | None = None  # the alert kind a pathology must raise; None: healthy
    layer: str | None = None  # the layer it must name ("" for the whole model)
    fault_step: int = 0  # where the fault starts
    reference: str = ""  # the publication or source of the pathology


@dataclass
class Outcome:
    scenario: str
    expected: str | None
    detected: bool = False
    layer_named: str | None = None
    layer_ok: bool | None = None
    latency: int | None = None  # steps from the fault to the step() that returned the alert
    alerts: list[str] = field(default_factory=list)


def _regression(n_in=16, n_out=4, batch=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(n_in, n_out, generator=g) / n_in**0.5

    def loss(model: nn.Module) -> torch.Tensor:
        x = torch.randn(batch, n_in)
        return nn.functional.mse_loss(model(x), torch.tanh(x @ teacher))

    return loss


def _mlp(widths=(16, 64, 64, 4), act=nn.ReLU):
    layers: list[nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), act()]
    return nn.Sequential(*layers[:-1])


def _steps(model, opt, loss_fn, fault: Callable[[int, torch.Tensor], torch.Tensor] | None = None):
    def step(t: int) -> torch.Tensor:
        loss = loss_fn(model)
        return fault(t, loss) if fault else loss

    return model, opt, step


# ----------------------------------------------------------------- pathologies
def sigmoid_stack():  # Glorot & Bengio 2010: saturating sigmoids, small weights (the demo's stack)
    model = build_model("vanishing")
    return _steps(model, torch.optim.SGD(model.parameters(), lr=0.01), _regression(n_in=32))


def born_dead_narrow_relu():  # Lu et al. 2019: deep narrow ReLU nets are often dead at initialisation
    for seed in range(200):
        torch.manual_seed(seed)
        model = _mlp((4,) + (4,) * 10 + (1,))
        x = torch.randn(256, 4)
        out = model[:-1](x)
        if (out == 0).all():  # every unit of the last hidden layer silent: born dead
            break
    return _steps(model, torch.optim.Adam(model.parameters(), lr=1e-3), _regression(n_in=4, n_out=1))


class _TanhRNN(nn.Module):
    def __init__(self, radius: float) -> None:
        super().__init__()
        self.rnn = nn.RNN(8, 32, nonlinearity="tanh", batch_first=True)
        with torch.no_grad():
            w = self.rnn.weight_hh_l0
            w.mul_(radius / torch.linalg.eigvals(w).abs().max())
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out[:, -1]).squeeze(-1)


def tanh_rnn_radius_3():  # Pascanu et al. 2013: spectral radius > 1 lets gradients explode
    model = _TanhRNN(3.0)

    def loss(m):
        x = torch.randn(16, 60, 8) * 0.05
        return (m(x) - x[:, 0, 0]).square().mean()

    return _steps(model, torch.optim.SGD(model.parameters(), lr=0.05), loss)


class _LogProb(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = _mlp((16, 32, 4))
        self.prob = nn.Linear(4, 4)

    def forward(self, x):
        return torch.log(torch.softmax(self.prob(self.body(x)), -1))


def nan_from_log_zero():  # log(0) = -inf, then NaN: the probabilities underflow at step 60
    model = _LogProb()
    base = _regression()

    def loss(m, t=[0]):  # noqa: B006 (a step counter)
        t[0] += 1
        if t[0] == 61:
            with torch.no_grad():
                m.prob.weight.mul_(1e4)  # saturate the softmax: exact zeros
        return base(m)

    return _steps(model, torch.optim.SGD(model.parameters(), lr=0.01), lambda m: loss(m))


class _Standardise(nn.Module):
    """(x - mean) / std over the batch: divides by zero when the batch is constant."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return self.scale * (x - x.mean(0)) / x.std(0)


def nan_from_divide_by_zero():  # a constant batch at step 60: 0 / 0 in the standardisation layer
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), _Standardise(32), nn.Linear(32, 4))
    base = _regression()

    def loss(m, t=[0]):  # noqa: B006
        t[0] += 1
        if t[0] == 61:
            return nn.functional.mse_loss(m(torch.ones(32, 16)), torch.zeros(32, 4))
        return base(m)

    return _steps(model, torch.optim.SGD(model.parameters(), lr=0.01), lambda m: loss(m))


def loss_spike():  # a 1e6x loss spike at step 80 (a corrupt batch)
    model = _mlp()
    return _steps(model, torch.optim.Adam(model.parameters(), lr=1e-3), _regression(),
                  lambda t, loss: loss * 1e6 if t == 80 else loss)  # fmt: skip


def dead_first_layer():  # bias -100 before a ReLU
    model = _mlp()
    with torch.no_grad():
        model[0].bias.fill_(-100.0)
    return _steps(model, torch.optim.Adam(model.parameters(), lr=1e-3), _regression())


def adam_lr_far_too_high():
    model = _mlp()
    return _steps(model, torch.optim.Adam(model.parameters(), lr=0.5), _regression())


def sgd_lr_1000x():  # lr 50 where 0.05 trains
    model = _mlp()
    return _steps(model, torch.optim.SGD(model.parameters(), lr=50.0), _regression())


def inf_weight_gradient():  # an Inf in one weight gradient at step 70 (a custom kernel bug)
    model = _mlp()
    base = _regression()

    def loss(m, t=[0]):  # noqa: B006
        t[0] += 1
        value = base(m)
        if t[0] == 71:
            m[2].weight.register_hook(lambda g: g.index_fill(0, torch.tensor([3]), float("inf")))
        return value

    return _steps(model, torch.optim.SGD(model.parameters(), lr=0.0), lambda m: loss(m))


# ----------------------------------------------------------------- healthy recipes
def healthy_mlp_adam():
    model = _mlp()
    return _steps(model, torch.optim.Adam(model.parameters(), lr=1e-3), _regression())


def healthy_mlp_sgd_momentum():
    model = _mlp()
    return _steps(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), _regression())


def healthy_cnn_batchnorm():
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
        nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4),
    )  # fmt: skip
    protos = torch.randn(4, 3, 8, 8)

    def loss(m):
        y = torch.randint(0, 4, (32,))
        return nn.functional.cross_entropy(m(protos[y] + 0.5 * torch.randn(32, 3, 8, 8)), y)

    return _steps(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), loss)


class _Encoder(nn.Module):
    def __init__(self, layer_scale: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x))).squeeze(-1)


def healthy_transformer_adamw():
    model = _Encoder()

    def loss(m):
        x = torch.randn(8, 12, 8)
        return nn.functional.mse_loss(m(x), x.sum(-1).cumsum(1) / 10)

    return _steps(model, torch.optim.AdamW(model.parameters(), lr=1e-3), loss)


class _LSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 32, batch_first=True)
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        out, _ = self.lstm(x)
        return self.head(out[:, -1]).squeeze(-1)


def healthy_lstm():
    def loss(m):
        x = torch.randn(16, 10, 4)
        return nn.functional.mse_loss(m(x), x[:, :, 0].sum(1) / 3)

    model = _LSTM()
    return _steps(model, torch.optim.Adam(model.parameters(), lr=1e-3), loss)


class _ScaledBlock(nn.Module):
    def __init__(self, d: int, kind: str) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        init = {"layer_scale": torch.full((d,), 1e-6), "rezero": torch.zeros(1), "gate": torch.zeros(d)}[kind]
        self.scale = nn.Parameter(init)
        self.kind = kind

    def forward(self, x):
        scale = torch.tanh(self.scale) if self.kind == "gate" else self.scale
        return x + scale * self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


def _scaled_residual(kind: str):
    def build():
        model = nn.Sequential(nn.Linear(16, 32), *[_ScaledBlock(32, kind) for _ in range(4)], nn.LayerNorm(32),
                              nn.Linear(32, 4))  # fmt: skip
        return _steps(model, torch.optim.AdamW(model.parameters(), lr=1e-3), _regression())

    return build


class _MoE(nn.Module):
    """Top-1 routing to 4 ReLU experts: some experts see few tokens in a window."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.router = nn.Linear(32, 4)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)) for _ in range(4))
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        choice = self.router(h).argmax(-1)
        out = h.clone()
        for i, expert in enumerate(self.experts):
            mask = choice == i
            if mask.any():
                out[mask] = h[mask] + expert(h[mask])
        return self.head(out)


def healthy_moe():
    model = _MoE()
    return _steps(model, torch.optim.AdamW(model.parameters(), lr=1e-3), _regression(batch=16))


def healthy_gpt2():
    import transformers

    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=0)  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)

    def loss(m):
        ids = torch.randint(0, 64, (8, 16))
        ids[:, 1::2] = ids[:, ::2]  # a learnable pattern
        return m(input_ids=ids, labels=ids).loss

    return _steps(model, torch.optim.AdamW(model.parameters(), lr=1e-3), loss)


def scenarios() -> list[Scenario]:
    return [
        Scenario("deep sigmoid stack", sigmoid_stack, expected="vanishing", layer="0",
                 reference="Glorot & Bengio 2010"),
        Scenario("born-dead narrow ReLU net", born_dead_narrow_relu, expected="dead_units", layer="18",
                 reference="Lu et al. 2019"),
        Scenario("tanh RNN, spectral radius 3", tanh_rnn_radius_3, expected="exploding", layer="",
                 reference="Pascanu et al. 2013"),
        Scenario("NaN from log(0)", nan_from_log_zero, expected="nonfinite", layer="prob", fault_step=60),
        Scenario("NaN from a divide by zero", nan_from_divide_by_zero, expected="nonfinite", layer="2", fault_step=60),
        Scenario("1e6x loss spike", loss_spike, expected="exploding", layer="", fault_step=80),
        Scenario("dead first layer (bias -100)", dead_first_layer, expected="dead_units", layer="0"),
        Scenario("Adam, lr 0.5", adam_lr_far_too_high, expected="update_ratio", layer="0"),
        Scenario("SGD, lr 1000x too high", sgd_lr_1000x, expected="exploding", layer=""),
        Scenario("Inf in one weight gradient", inf_weight_gradient, expected="nonfinite", layer="2", fault_step=70),
        Scenario("MLP, Adam", healthy_mlp_adam),
        Scenario("MLP, SGD + momentum", healthy_mlp_sgd_momentum),
        Scenario("CNN + BatchNorm, SGD", healthy_cnn_batchnorm),
        Scenario("pre-norm Transformer, AdamW", healthy_transformer_adamw),
        Scenario("LSTM, Adam", healthy_lstm),
        Scenario("layer scale 1e-6, AdamW", _scaled_residual("layer_scale")),
        Scenario("ReZero (alpha = 0), AdamW", _scaled_residual("rezero")),
        Scenario("zero-initialised gates, AdamW", _scaled_residual("gate")),
        Scenario("mixture of 4 experts, top-1", healthy_moe),
        Scenario("GPT-2 (transformers config), AdamW", healthy_gpt2),
    ]  # fmt: skip


def run(scenario: Scenario, seed: int = 0, flush_every: int = FLUSH_EVERY) -> Outcome:
    torch.manual_seed(seed)
    model, opt, loss_at = scenario.build()
    outcome = Outcome(scenario.name, scenario.expected)
    monitor = GradMonitor(model, flush_every=flush_every, optimizer=opt)
    returned_at: dict[int, int] = {}  # id(alert) -> step of the flush that returned it

    def note(alerts, step):
        for a in alerts:
            returned_at.setdefault(id(a), step)

    for t in range(scenario.steps):
        loss = loss_at(t)
        loss.backward()
        note(monitor.step(), t)
        opt.step()
        opt.zero_grad()
    note([a for a in monitor.alerts if id(a) not in returned_at], scenario.steps)  # close() flushes the rest
    monitor.close()
    note(monitor.alerts, scenario.steps)
    outcome.alerts = [f"{a.kind}@{a.step}:{a.layer or '(model)'}" for a in monitor.alerts]
    if scenario.expected is not None:
        hits = [a for a in monitor.alerts if a.kind == scenario.expected and a.step >= scenario.fault_step]
        if hits:
            first = hits[0]
            outcome.detected = True
            outcome.layer_named = first.layer
            outcome.layer_ok = first.layer == scenario.layer
            outcome.latency = returned_at[id(first)] - scenario.fault_step
    return outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="also write the outcomes to this JSON file")
    parser.add_argument("--only", help="run the scenarios whose name contains this text")
    parser.add_argument("--flush-every", type=int, default=FLUSH_EVERY,
                        help=f"the monitors' flush_every (default {FLUSH_EVERY}; GradMonitor's own default is 50)")
    args = parser.parse_args()
    with gradwatch_logger_at(logging.CRITICAL):  # the alerts are scored here, not printed
        outcomes = _run_all(args.only, args.flush_every)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([o.__dict__ for o in outcomes], f, indent=2)


def _run_all(only: str | None, flush_every: int) -> list[Outcome]:
    """Run and print every scenario (``only``: those whose name contains it), then the summary."""
    outcomes = []
    print(f"# gradwatch detection benchmark  torch {torch.__version__}, defaults, flush_every={flush_every}\n")
    print(f"{'scenario':38s} {'expected':13s} {'detected':9s} {'layer named':16s} {'latency':>8s}  alerts")
    for scenario in scenarios():
        if only and only not in scenario.name:
            continue
        try:
            outcome = run(scenario, flush_every=flush_every)
        except ImportError as exc:
            print(f"{scenario.name:38s} skipped ({exc})")
            continue
        outcomes.append(outcome)
        expected = scenario.expected or "(healthy)"
        detected = "-" if scenario.expected is None else ("yes" if outcome.detected else "NO")
        named = "-" if not outcome.detected else f"{outcome.layer_named or '(model)'} {'ok' if outcome.layer_ok else 'WRONG'}"
        latency = "-" if outcome.latency is None else str(outcome.latency)
        shown = ", ".join(outcome.alerts[:4]) + (f" (+{len(outcome.alerts) - 4})" if len(outcome.alerts) > 4 else "")
        print(f"{scenario.name:38s} {expected:13s} {detected:9s} {named:16s} {latency:>8s}  {shown or '-'}", flush=True)
    faults = [o for o in outcomes if o.expected]
    healthy = [o for o in outcomes if not o.expected]
    recall = sum(o.detected for o in faults) / max(len(faults), 1)
    named = sum(bool(o.layer_ok) for o in faults) / max(len(faults), 1)
    latencies = [o.latency for o in faults if o.latency is not None]
    alarms = [len(o.alerts) for o in healthy]
    print(f"\nrecall {recall:.0%} ({sum(o.detected for o in faults)}/{len(faults)}), right layer named "
          f"{named:.0%}, median latency {statistics.median(latencies) if latencies else math.nan:g} steps "
          f"(flush_every={flush_every}), false alarms per healthy run {sum(alarms) / max(len(alarms), 1):.2f} "
          f"({sum(alarms)} in {len(healthy)} runs)")  # fmt: skip
    return outcomes


if __name__ == "__main__":
    main()
