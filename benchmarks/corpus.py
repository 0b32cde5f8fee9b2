"""Detection measured on a generated corpus, gradwatch beside the rules production trainers run.

    python benchmarks/corpus.py                  # the full corpus (see RESULTS.md for its size and time)
    python benchmarks/corpus.py --quick          # the smoke subset the test suite runs
    python benchmarks/corpus.py --json out.json  # also every run's outcome

Runs are generated, not hand-picked: 6 model families (ReLU MLP, CNN with BatchNorm,
pre-norm residual MLP, GRU, small pre-norm Transformer, a mixture of experts whose last expert
runs one step in three) x 5 fault kinds x seeds, and
healthy recipes chosen to fool naive rules (warm-up and cosine decay, dropout, class
imbalance of 95% and 99% (SGD and Adam), batch size 1 and 2, a plateau of random labels, a high start that settles, a step
decay, layer scale 1e-6, zero-initialised gates, a loss weight ramped x30, a layer unfrozen
mid-run, float16 autocast with a GradScaler that recalibrates, a converging exact-fit regression, zero_grad that
keeps idle experts' zeros, 5000 steps regressed to zero: a slow collapse, in every family but the mixture of experts). Each seed draws the optimizer (SGD with
momentum, Adam, AdamW), flush_every (10 or 25) and the fault step.

Faults, injected at step ``f``:

- ``exploding``: the loss is multiplied by 1e4 at step f only (a corrupt batch), or from f on.
- ``vanishing``: the gradient reaching one hidden layer's output is multiplied by 1e-7 from f
  on (a saturated gate): that layer and every layer before it vanish.
- ``dead_units``: a hidden layer's bias (a BatchNorm's shift in the CNN) is set to -100
  before its ReLU at f; or, from f on, 53% of its units in one window and 47% in the next,
  alternately (a layer at its threshold: one alert expected).
- ``nonfinite``: a NaN in one layer's output at step f (forward), or an Inf in its output
  gradient (backward).
- ``update_ratio``: the learning rate of Adam/AdamW jumps to 0.1 at f for 4-19 steps, then returns.

Faults in the last window of short runs (60 steps with windows of 25, 100 with windows of
10): ``dead_units`` and ``vanishing`` at the last window's first step, which ``close()``
reports.

Ground truth is measured by the benchmark itself, never by gradwatch: the global and
per-layer gradient norms from ``p.grad``, the retained output gradients of the dead layer,
weight copies around ``optimizer.step()`` and the loss. A fault whose effect is not real
(the norm did not jump 10x, fewer than half the units died, no weight matrix changed by more
than 0.2 of its norm at two steps in a row, ...) is dropped and listed.

The peer rules run on the loss and global gradient norm the benchmark records:

- ``nonfinite loss``: the loss is NaN or Inf (every trainer);
- ``OLMo 6 std``: the loss or the gradient norm above the mean + 6 standard deviations of
  its last 128 finite values (from 20 values on; OLMo-core);
- ``Megatron 10x``: the loss above 10x its running maximum (Megatron-LM);
- ``ZClip 2.5``: the gradient norm's z-score above 2.5 against an EMA (alpha 0.97) of its
  mean and variance, fed the clipped value on a spike, after 25 warm-up steps (ZClip).

A peer rule "detects" a fault when it alarms at or after the fault step; it names neither a
kind nor a layer. gradwatch detects a fault when it returns an alert of the fault's kind for
a step at or after f; the right layer is the model ("(model)") for exploding and a layer
the ground truth marks for the other kinds; latency is from f to the ``step()`` that returned
the alert. Every run uses GradMonitor's defaults (``detail="standard"``, ``HealthConfig()``)
with the optimizer passed.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness import gradwatch_logger_at  # noqa: E402
from gradwatch import GradMonitor  # noqa: E402

KINDS = ("exploding", "vanishing", "dead_units", "nonfinite", "update_ratio")
STEPS = 130
CLASSES = 4


# ------------------------------------------------------------------ models
class MLP(nn.Module):
    def __init__(self, dropout: float = 0.0, width: int = 64) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(16, width), nn.Linear(width, width), nn.Linear(width, width)
        self.head = nn.Linear(width, CLASSES)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        for layer in (self.fc1, self.fc2, self.fc3):
            x = self.drop(torch.relu(layer(x)))
        return self.head(x)


class CNN(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.conv2, self.bn2 = nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.head = nn.Linear(16, CLASSES)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.head(self.drop(x.mean((2, 3))))


class Block(nn.Module):
    """Pre-norm residual MLP block; ``scale``: layer scale (a vector) or a tanh gate, else none."""

    def __init__(self, d: int, dropout: float = 0.0, scale: str = "") -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.drop = nn.Dropout(dropout)
        self.kind = scale
        if scale:
            self.scale = nn.Parameter(torch.full((d,), 1e-6) if scale == "layer_scale" else torch.zeros(d))

    def forward(self, x):
        h = self.fc2(self.drop(torch.relu(self.fc1(self.norm(x)))))
        if self.kind == "layer_scale":
            h = self.scale * h
        elif self.kind == "zero_gate":
            h = torch.tanh(self.scale) * h
        return x + h


class ResMLP(nn.Module):
    def __init__(self, dropout: float = 0.0, scale: str = "") -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.blocks = nn.ModuleList(Block(32, dropout, scale) for _ in range(3))
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, CLASSES)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class GRUNet(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.gru = nn.GRU(8, 32, batch_first=True)
        self.fc = nn.Linear(32, 32)
        self.head = nn.Linear(32, CLASSES)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        out, _ = self.gru(x)
        return self.head(self.drop(torch.relu(self.fc(out[:, -1]))))


class TransformerBlock(nn.Module):
    def __init__(self, d: int, dropout: float = 0.0, scale: str = "") -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, dropout=dropout, batch_first=True)
        self.mlp = Block(d, dropout, scale)

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return self.mlp(x)


class Transformer(nn.Module):
    def __init__(self, dropout: float = 0.0, scale: str = "") -> None:
        super().__init__()
        self.embed = nn.Linear(8, 32)
        self.blocks = nn.ModuleList(TransformerBlock(32, dropout, scale) for _ in range(2))
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, CLASSES)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(1))


class MoE(nn.Module):
    """A mixture of experts whose last expert gets tokens one step in three (an idle expert on the
    other two: not called, so its gradient stays None, or zeros with zero_grad(set_to_none=False))."""

    def __init__(self, dropout: float = 0.0, width: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(4))
        self.head = nn.Linear(width, CLASSES)
        self.drop = nn.Dropout(dropout)
        self.calls = 0

    def forward(self, x):
        h = self.drop(torch.relu(self.inp(x)))
        active = self.experts[:3] if self.calls % 3 else self.experts
        self.calls += 1
        return self.head(sum(torch.relu(expert(h)) for expert in active) / len(active))


@dataclass
class Family:
    name: str
    build: Callable[..., nn.Module]
    input_shape: tuple[int, ...]
    dead_layer: str  # followed by a ReLU: its bias (BatchNorm: its shift) is set to -100
    gate_layer: str  # its output gradient is multiplied by 1e-7 (vanishing)
    nan_layer: str  # NaN in its output / Inf in its output gradient
    scaled: bool = False  # takes layer scale / zero gates


FAMILIES = {
    "mlp": Family("mlp", MLP, (16,), dead_layer="fc2", gate_layer="fc2", nan_layer="fc2"),
    "cnn": Family("cnn", CNN, (3, 8, 8), dead_layer="bn2", gate_layer="conv2", nan_layer="conv2"),
    "resmlp": Family("resmlp", ResMLP, (16,), dead_layer="blocks.1.fc1", gate_layer="inp", nan_layer="blocks.1.fc1",
                     scaled=True),
    "gru": Family("gru", GRUNet, (10, 8), dead_layer="fc", gate_layer="gru", nan_layer="fc"),
    "transformer": Family("transformer", Transformer, (6, 8), dead_layer="blocks.1.mlp.fc1", gate_layer="embed",
                          nan_layer="blocks.1.mlp.fc1", scaled=True),
    "moe": Family("moe", MoE, (16,), dead_layer="inp", gate_layer="inp", nan_layer="experts.0"),
}  # fmt: skip


# ------------------------------------------------------------------ recipes
@dataclass
class Recipe:
    """How a run trains (healthy recipes vary it; faulty runs use a plain one)."""

    name: str = "plain"
    optimizer: str = "adam"  # sgd | adam | adamw
    lr: float | None = None  # None: the optimizer's usual value
    batch: int = 32
    dropout: float = 0.0
    scale: str = ""  # layer_scale | zero_gate (families that take it)
    labels: str = "teacher"  # teacher | imbalanced | random | regression (a perturbed copy of the model: the
    #: fit is exact, the loss falls by decades and every layer's gradient with it: convergence)
    schedule: str = ""  # warmup_cosine | step_decay
    high_start: bool = False  # the head starts 10x too large: gradient norms start high and settle
    #: the loss weight ramped to x30 over steps 60-99 and kept: a lasting change of scale (an abrupt
    #: x30 is an exploding gradient at that step, which tests/detect covers)
    loss_weight_change: bool = False
    unfreeze_at: int = 0  # the first layer is frozen until this step (gradual unfreezing)
    scaler: bool = False  # float16 autocast and a GradScaler that recalibrates: Inf gradients at steps 0-2, then none
    keep_grads: bool = False  # zero_grad(set_to_none=False): idle layers keep a zero gradient
    #: convergence compressed into the run: the loss weight falls 1e-6 over it, so every layer's
    #: gradient falls six decades together (an exact fit converges so, but slower than 130 steps:
    #: measured, 1-2 decades here without it)
    converge: bool = False
    imbalance: float = 0.95  # labels="imbalanced": this fraction of samples is class 0
    #: spikes far above the recent level are this recipe's normal (a rare class, a batch of 1 or 2,
    #: the jumps of a collapsed gradient): the ground truth's 10x-jump criterion does not apply
    noisy: bool = False
    steps: int = 0  # 0: STEPS
    only: tuple[str, ...] = ()  # the families this recipe runs on (empty: every family)
    width: int = 0  # the MLP's width (0: its default)


HEALTHY = [
    Recipe("Adam", "adam"),
    Recipe("SGD + momentum", "sgd"),
    Recipe("warm-up + cosine, AdamW", "adamw", lr=3e-3, schedule="warmup_cosine"),
    Recipe("step decay 0.1x at 60, SGD", "sgd", schedule="step_decay"),
    Recipe("dropout 0.3, AdamW", "adamw", dropout=0.3),
    Recipe("95% one class, Adam", "adam", labels="imbalanced"),
    Recipe("batch size 1, Adam", "adam", lr=3e-4, batch=1, noisy=True),
    Recipe("batch size 2, AdamW", "adamw", lr=3e-4, batch=2, noisy=True),
    Recipe("99% one class, SGD + momentum", "sgd", labels="imbalanced", imbalance=0.99, noisy=True),
    Recipe("99% one class, Adam", "adam", labels="imbalanced", imbalance=0.99, noisy=True),
    Recipe("plateau (random labels), AdamW", "adamw", labels="random"),
    Recipe("high start that settles, AdamW", "adamw", high_start=True),
    Recipe("layer scale 1e-6, AdamW", "adamw", scale="layer_scale"),
    Recipe("zero-initialised gates, AdamW", "adamw", scale="zero_gate"),
    Recipe("loss weight ramped to x30 from step 60, Adam", "adam", loss_weight_change=True),
    Recipe("first layer unfrozen at step 40, AdamW", "adamw", unfreeze_at=40),
    Recipe("float16 autocast, GradScaler that recalibrates, Adam", "adam", scaler=True),
    Recipe("converging regression (exact fit, gradients down 6 decades), SGD", "sgd", labels="regression",
           converge=True),
    Recipe("zero_grad(set_to_none=False) (idle experts keep zeros), AdamW", "adamw", keep_grads=True),
    Recipe("5000 steps of a narrow MLP regressed to zero, Adam (a slow collapse)", "adam", labels="zero", noisy=True,
           steps=5000, only=("mlp",), width=16),
    Recipe("5000 steps regressed to zero, Adam (a slow collapse)", "adam", labels="zero", noisy=True,
           steps=5000, only=("cnn", "resmlp", "gru", "transformer")),
]
_LR = {"sgd": 0.05, "adam": 1e-3, "adamw": 1e-3}


def regression_teacher(model: nn.Module) -> nn.Module:
    """A copy of the model with every weight moved by half its tensor's spread: a target the model
    can fit exactly (so the loss falls by decades), fixed for the run."""
    import copy

    teacher = copy.deepcopy(model)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(torch.randn_like(p) * 0.5 * (p.std() if p.numel() > 1 else p.abs().clamp_min(0.1)))
    teacher.requires_grad_(False)
    return teacher


def make_optimizer(model: nn.Module, recipe: Recipe) -> torch.optim.Optimizer:
    lr = recipe.lr if recipe.lr is not None else _LR[recipe.optimizer]
    if recipe.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    if recipe.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=lr)
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)


def lr_factor(recipe: Recipe, step: int) -> float:
    if recipe.schedule == "warmup_cosine":
        return (step + 1) / 30 if step < 30 else 0.5 * (1 + math.cos(math.pi * (step - 30) / (STEPS - 30)))
    if recipe.schedule == "step_decay":
        return 0.1 if step >= 60 else 1.0
    return 1.0


class Data:
    """A fixed random teacher; each step draws a batch from the run's own generator."""

    def __init__(self, family: Family, recipe: Recipe, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(10_000 + seed)
        self.shape, self.recipe = family.input_shape, recipe
        self.teacher = torch.randn(int(np.prod(self.shape)), CLASSES, generator=self.generator)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(self.recipe.batch, *self.shape, generator=self.generator)
        y = (x.reshape(len(x), -1) @ self.teacher).argmax(-1)
        if self.recipe.labels == "imbalanced":
            y = torch.where(torch.rand(len(y), generator=self.generator) < self.recipe.imbalance, torch.zeros_like(y), y)
        elif self.recipe.labels == "random":
            y = torch.randint(0, CLASSES, y.shape, generator=self.generator)
        return x, y


# ------------------------------------------------------------------ runs
@dataclass
class Run:
    family: str
    recipe: Recipe
    seed: int
    flush_every: int
    kind: str | None = None  # the fault; None: healthy
    fault_step: int = 0
    variant: str = ""  # the fault's form (forward/backward NaN, one-step/lasting spike, ...)
    duration: int = 0  # update_ratio: steps at the high learning rate
    steps: int = 0  # 0: the recipe's (else STEPS)

    @property
    def length(self) -> int:
        return self.steps or self.recipe.steps or STEPS

    @property
    def name(self) -> str:
        what = f"{self.kind}/{self.variant}@{self.fault_step}" if self.kind else f"healthy/{self.recipe.name}"
        return f"{self.family} {what} {self.recipe.optimizer} flush={self.flush_every} seed={self.seed}"


@dataclass
class Outcome:
    run: str
    family: str
    kind: str | None
    real: bool = True  # the ground truth confirmed the fault (faulty runs)
    why_not_real: str = ""
    expected_layers: list[str] = field(default_factory=list)
    detected: bool = False
    layer: str | None = None
    layer_ok: bool = False
    latency: int | None = None
    alerts_before_fault: int = 0
    alerts: list[str] = field(default_factory=list)
    peers: dict[str, int | None] = field(default_factory=dict)  # rule -> latency (None: no alarm after f)
    peers_before_fault: dict[str, bool] = field(default_factory=dict)
    seconds: float = 0.0


def corpus(seeds_faulty: int = 7, seeds_healthy: int = 6, families: list[str] | None = None) -> list[Run]:
    runs = []
    optimizers = ("sgd", "adam", "adamw")
    for name in families or list(FAMILIES):
        family = FAMILIES[name]
        for kind in KINDS:
            for seed in range(seeds_faulty):
                choices = ("adam", "adamw") if kind == "update_ratio" else optimizers
                recipe = Recipe("plain", choices[seed % len(choices)])
                variant = {
                    "exploding": ("one step", "lasting")[seed % 2],
                    "nonfinite": ("forward NaN", "backward Inf")[seed % 2],
                }.get(kind, "")
                runs.append(Run(name, recipe, seed, flush_every=(10, 25)[seed % 2], kind=kind,
                                fault_step=50 + (seed * 13) % 30, variant=variant,
                                duration=4 + (seed * 5) % 16))  # fmt: skip
        for seed in range(seeds_faulty, seeds_faulty + 2):  # Inf gradients from the fault on, under a GradScaler
            runs.append(Run(name, Recipe("plain", optimizers[seed % 3], scaler=True), seed,
                            flush_every=(10, 25)[seed % 2], kind="nonfinite", fault_step=50 + (seed * 13) % 30,
                            variant="persistent scaler skips"))  # fmt: skip
        for seed in range(2):  # faults in the last window of short runs: seen at its first (sampled) step
            steps, flush = ((60, 25), (100, 10))[seed]
            for kind in ("dead_units", "vanishing"):
                runs.append(Run(name, Recipe("plain", optimizers[seed % 3]), 20 + seed, flush_every=flush, kind=kind,
                                fault_step=steps - (steps % flush or flush), variant="last window", steps=steps))  # fmt: skip
        # a layer at the dead-unit threshold in alternate windows (53% dead, then 47%, ...): one alert
        runs.append(Run(name, Recipe("plain", "adam"), 30, flush_every=10, kind="dead_units", fault_step=40,
                        variant="alternate windows"))  # fmt: skip
        for recipe in HEALTHY:
            if (recipe.scale and not family.scaled) or (recipe.only and name not in recipe.only):
                continue
            for seed in range(seeds_healthy if recipe.steps <= 1000 else min(seeds_healthy, 2)):
                runs.append(Run(name, recipe, 100 + seed, flush_every=(25, 10)[seed % 2]))
    return runs


class Truth:
    """What the benchmark measures itself: the loss, gradient norms, which units pass gradient, update ratios."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.layers = {n: m for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))}
        self.loss: list[float] = []
        self.global_norm: list[float] = []
        self.layer_norm: list[dict[str, float]] = []
        self.ratios: list[dict[str, float]] = []
        self._before: dict[str, list[torch.Tensor]] = {}
        #: per step, per layer with units: which units had a non-zero output gradient (any row)
        self.alive_steps: list[dict[str, torch.Tensor]] = [{}]
        for name, module in self.layers.items():
            if isinstance(module, (nn.Linear, nn.Conv2d, nn.BatchNorm2d, nn.LayerNorm)):
                module.register_forward_hook(self._alive_hook(name))

    def _alive_hook(self, name: str):
        def hook(module, args, output):
            if not output.requires_grad:
                return

            def on_grad(grad):
                unit = 1 if grad.ndim == 4 else grad.ndim - 1
                alive = (grad != 0).transpose(0, unit).reshape(grad.shape[unit], -1).any(1)
                step = self.alive_steps[-1]
                step[name] = alive if name not in step else step[name] | alive

            output.register_hook(on_grad)

        return hook

    def after_backward(self, loss: torch.Tensor) -> None:
        self.loss.append(float(loss.detach()))
        norms = {}
        for name, module in self.layers.items():
            grads = [p.grad.detach().double().reshape(-1) for p in module.parameters(recurse=False) if p.grad is not None]
            norms[name] = float(torch.cat(grads).norm()) if grads else 0.0
        self.layer_norm.append(norms)
        self.global_norm.append(math.sqrt(sum(v * v for v in norms.values())))
        self._before = {
            name: [p.detach().clone() for p in m.parameters(recurse=False) if p.ndim >= 2] for name, m in self.layers.items()
        }

    def after_update(self) -> None:
        ratios = {}
        for name, module in self.layers.items():
            before = self._before.get(name, [])
            after = [p.detach() for p in module.parameters(recurse=False) if p.ndim >= 2]
            if before:
                num = sum(float((a - b).double().square().sum()) for a, b in zip(after, before))
                den = sum(float(b.double().square().sum()) for b in before)
                ratios[name] = math.sqrt(num / den) if den > 0 else 0.0
        self.ratios.append(ratios)
        self.alive_steps.append({})

    def pathologies(self, window: int = 25, recipe: Recipe | None = None) -> list[str]:
        """What is wrong with a run meant to be healthy, by the same criteria as the faults' ground truth
        (what the recipe does on purpose excepted: a scaler's Inf steps, a lasting change of scale, the spikes
        of a noisy recipe)."""
        found = []
        skip = 3 if recipe is not None and recipe.scaler else 0
        if not all(math.isfinite(v) for v in self.loss + self.global_norm[skip:]):
            found.append("a non-finite loss or gradient")
        for t in range(20 + skip, len(self.global_norm) if recipe is None or not recipe.noisy else 0):
            level = statistics.median(self.global_norm[t - 20 : t])
            if level > 0 and self.global_norm[t] >= 10 * level:
                found.append(f"the gradient norm jumped {self.global_norm[t] / level:.0f}x at step {t}")
                break
        for start in range(0, len(self.alive_steps) - window + 1, window):
            for name in self.alive_steps[start]:
                masks = [s[name] for s in self.alive_steps[start : start + window] if name in s]
                if len(masks) == window and masks[0].numel() >= 4:
                    dead = 1 - float(torch.stack(masks).any(0).double().mean())
                    if dead >= 0.5:
                        found.append(f"{dead:.0%} of {name}'s units dead over every step of steps {start}-{start + window - 1}")
        for name in self.layers:
            high = [r.get(name, 0.0) > 0.2 for r in self.ratios]
            if any(a and b for a, b in zip(high, high[1:])):
                found.append(f"{name}'s weights changed by more than 0.2 of their norm at two steps in a row")
        return found


def check_fault(run: Run, family: Family, truth: Truth) -> tuple[bool, str, list[str]]:
    """(real, why not, the layers an alert may name) from the benchmark's own measurements."""
    f = run.fault_step
    if run.kind == "exploding":
        before = statistics.median(truth.global_norm[f - 20 : f])
        after = [g for g in truth.global_norm[f : f + 3]]
        jump = max((g for g in after if math.isfinite(g)), default=math.inf) / before
        return jump >= 10, f"the global norm rose {jump:.1f}x, not 10x", [""]
    if run.kind == "vanishing":
        layers = []
        for name in truth.layers:
            pre = statistics.median(n[name] for n in truth.layer_norm[f - 20 : f])
            post = statistics.median(n[name] for n in truth.layer_norm[f + 1 : f + 11])
            if pre > 0 and post <= 1e-5 * pre:
                layers.append(name)
        return bool(layers), "no layer's gradient norm fell 1e5x", layers
    if run.kind == "dead_units" and run.variant == "alternate windows":  # over every step of the first window
        masks = [s[family.dead_layer] for s in truth.alive_steps[f : f + run.flush_every] if family.dead_layer in s]
        fraction = 1 - float(torch.stack(masks).any(0).double().mean()) if masks else 0.0
        return fraction >= 0.5, f"{fraction:.0%} of its units dead in the first window, not 50%", [family.dead_layer]
    if run.kind == "dead_units":  # over the 20 steps after the fault
        masks = [s[family.dead_layer] for s in truth.alive_steps[f + 1 : f + 21] if family.dead_layer in s]
        if not masks:
            return False, "no output gradient reached the dead layer", []
        fraction = 1 - float(torch.stack(masks).any(0).double().mean())
        return fraction >= 0.5, f"{fraction:.0%} of its units died, not 50%", [family.dead_layer]
    if run.kind == "nonfinite":
        bad = not math.isfinite(truth.loss[f]) or not math.isfinite(truth.global_norm[f])
        # persistent skips: Inf from the logits' gradient on, so the first non-finite gradient in
        # backward order is the last layer's
        layers = [list(truth.layers)[-1]] if run.variant == "persistent scaler skips" else [family.nan_layer]
        return bad, "neither the loss nor a gradient was non-finite at the fault step", layers
    if run.kind == "update_ratio":
        layers = []
        for name in truth.layers:
            high = [r.get(name, 0.0) > 0.2 for r in truth.ratios[f : f + run.duration + 1]]
            if any(a and b for a, b in zip(high, high[1:])):
                layers.append(name)
        return bool(layers), "no weight matrix changed by > 0.2 of its norm at two steps in a row", layers
    return True, "", []


# ------------------------------------------------------------------ peer rules
def peer_alarms(loss: list[float], norm: list[float]) -> dict[str, list[int]]:
    """Steps at which each peer rule alarms, from the loss and the global gradient norm."""
    alarms: dict[str, list[int]] = {"nonfinite loss": [], "OLMo 6 std": [], "Megatron 10x": [], "ZClip 2.5": []}
    history: dict[str, list[float]] = {"loss": [], "norm": []}
    running_max = -math.inf
    mean = var = None
    for t, (l_t, g_t) in enumerate(zip(loss, norm)):
        if not math.isfinite(l_t):
            alarms["nonfinite loss"].append(t)
        for key, value in (("loss", l_t), ("norm", g_t)):
            past = history[key][-128:]
            if math.isfinite(value):
                if len(past) >= 20 and value > statistics.fmean(past) + 6 * statistics.pstdev(past):
                    if t not in alarms["OLMo 6 std"]:
                        alarms["OLMo 6 std"].append(t)
                history[key].append(value)
        if math.isfinite(l_t):
            if t > 0 and l_t > 10 * running_max:
                alarms["Megatron 10x"].append(t)
            running_max = max(running_max, l_t)
        if math.isfinite(g_t):
            if mean is None:
                mean, var = g_t, 0.0
            else:
                std = math.sqrt(var)
                spike = t >= 25 and std > 0 and (g_t - mean) / std > 2.5
                if spike:
                    alarms["ZClip 2.5"].append(t)
                    g_t = mean + 2.5 * std  # ZClip feeds the clipped norm to its EMA
                mean_new = 0.97 * mean + 0.03 * g_t
                var = 0.97 * var + 0.03 * (g_t - mean) ** 2
                mean = mean_new
    return alarms


# ------------------------------------------------------------------ one run
def execute(run: Run) -> Outcome:
    family = FAMILIES[run.family]
    recipe = run.recipe
    torch.manual_seed(run.seed)
    kwargs = {"dropout": recipe.dropout}
    if family.scaled:
        kwargs["scale"] = recipe.scale
    if recipe.width:
        kwargs["width"] = recipe.width
    model = family.build(**kwargs)
    if recipe.high_start:
        with torch.no_grad():
            model.head.weight.mul_(10.0)
    teacher = regression_teacher(model) if recipe.labels == "regression" else None
    opt = make_optimizer(model, recipe)
    base_lr = [g["lr"] for g in opt.param_groups]
    data = Data(family, recipe, run.seed)
    truth = Truth(model)
    f = run.fault_step
    injected = {"grad_scale": None, "nan_now": False, "inf_now": False}

    def gate_hook(module, args, output):  # vanishing: from f on, the gradient at the gate's output x 1e-7
        if injected["grad_scale"] is not None and output.requires_grad:
            output.register_hook(lambda g: g * injected["grad_scale"])

    def nan_hook(module, args, output):
        if injected["nan_now"]:
            output = output * float("nan")
            return output
        if injected["inf_now"] and output.requires_grad:
            output.register_hook(lambda g: g * float("inf"))
        return None

    gate_module = model.get_submodule(family.gate_layer)
    if run.kind == "vanishing":
        if isinstance(gate_module, nn.GRU):
            gate_module.register_forward_hook(lambda m, a, out: gate_hook(m, a, out[0]))
        else:
            gate_module.register_forward_hook(gate_hook)
    if run.kind == "nonfinite":
        model.get_submodule(family.nan_layer).register_forward_hook(nan_hook)

    first_layer = next(m for m in model.modules() if any(True for _ in m.parameters(recurse=False)))
    if recipe.unfreeze_at:
        first_layer.requires_grad_(False)
    scaler = torch.amp.GradScaler("cpu") if recipe.scaler else None
    persistent_skips = run.variant == "persistent scaler skips"
    outcome = Outcome(run.name, run.family, run.kind)
    monitor = GradMonitor(model, flush_every=run.flush_every, optimizer=opt, scaler=scaler)
    returned: dict[int, int] = {}
    start = time.perf_counter()
    dead_module = model.get_submodule(family.dead_layer)
    for t in range(run.length):
        for group, lr in zip(opt.param_groups, base_lr):
            group["lr"] = lr * lr_factor(recipe, t)
        if run.kind == "update_ratio" and f <= t < f + run.duration:
            for group in opt.param_groups:
                group["lr"] = 0.1
        if t == f:
            if run.kind == "vanishing":
                injected["grad_scale"] = 1e-7
            elif run.kind == "dead_units" and run.variant == "alternate windows":
                alive_bias = dead_module.bias.detach().clone()
            elif run.kind == "dead_units":
                with torch.no_grad():
                    dead_module.bias.fill_(-100.0)
            elif run.kind == "nonfinite":
                injected["nan_now" if run.variant == "forward NaN" else "inf_now"] = True
        if run.variant == "alternate windows" and t >= f:  # 53% of the units dead, then 47%, window by window
            units = dead_module.bias.numel()
            dead = round(units * (0.53 if ((t - f) // run.flush_every) % 2 == 0 else 0.47))
            with torch.no_grad():
                dead_module.bias.copy_(alive_bias)
                dead_module.bias[:dead] = -100.0
        if recipe.unfreeze_at and t == recipe.unfreeze_at:
            first_layer.requires_grad_(True)
        x, y = data.batch()
        if scaler is not None:  # mixed precision as users run it with a scaler: float16 autocast
            with torch.autocast("cpu", dtype=torch.float16):
                logits = model(x)
            logits = logits.float()
        else:
            logits = model(x)
        if scaler is not None and (t < 3 if not persistent_skips else t >= f):  # Inf gradients: the scaler skips
            logits.register_hook(lambda g: g * float("inf"))
        if teacher is not None:
            with torch.no_grad():
                target = teacher(x)
            loss = nn.functional.mse_loss(logits, target)
        elif recipe.labels == "zero":  # regressed to zero: the fit is exact and the gradient collapses
            loss = logits.square().mean()
        else:
            loss = nn.functional.cross_entropy(logits, y)
        if run.kind == "exploding" and (t == f or (run.variant == "lasting" and t > f)):
            loss = loss * 1e4
        if recipe.converge:
            loss = loss * 10.0 ** (-6 * t / run.length)
        if recipe.loss_weight_change and t >= 60:
            loss = loss * 30.0 ** min(1.0, (t - 60) / 40)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        else:
            loss.backward()
        truth.after_backward(loss)
        for a in monitor.step():
            returned.setdefault(id(a), t)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        truth.after_update()
        opt.zero_grad(set_to_none=not recipe.keep_grads)
        injected["nan_now"] = injected["inf_now"] = False
    monitor.close()
    for a in monitor.alerts:
        returned.setdefault(id(a), run.length)
    outcome.seconds = time.perf_counter() - start
    outcome.alerts = [f"{a.kind}@{a.step}:{a.layer or '(model)'}" for a in monitor.alerts]

    peers = peer_alarms(truth.loss, truth.global_norm)
    if run.kind is None:
        outcome.peers = {rule: (steps[0] if steps else None) for rule, steps in peers.items()}
        wrong = truth.pathologies(window=run.flush_every, recipe=recipe)  # dead over a window: the monitor's window
        outcome.real = not wrong  # a healthy recipe that is not: listed, not counted
        outcome.why_not_real = "; ".join(wrong[:3])
        return outcome
    outcome.real, outcome.why_not_real, outcome.expected_layers = check_fault(run, family, truth)
    outcome.alerts_before_fault = sum(a.step < f for a in monitor.alerts)
    hits = [a for a in monitor.alerts if a.kind == run.kind and a.step >= f]
    if hits:
        first = min(hits, key=lambda a: returned[id(a)])
        outcome.detected = True
        outcome.layer = first.layer
        outcome.layer_ok = first.layer in outcome.expected_layers or any(
            a.layer in outcome.expected_layers for a in hits if returned[id(a)] == returned[id(first)]
        )
        outcome.latency = returned[id(first)] - f
    for rule, steps in peers.items():
        after = [s for s in steps if s >= f]
        outcome.peers[rule] = after[0] - f if after else None
        outcome.peers_before_fault[rule] = any(s < f for s in steps)
    return outcome


# ------------------------------------------------------------------ report
def summarise(outcomes: list[Outcome]) -> str:
    real = [o for o in outcomes if o.kind and o.real]
    healthy = [o for o in outcomes if o.kind is None and o.real]
    rules = list(outcomes[0].peers) if outcomes else []
    lines = ["| kind | runs | gradwatch: right kind | right layer | median latency | " + " | ".join(rules) + " |",
             "|---|---|---|---|---|" + "---|" * len(rules)]  # fmt: skip

    def pct(n: int, d: int) -> str:
        return f"{100 * n / d:.0f}% ({n}/{d})" if d else "-"

    def med(values: list[int]) -> str:
        return f"{statistics.median(values):g}" if values else "-"

    for kind in KINDS:
        runs = [o for o in real if o.kind == kind]
        found = [o for o in runs if o.detected]
        peer = []
        for rule in rules:
            hits = [o.peers[rule] for o in runs if o.peers[rule] is not None]
            peer.append(f"{pct(len(hits), len(runs))}, {med(hits)}")
        lines.append(
            f"| {kind} | {len(runs)} | {pct(len(found), len(runs))} | {pct(sum(o.layer_ok for o in runs), len(runs))} "
            f"| {med([o.latency for o in found])} | " + " | ".join(peer) + " |"
        )
    alarmed = [o for o in healthy if o.alerts]
    peer_false = [pct(sum(o.peers[r] is not None for o in healthy), len(healthy)) for r in rules]
    lines.append(f"| healthy runs with any alarm | {len(healthy)} | {pct(len(alarmed), len(healthy))} | | | "
                 + " | ".join(peer_false) + " |")  # fmt: skip
    faulty_real = [o for o in real]
    early = sum(o.alerts_before_fault > 0 for o in faulty_real)
    peer_early = [pct(sum(o.peers_before_fault.get(r, False) for o in faulty_real), len(faulty_real)) for r in rules]
    lines.append(f"| faulty runs with an alarm before the fault | {len(faulty_real)} | {pct(early, len(faulty_real))} | | | "
                 + " | ".join(peer_early) + " |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[Outcome]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one seed per family and kind, two healthy recipes")
    parser.add_argument("--json", help="also write every outcome to this JSON file")
    parser.add_argument("--family", action="append", help="only these families")
    parser.add_argument("--flush-every", type=int,
                        help="every run at this flush_every (default: each run's own, 10 or 25; GradMonitor's is 50)")
    args = parser.parse_args(argv)
    runs = quick(families=args.family) if args.quick else corpus(families=args.family)
    if args.flush_every:
        runs = [replace(run, flush_every=args.flush_every) for run in runs]
    start = time.perf_counter()
    outcomes = []
    for i, run in enumerate(runs):
        with gradwatch_logger_at(logging.CRITICAL):  # the alerts are counted here, not printed
            outcome = execute(run)
        outcomes.append(outcome)
        status = ("healthy: " + (", ".join(outcome.alerts[:3]) or "silent")) if run.kind is None else (
            "NOT REAL: " + outcome.why_not_real if not outcome.real else
            f"{'found' if outcome.detected else 'MISSED'} {outcome.layer if outcome.detected else ''} "
            f"latency {outcome.latency}")  # fmt: skip
        print(f"[{i + 1}/{len(runs)}] {run.name}: {status}", file=sys.stderr, flush=True)
    elapsed = time.perf_counter() - start
    dropped = [o for o in outcomes if o.kind and not o.real]
    unhealthy = [o for o in outcomes if o.kind is None and not o.real]
    print(f"# gradwatch detection corpus  torch {torch.__version__}, defaults, {len(runs)} runs in {elapsed:.0f} s\n")
    print(summarise(outcomes))
    print(f"\nDropped (the fault was not real): {len(dropped)}")
    for o in dropped:
        print(f"- {o.run}: {o.why_not_real}")
    print(f"\nHealthy recipes that were not healthy (the benchmark's own measurements; not counted): {len(unhealthy)}")
    for o in unhealthy:
        print(f"- {o.run}: {o.why_not_real}; gradwatch: {o.alerts[:4] or 'silent'}")
    missed = [o for o in outcomes if o.kind and o.real and (not o.detected or not o.layer_ok)]
    print(f"\nMissed or wrong layer: {len(missed)}")
    for o in missed:
        print(f"- {o.run}: {'named ' + repr(o.layer) if o.detected else 'missed'} (expected {o.expected_layers}); "
              f"alerts {o.alerts[:5]}")  # fmt: skip
    alarmed = [o for o in outcomes if o.kind is None and o.real and o.alerts]
    print(f"\nHealthy runs with an alert: {len(alarmed)}")
    for o in alarmed:
        print(f"- {o.run}: {o.alerts[:5]}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([{**o.__dict__} for o in outcomes], fh, indent=1)
    return outcomes


def quick(families: list[str] | None = None) -> list[Run]:
    """The smoke subset: every kind on the MLP and the CNN (one seed; the last-window and alternate-window
    faults on the MLP), and three healthy recipes each (one of them 99% one class); ``families``: of
    those, only these."""
    chosen = [f for f in ("mlp", "cnn") if families is None or f in families]
    runs = [r for r in corpus(seeds_faulty=1, seeds_healthy=1, families=chosen)]
    runs = [r for r in runs if r.family == "mlp" or r.variant not in ("last window", "alternate windows")]
    return [r for r in runs if r.kind is not None or r.recipe.name in ("Adam", "warm-up + cosine, AdamW",
                                                                        "99% one class, SGD + momentum")]


if __name__ == "__main__":
    main()
