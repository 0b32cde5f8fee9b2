"""`gradwatch demo`: a small model on generated data, optionally with a fault made on purpose."""

from __future__ import annotations

import itertools
import logging
import os
import sys
import time
from typing import TextIO

import torch
from torch import nn

from .alerts import Alert
from .monitor import GradMonitor

FAULTS = ("none", "exploding", "vanishing", "dead", "nan")
_COUNTER = itertools.count()


def build_model(fault: str) -> nn.Module:
    """A regression MLP; ``vanishing`` swaps in a deep sigmoid stack, ``dead`` kills layer 0."""
    if fault == "vanishing":
        layers: list[nn.Module] = [nn.Linear(32, 64), nn.Sigmoid()]
        for _ in range(24):
            lin = nn.Linear(64, 64)
            nn.init.normal_(lin.weight, std=0.05)
            nn.init.zeros_(lin.bias)
            layers += [lin, nn.Sigmoid()]
        return nn.Sequential(*layers, nn.Linear(64, 4))
    model = nn.Sequential(
        nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 4)
    )  # fmt: skip
    if fault == "dead":
        with torch.no_grad():
            model[0].bias.fill_(-100.0)  # every unit of layer 0 is dead before its ReLU
    return model


def _optimizer(model: nn.Module, fault: str) -> torch.optim.Optimizer:
    # The vanishing demo trains with SGD, whose step is the gradient: there a layer five decades
    # below the others really stops learning. Adam would rescue it (its step is normalised), and
    # gradwatch, told the optimizer, would rightly judge it by the absolute floor only.
    if fault == "vanishing":
        return torch.optim.SGD(model.parameters(), lr=0.05)
    return torch.optim.Adam(model.parameters(), lr=1e-3)


def run_demo(
    logdir: str = "runs/gradwatch-demo",
    steps: int = 300,
    fault: str = "none",
    flush_every: int = 25,
    out: TextIO = sys.stdout,
    seed: int = 0,
) -> list[Alert]:
    """Train the demo model with GradMonitor; returns the alerts it raised."""
    if fault not in FAULTS:
        raise ValueError(f"fault must be one of {FAULTS}, got {fault!r}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    torch.manual_seed(seed)
    model = build_model(fault)
    teacher = torch.randn(32, 4) / 32**0.5
    opt = _optimizer(model, fault)
    fault_step = max(steps * 2 // 3, 1) if steps > 40 else steps - 1
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger = logging.getLogger("gradwatch")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.WARNING)
    # Each demo its own run folder, so that runs never mix: TensorBoard and `gradwatch report`
    # on the parent folder show them side by side.
    run_dir = os.path.join(logdir, run_name(fault))
    print(f"gradwatch demo: {steps} steps, fault={fault}, TensorBoard logs in {run_dir}", file=out)
    started = time.monotonic()
    try:
        with GradMonitor(model, logdir=run_dir, flush_every=flush_every, optimizer=opt) as monitor:
            for step in range(steps):
                x = torch.randn(64, 32)
                y = torch.tanh(x @ teacher)
                pred = model(x)
                if fault == "nan" and step == fault_step:
                    pred = _poison_output(model, x)
                loss = nn.functional.mse_loss(pred, y)
                if fault == "exploding" and step == fault_step:
                    loss = loss * 1e6
                loss.backward()
                monitor.step()
                if not (fault == "nan" and step == fault_step):
                    opt.step()
                opt.zero_grad()
                if steps >= 200 and (step + 1) % max(steps // 10, 1) == 0:
                    print(f"  step {step + 1}/{steps}  loss {loss.item():.4g}  "
                          f"({time.monotonic() - started:.1f}s)", file=out)  # fmt: skip
            alerts = monitor.alerts  # close() on exit flushes the last window
        alerts = monitor.alerts
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    _print_summary(alerts, logdir, out)
    return alerts


def _print_summary(alerts: list[Alert], logdir: str, out: TextIO) -> None:
    if alerts:
        print(f"\n{len(alerts)} alert(s):", file=out)
        for a in alerts:
            print(f"  {a.message}", file=out)
    else:
        print("\nno alerts: gradients look healthy", file=out)
    print(f"\nOpen the dashboard:  tensorboard --logdir {logdir}", file=out)
    print("  then the Custom Scalars tab (gradient RMS per layer, log scale) and the Images tab", file=out)
    print(f"Summarise it here:   gradwatch report {logdir}", file=out)


def run_name(fault: str) -> str:
    """A run folder name that tells demos apart: the fault and the time, e.g. ``dead-20261130-171503``.

    Two demos started in the same second get a suffix.
    """
    return f"{fault}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid() % 1000:03d}{next(_COUNTER):02d}"


def _poison_output(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Run the forward pass with one NaN written into layer 2's output (its origin)."""

    def poison(module: nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
        output = output.clone()
        output[0, 0] = float("nan")
        return output

    # Registered before gradwatch's own hook would see it? gradwatch's hook was
    # registered first, so prepend ours to make the NaN part of the layer's output.
    handle = model[2].register_forward_hook(poison, prepend=True)
    try:
        return model(x)
    finally:
        handle.remove()
