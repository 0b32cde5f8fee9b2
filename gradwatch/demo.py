"""`gradwatch demo`: a small model on generated data, optionally with a fault made on purpose."""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

import torch
from torch import nn

from .alerts import Alert
from .monitor import GradMonitor

FAULTS = ("none", "exploding", "vanishing", "dead", "nan")


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
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    fault_step = max(steps * 2 // 3, 1) if steps > 40 else steps - 1
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger = logging.getLogger("gradwatch")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.WARNING)
    print(f"gradwatch demo: {steps} steps, fault={fault}, TensorBoard logs in {logdir}", file=out)
    started = time.monotonic()
    try:
        with GradMonitor(model, logdir=logdir, flush_every=flush_every) as monitor:
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
    if alerts:
        print(f"\n{len(alerts)} alert(s):", file=out)
        for a in alerts:
            print(f"  {a.message}", file=out)
    else:
        print("\nno alerts: gradients look healthy", file=out)
    print(f"\nOpen the dashboard:  tensorboard --logdir {logdir}", file=out)
    print(f"Summarise it here:   gradwatch report {logdir}", file=out)
    return alerts


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
