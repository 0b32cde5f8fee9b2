"""What gradwatch costs on a vanishing run (gradients of 1e-25, whose float32 squares are subnormal
or zero) against the same layer shapes with gradients of a normal size (#28 item 13).

    python benchmarks/subnormal.py            # about 2 minutes on 2 CPU cores
    python benchmarks/subnormal.py --steps 60  # a smoke test

Six runs in one process, interleaved step by step in balanced orders (each run right after every other equally often): the
vanishing demo's model (a 26-layer sigmoid stack, `gradwatch demo --fault vanishing`) with and
without gradwatch, and its twin (the same Linear shapes, tanh and orthogonal weights, whose
gradients stay near 1e-2) with and without gradwatch, and that twin again (its ratio to the
first is the noise floor, A/A). gradwatch's part of a step is the
median monitored step minus the median unmonitored step of the same model; the claim is that
the part is no larger on the vanishing model. No global float setting is changed (the model's
own sigmoid backward is slower on subnormals; that is the run's cost, not gradwatch's).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness import balanced_orders, gradwatch_logger_at  # noqa: E402

from gradwatch import GradMonitor  # noqa: E402
from gradwatch.demo import build_model  # noqa: E402


def twin() -> nn.Module:
    """The vanishing model's shapes with gradients of a normal size."""
    model = build_model("vanishing")
    for i, module in enumerate(model):
        if isinstance(module, nn.Sigmoid):
            model[i] = nn.Tanh()
        elif isinstance(module, nn.Linear):
            nn.init.orthogonal_(module.weight)
    return model


class Run:
    """One model, its optimizer and (optionally) its monitor, stepped one step at a time."""

    def __init__(self, name: str, model: nn.Module, monitored: bool) -> None:
        torch.manual_seed(0)
        self.name, self.model = name, model
        self.opt = torch.optim.SGD(model.parameters(), lr=0.05)
        self.monitor = GradMonitor(model, flush_every=25, optimizer=self.opt) if monitored else None
        self.teacher = torch.randn(32, 4) / 32**0.5
        self.times: list[float] = []
        self.smallest_grad = float("inf")

    def step(self, x: torch.Tensor) -> None:
        started = time.perf_counter()
        loss = nn.functional.mse_loss(self.model(x), torch.tanh(x @ self.teacher))
        loss.backward()
        if self.monitor is not None:
            self.monitor.step()
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)
        self.times.append(time.perf_counter() - started)

    def record_smallest_grad(self) -> None:
        self.model(torch.randn(64, 32)).square().mean().backward()
        self.smallest_grad = min(float(p.grad.abs().max()) for p in self.model.parameters())
        self.opt.zero_grad()


def main() -> None:
    with gradwatch_logger_at(logging.ERROR):  # the vanishing run alerts, as it should
        _main()


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "subnormal_results.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    runs = [Run("vanishing", build_model("vanishing"), False), Run("vanishing", build_model("vanishing"), True),
            Run("twin", twin(), False), Run("twin", twin(), True),
            Run("twin again (A/A)", twin(), False), Run("twin again (A/A)", twin(), True)]  # fmt: skip
    for run in runs:
        run.record_smallest_grad()
    inputs = torch.randn(args.steps + args.warmup, 64, 32)
    orders = balanced_orders(len(runs))
    for t in range(args.steps + args.warmup):
        for run in (runs[i] for i in orders[t % len(orders)]):
            run.step(inputs[t])
    results = {}
    for name in ("vanishing", "twin", "twin again (A/A)"):
        plain, monitored = (r for r in runs if r.name == name)
        base = statistics.median(plain.times[args.warmup :])
        with_monitor = statistics.median(monitored.times[args.warmup :])
        results[name] = {
            "largest |grad| of the weakest tensor": plain.smallest_grad,
            "unmonitored step ms": base * 1e3, "monitored step ms": with_monitor * 1e3,
            "gradwatch part ms": (with_monitor - base) * 1e3,
        }  # fmt: skip
        monitored.monitor.close()
    ratio = results["vanishing"]["gradwatch part ms"] / results["twin"]["gradwatch part ms"]
    results["gradwatch part, vanishing / twin"] = ratio
    # the noise floor: the same model measured twice
    results["gradwatch part, twin again / twin (A/A)"] = (
        results["twin again (A/A)"]["gradwatch part ms"] / results["twin"]["gradwatch part ms"]
    )
    print(json.dumps(results, indent=2))
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
